/* engine.c: the step loop: scheduling (running decodes, running prefill chunks, swapped, then
 * waiting sequences, within a token budget and max_seqs), all-or-nothing block allocation with
 * preemption of the newest running sequence, one forward pass per step, sampling and finish
 * checks, n > 1 by forking the prompt's blocks. The KV bookkeeping is kv/'s, the math model/'s.
 *
 * A sequence keeps every token it has (prompt + generated) and n_computed, the positions whose
 * KV is in its blocks; a step computes tokens[n_computed .. n_computed + chunk) and, when that
 * reaches the last token, samples the next one. Prefill, decode and recompute after a
 * preemption are therefore the same operation.
 *
 * Logit processing (penalties, logit_bias, min_p, min_tokens) and log-probabilities run on the
 * host (sample.c): a sequence that needs any of them this step has its logits row downloaded
 * (need_logits) and never takes the backend's draw or argmax, so a GPU honours them exactly as
 * the CPU does; every other sequence keeps the backend's draw and downloads nothing. A
 * sequence with prompt_logprobs computes its prompt one token per step without the prefix
 * cache, keeping each step's log-probability of the next prompt token.
 *
 * With KV tiers whose promotions run on the tiers' copy thread (kv/tier.h), a sequence whose
 * prefix lookup hit a tier is admitted PROMOTING: it holds its blocks (and its seats) but is
 * not computed until every copy has completed; the other sequences keep running meanwhile.
 * Each step polls the completions first; a step with nothing else to run waits for the copy
 * thread on its condition variable (bounded by ENGINE_PROMOTE_WAIT_NS), never spinning. */
#include "engine/engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/sample.h"
#include "kv/hash.h"
#include "kv/swap.h"
#include "model/forward.h"
#include "text/guide.h"
#include "text/tokenizer.h"

typedef enum seq_state {
    SEQ_FREE = 0,
    SEQ_WAITING,   /* queued; holds no blocks */
    SEQ_RUNNING,   /* holds blocks for positions [0, n_computed) */
    SEQ_PROMOTING, /* admitted: holds its prefix's blocks while the tiers' copy thread fills some
                    * of them; RUNNING (n_computed = what landed) once every copy completed */
    SEQ_SWAPPED,   /* its blocks are in host slots */
    SEQ_FORK_WAIT, /* sample i > 0 waiting for sample 0's prompt to fork from */
    SEQ_REMOTE,    /* holds the prompt's blocks while another process writes them */
    SEQ_HELD,      /* a given-up remote prefill whose writer may still write: its blocks stay
                    * referenced (never handed out, never registered) until released */
    SEQ_KEPT,      /* a prefill-only request, prefilled: its blocks stay referenced until
                    * kvf_engine_release_kept (its full ones are registered already) */
    SEQ_FINISHED,  /* released; its last output is pending or just reported */
} seq_state;

typedef struct eng_seq {
    seq_state state;
    uint64_t id;
    int32_t index, n;    /* sample index, samples of the request */
    int32_t parent;      /* slot of sample 0 while FORK_WAIT, else -1 */
    bool forked;         /* sample 0: its siblings have been forked */
    uint64_t arrival;    /* admission order; kept across preemption */
    kvf_engine_sampling sp;
    kvf_engine_rng rng;
    uint64_t root;
    int32_t *tokens; /* [max_ctx], prompt then generated */
    int32_t n_prompt, n_tokens, n_computed, n_generated;
    kvf_kv_seq kv;
    bool kv_live; /* kv initialised (needs fini) */
    kvf_engine_finish finish;
    bool pending; /* an output made outside a step, reported by the next step */
    int32_t pend_token;
    int32_t n_hit_blocks;  /* remote: leading blocks that were prefix-cache hits */
    bool prefill_only;     /* kvf_engine_request.prefill_only: KEPT after its first token */
    int64_t n_cached;      /* prompt tokens served by the prefix cache at the last admission */
    int64_t admitted_ns;   /* first admission (kvf_now_ns), 0 before */
    int64_t hold_until_ns; /* HELD: released at this kvf_now_ns() time at the latest */
    /* sp.prompt_logprobs (sample 0 only): rows for prompt tokens 1..n_prompt-1, each
     * 1 + sp.top_logprobs entries; allocated at add, freed the step after the slot is freed */
    kvf_engine_logprob *plp; /* [n_prompt - 1][1 + top_logprobs] */
    int32_t n_plp;           /* rows written so far (in order; recompute does not rewrite) */
    bool plp_given;          /* handed out on an output already */
    int32_t n_prior;         /* the prompt's trailing tokens that are output already (a
                              * resumed stream): counted as output by the penalties */
    struct guide_ent *guide; /* sp.guide_kind's compiled grammar (a reference), or NULL */
    kvf_text_matcher *gm;    /* this sample's position in it */
    bool gdraw;              /* this step's token is drawn on the backend under its mask */
} eng_seq;

/* A compiled guide, kept by its text while sequences use it and, unreferenced, among the
 * ENGINE_GUIDES_KEPT most recent (a client sends the same schema again and again). */
typedef struct guide_ent {
    int32_t kind;
    char *text;
    size_t len;
    kvf_text_grammar *g;
    int32_t refs;
    uint64_t last_use;
    struct guide_ent *next;
} guide_ent;

#define ENGINE_GUIDES_KEPT 16
/* A step with nothing to run but promotions in flight waits at most this long for one. */
#define ENGINE_PROMOTE_WAIT_NS 2000000
/* ... and their mask caches (each grammar's is bounded by text/grammar.h) at most this many
 * bytes together, so distinct hostile schemas cannot hold a worker's memory */
#define ENGINE_GUIDES_IDLE_BYTES ((size_t)256 << 20)

/* A new token's log-probabilities (sampling.logprobs), for its output. */
typedef struct tok_lp {
    float logprob;
    int32_t n_top;
    kvf_engine_logprob top[KVF_ENGINE_MAX_LOGPROBS];
} tok_lp;

struct kvf_engine {
    const kvf_model *m;
    const kvf_backend *be;
    void *be_ctx;
    kvf_engine_cfg cfg;
    kvf_kv_layout layout;
    kvf_kv_pool *pool;
    kvf_kv_swap *swap;
    kvf_model_fwd *fwd;
    int32_t vocab, max_ctx, max_blocks; /* max_blocks: per sequence */
    int32_t n_blocks;                   /* in the pool */
    double n_params;
    uint64_t default_root;

    eng_seq *seqs; /* [n_slots] */
    int32_t n_slots;
    int32_t *tok_buf;   /* [n_slots][max_ctx] */
    int32_t *order;     /* [n_slots] live slots by arrival */
    int32_t n_order;
    uint64_t next_arrival;

    /* step scratch, sized at creation */
    int32_t *set;       /* [max_seqs] slots running this step */
    int64_t *set_n;     /* [max_seqs] tokens each computes */
    kvf_kv_seq **set_kv; /* [max_seqs] */
    int32_t n_set;
    kvf_model_seq *mseq; /* [max_seqs] */
    float *logits;       /* [max_seqs][vocab] */
    int32_t *next;       /* [max_seqs] */
    kvf_backend_sample_row *draw; /* [max_seqs]: draws made by the backend (mseq[i].sample) */
    kvf_engine_output *outs; /* [2 * n_slots] */
    int32_t n_outs;
    bool in_step;
    const kvf_kv_seq **live; /* [n_slots] */
    kvf_engine_sampler sampler;
    float *proc_row;          /* [vocab] one sequence's processed copy of its row */
    kvf_engine_logprob **plp_dead; /* [n_slots] prompt-logprob rows of freed slots: their last
                                    * output may point at them until the next step */
    int32_t n_plp_dead;
    /* constrained decoding: the tokenizer's bytes as a trie, compiled guides, a mask */
    kvf_text_tokenizer *tok;
    kvf_text_vocab *gvocab;
    guide_ent *guides;
    uint64_t guide_clock;
    uint32_t *gmask;  /* [kvf_text_vocab_mask_words] */
    uint32_t *gmasks; /* [max_seqs][words]: masks of the step's backend draws */
    kvf_engine_stats st;
};

/* ---- defaults and names ------------------------------------------------------------------ */

void kvf_engine_cfg_default(kvf_engine_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->n_blocks = 512;
    c->block_size = 16;
    c->kv_dtype = KVF_DTYPE_F32;
    c->max_batch_tokens = 512;
    c->max_seqs = 32;
    c->max_queued = 256;
    c->swap_slots = 256;
    c->prefix_cache = true;
    c->preempt = KVF_ENGINE_PREEMPT_AUTO;
    c->flops_per_s = 2e10;
    c->copy_bytes_per_s = 4e9;
}

void kvf_engine_sampling_default(kvf_engine_sampling *s)
{
    memset(s, 0, sizeof *s);
    s->max_tokens = 16;
    s->top_p = 1.0f;
    s->n = 1;
}

void kvf_engine_sampling_model_eos(kvf_engine_sampling *s, const kvf_model *m)
{
    s->n_eos = 0;
    for (int32_t i = 0; i < m->cfg.n_eos && i < KVF_ENGINE_MAX_STOP; i++)
        s->eos_ids[s->n_eos++] = m->cfg.eos_ids[i];
}

const char *kvf_engine_finish_name(kvf_engine_finish f)
{
    switch (f) {
    case KVF_ENGINE_FINISH_NONE: return "none";
    case KVF_ENGINE_FINISH_STOP: return "stop";
    case KVF_ENGINE_FINISH_LENGTH: return "length";
    case KVF_ENGINE_FINISH_CANCELLED: return "cancelled";
    case KVF_ENGINE_FINISH_ERROR: return "error";
    case KVF_ENGINE_FINISH_PREFILLED: return "prefilled";
    }
    return "?";
}

/* ---- create / destroy -------------------------------------------------------------------- */

static kvf_status check_cfg(const kvf_model *m, const kvf_engine_cfg *c, kvf_err *err)
{
    if (c->block_size <= 0 || c->block_size > KVF_KV_MAX_BLOCK_SIZE ||
        (c->block_size & (c->block_size - 1)))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: block_size %d is not allowed (a power "
                           "of two, 1 to %d)", c->block_size, KVF_KV_MAX_BLOCK_SIZE);
    if (c->kv_dtype != KVF_DTYPE_F32 && c->kv_dtype != KVF_DTYPE_F16 &&
        c->kv_dtype != KVF_DTYPE_BF16 && c->kv_dtype != KVF_DTYPE_FP8_E4M3)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "engine: kv dtype %s is not supported "
                           "(use f32, f16, bf16 or fp8-e4m3)", kvf_dtype_name(c->kv_dtype));
    if (c->max_batch_tokens < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: max_batch_tokens %d must be at least 1",
                           c->max_batch_tokens);
    if (c->max_seqs < 1 || c->max_seqs > c->max_batch_tokens)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: max_seqs %d is not allowed (1 to "
                           "max_batch_tokens %d)", c->max_seqs, c->max_batch_tokens);
    if (c->max_queued < 1 || c->max_queued > 1 << 20)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: max_queued %d is not allowed (1 to %d)",
                           c->max_queued, 1 << 20);
    if (c->max_ctx < 0 || c->max_ctx > m->cfg.max_pos)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: max_ctx %d is not allowed (0 for the "
                           "model's, or 1 to max_position_embeddings %d)", c->max_ctx,
                           m->cfg.max_pos);
    if (c->swap_slots < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: swap_slots %d must not be negative",
                           c->swap_slots);
    if (c->preempt == KVF_ENGINE_PREEMPT_SWAP && c->swap_slots == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: preemption by swap needs swap_slots > 0");
    if ((int)c->preempt < 0 || c->preempt > KVF_ENGINE_PREEMPT_SWAP)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: preemption mode %d is not known (auto, "
                           "recompute or swap)", (int)c->preempt);
    if (c->threads < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: threads %d must not be negative",
                           c->threads);
    return KVF_OK;
}

void kvf_engine_destroy(kvf_engine *e)
{
    if (!e)
        return;
    if (e->seqs)
        for (int32_t i = 0; i < e->n_slots; i++)
            if (e->seqs[i].kv_live)
                kvf_kv_seq_fini(&e->seqs[i].kv);
    kvf_kv_swap_destroy(e->swap);
    kvf_kv_pool_destroy(e->pool);
    kvf_model_fwd_destroy(e->fwd);
    kvf_backend_destroy(e->be, e->be_ctx);
    kvf_engine_sampler_fini(&e->sampler);
    if (e->seqs)
        for (int32_t i = 0; i < e->n_slots; i++) {
            free(e->seqs[i].plp);
            kvf_text_matcher_destroy(e->seqs[i].gm);
        }
    for (guide_ent *g = e->guides, *n; g; g = n) {
        n = g->next;
        kvf_text_grammar_destroy(g->g);
        free(g->text);
        free(g);
    }
    kvf_text_vocab_destroy(e->gvocab);
    kvf_text_tokenizer_destroy(e->tok);
    free(e->gmask);
    free(e->gmasks);
    for (int32_t i = 0; i < e->n_plp_dead; i++)
        free(e->plp_dead[i]);
    free(e->plp_dead);
    free(e->proc_row);
    free(e->seqs);
    free(e->tok_buf);
    free(e->order);
    free(e->set);
    free(e->set_n);
    free(e->set_kv);
    free(e->mseq);
    free(e->logits);
    free(e->next);
    free(e->draw);
    free(e->outs);
    free(e->live);
    free(e);
}

/* ---- constrained decoding: the vocabulary and compiled guides ----------------------------- */

/* Loads dir's tokenizer.json for constrained decoding; a directory without one leaves guides
 * refused (a model given as bare weights still serves everything else). */
static kvf_status guide_setup(kvf_engine *e, const char *dir, kvf_err *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, R_OK) != 0) {
        kvf_log(KVF_LOG_INFO, "engine: no %s: constrained decoding (guides) is off", path);
        return KVF_OK;
    }
    /* a tokenizer this build cannot read costs guides only: the worker still serves the rest */
    kvf_err terr = {0};
    kvf_status st = kvf_text_tokenizer_load(dir, &e->tok, &terr);
    if (st == KVF_OK)
        st = kvf_text_vocab_create(e->tok, e->vocab, &e->gvocab, &terr);
    if (st == KVF_ERR_NOMEM)
        return kvf_err_set(err, st, "engine: the tokenizer for constrained decoding: %s", terr.msg);
    if (st != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "engine: constrained decoding (guides) is off: %s", terr.msg);
        kvf_text_tokenizer_destroy(e->tok);
        e->tok = NULL;
        e->gvocab = NULL;
        return KVF_OK;
    }
    size_t words = kvf_text_vocab_mask_words(e->gvocab);
    e->gmask = malloc(words * sizeof *e->gmask);
    e->gmasks = malloc((size_t)e->cfg.max_seqs * words * sizeof *e->gmasks);
    if (!e->gmask || !e->gmasks)
        return kvf_err_set(err, KVF_ERR_NOMEM, "engine: out of memory for a token mask");
    return KVF_OK;
}

static void guide_trim(kvf_engine *e);

/* The compiled grammar of a guide, with a reference taken: the kept one of the same text, or
 * a new compile (then the least recently used unreferenced ones past ENGINE_GUIDES_KEPT go). */
static kvf_status guide_acquire(kvf_engine *e, int32_t kind, const char *text, size_t len,
                                guide_ent **out, kvf_err *err)
{
    for (guide_ent *g = e->guides; g; g = g->next)
        if (g->kind == kind && g->len == len && (len == 0 || memcmp(g->text, text, len) == 0)) {
            g->refs++;
            g->last_use = ++e->guide_clock;
            *out = g;
            return KVF_OK;
        }
    guide_ent *g = calloc(1, sizeof *g);
    if (!g || !(g->text = malloc(len + 1))) {
        free(g);
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory for a %zu-byte guide", len);
    }
    if (len)
        memcpy(g->text, text, len);
    g->text[len] = '\0';
    int64_t t0 = kvf_now_ns();
    kvf_status st = kvf_text_guide_compile(kind, g->text, len, &g->g, err);
    if (st != KVF_OK) {
        free(g->text);
        free(g);
        return st;
    }
    kvf_log(KVF_LOG_DEBUG, "engine: compiled a %s guide of %zu bytes in %.2f ms",
            kvf_text_guide_kind_name(kind), len, (double)(kvf_now_ns() - t0) / 1e6);
    g->kind = kind;
    g->len = len;
    g->refs = 1;
    g->last_use = ++e->guide_clock;
    g->next = e->guides;
    e->guides = g;
    guide_trim(e);
    *out = g;
    return KVF_OK;
}

/* Forgets the least recently used unreferenced guides past ENGINE_GUIDES_KEPT of them or past
 * ENGINE_GUIDES_IDLE_BYTES of mask cache. */
static void guide_trim(kvf_engine *e)
{
    int32_t idle = 0;
    size_t bytes = 0;
    for (guide_ent *q = e->guides; q; q = q->next) {
        if (q->refs)
            continue;
        kvf_text_grammar_stats gs;
        kvf_text_grammar_stats_get(q->g, &gs);
        idle++;
        bytes += gs.cache_bytes;
    }
    while (idle > ENGINE_GUIDES_KEPT || (idle > 0 && bytes > ENGINE_GUIDES_IDLE_BYTES)) {
        guide_ent **victim = NULL;
        for (guide_ent **pp = &e->guides; *pp; pp = &(*pp)->next)
            if ((*pp)->refs == 0 && (!victim || (*pp)->last_use < (*victim)->last_use))
                victim = pp;
        guide_ent *v = *victim;
        *victim = v->next;
        kvf_text_grammar_stats gs;
        kvf_text_grammar_stats_get(v->g, &gs);
        bytes -= gs.cache_bytes < bytes ? gs.cache_bytes : bytes;
        kvf_text_grammar_destroy(v->g);
        free(v->text);
        free(v);
        idle--;
    }
}

/* Drops s's matcher and its reference to its guide (idempotent). */
static void guide_drop(eng_seq *s)
{
    kvf_text_matcher_destroy(s->gm);
    s->gm = NULL;
    if (s->guide)
        s->guide->refs--;
    s->guide = NULL;
}

/* s's matcher over g, with its end ids (stop and eos), advanced over the prompt's trailing
 * n_prior output tokens. */
static kvf_status guide_start(kvf_engine *e, eng_seq *s, guide_ent *g, const int32_t *prompt,
                              int32_t n_prompt, int32_t n_prior, kvf_err *err)
{
    int32_t ends[2 * KVF_ENGINE_MAX_STOP];
    size_t n_end = 0;
    for (int32_t i = 0; i < s->sp.n_stop; i++)
        ends[n_end++] = s->sp.stop_ids[i];
    for (int32_t i = 0; i < s->sp.n_eos; i++)
        ends[n_end++] = s->sp.eos_ids[i];
    kvf_status st = kvf_text_matcher_create(g->g, e->gvocab, ends, n_end, &s->gm, err);
    if (st != KVF_OK)
        return st;
    s->guide = g;
    g->refs++;
    for (int32_t i = n_prompt - n_prior; i < n_prompt; i++)
        if ((st = kvf_text_matcher_accept(s->gm, prompt[i], err)) != KVF_OK)
            return kvf_err_prefix(err, "the output already streamed does not follow the guide");
    return KVF_OK;
}

kvf_status kvf_engine_create(const kvf_model *m, const kvf_backend *be, const kvf_engine_cfg *cfg,
                             kvf_engine **out, kvf_err *err)
{
    if (!m || !be || !cfg || !out)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: create needs a model, a backend, a cfg "
                           "and an out pointer");
    kvf_status st = check_cfg(m, cfg, err);
    if (st != KVF_OK)
        return st;
    kvf_engine *e = calloc(1, sizeof *e);
    if (!e)
        return kvf_err_set(err, KVF_ERR_NOMEM, "engine: out of memory");
    e->m = m;
    e->be = be;
    e->cfg = *cfg;
    e->vocab = m->cfg.vocab_size;
    e->max_ctx = cfg->max_ctx ? cfg->max_ctx : m->cfg.max_pos;
    e->max_blocks = (int32_t)kvf_kv_blocks_for(e->max_ctx, cfg->block_size);
    e->n_params = (double)kvf_model_config_n_params(&m->cfg);
    const char *mid = cfg->model_id ? cfg->model_id : "";
    e->default_root = kvf_kv_hash_root(mid, NULL, 0);

    if ((st = kvf_model_kv_layout(m, cfg->block_size, cfg->kv_dtype, &e->layout, err)) != KVF_OK)
        goto fail;
    int64_t n_blocks = cfg->n_blocks;
    if (n_blocks == 0)
        n_blocks = cfg->kv_bytes / e->layout.block_bytes;
    if (n_blocks < 1 || n_blocks > INT32_MAX / 4) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "engine: a KV pool of %lld blocks (n_blocks %d, "
                         "kv_bytes %lld, %lld bytes a block) is not allowed (1 to %d blocks)",
                         (long long)n_blocks, cfg->n_blocks, (long long)cfg->kv_bytes,
                         (long long)e->layout.block_bytes, INT32_MAX / 4);
        goto fail;
    }
    e->n_blocks = (int32_t)n_blocks;
    /* the backend first: the pool is one allocation in the backend's memory (device memory on
     * a GPU), made through its kv_mem ops */
    kvf_backend_opts bo = {.n_threads = cfg->threads, .half_weights = cfg->half_weights,
                           .weight_dtype = cfg->weight_dtype,
                           .kv_k_scale = cfg->kv_k_scale, .kv_v_scale = cfg->kv_v_scale,
                           .matrix_dtype = cfg->matrix_dtype, .no_graphs = cfg->no_graphs,
                           .attn_decode = cfg->attn_decode};
    if ((st = kvf_backend_create(be, &bo, &e->be_ctx, err)) != KVF_OK)
        goto fail;
    kvf_kv_pool_cfg pc = {.layout = e->layout, .n_blocks = (int32_t)n_blocks,
                          .mem = kvf_backend_kv_mem(be, e->be_ctx),
                          .mem_ctx = e->be_ctx,
                          .on_event = cfg->on_event, .event_ctx = cfg->event_ctx,
                          .tier = cfg->kv_tier};
    if ((st = kvf_kv_pool_create(&pc, &e->pool, err)) != KVF_OK)
        goto fail;
    if (cfg->swap_slots > 0 && (st = kvf_kv_swap_create(e->pool, cfg->swap_slots, &e->swap, err)) != KVF_OK)
        goto fail;
    kvf_model_fwd_opts fo = {.max_tokens = cfg->max_batch_tokens, .max_seqs = cfg->max_seqs,
                             .max_ctx = e->max_ctx};
    if ((st = kvf_model_fwd_create(m, be, e->be_ctx, &e->layout, &fo, &e->fwd, err)) != KVF_OK)
        goto fail;
    if ((st = kvf_engine_sampler_init(&e->sampler, e->vocab, err)) != KVF_OK)
        goto fail;

    e->n_slots = cfg->max_queued;
    size_t S = (size_t)cfg->max_seqs, N = (size_t)e->n_slots;
    e->seqs = calloc(N, sizeof *e->seqs);
    e->tok_buf = malloc(N * (size_t)e->max_ctx * sizeof *e->tok_buf);
    e->order = malloc(N * sizeof *e->order);
    e->set = malloc(S * sizeof *e->set);
    e->set_n = malloc(S * sizeof *e->set_n);
    e->set_kv = malloc(S * sizeof *e->set_kv);
    e->mseq = malloc(S * sizeof *e->mseq);
    e->logits = malloc(S * (size_t)e->vocab * sizeof *e->logits);
    e->next = malloc(S * sizeof *e->next);
    e->draw = malloc(S * sizeof *e->draw);
    e->outs = malloc(2 * N * sizeof *e->outs);
    e->live = malloc(N * sizeof *e->live);
    e->proc_row = malloc((size_t)e->vocab * sizeof *e->proc_row);
    e->plp_dead = malloc(N * sizeof *e->plp_dead);
    if (!e->seqs || !e->tok_buf || !e->order || !e->set || !e->set_n || !e->set_kv || !e->mseq ||
        !e->logits || !e->next || !e->draw || !e->outs || !e->live || !e->proc_row ||
        !e->plp_dead) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "engine: out of memory for %d sequences of %d "
                         "positions", e->n_slots, e->max_ctx);
        goto fail;
    }
    for (size_t i = 0; i < N; i++) {
        e->seqs[i].tokens = e->tok_buf + i * (size_t)e->max_ctx;
        e->seqs[i].parent = -1;
    }
    if (cfg->tokenizer_dir && (st = guide_setup(e, cfg->tokenizer_dir, err)) != KVF_OK)
        goto fail;
    kvf_log(KVF_LOG_DEBUG, "engine: %d blocks of %d tokens (%s), budget %d tokens, %d running, "
            "%d queued, %d swap slots, prefix cache %s", (int)n_blocks, cfg->block_size,
            kvf_dtype_name(cfg->kv_dtype), cfg->max_batch_tokens, cfg->max_seqs, cfg->max_queued,
            cfg->swap_slots, cfg->prefix_cache ? "on" : "off");
    *out = e;
    return KVF_OK;
fail:
    kvf_engine_destroy(e);
    return st;
}

kvf_kv_pool *kvf_engine_pool(kvf_engine *e) { return e->pool; }

void *kvf_engine_backend_ctx(kvf_engine *e) { return e->be_ctx; }

kvf_status kvf_engine_set_prof(kvf_engine *e, kvf_model_fwd_prof *p, kvf_err *err)
{
    return kvf_model_fwd_set_prof(e->fwd, p, err);
}

/* ---- sequences --------------------------------------------------------------------------- */

static eng_seq *slot_seq(kvf_engine *e, int32_t slot) { return &e->seqs[slot]; }

/* Makes s's block table empty and ready (capacity for max_ctx, so steps never grow it). */
static kvf_status kv_reset(kvf_engine *e, eng_seq *s, kvf_err *err)
{
    if (s->kv_live)
        kvf_kv_seq_fini(&s->kv);
    kvf_kv_seq_init(&s->kv, e->pool, s->root);
    s->kv_live = true;
    return kvf_kv_seq_reserve(&s->kv, e->max_blocks, err);
}

static void kv_release(eng_seq *s)
{
    if (s->kv_live)
        kvf_kv_seq_fini(&s->kv);
    s->kv_live = false;
}

/* Whether s is sample 0 still collecting its prompt's log-probabilities. */
static bool plp_active(const eng_seq *s)
{
    return s->plp && s->n_plp < s->n_prompt - 1;
}

/* An output with no log-probabilities (NaN, no top entries, no prompt rows). */
static kvf_engine_output out_plain(const eng_seq *s, int32_t token, kvf_engine_finish fin)
{
    return (kvf_engine_output){.id = s->id, .index = s->index, .token = token,
                               .n_generated = s->n_generated, .finish = fin,
                               .n_cached = s->n_cached, .logprob = NAN};
}

/* Records an output: into this step's list (with lp, the token's log-probabilities, when not
 * NULL, and the prompt's rows on sample 0's first token), or pending for the next step (no
 * log-probabilities). */
static void emit(kvf_engine *e, eng_seq *s, int32_t token, kvf_engine_finish fin,
                 const tok_lp *lp)
{
    if (e->in_step) {
        kvf_engine_output *o = &e->outs[e->n_outs++];
        *o = out_plain(s, token, fin);
        if (lp && token >= 0) {
            o->logprob = lp->logprob;
            o->n_top = lp->n_top;
            memcpy(o->top, lp->top, (size_t)lp->n_top * sizeof *o->top);
        }
        if (s->sp.prompt_logprobs && s->index == 0 && token >= 0 && !s->plp_given) {
            s->plp_given = true;
            o->prompt_lps = s->plp;
            o->n_prompt_lps = s->plp ? s->n_plp : 0;
        }
    } else {
        s->pending = true;
        s->pend_token = token;
    }
}

/* Releases s and marks it finished; unforked siblings of sample 0 finish with it. */
static void finish_seq(kvf_engine *e, eng_seq *s, kvf_engine_finish why, bool with_output)
{
    kv_release(s);
    guide_drop(s);
    s->state = SEQ_FINISHED;
    s->finish = why;
    e->st.finished++;
    kvf_log(KVF_LOG_DEBUG, "engine: req %llu.%d: finished (%s) after %d tokens",
            (unsigned long long)s->id, s->index, kvf_engine_finish_name(why), s->n_generated);
    if (with_output)
        emit(e, s, -1, why, NULL);
    if (s->index == 0 && s->n > 1 && !s->forked) {
        int32_t me = (int32_t)(s - e->seqs);
        for (int32_t i = 0; i < e->n_order; i++) {
            eng_seq *c = slot_seq(e, e->order[i]);
            if (c->state == SEQ_FORK_WAIT && c->parent == me)
                finish_seq(e, c, why, true);
        }
    }
}

/* Appends a sampled token, checks the finish conditions and reports it. A prefill-only
 * request's first token is reported and its blocks kept instead. */
static void take_token(kvf_engine *e, eng_seq *s, int32_t tok, const tok_lp *lp)
{
    if (s->prefill_only) {
        s->n_generated++;
        s->state = SEQ_KEPT;
        guide_drop(s); /* its one token is drawn */
        emit(e, s, tok, KVF_ENGINE_FINISH_PREFILLED, lp);
        kvf_log(KVF_LOG_DEBUG, "engine: req %llu: prefilled (%d tokens, %lld cached); %d blocks "
                "kept", (unsigned long long)s->id, s->n_prompt, (long long)s->n_cached,
                s->kv.n_blocks);
        return;
    }
    s->tokens[s->n_tokens++] = tok;
    s->n_generated++;
    kvf_engine_finish fin = KVF_ENGINE_FINISH_NONE;
    for (int32_t i = 0; i < s->sp.n_stop && !fin; i++)
        if (tok == s->sp.stop_ids[i])
            fin = KVF_ENGINE_FINISH_STOP;
    for (int32_t i = 0; i < s->sp.n_eos && !fin; i++)
        if (tok == s->sp.eos_ids[i])
            fin = KVF_ENGINE_FINISH_STOP;
    if (!fin && s->gm && kvf_text_matcher_done(s->gm)) /* complete: nothing may follow */
        fin = KVF_ENGINE_FINISH_STOP;
    if (!fin && (s->n_generated >= s->sp.max_tokens || s->n_tokens >= e->max_ctx))
        fin = KVF_ENGINE_FINISH_LENGTH;
    emit(e, s, tok, fin, lp);
    if (fin)
        finish_seq(e, s, fin, false);
}

static int32_t sample_for(kvf_engine *e, eng_seq *s, const float *row, int32_t greedy)
{
    if (!(s->sp.temperature > 0))
        return greedy >= 0 ? greedy : kvf_engine_argmax(row, e->vocab);
    return kvf_engine_sample(&e->sampler, row, s->sp.temperature, s->sp.top_k, s->sp.top_p,
                             &s->rng);
}

/* Whether s's next token must be chosen on the host from its downloaded row: it has logit
 * processing to apply (kvf_engine_processes) or log-probabilities to report. Such a sequence
 * never takes the backend's draw or argmax. */
static bool host_path(const eng_seq *s)
{
    return s->sp.logprobs || s->gm || kvf_engine_processes(&s->sp, s->n_generated);
}

/* Copies row into proc_row with every id s's guide does not allow now at -inf (a 32-id word of
 * the mask at a time: inside a string most words are wholly allowed). False, with s finished,
 * when nothing is left to draw: the output complete and nothing may follow (STOP), complete with
 * no end id to take (ignore_eos: STOP), a dead end or a running bound (ERROR). */
static bool guide_mask_row(kvf_engine *e, eng_seq *s, const float *row)
{
    kvf_err gerr = {0};
    if (kvf_text_matcher_done(s->gm)) {
        finish_seq(e, s, KVF_ENGINE_FINISH_STOP, true);
        return false;
    }
    if (kvf_text_matcher_mask(s->gm, e->gmask, &gerr) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: guide: %s", (unsigned long long)s->id,
                s->index, gerr.msg);
        finish_seq(e, s, KVF_ENGINE_FINISH_ERROR, true);
        return false;
    }
    memcpy(e->proc_row, row, (size_t)e->vocab * sizeof *e->proc_row);
    int32_t allowed = 0;
    for (int32_t w = 0, base = 0; base < e->vocab; w++, base += 32) {
        uint32_t m = e->gmask[w];
        int32_t n = e->vocab - base < 32 ? e->vocab - base : 32;
        if (m == UINT32_MAX && n == 32) {
            allowed += 32;
            continue;
        }
        allowed += __builtin_popcount(m);
        for (int32_t b = 0; b < n; b++)
            if (!(m >> b & 1u))
                e->proc_row[base + b] = -INFINITY;
    }
    if (allowed == 0) {
        finish_seq(e, s, kvf_text_matcher_accepting(s->gm) ? KVF_ENGINE_FINISH_STOP
                                                           : KVF_ENGINE_FINISH_ERROR, true);
        return false;
    }
    return true;
}

/* Advances s's guide on tok (drawn under its mask; processing may have pushed every allowed
 * logit to -inf, when the draw's argmax fallback ignores the mask: the best allowed id of the
 * raw row is taken instead). Returns the token taken, or -1 with s finished (ERROR). */
static int32_t guide_accept(kvf_engine *e, eng_seq *s, const float *row, int32_t tok)
{
    if (tok < 0 || !(e->gmask[tok >> 5] >> (tok & 31) & 1u)) {
        int32_t best = -1;
        for (int32_t id = 0; id < e->vocab; id++)
            if (e->gmask[id >> 5] >> (id & 31) & 1u && (best < 0 || row[id] > row[best]))
                best = id;
        tok = best;
    }
    kvf_err gerr = {0};
    if (tok < 0 || kvf_text_matcher_accept(s->gm, tok, &gerr) != KVF_OK) {
        kvf_log(KVF_LOG_ERROR, "engine: req %llu.%d: guide: token %d: %s", (unsigned long long)s->id,
                s->index, tok, gerr.msg);
        finish_seq(e, s, KVF_ENGINE_FINISH_ERROR, true);
        return -1;
    }
    return tok;
}

/* Chooses s's next token from its raw row and takes it. A token drawn on the backend under a
 * guide's mask (gdraw) only advances the guide. A host-path sequence works on a copy of the row
 * (siblings share it): the guide's mask, then the logit processing, then the draw (greedy: its
 * argmax), with the raw row's log-probabilities when asked; any other takes drawn (the backend's
 * draw, >= 0) or samples the row itself (greedy: the backend's argmax when known). */
static void next_token(kvf_engine *e, eng_seq *s, const float *row, int32_t greedy,
                       int32_t drawn)
{
    if (s->gdraw) {
        s->gdraw = false;
        kvf_err gerr = {0};
        if (drawn < 0 || kvf_text_matcher_accept(s->gm, drawn, &gerr) != KVF_OK) {
            kvf_log(KVF_LOG_ERROR, "engine: req %llu.%d: guide: the backend drew %d: %s",
                    (unsigned long long)s->id, s->index, drawn, gerr.msg);
            finish_seq(e, s, KVF_ENGINE_FINISH_ERROR, true);
            return;
        }
        take_token(e, s, drawn, NULL);
        return;
    }
    if (!host_path(s)) {
        take_token(e, s, drawn >= 0 ? drawn : sample_for(e, s, row, greedy), NULL);
        return;
    }
    const float *use = row;
    if (s->gm) {
        if (!guide_mask_row(e, s, row))
            return;
        use = e->proc_row;
    }
    if (kvf_engine_processes(&s->sp, s->n_generated)) {
        if (use != e->proc_row)
            memcpy(e->proc_row, row, (size_t)e->vocab * sizeof *e->proc_row);
        /* output already streamed (n_prior) counts as output; min_tokens came reduced by it */
        kvf_engine_sampling sp = s->sp;
        if (sp.min_tokens > 0)
            sp.min_tokens += s->n_prior;
        kvf_engine_process_logits(&e->sampler, e->proc_row, &sp, s->tokens,
                                  s->n_prompt - s->n_prior, s->n_generated + s->n_prior);
        use = e->proc_row;
    }
    int32_t tok = sample_for(e, s, use, -1);
    if (s->gm && (tok = guide_accept(e, s, row, tok)) < 0)
        return;
    if (!s->sp.logprobs) {
        take_token(e, s, tok, NULL);
        return;
    }
    tok_lp lp;
    lp.logprob = kvf_engine_logprobs(row, e->vocab, tok, s->sp.top_logprobs, lp.top, &lp.n_top);
    take_token(e, s, tok, &lp);
}

/* After a step whose last computed position is n_computed - 1, stores the log-probability of
 * prompt token n_computed (and the top entries) from row, once per row. */
static void plp_store(kvf_engine *e, eng_seq *s, const float *row)
{
    int32_t r = s->n_computed - 1; /* row r is prompt token r + 1 */
    if (!plp_active(s) || r != s->n_plp)
        return;
    int32_t w = 1 + s->sp.top_logprobs, n_top = 0;
    kvf_engine_logprob *p = s->plp + (size_t)r * (size_t)w;
    int32_t id = s->tokens[r + 1];
    p[0] = (kvf_engine_logprob){.id = id};
    p[0].logprob = kvf_engine_logprobs(row, e->vocab, id, s->sp.top_logprobs, p + 1, &n_top);
    for (int32_t j = 1 + n_top; j < w; j++) /* a row with fewer non-NaN ids than asked */
        p[j] = (kvf_engine_logprob){.id = -1, .logprob = -INFINITY};
    s->n_plp++;
}

/* The largest chunk s may compute now, given c: a sequence collecting prompt log-probabilities
 * stops at the next prompt position whose row it still needs (one token a step). */
static int32_t chunk_cap(const eng_seq *s, int32_t c)
{
    if (!plp_active(s))
        return c;
    int32_t lim = s->n_plp + 1 - s->n_computed;
    lim = lim < 1 ? 1 : lim;
    return c < lim ? c : lim;
}

static eng_seq *find_live(kvf_engine *e, uint64_t id)
{
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->id == id && s->state != SEQ_FREE)
            return s;
    }
    return NULL;
}

static int32_t count_state(const kvf_engine *e, seq_state want)
{
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_order; i++)
        n += e->seqs[e->order[i]].state == want;
    return n;
}

/* Seats a sequence takes in the running batch once admitted: itself, plus its unforked
 * siblings when it is sample 0 of n. */
static int32_t seat_need(const eng_seq *s)
{
    return 1 + (s->index == 0 && !s->forked ? s->n - 1 : 0);
}

/* Seats taken now: running and remote sequences, and the unforked siblings of running ones. */
static int32_t seats_used(const kvf_engine *e)
{
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        const eng_seq *s = &e->seqs[e->order[i]];
        if (s->state == SEQ_RUNNING || s->state == SEQ_REMOTE || s->state == SEQ_PROMOTING)
            n += seat_need(s);
    }
    return n;
}

/* ---- add / cancel ------------------------------------------------------------------------ */

static kvf_status check_request(kvf_engine *e, const kvf_engine_request *r, kvf_err *err)
{
    const kvf_engine_sampling *p = &r->sampling;
    if (!r->prompt || r->n_prompt < 1 || r->n_prompt >= e->max_ctx)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: prompt of %d tokens is not "
                           "allowed (1 to %d: max_ctx %d less one to generate)",
                           (unsigned long long)r->id, r->n_prompt, e->max_ctx - 1, e->max_ctx);
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->vocab)
            return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: prompt token %d is %d "
                               "(the vocabulary is 0 to %d)", (unsigned long long)r->id, i,
                               r->prompt[i], e->vocab - 1);
    int64_t need = kvf_kv_blocks_for(r->n_prompt + 1, e->cfg.block_size);
    int32_t total = e->n_blocks;
    if (need > total)
        return kvf_err_set(err, KVF_ERR_LIMIT, "engine: req %llu: prompt of %d tokens needs %lld "
                           "blocks but the pool has %d", (unsigned long long)r->id, r->n_prompt,
                           (long long)need, total);
    if (p->max_tokens < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: max_tokens %d must be at "
                           "least 1", (unsigned long long)r->id, p->max_tokens);
    if (!(p->temperature >= 0) || p->temperature > KVF_ENGINE_MAX_TEMPERATURE)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: temperature %g is not "
                           "allowed (0 to %g)", (unsigned long long)r->id, (double)p->temperature,
                           (double)KVF_ENGINE_MAX_TEMPERATURE);
    if (!(p->top_p > 0 && p->top_p <= 1))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: top_p %g is not allowed "
                           "(greater than 0, at most 1)", (unsigned long long)r->id, (double)p->top_p);
    if (p->top_k < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: top_k %d must not be "
                           "negative", (unsigned long long)r->id, p->top_k);
    if (p->n < 1 || p->n > KVF_ENGINE_MAX_N || p->n > e->cfg.max_seqs)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: n %d is not allowed (1 to "
                           "%d)", (unsigned long long)r->id, p->n,
                           KVF_ENGINE_MAX_N < e->cfg.max_seqs ? KVF_ENGINE_MAX_N : e->cfg.max_seqs);
    if (p->n_stop < 0 || p->n_stop > KVF_ENGINE_MAX_STOP || p->n_eos < 0 ||
        p->n_eos > KVF_ENGINE_MAX_STOP)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: %d stop ids and %d eos ids "
                           "(0 to %d of each allowed)", (unsigned long long)r->id, p->n_stop,
                           p->n_eos, KVF_ENGINE_MAX_STOP);
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: presence_penalty %g is not "
                           "allowed (-2 to 2)", (unsigned long long)r->id,
                           (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: frequency_penalty %g is not "
                           "allowed (-2 to 2)", (unsigned long long)r->id,
                           (double)p->frequency_penalty);
    if (!(p->repetition_penalty >= 0 && p->repetition_penalty <= 2))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: repetition_penalty %g is not "
                           "allowed (greater than 0, at most 2; 0 or 1: off)",
                           (unsigned long long)r->id, (double)p->repetition_penalty);
    if (!(p->min_p >= 0 && p->min_p <= 1))
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: min_p %g is not allowed (0 "
                           "to 1)", (unsigned long long)r->id, (double)p->min_p);
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: min_tokens %d is not allowed "
                           "(0 to max_tokens %d)", (unsigned long long)r->id, p->min_tokens,
                           p->max_tokens);
    if (p->n_bias < 0 || p->n_bias > KVF_ENGINE_MAX_BIAS)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: %d logit_bias entries (0 to "
                           "%d allowed)", (unsigned long long)r->id, p->n_bias,
                           KVF_ENGINE_MAX_BIAS);
    for (int32_t i = 0; i < p->n_bias; i++) {
        if (p->bias[i].id < 0 || p->bias[i].id >= e->vocab)
            return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: logit_bias id %d is "
                               "outside the vocabulary (0 to %d)", (unsigned long long)r->id,
                               p->bias[i].id, e->vocab - 1);
        if (!(p->bias[i].bias >= -100 && p->bias[i].bias <= 100))
            return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: logit_bias %g for id %d "
                               "is not allowed (-100 to 100)", (unsigned long long)r->id,
                               (double)p->bias[i].bias, p->bias[i].id);
    }
    if (p->top_logprobs < 0 || p->top_logprobs > KVF_ENGINE_MAX_LOGPROBS ||
        p->top_logprobs > e->vocab)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: top_logprobs %d is not "
                           "allowed (0 to %d)", (unsigned long long)r->id, p->top_logprobs,
                           KVF_ENGINE_MAX_LOGPROBS < e->vocab ? KVF_ENGINE_MAX_LOGPROBS : e->vocab);
    if (p->guide_kind != KVF_TEXT_GUIDE_NONE) {
        if (p->guide_kind < 0 || p->guide_kind > KVF_TEXT_GUIDE_JSON_OBJECT)
            return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: guide kind %d is not "
                               "known", (unsigned long long)r->id, p->guide_kind);
        if (!e->gvocab)
            return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "engine: req %llu: constrained decoding "
                               "needs the model's tokenizer.json, which this worker did not load",
                               (unsigned long long)r->id);
        if (p->guide_len && !p->guide)
            return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: a guide of %zu bytes "
                               "without its text", (unsigned long long)r->id, p->guide_len);
    }
    if (r->n_prior_output > 0 && p->n != 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: n_prior_output %d with n %d "
                           "is not allowed (a resumed stream is one sample)",
                           (unsigned long long)r->id, r->n_prior_output, p->n);
    if (r->n_prior_output < 0 || r->n_prior_output >= r->n_prompt)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: n_prior_output %d is not "
                           "allowed (0 to %d: fewer than the prompt)", (unsigned long long)r->id,
                           r->n_prior_output, r->n_prompt - 1);
    if (r->prefill_only && p->n != 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: n %d with prefill_only is not "
                           "allowed (use 1)", (unsigned long long)r->id, p->n);
    if (find_live(e, r->id))
        return kvf_err_set(err, KVF_ERR_EXISTS, "engine: req %llu is already live",
                           (unsigned long long)r->id);
    if (e->n_order + p->n > e->n_slots)
        return kvf_err_set(err, KVF_ERR_FULL, "engine: req %llu: %d sequences do not fit (%d of "
                           "max_queued %d held)", (unsigned long long)r->id, p->n, e->n_order,
                           e->n_slots);
    return KVF_OK;
}

/* Takes free slots for every sample of r and queues them (sample 0 WAITING, the others
 * FORK_WAIT). *first_out gets sample 0. */
static kvf_status enqueue(kvf_engine *e, const kvf_engine_request *r, eng_seq **first_out,
                          kvf_err *err)
{
    uint64_t root = e->default_root;
    if (r->cache_salt && *r->cache_salt)
        root = kvf_kv_hash_root(e->cfg.model_id ? e->cfg.model_id : "", r->cache_salt,
                                strlen(r->cache_salt));
    uint64_t arrival = e->next_arrival++;
    int32_t first = -1, got = 0;
    for (int32_t slot = 0; slot < e->n_slots && got < r->sampling.n; slot++) {
        eng_seq *s = &e->seqs[slot];
        if (s->state != SEQ_FREE)
            continue;
        int32_t *tokens = s->tokens;
        memset(s, 0, sizeof *s);
        s->tokens = tokens;
        s->id = r->id;
        s->index = got;
        s->n = r->sampling.n;
        s->parent = got == 0 ? -1 : first;
        s->arrival = arrival;
        s->sp = r->sampling;
        s->prefill_only = r->prefill_only;
        s->root = root;
        kvf_engine_rng_seed(&s->rng, r->sampling.seed, (uint64_t)got);
        /* a resumed stream goes on with the draws it would have made: one per token drawn */
        s->n_prior = r->n_prior_output;
        for (int32_t i = 0; r->sampling.temperature > 0 && i < r->n_prior_output; i++)
            (void)kvf_engine_rng_uniform(&s->rng);
        s->n_prompt = r->n_prompt;
        if (got == 0) {
            memcpy(s->tokens, r->prompt, (size_t)r->n_prompt * sizeof *s->tokens);
            s->n_tokens = r->n_prompt;
        }
        s->state = got == 0 ? SEQ_WAITING : SEQ_FORK_WAIT;
        kvf_status st = kv_reset(e, s, err);
        if (st == KVF_OK && got == 0 && r->sampling.prompt_logprobs && r->n_prompt > 1) {
            size_t rows = (size_t)(r->n_prompt - 1), w = 1 + (size_t)r->sampling.top_logprobs;
            s->plp = malloc(rows * w * sizeof *s->plp);
            if (!s->plp)
                st = kvf_err_set(err, KVF_ERR_NOMEM, "out of memory for %zu prompt "
                                 "log-probability rows", rows);
        }
        e->order[e->n_order++] = slot;
        if (st != KVF_OK) {
            /* undo: the slots taken so far leave again */
            for (int32_t i = 0; i <= got; i++) {
                eng_seq *q = slot_seq(e, e->order[e->n_order - 1 - i]);
                kv_release(q);
                free(q->plp);
                q->plp = NULL;
                q->state = SEQ_FREE;
            }
            e->n_order -= got + 1;
            return kvf_err_prefix(err, "engine: req %llu", (unsigned long long)r->id);
        }
        if (got == 0)
            first = slot;
        got++;
    }
    if (r->sampling.guide_kind != KVF_TEXT_GUIDE_NONE) {
        guide_ent *g = NULL;
        kvf_status st = guide_acquire(e, r->sampling.guide_kind, r->sampling.guide,
                                      r->sampling.guide_len, &g, err);
        for (int32_t i = 0; i < got && st == KVF_OK; i++)
            st = guide_start(e, slot_seq(e, e->order[e->n_order - got + i]), g, r->prompt,
                             r->n_prompt, r->n_prior_output, err);
        if (g)
            g->refs--; /* the sequences hold their own */
        if (st != KVF_OK) {
            for (int32_t i = 0; i < got; i++) {
                eng_seq *q = slot_seq(e, e->order[e->n_order - 1 - i]);
                guide_drop(q);
                kv_release(q);
                free(q->plp);
                q->plp = NULL;
                q->state = SEQ_FREE;
            }
            e->n_order -= got;
            return kvf_err_prefix(err, "engine: req %llu", (unsigned long long)r->id);
        }
    }
    for (int32_t i = 0; i < got; i++) { /* the text was the caller's */
        eng_seq *q = slot_seq(e, e->order[e->n_order - got + i]);
        q->sp.guide = NULL;
        q->sp.guide_len = 0;
    }
    *first_out = slot_seq(e, first);
    return KVF_OK;
}

kvf_status kvf_engine_add(kvf_engine *e, const kvf_engine_request *req, kvf_err *err)
{
    if (!e || !req)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: add needs an engine and a request");
    kvf_status st = check_request(e, req, err);
    if (st != KVF_OK)
        return st;
    eng_seq *s;
    return enqueue(e, req, &s, err);
}

kvf_status kvf_engine_cancel(kvf_engine *e, uint64_t id, kvf_err *err)
{
    bool found = false;
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->id != id || s->state == SEQ_FREE || s->state == SEQ_HELD)
            continue; /* a held request leaves only through a release (kvf_engine_hold) */
        found = true;
        if (s->state != SEQ_FINISHED) /* a kept request reported its last output already */
            finish_seq(e, s, KVF_ENGINE_FINISH_CANCELLED, s->state != SEQ_KEPT);
    }
    if (!found)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: cancel: req %llu is not live",
                           (unsigned long long)id);
    kvf_log(KVF_LOG_DEBUG, "engine: req %llu: cancelled", (unsigned long long)id);
    return KVF_OK;
}

/* ---- remote prefill ---------------------------------------------------------------------- */

kvf_status kvf_engine_add_remote(kvf_engine *e, const kvf_engine_request *req,
                                 int32_t *block_ids_out, int32_t cap, int32_t *n_blocks_out,
                                 int64_t *n_cached_out, kvf_err *err)
{
    if (!e || !req || !block_ids_out || !n_blocks_out)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: add_remote needs an engine, a request "
                           "and block outputs");
    kvf_status st = check_request(e, req, err);
    if (st != KVF_OK)
        return st;
    if (req->sampling.n != 1)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "engine: req %llu: n %d with a remote "
                           "prefill is not supported (use 1)", (unsigned long long)req->id,
                           req->sampling.n);
    if (req->sampling.prompt_logprobs)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "engine: req %llu: prompt_logprobs with a "
                           "remote prefill is not supported (the prompt is computed elsewhere)",
                           (unsigned long long)req->id);
    int64_t need_ids = kvf_kv_blocks_for(req->n_prompt, e->cfg.block_size);
    if (need_ids > cap)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: the prompt takes %lld blocks "
                           "but block_ids_out holds %d", (unsigned long long)req->id,
                           (long long)need_ids, cap);
    eng_seq *s;
    if ((st = enqueue(e, req, &s, err)) != KVF_OK)
        return st;
    int64_t hit = 0;
    if (e->cfg.prefix_cache &&
        (st = kvf_kv_prefix_lookup(&s->kv, s->tokens, s->n_prompt, &hit, err)) != KVF_OK)
        goto undo;
    /* the writer is told which blocks hold the prefix: their copies from the tiers must have
     * landed (a failed one cuts the prefix), so a remote prefill waits for them here */
    while (kvf_kv_seq_promotions_pending(&s->kv) > 0)
        kvf_kv_pool_wait_promotions(e->pool, ENGINE_PROMOTE_WAIT_NS);
    hit = s->kv.n_tokens;
    if ((st = kvf_kv_seq_prepare_write(&s->kv, s->n_prompt - hit, err)) != KVF_OK)
        goto undo;
    memcpy(block_ids_out, s->kv.blocks, (size_t)s->kv.n_blocks * sizeof *block_ids_out);
    *n_blocks_out = s->kv.n_blocks;
    if (n_cached_out)
        *n_cached_out = hit;
    e->st.prefix_hit_tokens += hit;
    s->n_hit_blocks = s->kv.n_hashed;
    s->state = SEQ_REMOTE;
    return KVF_OK;
undo:
    kv_release(s);
    guide_drop(s);
    s->state = SEQ_FINISHED;
    s->pending = false;
    e->n_order--; /* it was appended last */
    s->state = SEQ_FREE;
    return kvf_err_prefix(err, "engine: req %llu", (unsigned long long)req->id);
}

kvf_status kvf_engine_remote_done(kvf_engine *e, uint64_t id, int32_t first_token, kvf_err *err)
{
    eng_seq *s = find_live(e, id);
    if (!s || s->state != SEQ_REMOTE)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: remote_done: req %llu is not waiting "
                           "for a remote prefill", (unsigned long long)id);
    if (first_token < 0 || first_token >= e->vocab)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: req %llu: first token %d is outside "
                           "the vocabulary (0 to %d)", (unsigned long long)id, first_token,
                           e->vocab - 1);
    if (s->gm && kvf_text_matcher_accept(s->gm, first_token, err) != KVF_OK)
        return kvf_err_prefix(err, "engine: req %llu: the remote prefill's first token",
                              (unsigned long long)id);
    s->n_computed = s->n_prompt;
    if (e->cfg.prefix_cache) {
        kvf_status st = kvf_kv_seq_commit(&s->kv, s->tokens, s->n_computed, err);
        if (st != KVF_OK)
            return kvf_err_prefix(err, "engine: req %llu", (unsigned long long)id);
    }
    s->state = SEQ_RUNNING;
    /* the prefill worker drew the first token with this sequence's first uniform (same seed,
     * same stream): the next draw here is the second, as a local prefill's would be */
    if (s->sp.temperature > 0)
        (void)kvf_engine_rng_uniform(&s->rng);
    take_token(e, s, first_token, NULL);
    return KVF_OK;
}

static void reclaim(kvf_engine *e);

kvf_status kvf_engine_hold(kvf_engine *e, uint64_t id, int64_t until_ns, int32_t *n_blocks_out,
                           kvf_err *err)
{
    eng_seq *s = e ? find_live(e, id) : NULL;
    if (!s || s->state != SEQ_REMOTE)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: hold: req %llu is not waiting for a "
                           "remote prefill", (unsigned long long)id);
    s->state = SEQ_HELD;
    s->finish = KVF_ENGINE_FINISH_CANCELLED;
    s->hold_until_ns = until_ns;
    e->st.finished++;
    emit(e, s, -1, KVF_ENGINE_FINISH_CANCELLED, NULL);
    if (n_blocks_out)
        *n_blocks_out = s->kv.n_blocks;
    kvf_log(KVF_LOG_DEBUG, "engine: req %llu: cancelled; %d blocks held", (unsigned long long)id,
            s->kv.n_blocks);
    return KVF_OK;
}

/* Gives s's blocks back (unregistered ones FREE, prefix-cache hits CACHED) and ends it. */
static void held_release(kvf_engine *e, eng_seq *s)
{
    (void)e;
    kv_release(s);
    s->state = SEQ_FINISHED;
}

kvf_status kvf_engine_release_held(kvf_engine *e, uint64_t id, int32_t *n_blocks_out,
                                   kvf_err *err)
{
    for (int32_t i = 0; e && i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->id != id || s->state != SEQ_HELD)
            continue;
        if (n_blocks_out)
            *n_blocks_out = s->kv.n_blocks;
        held_release(e, s);
        if (!e->in_step)
            reclaim(e);
        return KVF_OK;
    }
    return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: release_held: req %llu is not held",
                       (unsigned long long)id);
}

static int32_t release_expired(kvf_engine *e, int64_t now_ns)
{
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state != SEQ_HELD || now_ns < s->hold_until_ns)
            continue;
        kvf_log(KVF_LOG_DEBUG, "engine: req %llu: hold of %d blocks expired",
                (unsigned long long)s->id, s->kv.n_blocks);
        held_release(e, s);
        n++;
    }
    return n;
}

int32_t kvf_engine_release_expired(kvf_engine *e, int64_t now_ns)
{
    int32_t n = release_expired(e, now_ns);
    if (n > 0 && !e->in_step)
        reclaim(e);
    return n;
}

kvf_status kvf_engine_release_kept(kvf_engine *e, uint64_t id, int32_t *n_blocks_out,
                                   kvf_err *err)
{
    eng_seq *s = e ? find_live(e, id) : NULL;
    if (!s || s->state != SEQ_KEPT)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: release_kept: req %llu is not kept",
                           (unsigned long long)id);
    if (n_blocks_out)
        *n_blocks_out = s->kv.n_blocks;
    kv_release(s);
    s->state = SEQ_FINISHED;
    s->finish = KVF_ENGINE_FINISH_PREFILLED;
    e->st.finished++;
    if (!e->in_step)
        reclaim(e);
    return KVF_OK;
}

kvf_status kvf_engine_req_info_get(const kvf_engine *e, uint64_t id, kvf_engine_req_info *out,
                                   kvf_err *err)
{
    const eng_seq *s = NULL;
    for (int32_t i = 0; i < e->n_order && !s; i++) {
        const eng_seq *c = &e->seqs[e->order[i]];
        if (c->id == id && c->index == 0 && c->state != SEQ_FREE)
            s = c;
    }
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "engine: req %llu is not live",
                           (unsigned long long)id);
    kvf_engine_req_state st = KVF_ENGINE_REQ_QUEUED;
    switch (s->state) {
    case SEQ_RUNNING:
    case SEQ_PROMOTING: st = KVF_ENGINE_REQ_RUNNING; break;
    case SEQ_REMOTE: st = KVF_ENGINE_REQ_REMOTE; break;
    case SEQ_KEPT: st = KVF_ENGINE_REQ_KEPT; break;
    case SEQ_HELD: st = KVF_ENGINE_REQ_HELD; break;
    case SEQ_FINISHED: st = KVF_ENGINE_REQ_FINISHED; break;
    default: break;
    }
    bool kv = s->kv_live;
    *out = (kvf_engine_req_info){.state = st, .n_computed = s->n_computed,
                                 .n_cached = s->n_cached, .admitted_ns = s->admitted_ns,
                                 .blocks = kv ? s->kv.blocks : NULL,
                                 .n_blocks = kv ? s->kv.n_blocks : 0};
    return KVF_OK;
}

/* ---- preemption -------------------------------------------------------------------------- */

void kvf_engine_preempt_cost(const kvf_engine *e, int64_t n_tokens, int32_t n_blocks,
                             double *recompute_s_out, double *swap_s_out)
{
    *recompute_s_out = (double)n_tokens * 2.0 * e->n_params / e->cfg.flops_per_s;
    *swap_s_out = 2.0 * (double)n_blocks * (double)e->layout.block_bytes / e->cfg.copy_bytes_per_s;
}

/* Takes s out of the running batch: to host slots when swap is chosen and fits, otherwise
 * dropping its blocks to be recomputed from its tokens when it is admitted again. */
static void preempt(kvf_engine *e, eng_seq *s)
{
    bool swap = false;
    if (e->swap && s->kv.n_blocks > 0 && kvf_kv_swap_slots_free(e->swap) >= s->kv.n_blocks) {
        if (e->cfg.preempt == KVF_ENGINE_PREEMPT_SWAP) {
            swap = true;
        } else if (e->cfg.preempt == KVF_ENGINE_PREEMPT_AUTO) {
            double rc, sw;
            kvf_engine_preempt_cost(e, s->n_computed, s->kv.n_blocks, &rc, &sw);
            swap = sw < rc;
        }
    }
    kvf_err err = {0};
    if (swap && kvf_kv_swap_out(e->swap, &s->kv, &err) == KVF_OK) {
        s->state = SEQ_SWAPPED;
        e->st.preempt_swap++;
        kvf_log(KVF_LOG_DEBUG, "engine: req %llu.%d: preempted by swap (%d blocks)",
                (unsigned long long)s->id, s->index, s->kv.n_blocks);
        return;
    }
    if (swap)
        kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: swap out failed, recomputing: %s",
                (unsigned long long)s->id, s->index, err.msg);
    kvf_log(KVF_LOG_DEBUG, "engine: req %llu.%d: preempted by recompute (%d tokens)",
            (unsigned long long)s->id, s->index, s->n_computed);
    if (kv_reset(e, s, &err) != KVF_OK) {
        kvf_log(KVF_LOG_ERROR, "engine: req %llu.%d: %s", (unsigned long long)s->id, s->index,
                err.msg);
        finish_seq(e, s, KVF_ENGINE_FINISH_ERROR, true);
        return;
    }
    s->n_computed = 0;
    s->state = SEQ_WAITING;
    e->st.preempt_recompute++;
}

/* ---- the step ---------------------------------------------------------------------------- */

static void set_add(kvf_engine *e, eng_seq *s, int64_t n)
{
    e->set[e->n_set] = (int32_t)(s - e->seqs);
    e->set_n[e->n_set] = n;
    e->set_kv[e->n_set] = &s->kv;
    e->n_set++;
}

static void set_remove(kvf_engine *e, eng_seq *s)
{
    int32_t slot = (int32_t)(s - e->seqs);
    for (int32_t i = 0; i < e->n_set; i++) {
        if (e->set[i] != slot)
            continue;
        memmove(e->set + i, e->set + i + 1, (size_t)(e->n_set - i - 1) * sizeof *e->set);
        memmove(e->set_n + i, e->set_n + i + 1, (size_t)(e->n_set - i - 1) * sizeof *e->set_n);
        memmove(e->set_kv + i, e->set_kv + i + 1, (size_t)(e->n_set - i - 1) * sizeof *e->set_kv);
        e->n_set--;
        return;
    }
}

static int64_t set_need(kvf_engine *e)
{
    return e->n_set ? kvf_kv_pool_step_need(e->pool, e->set_kv, e->set_n, (size_t)e->n_set) : 0;
}

static eng_seq *newest_running(kvf_engine *e)
{
    for (int32_t i = e->n_order - 1; i >= 0; i--) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state == SEQ_RUNNING)
            return s;
    }
    return NULL;
}

/* Preempts the newest running sequences until the step's blocks fit. Returns how many were
 * preempted. A sequence that does not fit even alone finishes with LENGTH. */
static int32_t fit_step(kvf_engine *e)
{
    int32_t n = 0;
    while (e->n_set > 0 && set_need(e) > kvf_kv_pool_available(e->pool)) {
        eng_seq *v = newest_running(e);
        if (!v)
            break;
        set_remove(e, v);
        if (count_state(e, SEQ_RUNNING) == 1) {
            kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: a sequence of %d tokens no longer fits "
                    "the KV pool (%d blocks available)", (unsigned long long)v->id, v->index,
                    v->n_tokens, kvf_kv_pool_available(e->pool));
            finish_seq(e, v, KVF_ENGINE_FINISH_LENGTH, true);
        } else {
            preempt(e, v);
        }
        n++;
    }
    return n;
}

/* Reports outputs made outside a step (cancel, remote_done, errors). */
static void flush_pending(kvf_engine *e)
{
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (!s->pending)
            continue;
        s->pending = false;
        e->outs[e->n_outs++] =
            out_plain(s, s->pend_token, s->state == SEQ_FINISHED || s->state == SEQ_HELD
                                            ? s->finish : KVF_ENGINE_FINISH_NONE);
    }
}

/* Frees the slots of finished sequences whose last output has been reported. */
static void reclaim(kvf_engine *e)
{
    int32_t w = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state == SEQ_FINISHED && !s->pending) {
            s->state = SEQ_FREE;
            guide_drop(s);
            if (s->plp) /* its last output may point at it: freed at the next step */
                e->plp_dead[e->n_plp_dead++] = s->plp;
            s->plp = NULL;
            continue;
        }
        e->order[w++] = e->order[i];
    }
    e->n_order = w;
}

/* Completes finished promotions and lets each PROMOTING sequence whose copies all landed run:
 * its prefix is what landed (a failed copy cut it there). Returns how many started. */
static int32_t promotions_land(kvf_engine *e)
{
    kvf_kv_pool_poll_promotions(e->pool);
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state != SEQ_PROMOTING || kvf_kv_seq_promotions_pending(&s->kv) > 0)
            continue;
        int64_t hit = s->kv.n_tokens;
        s->n_computed = (int32_t)hit;
        s->n_cached = hit;
        e->st.prefix_hit_tokens += hit;
        s->state = SEQ_RUNNING;
        n++;
    }
    return n;
}

/* Chooses this step's sequences and chunks (see the file comment). */
static void schedule(kvf_engine *e)
{
    int32_t budget = e->cfg.max_batch_tokens, max_set = e->cfg.max_seqs;
    e->n_set = 0;
    /* 1. running decodes, one token each, oldest first */
    for (int32_t i = 0; i < e->n_order && e->n_set < max_set && budget > 0; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state == SEQ_RUNNING && s->n_tokens - s->n_computed == 1) {
            set_add(e, s, 1);
            budget--;
        }
    }
    /* 2. running prefills (or recomputes), a chunk each from what is left */
    for (int32_t i = 0; i < e->n_order && e->n_set < max_set && budget > 0; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        int32_t rem = s->n_tokens - s->n_computed;
        if (s->state == SEQ_RUNNING && rem > 1) {
            int32_t c = chunk_cap(s, rem < budget ? rem : budget);
            set_add(e, s, c);
            budget -= c;
        }
    }
    /* 3. make the running set fit, preempting the newest */
    int32_t n_pre = fit_step(e);
    if (n_pre > 0)
        return; /* under pressure: admit nothing new this step */
    /* 4. swapped sequences come back first, oldest first */
    int32_t seats = seats_used(e);
    bool swapped_left = false;
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state != SEQ_SWAPPED)
            continue;
        int32_t rem = s->n_tokens - s->n_computed;
        int32_t c = chunk_cap(s, rem < budget ? rem : budget);
        int64_t extra = c > 0 ? kvf_kv_blocks_for(s->n_computed + c, e->cfg.block_size) - s->kv.n_blocks : 0;
        if (e->n_set >= max_set || seats + seat_need(s) > max_set || c <= 0 ||
            set_need(e) + s->kv.n_blocks + (extra > 0 ? extra : 0) > kvf_kv_pool_available(e->pool)) {
            swapped_left = true;
            break;
        }
        kvf_err err = {0};
        if (kvf_kv_swap_in(e->swap, &s->kv, &err) != KVF_OK) {
            kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: swap in: %s", (unsigned long long)s->id,
                    s->index, err.msg);
            swapped_left = true;
            break;
        }
        s->state = SEQ_RUNNING;
        seats += seat_need(s);
        set_add(e, s, c);
        budget -= c;
    }
    if (swapped_left)
        return;
    /* 5. waiting sequences, oldest first, while their first chunk's blocks fit */
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *s = slot_seq(e, e->order[i]);
        if (s->state != SEQ_WAITING)
            continue;
        if (e->n_set >= max_set || seats + seat_need(s) > max_set || budget <= 0)
            break;
        int32_t bs = e->cfg.block_size;
        /* (a sequence collecting prompt log-probabilities computes every prompt token) */
        bool lookup = e->cfg.prefix_cache && s->n_tokens - 1 >= bs && !plp_active(s);
        int64_t hit_blocks = lookup ? kvf_kv_prefix_probe(e->pool, s->root, s->tokens, s->n_tokens - 1) : 0;
        int64_t start = hit_blocks * bs;
        int64_t c = chunk_cap(s, s->n_tokens - start < budget ? (int32_t)(s->n_tokens - start) : budget);
        /* an upper bound: hit blocks another sequence holds cost nothing */
        if (set_need(e) + kvf_kv_blocks_for(start + c, bs) > kvf_kv_pool_available(e->pool))
            break;
        int64_t hit = 0;
        kvf_err err = {0};
        if (lookup && kvf_kv_prefix_lookup(&s->kv, s->tokens, s->n_tokens - 1, &hit, &err) != KVF_OK) {
            kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: prefix lookup: %s",
                    (unsigned long long)s->id, s->index, err.msg);
            hit = 0;
        }
        if (!s->admitted_ns)
            s->admitted_ns = kvf_now_ns();
        if (kvf_kv_seq_promotions_pending(&s->kv) > 0) {
            /* admitted, its blocks held; computed once the copies land (promotions_land) */
            s->state = SEQ_PROMOTING;
            seats += seat_need(s);
            continue;
        }
        s->n_computed = (int32_t)hit;
        s->n_cached = hit;
        e->st.prefix_hit_tokens += hit;
        c = chunk_cap(s, s->n_tokens - hit < budget ? (int32_t)(s->n_tokens - hit) : budget);
        s->state = SEQ_RUNNING;
        seats += seat_need(s);
        set_add(e, s, c);
        budget -= (int32_t)c;
    }
}

/* Forks the unforked siblings of sample 0 (s) from its finished prompt and samples each one's
 * first token from the same logits row with its own generator and its own processing (on a
 * copy of the row: next_token). */
static void fork_siblings(kvf_engine *e, eng_seq *s, const float *row, int32_t greedy)
{
    int32_t me = (int32_t)(s - e->seqs);
    for (int32_t i = 0; i < e->n_order; i++) {
        eng_seq *c = slot_seq(e, e->order[i]);
        if (c->state != SEQ_FORK_WAIT || c->parent != me)
            continue;
        kvf_err err = {0};
        if (kvf_kv_seq_fork(&s->kv, &c->kv, &err) != KVF_OK) {
            kvf_log(KVF_LOG_ERROR, "engine: req %llu.%d: fork: %s", (unsigned long long)c->id,
                    c->index, err.msg);
            finish_seq(e, c, KVF_ENGINE_FINISH_ERROR, true);
            continue;
        }
        memcpy(c->tokens, s->tokens, (size_t)s->n_tokens * sizeof *c->tokens);
        c->n_tokens = c->n_computed = s->n_computed;
        c->parent = -1;
        c->state = SEQ_RUNNING;
        next_token(e, c, row, greedy, -1);
    }
    s->forked = true;
}

/* A guided sequence whose token nothing else needs on the host (no log-probabilities, no logit
 * processing, no siblings to fork) draws on the backend with its guide's mask (the bitset the
 * GPU sampler reads; a greedy one as top_k 1, u 0: the largest allowed logit), so its row never
 * leaves the device. True when set up as set row i's draw; false leaves it to the host path
 * (which also ends a complete or dead-ended match). */
static bool guide_draw(kvf_engine *e, eng_seq *s, int32_t i)
{
    if (!s->gm || s->sp.logprobs || kvf_engine_processes(&s->sp, s->n_generated) ||
        plp_active(s) || (s->index == 0 && s->n > 1 && !s->forked) ||
        kvf_text_matcher_done(s->gm))
        return false;
    size_t words = kvf_text_vocab_mask_words(e->gvocab);
    uint32_t *mask = e->gmasks + (size_t)i * words;
    kvf_err gerr = {0};
    if (kvf_text_matcher_mask(s->gm, mask, &gerr) != KVF_OK)
        return false;
    bool any = false;
    for (size_t w = 0; w < words && !any; w++)
        any = mask[w] != 0;
    if (!any)
        return false;
    if (s->sp.temperature > 0) {
        float u = (float)kvf_engine_rng_uniform(&s->rng);
        e->draw[i] = (kvf_backend_sample_row){.temperature = s->sp.temperature,
                                              .top_k = s->sp.top_k, .top_p = s->sp.top_p,
                                              .u = u < 1.0f ? u : nextafterf(1.0f, 0.0f),
                                              .mask = mask};
    } else {
        e->draw[i] = (kvf_backend_sample_row){.temperature = 1.0f, .top_k = 1, .top_p = 1.0f,
                                              .mask = mask};
    }
    e->mseq[i].sample = &e->draw[i];
    e->st.backend_draws++;
    s->gdraw = true;
    return true;
}

kvf_status kvf_engine_step(kvf_engine *e, const kvf_engine_output **out_out, int32_t *n_out,
                           kvf_err *err)
{
    int64_t t_step = kvf_now_ns();
    e->n_outs = 0;
    for (int32_t i = 0; i < e->n_plp_dead; i++) /* the last step's outputs are gone now */
        free(e->plp_dead[i]);
    e->n_plp_dead = 0;
    e->in_step = true;
    flush_pending(e);
    release_expired(e, t_step);
    promotions_land(e);
    schedule(e);
    if (e->n_set == 0 && count_state(e, SEQ_PROMOTING) > 0) {
        /* only promotions are pending: wait for the copy thread (bounded), then try again */
        kvf_kv_pool_wait_promotions(e->pool, ENGINE_PROMOTE_WAIT_NS);
        if (promotions_land(e) > 0)
            schedule(e);
    }
    e->st.last_step_seqs = 0;
    kvf_status st = KVF_OK;
    if (e->n_set == 0) {
        /* nothing runs: a lone sequence that cannot be admitted would wait forever */
        /* (held and kept blocks come back when released, promotions when copied: wait) */
        if (count_state(e, SEQ_RUNNING) == 0 && count_state(e, SEQ_REMOTE) == 0 &&
            count_state(e, SEQ_HELD) == 0 && count_state(e, SEQ_KEPT) == 0 &&
            count_state(e, SEQ_PROMOTING) == 0) {
            for (int32_t i = 0; i < e->n_order; i++) {
                eng_seq *s = slot_seq(e, e->order[i]);
                if (s->state == SEQ_WAITING || s->state == SEQ_SWAPPED) {
                    kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: %d tokens cannot be admitted "
                            "(%d blocks available)", (unsigned long long)s->id, s->index,
                            s->n_tokens, kvf_kv_pool_available(e->pool));
                    finish_seq(e, s, KVF_ENGINE_FINISH_LENGTH, true);
                    break;
                }
            }
        }
        goto out;
    }
    /* allocate every block of the step at once; schedule() made sure they fit */
    while ((st = kvf_kv_pool_alloc_step(e->pool, e->set_kv, e->set_n, (size_t)e->n_set, err)) ==
           KVF_ERR_FULL) {
        eng_seq *v = slot_seq(e, e->set[e->n_set - 1]);
        set_remove(e, v);
        if (v->state == SEQ_RUNNING)
            preempt(e, v);
        if (e->n_set == 0)
            goto out;
    }
    if (st != KVF_OK)
        goto fail;
    for (int32_t i = 0; i < e->n_set; i++) {
        eng_seq *s = slot_seq(e, e->set[i]);
        e->mseq[i] = (kvf_model_seq){.tokens = s->tokens + s->n_computed,
                                     .n_tokens = (int32_t)e->set_n[i],
                                     .start_pos = s->n_computed,
                                     .block_table = s->kv.blocks,
                                     .n_blocks = s->kv.n_blocks};
    }
    /* A sequence that emits a token this step and samples with a temperature draws on the
     * backend when it can (one uniform from its generator, as the host sampler takes), so the
     * logits stay there; they leave it only for the host sampler, always for a sequence about
     * to fork its siblings (they draw from its row), for one with logit processing or
     * log-probabilities (host_path: this is how a GPU honours penalties, logit_bias, min_p,
     * min_tokens and logprobs: the row comes to the host for such sequences only) and for one
     * collecting its prompt's log-probabilities. */
    bool need_logits = false, backend_draws = kvf_model_fwd_samples(e->fwd);
    for (int32_t i = 0; i < e->n_set; i++) {
        eng_seq *s = slot_seq(e, e->set[i]);
        bool emits = s->n_computed + (int32_t)e->set_n[i] >= s->n_tokens;
        if (emits && backend_draws && guide_draw(e, s, i))
            continue; /* drawn on the backend under its guide's mask */
        if (plp_active(s) || (emits && host_path(s)))
            need_logits = true;
        if (!emits || !(s->sp.temperature > 0) || host_path(s))
            continue;
        if (!backend_draws || (s->index == 0 && s->n > 1 && !s->forked)) {
            need_logits = true;
            continue;
        }
        float u = (float)kvf_engine_rng_uniform(&s->rng);
        e->draw[i] = (kvf_backend_sample_row){.temperature = s->sp.temperature,
                                              .top_k = s->sp.top_k, .top_p = s->sp.top_p,
                                              .u = u < 1.0f ? u : nextafterf(1.0f, 0.0f)};
        e->mseq[i].sample = &e->draw[i];
        e->st.backend_draws++;
    }
    int64_t t_fwd = kvf_now_ns();
    st = kvf_model_forward(e->fwd, e->mseq, e->n_set, kvf_kv_pool_base(e->pool), e->n_blocks,
                           need_logits ? e->logits : NULL, e->next, err);
    e->st.forward_ns += kvf_now_ns() - t_fwd;
    if (st != KVF_OK)
        goto fail;
    e->st.steps++;
    e->st.last_step_seqs = e->n_set;
    for (int32_t i = 0; i < e->n_set; i++) {
        eng_seq *s = slot_seq(e, e->set[i]);
        if (e->set_n[i] == 1 && s->n_generated > 0)
            e->st.decode_tokens++;
        else
            e->st.prefill_tokens += e->set_n[i];
        s->n_computed += (int32_t)e->set_n[i];
        if (e->cfg.prefix_cache) {
            kvf_err cerr = {0};
            if (kvf_kv_seq_commit(&s->kv, s->tokens, s->n_computed, &cerr) != KVF_OK)
                kvf_log(KVF_LOG_WARN, "engine: req %llu.%d: commit: %s",
                        (unsigned long long)s->id, s->index, cerr.msg);
        }
        const float *row = e->logits + (size_t)i * e->vocab;
        if (need_logits)
            plp_store(e, s, row);
        if (s->n_computed < s->n_tokens)
            continue; /* a prefill chunk that is not the last */
        if (s->index == 0 && s->n > 1 && !s->forked)
            fork_siblings(e, s, row, e->next[i]);
        next_token(e, s, row, e->next[i], e->mseq[i].sample ? e->next[i] : -1);
    }
    goto out;
fail:
    kvf_log(KVF_LOG_ERROR, "engine: step of %d sequences failed: %s", e->n_set, err ? err->msg : "");
    for (int32_t i = 0; i < e->n_set; i++) {
        eng_seq *s = slot_seq(e, e->set[i]);
        if (s->state == SEQ_RUNNING) {
            e->in_step = false; /* reported by the next step */
            finish_seq(e, s, KVF_ENGINE_FINISH_ERROR, true);
            e->in_step = true;
        }
    }
out:
    e->in_step = false;
    reclaim(e);
    *out_out = e->outs;
    *n_out = e->n_outs;
    e->st.step_ns += kvf_now_ns() - t_step;
    return st;
}

bool kvf_engine_busy(const kvf_engine *e)
{
    for (int32_t i = 0; i < e->n_order; i++) {
        const eng_seq *s = &e->seqs[e->order[i]];
        if (s->pending)
            return true;
        /* a held or kept sequence has nothing to compute: it waits for a release */
        if (s->state != SEQ_FREE && s->state != SEQ_FINISHED && s->state != SEQ_HELD &&
            s->state != SEQ_KEPT)
            return true;
    }
    return false;
}

void kvf_engine_get_stats(const kvf_engine *e, kvf_engine_stats *out)
{
    *out = e->st;
    out->promoting = count_state(e, SEQ_PROMOTING);
    out->running = count_state(e, SEQ_RUNNING) + count_state(e, SEQ_FORK_WAIT) + out->promoting;
    out->waiting = count_state(e, SEQ_WAITING);
    out->swapped = count_state(e, SEQ_SWAPPED);
    out->remote = count_state(e, SEQ_REMOTE);
    out->held = out->held_blocks = out->kept = out->kept_blocks = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        const eng_seq *s = &e->seqs[e->order[i]];
        if (s->state == SEQ_HELD) {
            out->held++;
            out->held_blocks += s->kv.n_blocks;
        } else if (s->state == SEQ_KEPT) {
            out->kept++;
            out->kept_blocks += s->kv.n_blocks;
        }
    }
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(e->pool, &ps);
    out->free_blocks = ps.free;
    out->cached_blocks = ps.cached;
    out->total_blocks = ps.total;
    out->swap_slots_free = e->swap ? kvf_kv_swap_slots_free(e->swap) : 0;
}

kvf_status kvf_engine_check(const kvf_engine *e, kvf_err *err)
{
    size_t n = 0;
    for (int32_t i = 0; i < e->n_order; i++) {
        const eng_seq *s = &e->seqs[e->order[i]];
        if (s->kv_live)
            e->live[n++] = &s->kv;
    }
    kvf_status st = kvf_kv_check_invariants(e->pool, e->live, n, err);
    if (st == KVF_OK && e->swap)
        st = kvf_kv_swap_check(e->swap, e->live, n, err);
    /* the engine's own rules: a running sequence's table covers exactly its computed KV; a
     * held one still holds its blocks and registered none beyond its prefix-cache hits */
    for (int32_t i = 0; st == KVF_OK && i < e->n_order; i++) {
        const eng_seq *s = &e->seqs[e->order[i]];
        if (s->state == SEQ_RUNNING && s->kv.n_tokens != s->n_computed)
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu.%d: table holds %lld "
                             "positions but %d are computed", (unsigned long long)s->id,
                             s->index, (long long)s->kv.n_tokens, s->n_computed);
        else if (s->state == SEQ_PROMOTING && !s->kv_live)
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu.%d: promoting without "
                             "a block table", (unsigned long long)s->id, s->index);
        else if (s->state != SEQ_PROMOTING && s->kv_live &&
                 kvf_kv_seq_promotions_pending(&s->kv) > 0)
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu.%d: %d promotions pending "
                             "outside the PROMOTING state", (unsigned long long)s->id, s->index,
                             kvf_kv_seq_promotions_pending(&s->kv));
        else if (s->state == SEQ_HELD && (!s->kv_live || s->kv.state != KVF_KV_SEQ_ACTIVE))
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu: held but its blocks "
                             "were released", (unsigned long long)s->id);
        else if (s->state == SEQ_KEPT && (!s->kv_live || s->kv.n_tokens != s->n_prompt))
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu: kept with %lld positions "
                             "in its table for a prompt of %d", (unsigned long long)s->id,
                             s->kv_live ? (long long)s->kv.n_tokens : -1LL, s->n_prompt);
        else if (s->state == SEQ_HELD && s->kv.n_hashed != s->n_hit_blocks)
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "engine: req %llu: held with %d registered "
                             "blocks but only %d were prefix-cache hits", (unsigned long long)s->id,
                             s->kv.n_hashed, s->n_hit_blocks);
    }
    return st;
}

/* ---- run to completion ------------------------------------------------------------------- */

kvf_status kvf_engine_run(kvf_engine *e, kvf_engine_output_fn fn, void *ctx, kvf_err *err)
{
    while (kvf_engine_busy(e)) {
        const kvf_engine_output *o;
        int32_t n;
        kvf_status st = kvf_engine_step(e, &o, &n, err);
        if (fn)
            for (int32_t i = 0; i < n; i++)
                fn(ctx, &o[i]);
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

typedef struct gen_ctx {
    uint64_t id;
    int32_t *out, cap, n;
    kvf_engine_finish finish;
} gen_ctx;

static void gen_collect(void *ctx, const kvf_engine_output *o)
{
    gen_ctx *g = ctx;
    if (o->id != g->id)
        return;
    if (o->token >= 0) {
        if (g->n < g->cap)
            g->out[g->n] = o->token;
        g->n++;
    }
    if (o->finish)
        g->finish = o->finish;
}

kvf_status kvf_engine_generate(kvf_engine *e, const kvf_engine_request *req, int32_t *out,
                               int32_t cap, int32_t *n_out, kvf_engine_finish *finish_out,
                               kvf_err *err)
{
    if (req && req->sampling.n != 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "engine: generate: n %d is not allowed (use 1; "
                           "kvf_engine_run takes n > 1)", req->sampling.n);
    kvf_status st = kvf_engine_add(e, req, err);
    if (st != KVF_OK)
        return st;
    gen_ctx g = {.id = req->id, .out = out, .cap = cap};
    st = kvf_engine_run(e, gen_collect, &g, err);
    if (n_out)
        *n_out = g.n;
    if (finish_out)
        *finish_out = g.finish;
    return st;
}
