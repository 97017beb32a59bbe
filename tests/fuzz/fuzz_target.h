/* fuzz_target.h - the two entry points every libFuzzer target defines
 * (libFuzzer's contract); fuzz_replay.c calls them on the saved corpora. */
#ifndef EMBER_FUZZ_TARGET_H
#define EMBER_FUZZ_TARGET_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
