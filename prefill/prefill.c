/* prefill.c: the prefill role's RemotePrefill, batched. gRPC threads only decode a call and hand
 * it to the worker's loop thread; there, every pass admits queued calls (FIFO, up to the forward
 * pass's max_seqs, waiting while the pool cannot hold a prompt), runs one kvf_model_forward step
 * over all admitted prompts (chunked to max_tokens), and as each prompt completes registers its
 * full blocks (KV events), writes the blocks the decode worker lacks through the transport and
 * answers the call when that write is acknowledged. Full blocks stay cached after release. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/sample.h"
#include "kv/hash.h"
#include "prefill/prefill.h"
#include "proto/worker.h"

typedef struct ppeer {
    uint8_t *desc;
    size_t len;
    kvf_xfer_peer *peer;
    struct ppeer *next;
} ppeer;

typedef enum pjob_state {
    PJ_QUEUED = 0,  /* waiting for admission (a seat in the batch, and blocks) */
    PJ_COMPUTE = 1, /* admitted: its blocks are held, chunks run in the shared steps */
    PJ_ID_WAIT = 2, /* computed; another write with its transfer id is still in flight */
    PJ_SENDING = 3, /* kvf_xfer_write accepted; waiting for the SENT event */
} pjob_state;

/* One RemotePrefill call, from its handler to its answer. Loop thread after enqueue. */
typedef struct pjob {
    kvf_prefill *p;
    kvf_rpc_call *call;
    Kvfleet__V1__RemotePrefillRequest *rq;
    const char *id;          /* request id for logs ("-" when none) */
    pjob_state state;
    bool delayed;            /* the fault delay ran */
    bool has_seq;            /* seq holds blocks of our pool */
    int64_t t_enqueue_ns, t_start_ns, t_computed_ns, deadline_ns;
    int32_t n;               /* prompt tokens */
    int64_t nb;              /* blocks of the prompt */
    int64_t hit, pos;        /* tokens found in our cache; tokens whose KV is computed */
    int32_t take;            /* tokens of this job in the current step */
    int32_t first_token;
    int32_t n_pairs;
    kvf_xfer_peer *peer;     /* NULL when decode holds every block already */
    kvf_kv_seq seq;
    Kvfleet__V1__PrefillStats stats;
    struct pjob *next;
} pjob;

struct kvf_prefill {
    kvf_worker *w;
    int32_t fault_delay_ms;
    atomic_int_fast64_t queued_tokens; /* prompt tokens of calls not yet answered; any thread */
    /* loop thread from here on */
    pjob *jobs, *jobs_tail;  /* every live call, in arrival order */
    int32_t n_queued, n_compute, n_sending; /* n_sending counts PJ_ID_WAIT too */
    bool pool_changed;       /* blocks were released since admission last failed */
    bool blocked;            /* the head of the queue did not fit in the pool */
    bool shut;
    ppeer *peers;
    int32_t max_seqs, max_tokens, vocab;
    kvf_model_seq *step_seqs; /* [max_seqs] */
    pjob **step_jobs;         /* [max_seqs] */
    int32_t *next;            /* [max_seqs] greedy ids */
    float *logits;            /* [max_seqs][vocab] */
    kvf_backend_sample_row *draw; /* [max_seqs]: first tokens drawn on the backend */
    kvf_engine_sampler sampler;
    int64_t max_step_seqs;
    kvf_metric *m_requests, *m_failed, *m_tokens, *m_cached, *m_bytes, *m_expired_queued,
        *m_steps, *m_step_seqs, *m_step_seqs_max, *m_queue_ms;
};

static kvf_xfer_peer *peer_get(kvf_prefill *p, const uint8_t *desc, size_t len, kvf_err *err)
{
    kvf_xfer *x = kvf_worker_xfer(p->w);
    for (ppeer **pp = &p->peers; *pp;) {
        ppeer *e = *pp;
        bool busy = false; /* a write still in flight to it keeps the peer until its event */
        for (pjob *j = p->jobs; j && !busy; j = j->next)
            busy = j->state == PJ_SENDING && j->peer == e->peer;
        if (!busy && kvf_xfer_peer_status(e->peer) == KVF_ERR_PEER_LOST) {
            /* a decode worker gone (or restarted): forget it; connect again if it is this one */
            kvf_xfer_disconnect(x, e->peer);
            for (pjob *j = p->jobs; j; j = j->next)
                if (j->peer == e->peer)
                    j->peer = NULL; /* computing for a lost peer: reconnects when it sends */
            *pp = e->next;
            free(e->desc);
            free(e);
            continue;
        }
        if (e->len == len && memcmp(e->desc, desc, len) == 0)
            return e->peer;
        pp = &e->next;
    }
    ppeer *e = calloc(1, sizeof *e);
    if (!e || !(e->desc = malloc(len ? len : 1))) {
        free(e);
        kvf_err_set(err, KVF_ERR_NOMEM, "prefill: out of memory");
        return NULL;
    }
    memcpy(e->desc, desc, len);
    e->len = len;
    if (kvf_xfer_connect(x, desc, len, &e->peer, err) != KVF_OK) {
        free(e->desc);
        free(e);
        return NULL;
    }
    e->next = p->peers;
    p->peers = e;
    return e->peer;
}

/* ---- answering a call ------------------------------------------------------------------- */

static void job_release_blocks(kvf_prefill *p, pjob *j)
{
    if (!j->has_seq)
        return;
    kvf_err ferr = {0};
    if (kvf_kv_seq_free(&j->seq, &ferr) != KVF_OK)
        kvf_log(KVF_LOG_ERROR, "prefill: req %s: releasing its blocks: %s", j->id, ferr.msg);
    kvf_kv_seq_fini(&j->seq);
    j->has_seq = false;
    p->pool_changed = true;
}

static void job_unlink(kvf_prefill *p, pjob *j)
{
    pjob *prev = NULL;
    for (pjob *q = p->jobs; q; prev = q, q = q->next)
        if (q == j) {
            if (prev)
                prev->next = j->next;
            else
                p->jobs = j->next;
            if (p->jobs_tail == j)
                p->jobs_tail = prev;
            break;
        }
    switch (j->state) {
    case PJ_QUEUED: p->n_queued--; break;
    case PJ_COMPUTE: p->n_compute--; break;
    case PJ_ID_WAIT:
    case PJ_SENDING: p->n_sending--; break;
    }
}

/* Takes j out of the worker: its blocks back to the pool, out of the list and the queue count. */
static void job_leave(kvf_prefill *p, pjob *j)
{
    job_release_blocks(p, j);
    job_unlink(p, j);
    atomic_fetch_sub(&p->queued_tokens, (int64_t)j->rq->n_token_ids);
}

/* Ends j without an answer: its write may still land, and only an answer from this worker tells
 * decode that it has stopped (decode then keeps the blocks until the write's deadline). */
static void job_abandon(kvf_prefill *p, pjob *j, const char *msg)
{
    job_leave(p, j);
    kvf_log(KVF_LOG_WARN, "prefill: req %s: %s", j->id, msg);
    kvf_metric_add(p->m_failed, 1);
    kvf_rpc_call_abandon(j->call, msg);
    kvf_rpc_msg_free(j->rq);
    free(j);
}

/* Ends a call: releases its blocks, answers (first token and stats, or st and msg), frees it. */
static void job_finish(kvf_prefill *p, pjob *j, kvf_status st, const char *msg)
{
    job_leave(p, j);
    if (st == KVF_OK) {
        const kvf_kv_layout *l = kvf_worker_layout(p->w);
        j->stats.prompt_tokens = j->n;
        j->stats.cached_tokens = (int32_t)j->hit;
        j->stats.computed_tokens = j->n - (int32_t)j->hit;
        j->stats.blocks_sent = j->n_pairs;
        j->stats.bytes_sent = (int64_t)j->n_pairs * l->block_bytes;
        j->stats.transfer_ms = (double)(kvf_now_ns() - j->t_computed_ns) / 1e6;
        kvf_metric_add(p->m_tokens, (double)(j->n - j->hit));
        kvf_metric_add(p->m_cached, (double)j->hit);
        kvf_metric_add(p->m_bytes, (double)j->stats.bytes_sent);
        kvf_log(KVF_LOG_DEBUG, "prefill: req %s: %d tokens (%lld cached here), %d blocks sent; "
                "queued %.1f ms, prefill %.1f ms, transfer %.1f ms", j->id, j->n,
                (long long)j->hit, j->n_pairs, j->stats.queue_ms, j->stats.prefill_ms,
                j->stats.transfer_ms);
        Kvfleet__V1__RemotePrefillResponse r = KVFLEET__V1__REMOTE_PREFILL_RESPONSE__INIT;
        r.first_token = j->first_token;
        r.stats = &j->stats;
        kvf_rpc_buf buf = {0};
        kvf_err err = {0};
        if ((st = kvf_rpc_msg_encode(&r, &buf, &err)) == KVF_OK &&
            (st = kvf_rpc_call_send(j->call, buf.data, buf.len, &err)) == KVF_OK) {
            kvf_rpc_call_finish(j->call, KVF_OK, NULL);
        } else {
            kvf_log(KVF_LOG_WARN, "prefill: req %s: answering: %s", j->id, err.msg);
            kvf_rpc_call_finish(j->call, st, err.msg);
        }
        kvf_rpc_buf_free(&buf);
    } else {
        kvf_log(KVF_LOG_WARN, "%s", msg);
        kvf_metric_add(p->m_failed, 1);
        kvf_rpc_call_finish(j->call, st, msg);
    }
    kvf_rpc_msg_free(j->rq);
    free(j);
}

static void job_fail(kvf_prefill *p, pjob *j, const kvf_err *err)
{
    job_finish(p, j, err->status != KVF_OK ? err->status : KVF_ERR_INTERNAL, err->msg);
}

/* ---- admission -------------------------------------------------------------------------- */

/* Checks what decode asks for against this worker and fills n, nb and the deadline. */
static kvf_status job_check(kvf_prefill *p, pjob *j, kvf_err *err)
{
    kvf_worker *w = p->w;
    const Kvfleet__V1__RemotePrefillRequest *rq = j->rq;
    const kvf_kv_layout *l = kvf_worker_layout(w);
    const kvf_model *m = kvf_worker_model(w);
    const char *id = j->id;
    kvf_status st;
    if (!rq->dst_layout || !rq->dst || rq->dst->blob.len == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: dst_layout and dst are required", id);
    kvf_dtype dt;
    if ((st = kvf_rpc_dtype_from_msg(rq->dst_layout->dtype, &dt, err)) != KVF_OK)
        return kvf_err_prefix(err, "prefill: req %s: dst_layout", id);
    kvf_kv_layout dl = {.n_layers = rq->dst_layout->n_layers, .n_kv_heads = rq->dst_layout->n_kv_heads,
                        .head_dim = rq->dst_layout->head_dim, .block_size = rq->dst_layout->block_size,
                        .dtype = dt, .block_bytes = rq->dst_layout->block_bytes};
    if ((st = kvf_kv_layout_check_same(l, "here", &dl, "at the decode worker", err)) != KVF_OK)
        return kvf_err_prefix(err, "prefill: req %s", id);
    int32_t n = (int32_t)rq->n_token_ids;
    int64_t nb = kvf_kv_blocks_for(n, l->block_size);
    if (n < 1 || (int64_t)rq->n_dst_block_ids != nb || rq->dst_cached_blocks < 0 ||
        rq->dst_cached_blocks > nb)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: %d tokens take %lld blocks of %d "
                           "but dst_block_ids has %zu and dst_cached_blocks is %d", id, n,
                           (long long)nb, l->block_size, rq->n_dst_block_ids, rq->dst_cached_blocks);
    for (int32_t i = 0; i < n; i++)
        if (rq->token_ids[i] < 0 || rq->token_ids[i] >= m->cfg.vocab_size)
            return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: token %d at index %d is "
                               "outside the vocabulary (0 to %d)", id, rq->token_ids[i], i,
                               m->cfg.vocab_size - 1);
    if (n > m->cfg.max_pos)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: %d tokens exceed the model's "
                           "max_position_embeddings (%d)", id, n, m->cfg.max_pos);
    /* the engine's range: a first token drawn here must be one decode would accept */
    const Kvfleet__V1__SamplingParams *sp = rq->sampling;
    if (sp && (!(sp->temperature >= 0) || sp->temperature > KVF_ENGINE_MAX_TEMPERATURE ||
               sp->top_k < 0))
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: sampling temperature %g or "
                           "top_k %d is not allowed (temperature 0 to %g, top_k >= 0)", id,
                           (double)sp->temperature, sp->top_k, (double)KVF_ENGINE_MAX_TEMPERATURE);
    j->n = n;
    j->nb = nb;
    return KVF_OK;
}

/* Tries to admit the queued job j: checks, connects to decode's transport, takes its cached
 * prefix and blocks for the rest. KVF_ERR_FULL: the pool cannot hold it now (nothing held;
 * it stays queued). Any other error: the caller fails the call. */
static kvf_status job_admit(kvf_prefill *p, pjob *j, kvf_err *err)
{
    kvf_worker *w = p->w;
    const Kvfleet__V1__RemotePrefillRequest *rq = j->rq;
    kvf_status st;
    if (!j->delayed) {
        j->delayed = true;
        if (p->fault_delay_ms > 0)
            kvf_sleep_ms(p->fault_delay_ms);
        if ((st = job_check(p, j, err)) != KVF_OK)
            return st;
        if (rq->dst_cached_blocks < j->nb &&
            !(j->peer = peer_get(p, rq->dst->blob.data, rq->dst->blob.len, err)))
            return kvf_err_prefix(err, "prefill: req %s: decode's transport", j->id);
    }
    if (kvf_now_ns() >= j->deadline_ns)
        return kvf_err_set(err, KVF_ERR_TIMEOUT, "prefill: req %s: its deadline passed while it was "
                           "queued (%.1f ms)", j->id, (double)(kvf_now_ns() - j->t_enqueue_ns) / 1e6);

    /* own prefix cache, then blocks for the rest (all or nothing) */
    const char *salt = rq->cache_salt && *rq->cache_salt ? rq->cache_salt : NULL;
    kvf_kv_seq_init(&j->seq, kvf_worker_pool(w),
                    kvf_kv_hash_root(kvf_worker_model_id(w), salt, salt ? strlen(salt) : 0));
    j->has_seq = true;
    int64_t hit = 0;
    if ((st = kvf_kv_prefix_lookup(&j->seq, rq->token_ids, j->n - 1, &hit, err)) != KVF_OK ||
        (st = kvf_kv_seq_prepare_write(&j->seq, j->n - hit, err)) != KVF_OK) {
        kvf_err_prefix(err, "prefill: req %s", j->id);
        job_release_blocks(p, j);
        return st;
    }
    j->hit = j->pos = hit;
    j->t_start_ns = kvf_now_ns();
    j->stats.queue_ms = (double)(j->t_start_ns - j->t_enqueue_ns) / 1e6;
    kvf_metric_observe(p->m_queue_ms, j->stats.queue_ms);
    return KVF_OK;
}

/* Admits queued calls in arrival order while the batch has seats and the pool has blocks. */
static void admit_pass(kvf_prefill *p)
{
    if (p->blocked && !p->pool_changed && p->n_compute + p->n_sending > 0)
        return; /* nothing was released since the head did not fit: it still does not */
    p->blocked = false;
    p->pool_changed = false;
    for (pjob *j = p->jobs, *nx; j && p->n_compute < p->max_seqs; j = nx) {
        nx = j->next;
        if (j->state != PJ_QUEUED)
            continue;
        kvf_err err = {0};
        kvf_status st = job_admit(p, j, &err);
        if (st == KVF_ERR_FULL && p->n_compute + p->n_sending > 0) {
            /* wait for blocks to come back; later calls wait behind it (no overtaking) */
            kvf_log(KVF_LOG_DEBUG, "prefill: req %s waits for blocks: %s", j->id, err.msg);
            p->blocked = true;
            return;
        }
        if (st != KVF_OK) {
            if (st == KVF_ERR_TIMEOUT)
                kvf_metric_add(p->m_expired_queued, 1);
            job_fail(p, j, &err);
            continue;
        }
        p->n_queued--;
        p->n_compute++;
        j->state = PJ_COMPUTE;
    }
}

/* ---- sending ---------------------------------------------------------------------------- */

/* A computed job: writes the blocks decode lacks (or answers at once when it lacks none). */
static void job_send(kvf_prefill *p, pjob *j)
{
    const Kvfleet__V1__RemotePrefillRequest *rq = j->rq;
    kvf_err err = {0};
    if (rq->dst_cached_blocks >= j->nb) {
        job_finish(p, j, KVF_OK, NULL);
        return;
    }
    /* the SENT event names only the id: one write per id at a time (two decode workers may
     * pick the same transfer id) */
    for (pjob *q = p->jobs; q; q = q->next)
        if (q != j && q->state == PJ_SENDING && q->rq->transfer_id == rq->transfer_id) {
            j->state = PJ_ID_WAIT;
            return;
        }
    /* past the deadline decode has given up and may have handed its blocks to another
     * sequence: writing now would corrupt them */
    if (kvf_now_ns() > j->deadline_ns) {
        kvf_err_set(&err, KVF_ERR_TIMEOUT, "prefill: req %s: the deadline passed during the "
                    "prefill (%.1f ms); nothing was written", j->id, j->stats.prefill_ms);
        job_fail(p, j, &err);
        return;
    }
    if (!j->peer && !(j->peer = peer_get(p, rq->dst->blob.data, rq->dst->blob.len, &err))) {
        kvf_err_prefix(&err, "prefill: req %s: decode's transport", j->id);
        job_fail(p, j, &err);
        return;
    }
    kvf_xfer_pair *pairs = malloc((size_t)j->nb * sizeof *pairs);
    if (!pairs) {
        kvf_err_set(&err, KVF_ERR_NOMEM, "prefill: req %s: out of memory", j->id);
        job_fail(p, j, &err);
        return;
    }
    int32_t n_pairs = 0;
    for (int64_t i = rq->dst_cached_blocks; i < j->nb; i++)
        pairs[n_pairs++] = (kvf_xfer_pair){.src = j->seq.blocks[i], .dst = rq->dst_block_ids[i]};
    kvf_status st = kvf_xfer_write(kvf_worker_xfer(p->w), j->peer, rq->transfer_id, pairs,
                                   (size_t)n_pairs, j->deadline_ns, &err);
    free(pairs);
    if (st != KVF_OK) {
        kvf_err_prefix(&err, "prefill: req %s: transfer %llu", j->id,
                       (unsigned long long)rq->transfer_id);
        job_fail(p, j, &err);
        return;
    }
    j->n_pairs = n_pairs;
    j->state = PJ_SENDING;
}

/* A computed job leaves the batch: registers its blocks and starts its write. */
static void job_computed(kvf_prefill *p, pjob *j)
{
    kvf_err err = {0};
    j->t_computed_ns = kvf_now_ns();
    j->stats.prefill_ms = (double)(j->t_computed_ns - j->t_start_ns) / 1e6;
    p->n_compute--;
    p->n_sending++;
    j->state = PJ_ID_WAIT;
    if (kvf_kv_seq_commit(&j->seq, j->rq->token_ids, j->n, &err) != KVF_OK) { /* STORED events */
        kvf_err_prefix(&err, "prefill: req %s", j->id);
        job_fail(p, j, &err);
        return;
    }
    job_send(p, j);
}

static void on_xfer_event(void *ctx, const kvf_xfer_event *ev)
{
    kvf_prefill *p = ctx;
    if (ev->kind != KVF_XFER_SENT)
        return;
    for (pjob *j = p->jobs; j; j = j->next) {
        if (j->state != PJ_SENDING || j->rq->transfer_id != ev->id)
            continue;
        if (ev->status == KVF_OK) {
            job_finish(p, j, KVF_OK, NULL);
        } else {
            kvf_err err = {0};
            kvf_err_set(&err, ev->status, "prefill: req %s: transfer %llu: %s", j->id,
                        (unsigned long long)ev->id, kvf_status_str(ev->status));
            job_fail(p, j, &err);
        }
        /* a write that waited for this id may start now */
        for (pjob *q = p->jobs; q; q = q->next)
            if (q->state == PJ_ID_WAIT && q->rq->transfer_id == ev->id) {
                job_send(p, q);
                break;
            }
        return;
    }
    kvf_log(KVF_LOG_DEBUG, "prefill: transfer %llu: event for no call", (unsigned long long)ev->id);
}

/* ---- the shared step -------------------------------------------------------------------- */

/* One forward step over the admitted prompts: in arrival order, each takes as many of its
 * remaining tokens as the step's token budget has left (chunked prefill). */
static void step_pass(kvf_prefill *p)
{
    kvf_worker *w = p->w;
    kvf_kv_pool *pool = kvf_worker_pool(w);
    const kvf_kv_layout *l = kvf_worker_layout(w);
    int32_t ns = 0, budget = p->max_tokens;
    bool want_logits = false;
    for (pjob *j = p->jobs; j && ns < p->max_seqs && budget > 0; j = j->next) {
        if (j->state != PJ_COMPUTE)
            continue;
        int64_t left = j->n - j->pos;
        j->take = (int32_t)(left < budget ? left : budget);
        budget -= j->take;
        const Kvfleet__V1__SamplingParams *sp = j->rq->sampling;
        p->step_seqs[ns] = (kvf_model_seq){.tokens = j->rq->token_ids + j->pos, .n_tokens = j->take,
                                           .start_pos = (int32_t)j->pos,
                                           .block_table = j->seq.blocks, .n_blocks = j->seq.n_blocks};
        if (j->pos + j->take == j->n && sp && sp->temperature > 0) {
            /* the first token: drawn on the backend when it can (the logits stay there), with
             * the uniform the host sampler would take from the same generator */
            if (kvf_model_fwd_samples(kvf_worker_fwd(w))) {
                kvf_engine_rng rng;
                kvf_engine_rng_seed(&rng, sp->seed, 0);
                float u = (float)kvf_engine_rng_uniform(&rng);
                p->draw[ns] = (kvf_backend_sample_row){
                    .temperature = sp->temperature, .top_k = sp->top_k > 0 ? sp->top_k : 0,
                    .top_p = sp->top_p > 0 && sp->top_p < 1 ? sp->top_p : 1.0f,
                    .u = u < 1.0f ? u : nextafterf(1.0f, 0.0f)};
                p->step_seqs[ns].sample = &p->draw[ns];
            } else {
                want_logits = true;
            }
        }
        p->step_jobs[ns++] = j;
    }
    if (ns == 0)
        return;
    kvf_err err = {0};
    kvf_status st = kvf_model_forward(kvf_worker_fwd(w), p->step_seqs, ns, kvf_kv_pool_base(pool),
                                      l->block_bytes ? kvf_kv_pool_bytes(pool) / l->block_bytes : 0,
                                      want_logits ? p->logits : NULL, p->next, &err);
    kvf_metric_add(p->m_steps, 1);
    kvf_metric_observe(p->m_step_seqs, ns);
    if (ns > p->max_step_seqs) {
        p->max_step_seqs = ns;
        kvf_metric_set(p->m_step_seqs_max, ns);
    }
    for (int32_t i = 0; i < ns; i++) {
        pjob *j = p->step_jobs[i];
        if (st != KVF_OK) {
            kvf_err e = err;
            kvf_err_prefix(&e, "prefill: req %s", j->id);
            job_fail(p, j, &e);
            continue;
        }
        j->pos += j->take;
        kvf_err cerr = {0};
        if (j->pos < j->n) {
            /* the chunk's full blocks are final: later calls may reuse them already */
            if (kvf_kv_seq_commit(&j->seq, j->rq->token_ids, j->pos, &cerr) != KVF_OK) {
                kvf_err_prefix(&cerr, "prefill: req %s", j->id);
                job_fail(p, j, &cerr);
            }
            continue;
        }
        const Kvfleet__V1__SamplingParams *sp = j->rq->sampling;
        if (p->step_seqs[i].sample) {
            j->first_token = p->next[i];
        } else if (sp && sp->temperature > 0) {
            kvf_engine_rng rng;
            kvf_engine_rng_seed(&rng, sp->seed, 0);
            j->first_token = kvf_engine_sample(&p->sampler, p->logits + (size_t)i * (size_t)p->vocab,
                                               sp->temperature, sp->top_k,
                                               sp->top_p > 0 && sp->top_p < 1 ? sp->top_p : 1.0f, &rng);
        } else {
            j->first_token = p->next[i];
        }
        job_computed(p, j);
    }
}

/* Drives the writes in flight to their SENT events before the next step. Bytes (over tcp) and
 * the decode worker's acknowledgement move only while this process progresses the transport,
 * which a forward step does not: a prompt that is computed would otherwise wait for the next
 * step of the others before its answer goes out (and over tcp a long batch would stall its
 * bytes until the peer's endpoint times out). A write ends by its deadline (plus one progress
 * call) at the latest. */
static void drain_sends(kvf_prefill *p)
{
    kvf_xfer *x = kvf_worker_xfer(p->w);
    while (p->n_sending > 0) {
        int64_t until = 0;
        for (pjob *j = p->jobs; j; j = j->next)
            if (j->state == PJ_SENDING && j->deadline_ns > until)
                until = j->deadline_ns;
        if (until == 0)
            return; /* only PJ_ID_WAIT left: cannot happen without a write in flight */
        kvf_xfer_event ev;
        kvf_err err = {0};
        if (kvf_xfer_wait(x, &ev, until + 100000000LL, &err) != KVF_OK) {
            kvf_log(KVF_LOG_WARN, "prefill: %d writes still in flight past their deadlines: %s",
                    p->n_sending, err.msg);
            return;
        }
        on_xfer_event(p, &ev);
    }
}

/* Every loop pass: cancelled and expired calls leave, queued calls join, one step runs. */
static void on_tick(void *ctx)
{
    kvf_prefill *p = ctx;
    if (p->shut)
        return;
    int64_t now = kvf_now_ns();
    for (pjob *j = p->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (j->state != PJ_QUEUED && j->state != PJ_COMPUTE)
            continue; /* a write in flight ends with its event, never later than its deadline */
        kvf_err err = {0};
        if (now >= j->deadline_ns) {
            if (j->state == PJ_QUEUED) {
                kvf_metric_add(p->m_expired_queued, 1);
                kvf_err_set(&err, KVF_ERR_TIMEOUT, "prefill: req %s: its deadline passed while it "
                            "was queued (%.1f ms)", j->id, (double)(now - j->t_enqueue_ns) / 1e6);
            } else {
                kvf_err_set(&err, KVF_ERR_TIMEOUT, "prefill: req %s: the deadline passed during "
                            "the prefill (%lld of %d tokens computed); nothing was written",
                            j->id, (long long)j->pos, j->n);
            }
        } else if (kvf_rpc_call_is_cancelled(j->call)) {
            kvf_err_set(&err, KVF_ERR_CANCELLED, "prefill: req %s: the caller cancelled it (%s)",
                        j->id, j->state == PJ_QUEUED ? "queued" : "computing");
        } else {
            continue;
        }
        job_fail(p, j, &err);
    }
    admit_pass(p);
    if (p->n_compute > 0 && p->n_sending > 0)
        drain_sends(p); /* with no step to run, the loop's idle wait progresses them */
    step_pass(p);
    if (p->n_compute > 0 || (p->n_queued > 0 && p->n_compute < p->max_seqs && !p->blocked))
        kvf_worker_wake(p->w); /* more to compute: no sleep before the next pass */
}

/* ---- the handler ------------------------------------------------------------------------ */

static void wake_loop(void *arg)
{
    kvf_worker_wake(arg);
}

static void enqueue_job(kvf_worker *w, void *arg)
{
    pjob *j = arg;
    kvf_prefill *p = j->p;
    p->n_queued++;
    if (p->jobs_tail)
        p->jobs_tail->next = j;
    else
        p->jobs = j;
    p->jobs_tail = j;
    if (p->shut) { /* posted while the loop was ending: on_shutdown has run */
        job_finish(p, j, KVF_ERR_CANCELLED, "prefill: shutting down");
        return;
    }
    kvf_rpc_call_on_cancel(j->call, wake_loop, w);
}

/* RemotePrefill is registered as a server-streaming method that sends exactly one message:
 * on the wire that is a unary answer, and the call can be answered later by the loop thread
 * instead of holding a gRPC handler thread for the whole prefill. */
static void h_remote_prefill(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    kvf_prefill *p = ctx;
    Kvfleet__V1__RemotePrefillRequest *rq = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_rpc_remote_prefill_request_decode(req, len, &rq, &err);
    if (st != KVF_OK) {
        kvf_rpc_call_finish(call, st, err.msg);
        return;
    }
    kvf_metric_add(p->m_requests, 1);
    pjob *j = calloc(1, sizeof *j);
    if (!j) {
        kvf_rpc_msg_free(rq);
        kvf_rpc_call_finish(call, KVF_ERR_NOMEM, "prefill: out of memory");
        return;
    }
    Kvfleet__V1__PrefillStats init = KVFLEET__V1__PREFILL_STATS__INIT;
    j->stats = init;
    j->p = p;
    j->call = call;
    j->rq = rq;
    j->id = rq->request_id && *rq->request_id ? rq->request_id : "-";
    j->t_enqueue_ns = kvf_now_ns();
    int64_t now_wall = kvf_wall_ms();
    j->deadline_ns = j->t_enqueue_ns + (rq->deadline_unix_ms > 0
                                            ? (rq->deadline_unix_ms - now_wall) * 1000000LL
                                            : 30000LL * 1000000LL);
    atomic_fetch_add(&p->queued_tokens, (int64_t)rq->n_token_ids);
    if (kvf_worker_post(p->w, enqueue_job, j) != KVF_OK) {
        atomic_fetch_sub(&p->queued_tokens, (int64_t)rq->n_token_ids);
        kvf_rpc_msg_free(rq);
        free(j);
        kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "prefill: shutting down");
    }
}

static int64_t queued_tokens(void *ctx)
{
    kvf_prefill *p = ctx;
    return atomic_load(&p->queued_tokens);
}

/* Load: running = calls admitted to the batch or writing their KV; waiting = calls queued. */
static void fill_load(void *ctx, kvf_worker_load *l)
{
    kvf_prefill *p = ctx;
    l->running = p->n_compute + p->n_sending;
    l->waiting = p->n_queued;
}

/* The loop's last pass: every call is answered and every block returns to the pool. */
static void on_shutdown(void *ctx)
{
    kvf_prefill *p = ctx;
    kvf_xfer *x = kvf_worker_xfer(p->w);
    p->shut = true;
    for (pjob *j = p->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (j->state != PJ_SENDING)
            job_finish(p, j, KVF_ERR_CANCELLED, "prefill: shutting down");
    }
    /* writes in flight: closing their peers ends them with CANCELLED events; the blocks go
     * back once the transport let go of them. A write still without its event after 2 s is
     * abandoned, not answered: its bytes may yet land (tcp's socket buffers), and an answer
     * would tell decode its blocks are safe to reuse. */
    for (ppeer *e = p->peers, *n; e; e = n) {
        n = e->next;
        kvf_xfer_disconnect(x, e->peer);
        free(e->desc);
        free(e);
    }
    p->peers = NULL;
    int64_t end = kvf_now_ns() + 2000000000LL;
    while (p->jobs && kvf_now_ns() < end) {
        kvf_xfer_event ev;
        kvf_xfer_progress(x);
        if (kvf_xfer_poll(x, &ev))
            on_xfer_event(p, &ev);
        else
            kvf_sleep_ms(1);
    }
    while (p->jobs)
        job_abandon(p, p->jobs, "shutting down with its KV write still in flight; the call is "
                    "abandoned unanswered");
}

kvf_status kvf_prefill_create(kvf_worker *w, int32_t fault_delay_ms, kvf_prefill **out,
                              kvf_err *err)
{
    if (kvf_worker_role_of(w) != KVF_WORKER_PREFILL)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: the worker was not created as a prefill worker");
    kvf_prefill *p = calloc(1, sizeof *p);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "prefill: out of memory");
    p->w = w;
    p->fault_delay_ms = fault_delay_ms;
    const kvf_model_fwd_opts *lim = kvf_model_fwd_limits(kvf_worker_fwd(w));
    p->max_seqs = lim->max_seqs > 0 ? lim->max_seqs : 1;
    p->max_tokens = lim->max_tokens > 0 ? lim->max_tokens : 1;
    p->vocab = kvf_worker_model(w)->cfg.vocab_size;
    kvf_status st;
    p->step_seqs = calloc((size_t)p->max_seqs, sizeof *p->step_seqs);
    p->step_jobs = calloc((size_t)p->max_seqs, sizeof *p->step_jobs);
    p->next = calloc((size_t)p->max_seqs, sizeof *p->next);
    p->logits = malloc((size_t)p->max_seqs * (size_t)p->vocab * sizeof *p->logits);
    p->draw = malloc((size_t)p->max_seqs * sizeof *p->draw);
    if (!p->step_seqs || !p->step_jobs || !p->next || !p->logits || !p->draw) {
        int32_t ms = p->max_seqs;
        kvf_prefill_destroy(p);
        return kvf_err_set(err, KVF_ERR_NOMEM, "prefill: out of memory for a batch of %d "
                           "sequences (--max-seqs)", ms);
    }
    if ((st = kvf_engine_sampler_init(&p->sampler, p->vocab, err)) != KVF_OK) {
        kvf_prefill_destroy(p);
        return st;
    }
    static const double seq_bounds[] = {1, 2, 4, 8, 16, 32, 64};
    static const double ms_bounds[] = {1, 5, 10, 50, 100, 500, 1000, 5000};
    kvf_metrics *m = kvf_worker_metrics(w);
    const char *lb = "role=\"prefill\"";
    if ((st = kvf_metrics_counter(m, "kvfleet_prefill_requests_total", lb, "RemotePrefill calls", &p->m_requests, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_failed_total", lb, "RemotePrefill calls that failed", &p->m_failed, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_computed_tokens_total", lb, "prompt tokens computed", &p->m_tokens, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_cached_tokens_total", lb, "prompt tokens found in this worker's cache", &p->m_cached, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_kv_bytes_sent_total", lb, "KV bytes written to decode workers", &p->m_bytes, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_expired_queued_total", lb, "RemotePrefill calls whose deadline passed before they were admitted", &p->m_expired_queued, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_steps_total", lb, "forward steps of the prefill batch", &p->m_steps, err)) ||
        (st = kvf_metrics_histogram(m, "kvfleet_prefill_step_seqs", lb, "prompts computed together in one forward step", seq_bounds, sizeof seq_bounds / sizeof seq_bounds[0], &p->m_step_seqs, err)) ||
        (st = kvf_metrics_gauge(m, "kvfleet_prefill_step_seqs_max", lb, "most prompts computed together in one forward step so far", &p->m_step_seqs_max, err)) ||
        (st = kvf_metrics_histogram(m, "kvfleet_prefill_queue_ms", lb, "time a RemotePrefill call waited for admission", ms_bounds, sizeof ms_bounds / sizeof ms_bounds[0], &p->m_queue_ms, err)) ||
        (st = kvf_rpc_server_add_stream(kvf_worker_rpc_server(w), KVF_RPC_WORKER_REMOTE_PREFILL,
                                        h_remote_prefill, p, err))) {
        kvf_prefill_destroy(p);
        return st;
    }
    kvf_worker_hooks h = {.ctx = p, .on_shutdown = on_shutdown, .on_tick = on_tick,
                          .on_xfer_event = on_xfer_event, .queued_prefill_tokens = queued_tokens,
                          .fill_load = fill_load};
    kvf_worker_set_hooks(w, &h);
    *out = p;
    return KVF_OK;
}

void kvf_prefill_destroy(kvf_prefill *p)
{
    if (!p)
        return;
    /* calls the loop never saw end with the worker; anything left here was answered */
    kvf_engine_sampler_fini(&p->sampler);
    free(p->step_seqs);
    free(p->step_jobs);
    free(p->next);
    free(p->logits);
    free(p->draw);
    free(p);
}
