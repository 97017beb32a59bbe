/* test_mtp.c - the MTP ("nextn") head of qwen35 files against llama.cpp.
 *
 * The fixture qwen35-mtp-normjit-f32 stores three trunk blocks and one MTP
 * block, and carries llama.cpp's h_nextn rows (the output-normed hidden
 * state the trunk hands the head) and the head's logits for the prompt,
 * where row p drafts prompt token p+1 from token p and h_nextn[p-1].
 *
 *  - the trunk's hidden rows (model_batch.hidden) equal h_nextn within the
 *    trunk's logit bound;
 *  - the head's logits equal llama.cpp's within that bound, fed either
 *    llama.cpp's h_nextn or ember's own (the path a speculative decoder
 *    takes), with the argmax equal wherever llama.cpp's margin allows;
 *  - the head is batch-invariant: one row at a time gives the same bits
 *    as the whole prompt at once;
 *  - the MTP drafter (engine_spec.h), fed the trunk's hidden rows through
 *    spec_observe in uneven chunks, drafts at every prefix length the
 *    token llama.cpp's MTP logits rank first;
 *  - while the cost governor holds speculation paused the head only keeps
 *    the hidden rows; its batched catch-up afterwards gives the eager
 *    head's rows and drafts bit for bit (with and without a gap);
 *  - `ember logits --mtp` writes the same bits as the in-process head fed
 *    ember's own hidden rows;
 *  - `ember mkmodel --arch qwen35 --mtp` writes a file whose head loads and
 *    runs and whose trunk gives the same logits bit for bit as the file
 *    without the block (as llama.cpp's fixture checks for its own);
 *  - a model without MTP tensors reports none and refuses an MTP context
 *    (and `ember logits --mtp` says so). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_spec.h"
#include "model/model.h"
#include "test_util.h"

#define FIXTURE "reference/qwen35-mtp-normjit-f32"
static const double bound = 1e-3; /* the trunk's bound for F32 fixtures (test_model.c) */

typedef struct mtp_fixture {
    model *m;
    int n_prompt, V, D;
    int32_t *prompt;       /* (n_prompt) */
    float *ref_hidden;     /* (n_prompt, D) llama.cpp's h_nextn */
    float *ref_mtp;        /* (n_prompt, V) llama.cpp's MTP logits */
} mtp_fixture;

static bool fixture_open(mtp_fixture *f) {
    memset(f, 0, sizeof *f);
    const char *gguf = fixture_path(FIXTURE ".gguf");
    if (gguf == NULL) return false;
    ember_error err;
    f->m = model_load(gguf, &err);
    if (f->m == NULL) fail_msg("model_load: %s", err.msg);
    const model_hparams *hp = model_get_hparams(f->m);
    f->V = hp->n_vocab;
    f->D = hp->n_embd;
    cJSON *j = test_load_json(fixture_path(FIXTURE ".json"));
    cJSON *ids = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "prompt"), "ids");
    f->n_prompt = cJSON_GetArraySize(ids);
    f->prompt = malloc((size_t)f->n_prompt * sizeof *f->prompt);
    for (int i = 0; i < f->n_prompt; i++) f->prompt[i] = cJSON_GetArrayItem(ids, i)->valueint;
    cJSON_Delete(j);
    size_t n_hidden, n_mtp;
    f->ref_hidden = read_whole_file(fixture_path(FIXTURE ".h_nextn.f32"), &n_hidden);
    f->ref_mtp = read_whole_file(fixture_path(FIXTURE ".mtp_logits.f32"), &n_mtp);
    assert_non_null(f->ref_hidden);
    assert_non_null(f->ref_mtp);
    assert_int_equal(n_hidden, (size_t)f->n_prompt * f->D * sizeof(float));
    assert_int_equal(n_mtp, (size_t)f->n_prompt * f->V * sizeof(float));
    return true;
}

static void fixture_close(mtp_fixture *f) {
    model_free(f->m);
    free(f->prompt);
    free(f->ref_hidden);
    free(f->ref_mtp);
}

/* The trunk over the whole prompt: the hidden rows of every position. */
static void trunk_hidden(const mtp_fixture *f, float *hidden) {
    ember_error err;
    kv_pool_config cfg;
    model_kv_config(f->m, 16, &cfg);
    kv_pool *pool = kv_pool_create(&cfg, &err);
    assert_non_null(pool);
    model_ctx *ctx = model_ctx_create(f->m, pool, 2, 128, &err);
    assert_non_null(ctx);
    model_state *state = model_state_create(f->m, &err);
    assert_non_null(state);
    kv_seq seq;
    kv_seq_init(&seq);
    float *logits = malloc((size_t)f->n_prompt * f->V * sizeof(float));
    if (model_eval_hidden(ctx, &seq, state, f->prompt, f->n_prompt, true, logits, hidden, &err) < 0)
        fail_msg("trunk: %s", err.msg);
    free(logits);
    kv_seq_release(pool, &seq);
    model_state_free(state);
    model_ctx_free(ctx);
    kv_pool_free(pool);
}

/* The MTP head over the prompt, `step` rows per forward; h_prev row p is
 * hidden row p-1 (zeros at p = 0), as llama.cpp's draft-mtp driver feeds it. */
static void mtp_logits(const mtp_fixture *f, const float *hidden, int step, float *logits, float *head_out) {
    ember_error err;
    kv_pool_config cfg;
    model_mtp_kv_config(f->m, 16, &cfg);
    kv_pool *pool = kv_pool_create(&cfg, &err);
    assert_non_null(pool);
    model_ctx *ctx = model_mtp_ctx_create(f->m, pool, 2, 128, &err);
    if (ctx == NULL) fail_msg("model_mtp_ctx_create: %s", err.msg);
    kv_seq seq;
    kv_seq_init(&seq);
    int n = f->n_prompt, D = f->D;
    float *h_prev = calloc((size_t)n * D, sizeof(float));
    memcpy(h_prev + D, hidden, (size_t)(n - 1) * D * sizeof(float));
    for (int start = 0; start < n; start += step) {
        int k = n - start < step ? n - start : step;
        if (model_mtp_eval(ctx, &seq, f->prompt + start, k, h_prev + (size_t)start * D, logits + (size_t)start * f->V,
                           head_out ? head_out + (size_t)start * D : NULL, &err) < 0)
            fail_msg("mtp: %s", err.msg);
    }
    free(h_prev);
    kv_seq_release(pool, &seq);
    model_ctx_free(ctx);
    kv_pool_free(pool);
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Max |mine - ref| over rows x width; argmax checked where the reference's
 * top-1 margin exceeds twice the bound (logits only: argmax_rows true). */
static double max_diff(const float *mine, const float *ref, int rows, int width, bool argmax_rows, int *checked) {
    double d = 0;
    for (int p = 0; p < rows; p++) {
        const float *a = mine + (size_t)p * width, *r = ref + (size_t)p * width;
        for (int i = 0; i < width; i++) d = fmax(d, fabs((double)a[i] - r[i]));
        if (!argmax_rows) continue;
        int rb = argmax(r, width);
        float second = -INFINITY;
        for (int i = 0; i < width; i++)
            if (i != rb && r[i] > second) second = r[i];
        if (r[rb] - second > 2 * bound) {
            if (argmax(a, width) != rb) fail_msg("row %d: MTP argmax %d, llama.cpp %d", p, argmax(a, width), rb);
            (*checked)++;
        }
    }
    return d;
}

static void test_mtp_reference(void **unused) {
    (void)unused;
    mtp_fixture f;
    if (!fixture_open(&f)) return;
    assert_true(model_has_mtp(f.m));
    assert_int_equal(model_get_hparams(f.m)->n_layer, 3);
    int n = f.n_prompt, D = f.D, V = f.V;
    float *hidden = malloc((size_t)n * D * sizeof(float));
    trunk_hidden(&f, hidden);
    int checked = 0;
    double d_hidden = max_diff(hidden, f.ref_hidden, n, D, false, &checked);

    float *from_ref = malloc((size_t)n * V * sizeof(float));
    float *from_own = malloc((size_t)n * V * sizeof(float));
    mtp_logits(&f, f.ref_hidden, n, from_ref, NULL);
    mtp_logits(&f, hidden, n, from_own, NULL);
    double d_ref = max_diff(from_ref, f.ref_mtp, n, V, true, &checked);
    double d_own = max_diff(from_own, f.ref_mtp, n, V, true, &checked);
    print_message("qwen35-mtp: %d rows; hidden max |diff| %.3g; MTP logits max |diff| %.3g (llama.cpp's h), "
                  "%.3g (ember's h); bound %.3g; argmax checked at %d rows\n",
                  n, d_hidden, d_ref, d_own, bound, checked);
    assert_true(d_hidden <= bound);
    assert_true(d_ref <= bound);
    assert_true(d_own <= bound);
    assert_true(checked >= n); /* every row of both runs has a margin > 2e-3 but a handful */
    free(hidden);
    free(from_ref);
    free(from_own);
    fixture_close(&f);
}

static void test_mtp_batch_invariance(void **unused) {
    (void)unused;
    mtp_fixture f;
    if (!fixture_open(&f)) return;
    int n = f.n_prompt, D = f.D, V = f.V;
    float *whole = malloc((size_t)n * V * sizeof(float)), *rows = malloc((size_t)n * V * sizeof(float));
    float *head_whole = malloc((size_t)n * D * sizeof(float)), *head_rows = malloc((size_t)n * D * sizeof(float));
    mtp_logits(&f, f.ref_hidden, n, whole, head_whole);
    mtp_logits(&f, f.ref_hidden, 1, rows, head_rows);
    assert_memory_equal(whole, rows, (size_t)n * V * sizeof(float));
    assert_memory_equal(head_whole, head_rows, (size_t)n * D * sizeof(float));
    mtp_logits(&f, f.ref_hidden, 7, rows, NULL);
    assert_memory_equal(whole, rows, (size_t)n * V * sizeof(float));
    free(whole);
    free(rows);
    free(head_whole);
    free(head_rows);
    fixture_close(&f);
}

static void test_mtp_drafter_matches_head(void **unused) {
    (void)unused;
    mtp_fixture f;
    if (!fixture_open(&f)) return;
    int n = f.n_prompt, D = f.D, V = f.V;
    float *hidden = malloc((size_t)n * D * sizeof(float));
    trunk_hidden(&f, hidden);
    ember_error err;
    spec_config cfg = {.kind = SPEC_MTP, .k = 1};
    spec_drafter *d = spec_drafter_create(f.m, &cfg, 16, 2, 32, &err);
    if (d == NULL) fail_msg("%s", err.msg);
    assert_true(spec_drafter_wants_hidden(d));
    spec_seq *s = spec_seq_create(d, 0, &err);
    assert_non_null(s);
    /* Observe in chunks of 1, 2, 3, ... rows; after each, the draft for
     * the next position is the head's argmax at the newest committed row. */
    int64_t at = 0;
    int checked = 0;
    for (int chunk = 1; at < n - 1; chunk++) {
        int64_t len = at + chunk < n - 1 ? chunk : n - 1 - at;
        spec_observe(d, s, f.prompt, at, len, hidden + (size_t)at * D);
        at += len;
        int32_t draft[4];
        assert_int_equal(spec_draft(d, s, f.prompt, at + 1, 1, draft), 1);
        assert_int_equal(draft[0], argmax(f.ref_mtp + (size_t)at * V, V));
        checked++;
        /* asking before the head has seen the newest row drafts nothing */
        if (at + 2 <= n) assert_int_equal(spec_draft(d, s, f.prompt, at + 2, 1, draft), 0);
    }
    print_message("MTP drafter: first draft equals llama.cpp's MTP argmax at %d prefix lengths\n", checked);
    spec_seq_free(d, s);
    spec_drafter_free(d);
    free(hidden);
    fixture_close(&f);
}

/* A paused cost governor (engine_spec.c) leaves the head idle: it keeps
 * the hidden rows it is handed and computes its rows in one batch when it
 * drafts (or exports) again. Those rows are the eager head's, bit for bit:
 * the exported K/V and hidden rows are equal, and so are the drafts, also
 * after a gap (a cached prefix the head never saw, zero rows). */
static void test_mtp_lazy_catch_up(void **unused) {
    (void)unused;
    mtp_fixture f;
    if (!fixture_open(&f)) return;
    int n = f.n_prompt, D = f.D;
    float *hidden = malloc((size_t)n * D * sizeof(float));
    trunk_hidden(&f, hidden);
    ember_error err;
    spec_config cfg = {.kind = SPEC_MTP, .k = 4, .adaptive = true};
    for (int64_t gap = 0; gap <= 5; gap += 5) {
        spec_drafter *d[2];
        spec_seq *s[2];
        uint32_t *rows[2];
        int32_t drafts[2][4];
        int got[2];
        for (int lazy = 0; lazy < 2; lazy++) {
            d[lazy] = spec_drafter_create(f.m, &cfg, 16, 2, 32, &err);
            if (d[lazy] == NULL) fail_msg("%s", err.msg);
            s[lazy] = spec_seq_create(d[lazy], 0, &err);
            assert_non_null(s[lazy]);
            if (lazy) spec_drafter_hold_paused(d[lazy], true);
            for (int64_t at = gap, chunk = 1; at < n - 1; at += chunk, chunk++) {
                if (at + chunk > n - 1) chunk = n - 1 - at;
                spec_observe(d[lazy], s[lazy], f.prompt, at, chunk, hidden + (size_t)at * D);
            }
            if (lazy) spec_drafter_hold_paused(d[lazy], false);
            got[lazy] = spec_draft(d[lazy], s[lazy], f.prompt, n, 4, drafts[lazy]);
            rows[lazy] = spec_export(d[lazy], s[lazy], n - 1);
        }
        assert_int_equal(got[0], got[1]);
        assert_true(got[0] > 0);
        assert_memory_equal(drafts[0], drafts[1], (size_t)got[0] * sizeof(int32_t));
        if (gap == 0) { /* a head that saw every row exports them; the lazy one the same bits */
            assert_non_null(rows[0]);
            assert_non_null(rows[1]);
            assert_memory_equal(rows[0], rows[1], (size_t)(n - 1) * spec_state_words(d[0]) * sizeof(uint32_t));
        } else { /* zero rows in the gap: not faithful, nothing to export, either way */
            assert_null(rows[0]);
            assert_null(rows[1]);
        }
        for (int lazy = 0; lazy < 2; lazy++) {
            free(rows[lazy]);
            spec_seq_free(d[lazy], s[lazy]);
            spec_drafter_free(d[lazy]);
        }
        print_message("MTP head, lazy catch-up after a pause (gap %lld): %d drafts equal to the eager head's\n",
                      (long long)gap, got[0]);
    }
    free(hidden);
    fixture_close(&f);
}

static void test_logits_cli_mtp(void **unused) {
    (void)unused;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    mtp_fixture f;
    if (!fixture_open(&f)) return;
    int n = f.n_prompt, D = f.D, V = f.V;
    char *dir = make_temp_dir(), out_path[512], *cmd = malloc(16384), *out;
    snprintf(out_path, sizeof out_path, "%s/mtp.f32", dir);
    int len = snprintf(cmd, 16384, "%s logits %s --mtp --out %s --tokens ", ember_binary(), fixture_path(FIXTURE ".gguf"),
                       out_path);
    for (int i = 0; i < n; i++) len += snprintf(cmd + len, 16384 - (size_t)len, "%s%d", i ? "," : "", f.prompt[i]);
    snprintf(cmd + len, 16384 - (size_t)len, " 2>&1");
    assert_int_equal(run_capture(cmd, &out), 0);
    free(out);
    size_t size;
    float *file = read_whole_file(out_path, &size);
    assert_int_equal(size, (size_t)n * V * sizeof(float));
    float *hidden = malloc((size_t)n * D * sizeof(float)), *mine = malloc((size_t)n * V * sizeof(float));
    trunk_hidden(&f, hidden);
    mtp_logits(&f, hidden, n, mine, NULL);
    assert_memory_equal(file, mine, (size_t)n * V * sizeof(float));

    const char *plain = fixture_path("reference/qwen35-f32.gguf");
    snprintf(cmd, 16384, "%s logits %s --mtp --tokens 1,2,3 --out %s 2>&1", ember_binary(), plain, out_path);
    assert_int_not_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, "no MTP"));
    free(out);
    free(file);
    free(hidden);
    free(mine);
    free(cmd);
    remove_tree(dir);
    free(dir);
    fixture_close(&f);
}

/* ember logits over ids into out_path (run under ctest: EMBER_BIN). */
static void logits_file(const char *model_path, const char *extra, const char *out_path) {
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "%s logits %s %s --tokens 1,40,41,42,43,44,45,46,47,48,49,50 --out %s 2>&1",
             ember_binary(), model_path, extra, out_path);
    int rc = run_capture(cmd, &out);
    if (rc != 0) fail_msg("%s: %s", cmd, out);
    free(out);
}

static void test_mkmodel_mtp(void **unused) {
    (void)unused;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    char *dir = make_temp_dir(), with[512], without[512], a[512], b[512], c[512], cmd[2048], *out;
    snprintf(with, sizeof with, "%s/mtp.gguf", dir);
    snprintf(without, sizeof without, "%s/plain.gguf", dir);
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen35 --mtp --out %s 2>&1 && %s mkmodel --arch qwen35 --out %s 2>&1",
             ember_binary(), with, ember_binary(), without);
    assert_int_equal(run_capture(cmd, &out), 0);
    free(out);
    ember_error err;
    model *m = model_load(with, &err);
    if (m == NULL) fail_msg("%s", err.msg);
    assert_true(model_has_mtp(m));
    model_free(m);
    snprintf(a, sizeof a, "%s/a.f32", dir);
    snprintf(b, sizeof b, "%s/b.f32", dir);
    snprintf(c, sizeof c, "%s/c.f32", dir);
    logits_file(with, "", a);
    logits_file(without, "", b);
    logits_file(with, "--mtp", c);
    size_t na, nb, nc;
    float *la = read_whole_file(a, &na), *lb = read_whole_file(b, &nb), *lc = read_whole_file(c, &nc);
    assert_int_equal(na, nb);
    assert_memory_equal(la, lb, na);
    assert_int_equal(nc, na);
    assert_memory_not_equal(la, lc, na);
    for (size_t i = 0; i < nc / sizeof(float); i++) assert_true(isfinite(lc[i]));
    free(la);
    free(lb);
    free(lc);
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --mtp --out %s/x.gguf 2>&1", ember_binary(), dir);
    assert_int_not_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, "no MTP block"));
    free(out);
    remove_tree(dir);
    free(dir);
}

static void test_no_mtp(void **unused) {
    (void)unused;
    const char *gguf = fixture_path("reference/qwen35-f32.gguf");
    if (gguf == NULL) return;
    ember_error err;
    model *m = model_load(gguf, &err);
    assert_non_null(m);
    assert_false(model_has_mtp(m));
    kv_pool_config cfg;
    model_kv_config(m, 4, &cfg);
    kv_pool *pool = kv_pool_create(&cfg, &err);
    assert_non_null(pool);
    assert_null(model_mtp_ctx_create(m, pool, 1, 8, &err));
    assert_non_null(strstr(err.msg, "no MTP"));
    kv_pool_free(pool);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mtp_reference),
        cmocka_unit_test(test_mtp_batch_invariance),
        cmocka_unit_test(test_mtp_drafter_matches_head),
        cmocka_unit_test(test_mtp_lazy_catch_up),
        cmocka_unit_test(test_logits_cli_mtp),
        cmocka_unit_test(test_mkmodel_mtp),
        cmocka_unit_test(test_no_mtp),
    };
    return test_run_group(tests, NULL, NULL);
}
