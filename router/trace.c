/* trace.c: the Mooncake JSON Lines reader. One line at a time through jansson; each request's
 * prompt is materialised as token ids only long enough to hash it. */
#include "router/trace.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "kv/hash.h"

void kvf_router_trace_block_tokens(int64_t id, int32_t offset, int32_t n, int32_t *out)
{
    for (int32_t j = 0; j < n; j++) {
        uint64_t x = ((uint64_t)id << 21) ^ (uint64_t)(offset + j);
        x += 0x9E3779B97F4A7C15ull;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        x ^= x >> 31;
        out[j] = (int32_t)(x % 32000) + 1;
    }
}

void kvf_router_trace_fini(kvf_router_trace *t)
{
    if (!t)
        return;
    free(t->reqs);
    free(t->hashes);
    memset(t, 0, sizeof *t);
}

/* Grows *arr (of elem bytes) to hold need elements. */
static int grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 1024;
    while (c < need)
        c *= 2;
    void *p = realloc(*arr, c * elem);
    if (!p)
        return -1;
    *arr = p;
    *cap = c;
    return 0;
}

static kvf_status sizes_check(int32_t block_size, int32_t trace_block_tokens, kvf_err *err)
{
    if (block_size <= 0 || trace_block_tokens <= 0 || trace_block_tokens % block_size != 0 ||
        trace_block_tokens > (1 << 20))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "trace: trace block of %d tokens is not a multiple of block size %d "
                           "(or is out of range 1 .. 2^20)", trace_block_tokens, block_size);
    return KVF_OK;
}

/* Reads every line of f (named path in messages); closes f. */
static kvf_status trace_read(FILE *f, const char *path, const char *model, int32_t block_size,
                             int32_t trace_block_tokens, size_t max_requests,
                             kvf_router_trace *out, kvf_err *err)
{
    kvf_router_trace t = {.block_size = block_size, .trace_block_tokens = trace_block_tokens};
    size_t req_cap = 0, hash_cap = 0, tok_cap = 0;
    int32_t *tokens = NULL;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    long lineno = 0;
    kvf_status st = KVF_OK;
    uint64_t root = kvf_kv_hash_root(model, NULL, 0);
    double last_t = 0;
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        if (max_requests && t.n_reqs >= max_requests)
            break;
        size_t k = (size_t)len;
        while (k && (line[k - 1] == '\n' || line[k - 1] == '\r' || line[k - 1] == ' '))
            k--;
        if (!k)
            continue;
        json_t *j = NULL;
        if ((st = kvf_json_load_buf(line, k, "trace line", &j, err)) != KVF_OK)
            goto fail_line;
        int64_t ts, in_len, out_len;
        if ((st = kvf_json_get_int(j, "timestamp", &ts, err)) != KVF_OK ||
            (st = kvf_json_get_int(j, "input_length", &in_len, err)) != KVF_OK ||
            (st = kvf_json_get_int(j, "output_length", &out_len, err)) != KVF_OK) {
            json_decref(j);
            goto fail_line;
        }
        json_t *ids = json_object_get(j, "hash_ids");
        int64_t want = (in_len + trace_block_tokens - 1) / trace_block_tokens;
        if (!json_is_array(ids)) {
            st = kvf_err_set(err, KVF_ERR_PARSE, "\"hash_ids\" is %s, expected an array",
                             ids ? kvf_json_kind(ids) : "missing");
        } else if (in_len < 1 || in_len > (1 << 30) || out_len < 0 || out_len > (1 << 30)) {
            st = kvf_err_set(err, KVF_ERR_PARSE,
                             "\"input_length\" (%lld) must be 1 .. 2^30 and \"output_length\" "
                             "(%lld) 0 .. 2^30", (long long)in_len, (long long)out_len);
        } else if ((int64_t)json_array_size(ids) != want) {
            st = kvf_err_set(err, KVF_ERR_PARSE,
                             "\"hash_ids\" has %zu entries; input_length %lld needs %lld of %d tokens",
                             json_array_size(ids), (long long)in_len, (long long)want,
                             trace_block_tokens);
        } else if ((double)ts / 1000.0 < last_t) {
            st = kvf_err_set(err, KVF_ERR_PARSE, "\"timestamp\" %lld ms goes backwards (previous %.0f ms)",
                             (long long)ts, last_t * 1000.0);
        }
        if (st != KVF_OK) {
            json_decref(j);
            goto fail_line;
        }
        int64_t n_blocks = in_len / block_size;
        if (grow((void **)&tokens, &tok_cap, (size_t)in_len, sizeof *tokens) ||
            grow((void **)&t.reqs, &req_cap, t.n_reqs + 1, sizeof *t.reqs) ||
            /* + 1: the array exists even when every prompt is shorter than a block, so
             * t.hashes + first is never arithmetic on NULL (found by tests/fuzz/fuzz_trace) */
            grow((void **)&t.hashes, &hash_cap, t.n_hashes + (size_t)n_blocks + 1, sizeof *t.hashes)) {
            json_decref(j);
            st = kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
            goto fail_line;
        }
        for (int64_t b = 0; b < want; b++) {
            json_t *v = json_array_get(ids, (size_t)b);
            if (!json_is_integer(v)) {
                st = kvf_err_set(err, KVF_ERR_PARSE, "\"hash_ids\"[%lld] is %s, expected an integer",
                                 (long long)b, kvf_json_kind(v));
                json_decref(j);
                goto fail_line;
            }
            int64_t off = b * trace_block_tokens;
            int64_t n = in_len - off < trace_block_tokens ? in_len - off : trace_block_tokens;
            kvf_router_trace_block_tokens(json_integer_value(v), 0, (int32_t)n, tokens + off);
        }
        json_decref(j);
        kvf_router_trace_req *r = &t.reqs[t.n_reqs++];
        r->t_s = (double)ts / 1000.0;
        r->n_tokens = in_len;
        r->n_out = (int32_t)out_len;
        r->n_trace_blocks = (int32_t)want;
        r->first = (int64_t)t.n_hashes;
        r->n_blocks = (int32_t)n_blocks;
        t.n_hashes += kvf_kv_hash_blocks(root, tokens, (size_t)in_len, block_size,
                                         t.hashes + t.n_hashes);
        last_t = r->t_s;
    }
    if (ferror(f)) {
        st = kvf_err_set(err, KVF_ERR_IO, "trace: %s: read error", path);
        goto fail;
    }
    if (!t.n_reqs) {
        st = kvf_err_set(err, KVF_ERR_PARSE, "trace: %s: no requests", path);
        goto fail;
    }
    free(line);
    free(tokens);
    fclose(f);
    *out = t;
    return KVF_OK;
fail_line:
    kvf_err_prefix(err, "trace: %s:%ld", path, lineno);
fail:
    free(line);
    free(tokens);
    fclose(f);
    kvf_router_trace_fini(&t);
    return st;
}

kvf_status kvf_router_trace_load(const char *path, const char *model, int32_t block_size,
                                 int32_t trace_block_tokens, size_t max_requests,
                                 kvf_router_trace *out, kvf_err *err)
{
    kvf_status st = sizes_check(block_size, trace_block_tokens, err);
    if (st != KVF_OK)
        return st;
    FILE *f = fopen(path, "r");
    if (!f)
        return kvf_err_set(err, KVF_ERR_IO, "trace: %s: %s", path, strerror(errno));
    return trace_read(f, path, model, block_size, trace_block_tokens, max_requests, out, err);
}

kvf_status kvf_router_trace_parse(const char *name, const void *data, size_t len,
                                  const char *model, int32_t block_size,
                                  int32_t trace_block_tokens, size_t max_requests,
                                  kvf_router_trace *out, kvf_err *err)
{
    kvf_status st = sizes_check(block_size, trace_block_tokens, err);
    if (st != KVF_OK)
        return st;
    if (len == 0)
        return kvf_err_set(err, KVF_ERR_PARSE, "trace: %s: no requests", name);
    FILE *f = fmemopen((void *)data, len, "r");
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOMEM, "trace: %s: %s", name, strerror(errno));
    return trace_read(f, name, model, block_size, trace_block_tokens, max_requests, out, err);
}
