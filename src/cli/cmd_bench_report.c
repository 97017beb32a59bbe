/* cmd_bench_report.c - what `ember bench` writes (bench.h): per-request CSV
 * and JSONL, summary.json, the summary on stdout and a self-contained HTML
 * report whose plots are inline SVG drawn here (no script, no network).
 *
 * The measured token hit rate is the sum of the cached tokens the server
 * reported over the sum of its prompt tokens, over the requests that
 * reported both; the ideal rates are over the trace's scaled input tokens.
 * Percentiles are nearest-rank over the requests that produced a token. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli/bench.h"

typedef struct summary {
    int n, ok, errors;
    int64_t prompt, cached, input, ideal, lru, completion;
    double hit, ideal_hit, lru_hit;   /* < 0: not known */
    double p50, p90, p99;             /* TTFT seconds; < 0: none */
    double wall, req_s, out_tok_s, prompt_tok_s;
} summary;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct_rank(const double *v, int n, double p) {
    if (n == 0) return -1;
    int k = (int)ceil(p * n) - 1;
    if (k < 0) k = 0;
    if (k >= n) k = n - 1;
    return v[k];
}

static void summarize(const bench_workload *w, double wall, summary *s) {
    memset(s, 0, sizeof *s);
    s->n = w->n;
    s->wall = wall;
    double *ttft = malloc((size_t)(w->n ? w->n : 1) * sizeof *ttft);
    int nt = 0;
    bool ideal_known = true, lru_known = true;
    for (int i = 0; i < w->n; i++) {
        const bench_req *r = &w->reqs[i];
        if (r->error[0] || r->status != 200) s->errors++;
        else s->ok++;
        if (r->prompt_tokens > 0 && r->cached_tokens >= 0) {
            s->prompt += r->prompt_tokens;
            s->cached += r->cached_tokens;
        }
        s->completion += r->completion_tokens > 0 ? r->completion_tokens : 0;
        if (r->ttft_s >= 0 && ttft) ttft[nt++] = r->ttft_s;
        s->input += r->input_tokens;
        if (r->ideal_cached < 0) ideal_known = false;
        else s->ideal += r->ideal_cached;
        if (r->lru_cached < 0) lru_known = false;
        else s->lru += r->lru_cached;
    }
    s->hit = s->prompt > 0 ? (double)s->cached / (double)s->prompt : -1;
    s->ideal_hit = ideal_known && s->input > 0 ? (double)s->ideal / (double)s->input : -1;
    s->lru_hit = lru_known && s->input > 0 ? (double)s->lru / (double)s->input : -1;
    if (ttft) qsort(ttft, (size_t)nt, sizeof *ttft, cmp_double);
    s->p50 = pct_rank(ttft, nt, 0.50);
    s->p90 = pct_rank(ttft, nt, 0.90);
    s->p99 = pct_rank(ttft, nt, 0.99);
    free(ttft);
    s->req_s = wall > 0 ? s->ok / wall : 0;
    s->out_tok_s = wall > 0 ? (double)s->completion / wall : 0;
    s->prompt_tok_s = wall > 0 ? (double)s->prompt / wall : 0;
}

static double decode_rate(const bench_req *r) {
    double d = r->total_s - r->ttft_s;
    return r->completion_tokens > 1 && r->ttft_s >= 0 && d > 0 ? (r->completion_tokens - 1) / d : 0;
}

static int mkdirs(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

static FILE *open_out(const bench_opts *o, const char *name, char *err, size_t cap) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", o->out_dir, name);
    FILE *f = fopen(path, "w");
    if (f == NULL) snprintf(err, cap, "cannot write %s", path);
    return f;
}

static void csv_field(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static cJSON *req_json(const bench_req *r, int i) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "index", i);
    cJSON_AddNumberToObject(j, "session", r->session);
    cJSON_AddNumberToObject(j, "turn", r->turn);
    cJSON_AddNumberToObject(j, "scheduled_s", r->t_s);
    cJSON_AddNumberToObject(j, "start_s", r->start_s);
    cJSON_AddNumberToObject(j, "status", r->status);
    cJSON_AddNumberToObject(j, "prompt_tokens", (double)r->prompt_tokens);
    cJSON_AddNumberToObject(j, "cached_tokens", (double)r->cached_tokens);
    cJSON_AddNumberToObject(j, "ideal_cached_tokens", (double)r->ideal_cached);
    cJSON_AddNumberToObject(j, "lru_cached_tokens", (double)r->lru_cached);
    cJSON_AddNumberToObject(j, "completion_tokens", r->completion_tokens);
    cJSON_AddNumberToObject(j, "ttft_s", r->ttft_s);
    cJSON_AddNumberToObject(j, "total_s", r->total_s);
    cJSON_AddNumberToObject(j, "decode_tok_s", decode_rate(r));
    cJSON_AddStringToObject(j, "error", r->error);
    return j;
}

/* ---- SVG ---- */

typedef struct series {
    const double *x, *y;
    int n;
    const char *color, *label;
    bool line;
    bool dashed;
} series;

static double nice_step(double range) {
    if (range <= 0) return 1;
    double raw = range / 5, mag = pow(10, floor(log10(raw))), r = raw / mag;
    return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
}

static void svg_plot(FILE *f, const char *title, const char *xlabel, const char *ylabel, const series *s, int ns,
                     bool y_percent) {
    const double W = 640, H = 320, L = 64, R = 16, T = 40, B = 44;
    double x0 = INFINITY, x1 = -INFINITY, y1 = y_percent ? 1 : 0;
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < s[k].n; i++) {
            if (!isfinite(s[k].x[i]) || !isfinite(s[k].y[i])) continue;
            if (s[k].x[i] < x0) x0 = s[k].x[i];
            if (s[k].x[i] > x1) x1 = s[k].x[i];
            if (s[k].y[i] > y1) y1 = s[k].y[i];
        }
    if (!isfinite(x0)) x0 = 0, x1 = 1;
    if (x1 <= x0) x1 = x0 + 1;
    double ys = nice_step(y1), xs = nice_step(x1 - x0);
    y1 = ceil(y1 / ys) * ys;
    if (y1 <= 0) y1 = 1;
#define PX(v) (L + ((v) - x0) / (x1 - x0) * (W - L - R))
#define PY(v) (H - B - (v) / y1 * (H - T - B))
    fprintf(f, "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\">\n",
            W, H, W, H);
    fprintf(f, "<text x=\"%.0f\" y=\"18\" class=\"t\">%s</text>\n", L, title);
    for (double v = 0; v <= y1 + ys / 2; v += ys) {
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"g\"/>", L, W - R, PY(v), PY(v));
        if (y_percent) fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"yl\">%.0f%%</text>\n", L - 6, PY(v) + 4, 100 * v);
        else fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"yl\">%g</text>\n", L - 6, PY(v) + 4, v);
    }
    for (double v = ceil(x0 / xs) * xs; v <= x1 + xs / 1e6; v += xs)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"xl\">%g</text>\n", PX(v), H - B + 16, v);
    fprintf(f, "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.0f\" y2=\"%.0f\" class=\"a\"/>", L, W - R, H - B, H - B);
    fprintf(f, "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.0f\" y2=\"%.0f\" class=\"a\"/>\n", L, L, T, H - B);
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" class=\"xt\">%s</text>", (L + W - R) / 2, H - 8, xlabel);
    fprintf(f, "<text transform=\"translate(14 %.0f) rotate(-90)\" class=\"xt\">%s</text>\n", (T + H - B) / 2, ylabel);
    double lx = L + 8;
    for (int k = 0; k < ns; k++) {
        fprintf(f, "<rect x=\"%.0f\" y=\"26\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%.0f\" y=\"35\" class=\"lg\">%s</text>\n",
                lx, s[k].color, lx + 14, s[k].label);
        lx += 24 + 6.5 * (double)strlen(s[k].label);
        if (s[k].line) {
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", s[k].color,
                    s[k].dashed ? " stroke-dasharray=\"6 4\"" : "");
            for (int i = 0; i < s[k].n; i++)
                if (isfinite(s[k].y[i])) fprintf(f, "%.1f,%.1f ", PX(s[k].x[i]), PY(s[k].y[i]));
            fprintf(f, "\"/>\n");
        } else {
            for (int i = 0; i < s[k].n; i++)
                if (isfinite(s[k].y[i]))
                    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\" fill-opacity=\"0.7\"/>",
                            PX(s[k].x[i]), PY(s[k].y[i]), s[k].color);
            fprintf(f, "\n");
        }
    }
#undef PX
#undef PY
    fprintf(f, "</svg></figure>\n");
}

static void svg_bars(FILE *f, const char *title, const char *const *labels, const double *v, int n) {
    const double W = 640, row = 28, T = 34, L = 250;
    double H = T + row * n + 12, max = 0;
    for (int i = 0; i < n; i++) max = v[i] > max ? v[i] : max;
    if (max <= 0) max = 1;
    fprintf(f, "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\">\n",
            W, H, W, H);
    fprintf(f, "<text x=\"8\" y=\"18\" class=\"t\">%s</text>\n", title);
    for (int i = 0; i < n; i++) {
        double y = T + row * i, w = (W - L - 90) * v[i] / max;
        fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" class=\"yl\">%s</text>", L - 8, y + 15, labels[i]);
        fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.1f\" height=\"18\" fill=\"#57ab5a\"/>", L, y + 2, w);
        fprintf(f, "<text x=\"%.1f\" y=\"%.0f\" class=\"lg\">%.0f</text>\n", L + w + 6, y + 15, v[i]);
    }
    fprintf(f, "</svg></figure>\n");
}

static double stat_delta(const bench_server *srv, const char *key) {
    const cJSON *a = cJSON_GetObjectItem(srv->stats_after, key), *b = cJSON_GetObjectItem(srv->stats_before, key);
    return cJSON_IsNumber(a) && cJSON_IsNumber(b) ? a->valuedouble - b->valuedouble : 0;
}

static void html_escape(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

static void fmt_pct(char *b, size_t cap, double v) {
    if (v < 0) snprintf(b, cap, "n/a");
    else snprintf(b, cap, "%.1f%%", 100 * v);
}

static void fmt_ms(char *b, size_t cap, double v) {
    if (v < 0) snprintf(b, cap, "n/a");
    else snprintf(b, cap, "%.1f ms", 1000 * v);
}

static void write_html(FILE *f, const bench_opts *o, const bench_workload *w, const bench_server *srv,
                       const summary *s) {
    char hit[32], ideal[32], lru[32], p50[32], p90[32], p99[32], shit[32];
    fmt_pct(hit, sizeof hit, s->hit);
    fmt_pct(ideal, sizeof ideal, s->ideal_hit);
    fmt_pct(lru, sizeof lru, s->lru_hit);
    fmt_ms(p50, sizeof p50, s->p50);
    fmt_ms(p90, sizeof p90, s->p90);
    fmt_ms(p99, sizeof p99, s->p99);
    fmt_pct(shit, sizeof shit, srv->ember && srv->prompt_tokens > 0 ? srv->cached_tokens / srv->prompt_tokens : -1);
    time_t now = time(NULL);
    char when[64];
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    fputs("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>ember bench</title>\n<style>\n"
          "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1340px;color:#1f2328;padding:0 16px}\n"
          "h1{font-size:22px;margin:0 0 4px}.dim{color:#656d76}table{border-collapse:collapse;margin:12px 0}\n"
          "td,th{padding:4px 12px;border-bottom:1px solid #d0d7de;text-align:left}td.n{text-align:right}\n"
          ".plots{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;border:1px solid #d0d7de;border-radius:6px}\n"
          "svg text{font:11px system-ui,sans-serif;fill:#424a53}svg .t{font-size:13px;font-weight:600;fill:#1f2328}\n"
          "svg .yl{text-anchor:end}svg .xl{text-anchor:middle}svg .xt{text-anchor:middle;font-size:12px}\n"
          "svg .g{stroke:#eaeef2}svg .a{stroke:#8c959f}\n</style></head><body>\n", f);
    fputs("<h1>", f);
    html_escape(f, o->title ? o->title : "ember bench");
    fputs("</h1>\n<p class=\"dim\">", f);
    html_escape(f, o->trace);
    fprintf(f, " &middot; %s &middot; %d requests &middot; %d client%s &middot; %s &middot; block %d tokens &middot; %s</p>\n",
            w->kind == BENCH_MOONCAKE ? "Mooncake trace" : "ember sessions", w->n, o->clients,
            o->clients == 1 ? "" : "s", o->timestamps ? "on the trace's timestamps" : "as fast as possible",
            o->block_tokens, when);
    fputs("<table><tr><th>server</th><td>", f);
    html_escape(f, o->url);
    fprintf(f, "%s</td></tr>\n", srv->ember ? " (ember)" : "");
    fprintf(f, "<tr><th>requests</th><td>%d ok, %d errors in %.2f s: %.2f req/s, %.0f output tok/s, %.0f prompt tok/s</td></tr>\n",
            s->ok, s->errors, s->wall, s->req_s, s->out_tok_s, s->prompt_tok_s);
    fprintf(f, "<tr><th>token hit rate (measured)</th><td>%s (%lld of %lld prompt tokens, from each response's usage)</td></tr>\n",
            hit, (long long)s->cached, (long long)s->prompt);
    if (srv->ember)
        fprintf(f, "<tr><th>token hit rate (server counters)</th><td>%s (%.0f of %.0f: ember /metrics over the run)</td></tr>\n",
                shit, srv->cached_tokens, srv->prompt_tokens);
    fprintf(f, "<tr><th>ideal hit rate</th><td>%s with an unbounded cache; %s with an LRU of %lld tokens</td></tr>\n",
            ideal, lru, (long long)o->capacity_tokens);
    fprintf(f, "<tr><th>TTFT</th><td>p50 %s, p90 %s, p99 %s</td></tr></table>\n", p50, p90, p99);

    int n = w->n;
    double *t = calloc((size_t)n + 1, sizeof *t), *ttft = calloc((size_t)n + 1, sizeof *ttft),
           *idx = calloc((size_t)n + 1, sizeof *idx), *cm = calloc((size_t)n + 1, sizeof *cm),
           *ci = calloc((size_t)n + 1, sizeof *ci), *cl = calloc((size_t)n + 1, sizeof *cl),
           *plen = calloc((size_t)n + 1, sizeof *plen), *warm = calloc((size_t)n + 1, sizeof *warm),
           *cold = calloc((size_t)n + 1, sizeof *cold), *wx = calloc((size_t)n + 1, sizeof *wx),
           *cx = calloc((size_t)n + 1, sizeof *cx);
    if (!t || !ttft || !idx || !cm || !ci || !cl || !plen || !warm || !cold || !wx || !cx) goto done;
    int64_t sp = 0, sc = 0, si = 0, sid = 0, sl = 0;
    int nw = 0, nc = 0;
    /* cumulative rates in the order requests finished their first token is noisy; use start order */
    for (int i = 0; i < n; i++) {
        const bench_req *r = &w->reqs[i];
        t[i] = r->start_s;
        ttft[i] = r->ttft_s >= 0 ? 1000 * r->ttft_s : NAN;
        idx[i] = i + 1;
        if (r->prompt_tokens > 0 && r->cached_tokens >= 0) sp += r->prompt_tokens, sc += r->cached_tokens;
        si += r->input_tokens;
        sid += r->ideal_cached > 0 ? r->ideal_cached : 0;
        sl += r->lru_cached > 0 ? r->lru_cached : 0;
        cm[i] = sp ? (double)sc / (double)sp : NAN;
        ci[i] = si && r->ideal_cached >= 0 ? (double)sid / (double)si : NAN;
        cl[i] = si && r->lru_cached >= 0 ? (double)sl / (double)si : NAN;
        if (r->ttft_s >= 0 && r->prompt_tokens > 0) {
            bool is_warm = r->cached_tokens * 2 > r->prompt_tokens;
            if (is_warm) wx[nw] = (double)r->prompt_tokens, warm[nw++] = 1000 * r->ttft_s;
            else cx[nc] = (double)r->prompt_tokens, cold[nc++] = 1000 * r->ttft_s;
        }
        plen[i] = (double)r->prompt_tokens;
    }
    fputs("<div class=\"plots\">\n", f);
    series s1[] = {{t, ttft, n, "#0969da", "TTFT of each request", false}};
    svg_plot(f, "TTFT over time", "request start (s)", "TTFT (ms)", s1, 1, false);
    series s2[] = {{idx, cm, n, "#0969da", "measured", true},
                   {idx, ci, w->kind == BENCH_MOONCAKE ? n : 0, "#8250df", "ideal, unbounded", true, true},
                   {idx, cl, w->kind == BENCH_MOONCAKE && o->capacity_tokens > 0 ? n : 0, "#bf8700", "ideal, LRU", true,
                    true}};
    svg_plot(f, "Token hit rate vs ideal (cumulative)", "requests", "hit rate", s2, 3, true);
    series s4[] = {{cx, cold, nc, "#cf222e", "mostly prefilled", false}, {wx, warm, nw, "#1a7f37", "mostly cached", false}};
    svg_plot(f, "TTFT vs prompt length", "prompt tokens", "TTFT (ms)", s4, 2, false);
    if (srv->ember) {
        const cJSON *tier = cJSON_GetObjectItem(srv->stats_after, "tier");
        char l0[96];
        snprintf(l0, sizeof l0, "%s tier (matched_tokens)", cJSON_IsString(tier) ? tier->valuestring : "memory");
        const char *labels[] = {l0, "checkpoint records (ckpt_matched)", "SSD reads (disk_hits x block)",
                                "speculative prefix layer", "prefilled (served_tokens)"};
        const cJSON *bsz = cJSON_GetObjectItem(srv->stats_after, "block_size");
        double bs = cJSON_IsNumber(bsz) ? bsz->valuedouble : 16;
        double v[] = {stat_delta(srv, "matched_tokens") - stat_delta(srv, "ckpt_matched_tokens"),
                      stat_delta(srv, "ckpt_matched_tokens"), stat_delta(srv, "disk_hits") * bs,
                      stat_delta(srv, "spec_prefix_hit_tokens"), stat_delta(srv, "served_tokens")};
        svg_bars(f, "Cached tokens per tier over the run (ember /v1/cache/stats)", labels, v, 5);
    } else {
        const char *labels[] = {"cached (usage)", "prefilled"};
        double v[] = {(double)s->cached, (double)(s->prompt - s->cached)};
        svg_bars(f, "Prompt tokens (this server reports no tiers)", labels, v, 2);
    }
    fputs("</div>\n<p class=\"dim\">Ideal rates count, for each request, its leading trace blocks seen before "
          "(capped at N-1 tokens), with an unbounded cache or an LRU of the server's capacity; they need a "
          "Mooncake trace. Written by <code>ember bench</code>; per-request data in requests.csv and "
          "requests.jsonl beside this file.</p>\n</body></html>\n", f);
done:
    free(t), free(ttft), free(idx), free(cm), free(ci), free(cl), free(plen), free(warm), free(cold), free(wx), free(cx);
}

int bench_write_outputs(const bench_opts *o, const bench_workload *w, const bench_server *srv, double wall_s,
                        char *err, size_t cap) {
    if (mkdirs(o->out_dir) < 0) {
        snprintf(err, cap, "cannot create the directory %s", o->out_dir);
        return -1;
    }
    summary s;
    summarize(w, wall_s, &s);
    FILE *csv = open_out(o, "requests.csv", err, cap);
    if (csv == NULL) return -1;
    fprintf(csv, "index,session,turn,scheduled_s,start_s,status,prompt_tokens,cached_tokens,ideal_cached_tokens,"
                 "lru_cached_tokens,completion_tokens,ttft_s,total_s,decode_tok_s,error\n");
    FILE *jl = open_out(o, "requests.jsonl", err, cap);
    if (jl == NULL) {
        fclose(csv);
        return -1;
    }
    for (int i = 0; i < w->n; i++) {
        const bench_req *r = &w->reqs[i];
        fprintf(csv, "%d,%d,%d,%.6f,%.6f,%d,%lld,%lld,%lld,%lld,%d,%.6f,%.6f,%.2f,", i, r->session, r->turn, r->t_s,
                r->start_s, r->status, (long long)r->prompt_tokens, (long long)r->cached_tokens,
                (long long)r->ideal_cached, (long long)r->lru_cached, r->completion_tokens, r->ttft_s, r->total_s,
                decode_rate(r));
        csv_field(csv, r->error);
        fputc('\n', csv);
        cJSON *j = req_json(r, i);
        char *line = cJSON_PrintUnformatted(j);
        cJSON_Delete(j);
        if (line) fprintf(jl, "%s\n", line);
        free(line);
    }
    bool bad = fclose(csv) != 0;
    bad |= fclose(jl) != 0;

    cJSON *sj = cJSON_CreateObject();
    cJSON_AddStringToObject(sj, "trace", o->trace);
    cJSON_AddStringToObject(sj, "kind", w->kind == BENCH_MOONCAKE ? "mooncake" : "sessions");
    cJSON_AddStringToObject(sj, "url", o->url);
    cJSON_AddNumberToObject(sj, "clients", o->clients);
    cJSON_AddBoolToObject(sj, "timestamps", o->timestamps);
    cJSON_AddNumberToObject(sj, "speed", o->speed);
    cJSON_AddNumberToObject(sj, "block_tokens", o->block_tokens);
    cJSON_AddNumberToObject(sj, "requests", s.n);
    cJSON_AddNumberToObject(sj, "ok", s.ok);
    cJSON_AddNumberToObject(sj, "errors", s.errors);
    cJSON_AddNumberToObject(sj, "wall_s", s.wall);
    cJSON_AddNumberToObject(sj, "prompt_tokens", (double)s.prompt);
    cJSON_AddNumberToObject(sj, "cached_tokens", (double)s.cached);
    cJSON_AddNumberToObject(sj, "completion_tokens", (double)s.completion);
    cJSON_AddNumberToObject(sj, "token_hit_rate", s.hit);
    cJSON_AddNumberToObject(sj, "trace_input_tokens", (double)s.input);
    cJSON_AddNumberToObject(sj, "ideal_hit_rate_unbounded", s.ideal_hit);
    cJSON_AddNumberToObject(sj, "ideal_hit_rate_lru", s.lru_hit);
    cJSON_AddNumberToObject(sj, "lru_capacity_tokens", (double)o->capacity_tokens);
    cJSON_AddNumberToObject(sj, "ttft_p50_s", s.p50);
    cJSON_AddNumberToObject(sj, "ttft_p90_s", s.p90);
    cJSON_AddNumberToObject(sj, "ttft_p99_s", s.p99);
    cJSON_AddNumberToObject(sj, "requests_per_s", s.req_s);
    cJSON_AddNumberToObject(sj, "output_tokens_per_s", s.out_tok_s);
    cJSON_AddNumberToObject(sj, "prompt_tokens_per_s", s.prompt_tok_s);
    if (srv->ember) {
        cJSON *e = cJSON_AddObjectToObject(sj, "server");
        cJSON_AddNumberToObject(e, "prompt_tokens", srv->prompt_tokens);
        cJSON_AddNumberToObject(e, "cached_tokens", srv->cached_tokens);
        cJSON_AddNumberToObject(e, "token_hit_rate", srv->prompt_tokens > 0 ? srv->cached_tokens / srv->prompt_tokens : -1);
        cJSON_AddNumberToObject(e, "pool_capacity_tokens", (double)srv->pool_capacity_tokens);
    }
    char *text = cJSON_Print(sj);
    cJSON_Delete(sj);
    FILE *f = open_out(o, "summary.json", err, cap);
    if (f == NULL) {
        free(text);
        return -1;
    }
    fprintf(f, "%s\n", text ? text : "{}");
    free(text);
    bad |= fclose(f) != 0;
    f = open_out(o, "report.html", err, cap);
    if (f == NULL) return -1;
    write_html(f, o, w, srv, &s);
    bad |= fclose(f) != 0;
    if (bad) {
        snprintf(err, cap, "cannot write the results under %s", o->out_dir);
        return -1;
    }

    char hit[32], ideal[32], lru[32], p50[32], p90[32], p99[32];
    fmt_pct(hit, sizeof hit, s.hit);
    fmt_pct(ideal, sizeof ideal, s.ideal_hit);
    fmt_pct(lru, sizeof lru, s.lru_hit);
    fmt_ms(p50, sizeof p50, s.p50);
    fmt_ms(p90, sizeof p90, s.p90);
    fmt_ms(p99, sizeof p99, s.p99);
    printf("requests        %d ok, %d errors in %.2f s: %.2f req/s, %.0f output tok/s, %.0f prompt tok/s\n", s.ok,
           s.errors, s.wall, s.req_s, s.out_tok_s, s.prompt_tok_s);
    printf("token hit rate  %s measured (%lld of %lld prompt tokens, from usage)\n", hit, (long long)s.cached,
           (long long)s.prompt);
    if (srv->ember)
        printf("server          %.1f%% (ember /metrics over the run: %.0f of %.0f)\n",
               srv->prompt_tokens > 0 ? 100 * srv->cached_tokens / srv->prompt_tokens : 0.0, srv->cached_tokens,
               srv->prompt_tokens);
    printf("ideal           %s with an unbounded cache, %s with an LRU of %lld tokens\n", ideal, lru,
           (long long)o->capacity_tokens);
    printf("TTFT            p50 %s, p90 %s, p99 %s\n", p50, p90, p99);
    printf("written         %s/{requests.csv,requests.jsonl,summary.json,report.html}\n", o->out_dir);
    return 0;
}
