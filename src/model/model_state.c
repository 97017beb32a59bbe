/* model_state.c - the per-sequence recurrent state (see model.h).
 *
 * One flat float array per sequence: for each ARR/LIST layer its conv state
 * ((d_conv - 1) rows of conv_dim, oldest first) at layer_weights.conv_off and
 * its recurrent state at layer_weights.ssm_off (GDN: per value head a
 * d_v x d_k matrix; mamba2: per head a P x N matrix). A snapshot is a small
 * header (magic, float count, position) followed by those floats verbatim, so
 * restore is a memcpy and bit-exact. */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

enum { STATE_MAGIC = 0x54534d45 }; /* "EMST" */

typedef struct state_header {
    uint32_t magic;
    uint32_t reserved;
    uint64_t n_floats;
    int64_t pos;
} state_header;

bool model_has_state(const model *m) { return m->state_floats > 0; }

model_state *model_state_create(const model *m, ember_error *err) {
    model_state *s = calloc(1, sizeof *s);
    if (s) s->data = calloc(m->state_floats ? m->state_floats : 1, sizeof(float));
    if (s == NULL || s->data == NULL) {
        if (s) free(s);
        ember_fail(err, "out of memory for a recurrent state of %zu floats", m->state_floats);
        return NULL;
    }
    s->m = m;
    return s;
}

void model_state_free(model_state *s) {
    if (s == NULL) return;
    free(s->data);
    free(s);
}

void model_state_reset(model_state *s) {
    memset(s->data, 0, s->m->state_floats * sizeof(float));
    s->pos = 0;
}

int64_t model_state_pos(const model_state *s) { return s->pos; }

size_t model_state_bytes(const model *m) { return sizeof(state_header) + m->state_floats * sizeof(float); }

void model_state_snapshot(const model_state *s, void *buf) {
    state_header h = {STATE_MAGIC, 0, s->m->state_floats, s->pos};
    memcpy(buf, &h, sizeof h);
    memcpy((char *)buf + sizeof h, s->data, s->m->state_floats * sizeof(float));
}

int model_state_restore(model_state *s, const void *buf, size_t n_bytes, ember_error *err) {
    state_header h;
    if (n_bytes != model_state_bytes(s->m)) return ember_fail(err, "state snapshot has %zu bytes, expected %zu", n_bytes, model_state_bytes(s->m));
    memcpy(&h, buf, sizeof h);
    if (h.magic != STATE_MAGIC || h.n_floats != s->m->state_floats || h.pos < 0)
        return ember_fail(err, "state snapshot does not belong to this model");
    memcpy(s->data, (const char *)buf + sizeof h, s->m->state_floats * sizeof(float));
    s->pos = h.pos;
    return 0;
}

void model_state_copy(model_state *dst, const model_state *src) {
    memcpy(dst->data, src->data, src->m->state_floats * sizeof(float));
    dst->pos = src->pos;
}
