/* fuzz_replay.c - runs a libFuzzer target without libFuzzer.
 *
 * Linked with one tests/fuzz/fuzz_*.c in the ordinary builds (gcc, Release
 * and ASan+UBSan), it feeds every file under the directories given on the
 * command line (the target's seed corpus and its crash reproducers, kept in
 * tests/fuzz/<target>/) to LLVMFuzzerTestOneInput, once each, in name
 * order. CTest runs it, so an input that once crashed a target is replayed
 * by every `make test` under the sanitizers. A directory without any input
 * is an error: an empty replay would pass without testing anything. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int replay_path(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fuzz_replay: cannot stat %s\n", path);
        exit(1);
    }
    if (S_ISDIR(st.st_mode)) {
        struct dirent **names;
        int n = scandir(path, &names, NULL, alphasort);
        if (n < 0) {
            fprintf(stderr, "fuzz_replay: cannot list %s\n", path);
            exit(1);
        }
        int count = 0;
        for (int i = 0; i < n; i++) {
            if (names[i]->d_name[0] != '.') {
                char child[4096];
                snprintf(child, sizeof child, "%s/%s", path, names[i]->d_name);
                count += replay_path(child);
            }
            free(names[i]);
        }
        free(names);
        return count;
    }
    if (!S_ISREG(st.st_mode)) return 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "fuzz_replay: cannot open %s\n", path);
        exit(1);
    }
    uint8_t *data = malloc((size_t)st.st_size + 1);
    size_t got = fread(data, 1, (size_t)st.st_size, f);
    fclose(f);
    LLVMFuzzerTestOneInput(data, got);
    free(data);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR_OR_FILE...\n", argv[0]);
        return 2;
    }
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        int n = replay_path(argv[i]);
        printf("fuzz_replay: %d inputs from %s\n", n, argv[i]);
        if (n == 0) {
            fprintf(stderr, "fuzz_replay: no input under %s\n", argv[i]);
            return 1;
        }
    }
    return 0;
}
