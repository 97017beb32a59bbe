/* fuzz_apc_disk.c - libFuzzer target for the SSD tier's file reader.
 *
 * Feeds arbitrary bytes to apc_disk_parse_image, the same header, key-chain,
 * token and checksum path that start-up and every disk lookup run, under a
 * fixed namespace and a small layout (3 layers, one of width 0, a 24-byte
 * recurrent state in exact files and skeletons). The first
 * input byte picks the block-key hash kind. Built outside CI by `make fuzz`
 * (clang, -fsanitize=fuzzer,address,undefined):
 *
 *   make fuzz && ./fuzz_apc_disk -seeds corpus/     # write valid seed files
 *   ./fuzz_apc_disk -max_total_time=600 corpus/     # ten minutes
 *
 * Seeds are valid shards, snapshots and skeletons, so mutations start past the
 * checksums and reach the deep checks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "apc/apc_disk.h"
#include "fuzz_target.h"

static int kw[3] = {8, 0, 4}, vw[3] = {8, 0, 12};
static const apc_layout LAY = {3, kw, vw, 32, 24, 0};

static void expect_for(uint8_t sel, apc_disk_expect *ex) {
    for (int i = 0; i < 16; i++) ex->ns[i] = (uint8_t)(0xa5 ^ (i * 29));
    ex->hash = (sel & 1) ? APC_HASH_XXH3 : APC_HASH_SHA256;
    ex->layout = &LAY;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    apc_disk_expect ex;
    expect_for(data[0], &ex);
    apc_disk_header h;
    ember_error err;
    if (apc_disk_parse_image(data + 1, size - 1, &ex, &h, &err) == 0) apc_disk_header_free(&h);
    return 0;
}

/* ---- seeds ---- */

static uint64_t st = 88172645463325252ull;
static uint32_t rnd(void) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (uint32_t)st;
}

static void write_seed(const char *dir, int idx, uint8_t sel, uint32_t kind, uint32_t nb, uint32_t last, uint64_t nex) {
    apc_disk_expect ex;
    expect_for(sel, &ex);
    apc_disk_header h;
    memset(&h, 0, sizeof h);
    h.kind = kind;
    h.salt = rnd();
    uint64_t nt = kind == APC_DISK_KIND_SHARD ? 16ull * (nb - 1) + last : nex;
    int32_t *tok = malloc(nt * 4);
    for (uint64_t i = 0; i < nt; i++) tok[i] = (int32_t)(rnd() % 5000);
    apc_key keys[16], parent;
    memset(&parent, 0, sizeof parent);
    if (kind == APC_DISK_KIND_SHARD) {
        for (uint32_t j = 0; j < nb; j++) {
            int rows = j + 1 < nb ? 16 : (int)last;
            keys[j] = rows == 16 ? apc_block_key(ex.hash, &parent, h.salt, tok + 16 * j)
                                 : apc_partial_key(ex.hash, &parent, h.salt, tok + 16 * j, rows);
            parent = keys[j];
        }
        h.n_blocks = nb;
        h.last_rows = last;
        h.keys = keys;
        h.content = keys[nb - 1];
    } else if (kind == APC_DISK_KIND_SKEL) {
        h.content = apc_disk_skel_key(h.salt, tok, (int64_t)nt);
        h.first_block = rnd() % 4;
    } else {
        h.content = apc_disk_exact_key(h.salt, tok, (int64_t)nt);
    }
    h.n_tokens = nt;
    h.state_bytes = kind == APC_DISK_KIND_SHARD ? 0 : LAY.state_bytes;
    uint64_t bytes = apc_disk_file_bytes(&LAY, kind, h.n_blocks, nt);
    uint8_t *img = malloc(bytes + 1);
    img[0] = sel;
    apc_disk_write_header(img + 1, ex.ns, &h, &LAY);
    uint8_t *p = img + 1 + APC_DISK_HEADER_BYTES + 16 * (size_t)h.n_blocks;
    for (uint64_t i = 0; i < nt; i++) memcpy(p + 4 * i, &tok[i], 4);
    for (uint8_t *q = p + 4 * nt; q < img + 1 + bytes - 8; q++) *q = (uint8_t)rnd(); /* K/V and state */
    uint64_t sum = XXH3_64bits(img + 1, bytes - 8);
    memcpy(img + 1 + bytes - 8, &sum, 8);
    char path[4096];
    snprintf(path, sizeof path, "%s/seed-%02d", dir, idx);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(img, 1, bytes + 1, f);
        fclose(f);
    }
    free(img);
    free(tok);
}

/* libFuzzer calls this before its own argument parsing. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    for (int i = 1; i + 1 < *argc; i++)
        if (strcmp((*argv)[i], "-seeds") == 0) {
            const char *dir = (*argv)[i + 1];
            int k = 0;
            for (uint8_t sel = 0; sel < 2; sel++) {
                write_seed(dir, k++, sel, APC_DISK_KIND_SHARD, 1, 16, 0);
                write_seed(dir, k++, sel, APC_DISK_KIND_SHARD, 3, 5, 0);
                write_seed(dir, k++, sel, APC_DISK_KIND_SHARD, 2, 16, 0);
                write_seed(dir, k++, sel, APC_DISK_KIND_EXACT, 0, 0, 7);
                write_seed(dir, k++, sel, APC_DISK_KIND_SKEL, 0, 0, 9);
            }
            printf("wrote %d seeds to %s\n", k, dir);
            exit(0);
        }
    return 0;
}
