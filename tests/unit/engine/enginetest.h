/* enginetest.h: what the engine tests share: loading a fixture model and its expected.json,
 * an engine over it, and running requests to completion with the invariants checked after
 * every step. Header-only; include after cmocka's headers and testutil.h. */
#ifndef KVF_ENGINETEST_H
#define KVF_ENGINETEST_H

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

#define ET_MAX_CASES 16
#define ET_MAX_TOK 512

typedef struct et_case {
    char name[64];
    int32_t prompt[ET_MAX_TOK], greedy[ET_MAX_TOK];
    int32_t n_prompt, n_greedy;
} et_case;

typedef struct et_fixture {
    kvf_model *m;
    et_case cases[ET_MAX_CASES];
    int32_t n_cases, n_new;
} et_fixture;

static inline void et_ints(const json_t *arr, int32_t *out, int32_t *n)
{
    *n = (int32_t)json_array_size(arr);
    assert_true(*n <= ET_MAX_TOK);
    for (int32_t i = 0; i < *n; i++)
        out[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
}

static inline et_fixture *et_open(const char *name)
{
    et_fixture *f = calloc(1, sizeof *f);
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/models/%s", name);
    kvf_err err = {0};
    if (kvf_model_load(kvf_test_shared_path(rel), &f->m, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    snprintf(rel, sizeof rel, "fixtures/models/%s/expected.json", name);
    json_error_t je;
    json_t *j = json_load_file(kvf_test_shared_path(rel), 0, &je);
    if (!j)
        fail_msg("%s: %s", rel, je.text);
    f->n_new = (int32_t)json_integer_value(json_object_get(j, "n_new"));
    json_t *cases = json_object_get(j, "cases");
    f->n_cases = (int32_t)json_array_size(cases);
    assert_true(f->n_cases > 0 && f->n_cases <= ET_MAX_CASES);
    for (int32_t i = 0; i < f->n_cases; i++) {
        json_t *c = json_array_get(cases, (size_t)i);
        et_case *k = &f->cases[i];
        snprintf(k->name, sizeof k->name, "%s", json_string_value(json_object_get(c, "name")));
        et_ints(json_object_get(c, "prompt"), k->prompt, &k->n_prompt);
        et_ints(json_object_get(c, "greedy"), k->greedy, &k->n_greedy);
        assert_int_equal(k->n_greedy, f->n_new);
    }
    json_decref(j);
    return f;
}

static inline void et_close(et_fixture *f)
{
    kvf_model_destroy(f->m);
    free(f);
}

static inline const et_case *et_find(const et_fixture *f, const char *name)
{
    for (int32_t i = 0; i < f->n_cases; i++)
        if (strcmp(f->cases[i].name, name) == 0)
            return &f->cases[i];
    fail_msg("no fixture case %s", name);
    return NULL;
}

static inline kvf_engine *et_engine(const kvf_model *m, const kvf_engine_cfg *cfg)
{
    kvf_engine *e = NULL;
    kvf_err err = {0};
    if (kvf_engine_create(m, kvf_model_backend_cpu(), cfg, &e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    return e;
}

static inline void et_cfg(kvf_engine_cfg *c)
{
    kvf_engine_cfg_default(c);
    c->n_blocks = 256;
    c->max_batch_tokens = 64;
    c->max_seqs = 32;
    c->max_queued = 64;
    c->threads = 2;
}

/* Collected outputs, per (request id, sample index). */
#define ET_MAX_SEQS 64
typedef struct et_result {
    int32_t tokens[ET_MAX_SEQS][ET_MAX_TOK];
    int32_t n[ET_MAX_SEQS];
    kvf_engine_finish finish[ET_MAX_SEQS];
    int32_t outputs_per_step_max;
} et_result;

/* Slot of (id, index) in a result: id * n_per + index, ids from 0. */
static inline void et_collect(et_result *r, const kvf_engine_output *o, int32_t n_per)
{
    int32_t k = (int32_t)o->id * n_per + o->index;
    assert_true(k >= 0 && k < ET_MAX_SEQS);
    assert_int_equal(r->finish[k], KVF_ENGINE_FINISH_NONE); /* nothing after a finish */
    if (o->token >= 0) {
        assert_true(r->n[k] < ET_MAX_TOK);
        r->tokens[k][r->n[k]++] = o->token;
        assert_int_equal(o->n_generated, r->n[k]);
    }
    r->finish[k] = o->finish;
}

/* Steps e until idle, checking the invariants after every step; returns the steps taken. */
static inline int32_t et_run(kvf_engine *e, et_result *r, int32_t n_per)
{
    int32_t steps = 0;
    kvf_err err = {0};
    while (kvf_engine_busy(e)) {
        const kvf_engine_output *o;
        int32_t n;
        if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
            fail_msg("step %d: %s", steps, err.msg);
        for (int32_t i = 0; i < n; i++)
            et_collect(r, &o[i], n_per);
        if (kvf_engine_check(e, &err) != KVF_OK)
            fail_msg("after step %d: %s", steps, err.msg);
        steps++;
        assert_true(steps < 100000);
    }
    return steps;
}

static inline kvf_engine_request et_req(uint64_t id, const int32_t *prompt, int32_t n_prompt,
                                        int32_t max_tokens)
{
    kvf_engine_request r = {.id = id, .prompt = prompt, .n_prompt = n_prompt};
    kvf_engine_sampling_default(&r.sampling);
    r.sampling.max_tokens = max_tokens;
    return r;
}

static inline void et_add(kvf_engine *e, const kvf_engine_request *r)
{
    kvf_err err = {0};
    if (kvf_engine_add(e, r, &err) != KVF_OK)
        fail_msg("add: %s", err.msg);
}

static inline void et_assert_tokens(const char *what, const int32_t *got, int32_t n_got,
                                    const int32_t *want, int32_t n_want)
{
    int32_t n = n_got < n_want ? n_got : n_want;
    for (int32_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s: token %d is %d, want %d", what, i, got[i], want[i]);
    if (n_got != n_want)
        fail_msg("%s: %d tokens, want %d", what, n_got, n_want);
}

#endif
