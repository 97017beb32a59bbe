/* fuzz_config.c - libFuzzer target for the YAML configuration loader
 * (serve_config_load_string, the code behind `ember serve --config`).
 *
 * The input is the file's text. The loader either accepts it or fails with a
 * message that names the file ("fuzz.yaml:LINE: key: ..."); on success the
 * range validation runs over the result, and every string setting must
 * still be NUL-terminated inside its field. Unknown keys only warn (the log
 * is silenced here). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "serve/serve_config.h"
#include "fuzz_target.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    ember_log_set_level(EMBER_LOG_ERROR);
    return 0;
}

#define TERMINATED(field) (memchr((field), '\0', sizeof(field)) != NULL)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    serve_config c;
    serve_config_defaults(&c);
    ember_error err;
    err.msg[0] = '\0';
    if (serve_config_load_string(&c, (const char *)data, size, "fuzz.yaml", &err) < 0) {
        if (strncmp(err.msg, "fuzz.yaml", 9) != 0) abort(); /* the message names the file */
        return 0;
    }
    if (!TERMINATED(c.host) || !TERMINATED(c.api_key) || !TERMINATED(c.model_id) || !TERMINATED(c.disk_path) ||
        !TERMINATED(c.disk_read_mode) || !TERMINATED(c.disk_namespace))
        abort();
    err.msg[0] = '\0';
    if (serve_config_validate(&c, &err) < 0 && err.msg[0] == '\0') abort();
    return 0;
}
