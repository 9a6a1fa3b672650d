/* prefill.c: the prefill role's RemotePrefill, as a handler over the worker's engine. gRPC
 * threads only hand a decoded call to the worker's loop thread; there each call is checked and
 * handed to the engine as a prefill-only request (kvf_engine_request.prefill_only), so
 * concurrent calls share the engine's steps, chunked to its token budget, with its prefix cache,
 * admission and sampler. When the engine reports a call prefilled (its first token, its blocks
 * kept), this file writes the blocks the decode worker lacks through the transport and answers
 * the call once that write is acknowledged; then the engine releases the blocks (full ones stay
 * cached). Deadlines, cancellation, the late-write rules and the queue metrics are kept here. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "prefill/prefill.h"

typedef struct ppeer {
    uint8_t *desc;
    size_t len;
    kvf_xfer_peer *peer;
    struct ppeer *next;
} ppeer;

typedef enum pjob_state {
    PJ_BACKLOG = 0, /* not in the engine yet (its checks and fault delay to run, or the engine
                     * holds max_queued requests already) */
    PJ_ENGINE = 1,  /* in the engine: queued there or computing */
    PJ_ID_WAIT = 2, /* prefilled; another write with its transfer id is still in flight */
    PJ_SENDING = 3, /* kvf_xfer_write accepted; waiting for the SENT event */
} pjob_state;

/* One RemotePrefill call, from its handler to its answer. Loop thread after enqueue. */
typedef struct pjob {
    kvf_prefill *p;
    kvf_rpc_call *call;
    kvf_rpc_remote_prefill_req *rq;
    const char *id;          /* request id for logs */
    pjob_state state;
    bool checked;            /* the fault delay and the checks ran */
    uint64_t eng_id;         /* its engine request while state >= PJ_ENGINE, else 0 */
    int64_t t_enqueue_ns, t_computed_ns, deadline_ns;
    int32_t n;               /* prompt tokens */
    int64_t nb;              /* blocks of the prompt */
    int32_t first_token;
    bool has_first_lp; /* sampling.logprobs: the first token's, for the answer */
    kvf_rpc_logprob first_lp;
    int32_t n_pairs;
    kvf_xfer_peer *peer;     /* NULL when decode holds every block already */
    kvf_rpc_prefill_stats stats;
    struct pjob *next;
} pjob;

struct kvf_prefill {
    kvf_worker *w;
    int32_t fault_delay_ms;
    atomic_int_fast64_t queued_tokens; /* prompt tokens of calls not yet answered; any thread */
    /* loop thread from here on */
    pjob *jobs, *jobs_tail;  /* every live call, in arrival order */
    int32_t n_backlog, n_engine, n_sending; /* n_sending counts PJ_ID_WAIT too */
    bool shut;
    uint64_t next_eng_id;
    int64_t seen_steps, max_step_seqs;
    ppeer *peers;
    kvf_metric *m_requests, *m_failed, *m_tokens, *m_cached, *m_bytes, *m_expired_queued,
        *m_steps, *m_step_seqs, *m_step_seqs_max, *m_queue_ms;
};

static kvf_engine *engine_of(kvf_prefill *p) { return kvf_worker_engine(p->w); }

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

/* Gives j's engine request up: a kept one's blocks go back (full ones stay cached), a queued or
 * computing one is cancelled. */
static void job_release_engine(kvf_prefill *p, pjob *j)
{
    if (!j->eng_id)
        return;
    kvf_err err = {0};
    kvf_status st = kvf_engine_release_kept(engine_of(p), j->eng_id, NULL, &err);
    if (st == KVF_ERR_NOT_FOUND)
        st = kvf_engine_cancel(engine_of(p), j->eng_id, &err);
    if (st != KVF_OK && st != KVF_ERR_NOT_FOUND)
        kvf_log(KVF_LOG_ERROR, "prefill: req %s: releasing its blocks: %s", j->id, err.msg);
    j->eng_id = 0;
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
    case PJ_BACKLOG: p->n_backlog--; break;
    case PJ_ENGINE: p->n_engine--; break;
    case PJ_ID_WAIT:
    case PJ_SENDING: p->n_sending--; break;
    }
}

/* Takes j out of the worker: its blocks back to the pool, out of the list and the queue count. */
static void job_leave(kvf_prefill *p, pjob *j)
{
    job_release_engine(p, j);
    job_unlink(p, j);
    atomic_fetch_sub(&p->queued_tokens, (int64_t)j->rq->n_token_ids);
}

static void job_free(pjob *j)
{
    free(j->rq);
    free(j);
}

/* Ends j without an answer: its write may still land, and only an answer from this worker tells
 * decode that it has stopped (decode then keeps the blocks until the write's deadline). */
static void job_abandon(kvf_prefill *p, pjob *j, const char *msg)
{
    job_leave(p, j);
    kvf_log(KVF_LOG_WARN, "prefill: req %s: %s", j->id, msg);
    kvf_metric_add(p->m_failed, 1);
    kvf_rpc_call_abandon(j->call, msg);
    job_free(j);
}

/* Ends a call: releases its blocks, answers (first token and stats, or st and msg), frees it. */
static void job_finish(kvf_prefill *p, pjob *j, kvf_status st, const char *msg)
{
    job_leave(p, j);
    if (st == KVF_OK) {
        const kvf_kv_layout *l = kvf_worker_layout(p->w);
        kvf_rpc_prefill_stats *s = &j->stats;
        s->prompt_tokens = j->n;
        s->computed_tokens = j->n - s->cached_tokens;
        s->blocks_sent = j->n_pairs;
        s->bytes_sent = (int64_t)j->n_pairs * l->block_bytes;
        s->transfer_ms = (double)(kvf_now_ns() - j->t_computed_ns) / 1e6;
        kvf_metric_add(p->m_tokens, (double)s->computed_tokens);
        kvf_metric_add(p->m_cached, (double)s->cached_tokens);
        kvf_metric_add(p->m_bytes, (double)s->bytes_sent);
        kvf_log(KVF_LOG_DEBUG, "prefill: req %s: %d tokens (%d cached here), %d blocks sent; "
                "queued %.1f ms, prefill %.1f ms, transfer %.1f ms", j->id, j->n,
                s->cached_tokens, j->n_pairs, s->queue_ms, s->prefill_ms, s->transfer_ms);
        kvf_rpc_remote_prefill_resp r = {.first_token = j->first_token, .has_stats = true,
                                         .stats = *s, .has_first_logprob = j->has_first_lp,
                                         .first_logprob = j->first_lp};
        kvf_err err = {0};
        if ((st = kvf_rpc_call_send_remote_prefill(j->call, &r, &err)) == KVF_OK) {
            kvf_rpc_call_finish(j->call, KVF_OK, NULL);
        } else {
            kvf_log(KVF_LOG_WARN, "prefill: req %s: answering: %s", j->id, err.msg);
            kvf_rpc_call_finish(j->call, st, err.msg);
        }
    } else {
        kvf_log(KVF_LOG_WARN, "%s", msg);
        kvf_metric_add(p->m_failed, 1);
        kvf_rpc_call_finish(j->call, st, msg);
    }
    job_free(j);
}

static void job_fail(kvf_prefill *p, pjob *j, const kvf_err *err)
{
    job_finish(p, j, err->status != KVF_OK ? err->status : KVF_ERR_INTERNAL, err->msg);
}

static pjob *find_eng(kvf_prefill *p, uint64_t eng_id)
{
    for (pjob *j = p->jobs; j; j = j->next)
        if (j->eng_id == eng_id)
            return j;
    return NULL;
}

/* ---- into the engine ---------------------------------------------------------------------- */

/* Checks what decode asks for against this worker and fills n and nb. The prompt's own checks
 * (ids in the vocabulary, its length, the sampling range) are the engine's. */
static kvf_status job_check(kvf_prefill *p, pjob *j, kvf_err *err)
{
    const kvf_rpc_remote_prefill_req *rq = j->rq;
    const kvf_kv_layout *l = kvf_worker_layout(p->w);
    const char *id = j->id;
    if (!rq->has_dst_layout || rq->dst.blob_len == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: dst_layout and dst are required", id);
    if (kvf_kv_layout_check_same(l, "here", &rq->dst_layout, "at the decode worker", err) != KVF_OK)
        return kvf_err_prefix(err, "prefill: req %s", id);
    int32_t n = (int32_t)rq->n_token_ids;
    int64_t nb = kvf_kv_blocks_for(n, l->block_size);
    if ((int64_t)rq->n_dst_block_ids != nb)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: %d tokens take %lld blocks of %d "
                           "but dst_block_ids has %zu and dst_cached_blocks is %d", id, n,
                           (long long)nb, l->block_size, rq->n_dst_block_ids, rq->dst_cached_blocks);
    j->n = n;
    j->nb = nb;
    return KVF_OK;
}

/* Hands the backlogged job j to the engine: the fault delay and checks (once), decode's
 * transport, then a prefill-only request. KVF_ERR_FULL: the engine holds as many requests as it
 * may (j stays in the backlog). Any other error: the caller fails the call. */
static kvf_status job_enter(kvf_prefill *p, pjob *j, kvf_err *err)
{
    const kvf_rpc_remote_prefill_req *rq = j->rq;
    kvf_status st;
    if (!j->checked) {
        j->checked = true;
        if (p->fault_delay_ms > 0)
            kvf_sleep_ms(p->fault_delay_ms);
        if ((st = job_check(p, j, err)) != KVF_OK)
            return st;
        if (rq->dst_cached_blocks < j->nb &&
            !(j->peer = peer_get(p, rq->dst.blob, rq->dst.blob_len, err)))
            return kvf_err_prefix(err, "prefill: req %s: decode's transport", j->id);
    }
    if (kvf_now_ns() >= j->deadline_ns)
        return kvf_err_set(err, KVF_ERR_TIMEOUT, "prefill: req %s: its deadline passed while it was "
                           "queued (%.1f ms)", j->id, (double)(kvf_now_ns() - j->t_enqueue_ns) / 1e6);
    kvf_engine_request er = {.id = ++p->next_eng_id, .prompt = rq->token_ids, .n_prompt = j->n,
                             .cache_salt = rq->cache_salt[0] ? rq->cache_salt : NULL,
                             .prefill_only = true};
    kvf_worker_sampling(p->w, &rq->sampling, &er.sampling);
    er.sampling.max_tokens = 1;
    er.sampling.n = 1; /* one first token, whatever n decode will run */
    if ((st = kvf_engine_add(engine_of(p), &er, err)) != KVF_OK)
        return st == KVF_ERR_FULL ? st : kvf_err_prefix(err, "prefill: req %s", j->id);
    j->eng_id = er.id;
    return KVF_OK;
}

/* Hands backlogged calls to the engine in arrival order while it takes them. True when one
 * went in. */
static bool enter_pass(kvf_prefill *p)
{
    bool entered = false;
    for (pjob *j = p->jobs, *nx; j && p->n_backlog > 0; j = nx) {
        nx = j->next;
        if (j->state != PJ_BACKLOG)
            continue;
        kvf_err err = {0};
        kvf_status st = job_enter(p, j, &err);
        if (st == KVF_ERR_FULL)
            break; /* in order: the calls behind it wait too */
        if (st != KVF_OK) {
            if (st == KVF_ERR_TIMEOUT)
                kvf_metric_add(p->m_expired_queued, 1);
            job_fail(p, j, &err);
            continue;
        }
        p->n_backlog--;
        p->n_engine++;
        j->state = PJ_ENGINE;
        entered = true;
    }
    return entered;
}

/* ---- sending ---------------------------------------------------------------------------- */

/* A prefilled job: writes the blocks decode lacks (or answers at once when it lacks none). */
static void job_send(kvf_prefill *p, pjob *j)
{
    const kvf_rpc_remote_prefill_req *rq = j->rq;
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
    if (!j->peer && !(j->peer = peer_get(p, rq->dst.blob, rq->dst.blob_len, &err))) {
        kvf_err_prefix(&err, "prefill: req %s: decode's transport", j->id);
        job_fail(p, j, &err);
        return;
    }
    kvf_engine_req_info info;
    if (kvf_engine_req_info_get(engine_of(p), j->eng_id, &info, &err) != KVF_OK ||
        info.n_blocks != j->nb) {
        if (err.status == KVF_OK)
            kvf_err_set(&err, KVF_ERR_INTERNAL, "prefill: req %s: %d blocks kept for a prompt of "
                        "%lld", j->id, info.n_blocks, (long long)j->nb);
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
        pairs[n_pairs++] = (kvf_xfer_pair){.src = info.blocks[i], .dst = rq->dst_block_ids[i]};
    kvf_xfer_token token;
    _Static_assert(sizeof token.b == sizeof rq->transfer_token, "token sizes");
    memcpy(token.b, rq->transfer_token, sizeof token.b);
    kvf_status st = kvf_xfer_write_token(kvf_worker_xfer(p->w), j->peer, rq->transfer_id, &token,
                                         pairs, (size_t)n_pairs, j->deadline_ns, &err);
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

/* The engine prefilled j (its blocks are kept, the full ones registered): its write starts. */
static void job_prefilled(kvf_prefill *p, pjob *j, int32_t first_token)
{
    kvf_engine_req_info info = {0};
    kvf_err err = {0};
    (void)kvf_engine_req_info_get(engine_of(p), j->eng_id, &info, &err);
    j->t_computed_ns = kvf_now_ns();
    j->first_token = first_token;
    j->stats.cached_tokens = (int32_t)info.n_cached;
    if (info.admitted_ns) {
        j->stats.queue_ms = (double)(info.admitted_ns - j->t_enqueue_ns) / 1e6;
        j->stats.prefill_ms = (double)(j->t_computed_ns - info.admitted_ns) / 1e6;
        kvf_metric_observe(p->m_queue_ms, j->stats.queue_ms);
    }
    p->n_engine--;
    p->n_sending++;
    j->state = PJ_ID_WAIT;
    job_send(p, j);
}

/* Engine outputs: a call's first token (PREFILLED), or its end inside the engine. */
static void on_output(void *ctx, const kvf_engine_output *o)
{
    kvf_prefill *p = ctx;
    pjob *j = find_eng(p, o->id);
    if (!j || j->state != PJ_ENGINE)
        return; /* a call that left already (its cancellation being reported) */
    if (o->finish == KVF_ENGINE_FINISH_PREFILLED) {
        j->has_first_lp = o->n_top > 0 || o->logprob == o->logprob; /* not NaN: asked for */
        if (j->has_first_lp)
            kvf_worker_logprob(o, &j->first_lp);
        job_prefilled(p, j, o->token);
        return;
    }
    kvf_err err = {0};
    kvf_err_set(&err, o->finish == KVF_ENGINE_FINISH_LENGTH ? KVF_ERR_LIMIT : KVF_ERR_INTERNAL,
                "prefill: req %s: the engine ended it (%s)%s", j->id,
                kvf_engine_finish_name(o->finish),
                o->finish == KVF_ENGINE_FINISH_LENGTH ? ": its blocks cannot fit in this pool" : "");
    j->eng_id = 0; /* finished in the engine: nothing to release */
    job_fail(p, j, &err);
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

/* The engine's step since the last pass, in the prefill metrics. */
static void step_metrics(kvf_prefill *p)
{
    kvf_engine_stats es;
    kvf_engine_get_stats(engine_of(p), &es);
    if (es.steps == p->seen_steps)
        return;
    p->seen_steps = es.steps;
    kvf_metric_add(p->m_steps, 1);
    kvf_metric_observe(p->m_step_seqs, es.last_step_seqs);
    if (es.last_step_seqs > p->max_step_seqs) {
        p->max_step_seqs = es.last_step_seqs;
        kvf_metric_set(p->m_step_seqs_max, es.last_step_seqs);
    }
}

/* Every loop pass, after the engine's step: cancelled and expired calls leave, backlogged calls
 * go into the engine, and writes in flight are driven while the engine still computes. */
static void on_tick(void *ctx)
{
    kvf_prefill *p = ctx;
    if (p->shut)
        return;
    step_metrics(p);
    int64_t now = kvf_now_ns();
    for (pjob *j = p->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (j->state != PJ_BACKLOG && j->state != PJ_ENGINE)
            continue; /* a write in flight ends with its event, never later than its deadline */
        kvf_engine_req_info info = {.state = KVF_ENGINE_REQ_QUEUED};
        kvf_err err = {0};
        if (j->state == PJ_ENGINE)
            (void)kvf_engine_req_info_get(engine_of(p), j->eng_id, &info, &err);
        bool queued = info.state == KVF_ENGINE_REQ_QUEUED;
        if (now >= j->deadline_ns) {
            if (queued) {
                kvf_metric_add(p->m_expired_queued, 1);
                kvf_err_set(&err, KVF_ERR_TIMEOUT, "prefill: req %s: its deadline passed while it "
                            "was queued (%.1f ms)", j->id, (double)(now - j->t_enqueue_ns) / 1e6);
            } else {
                kvf_err_set(&err, KVF_ERR_TIMEOUT, "prefill: req %s: the deadline passed during "
                            "the prefill (%lld of %d tokens computed); nothing was written",
                            j->id, (long long)info.n_computed, j->n);
            }
        } else if (kvf_rpc_call_is_cancelled(j->call)) {
            kvf_err_set(&err, KVF_ERR_CANCELLED, "prefill: req %s: the caller cancelled it (%s)",
                        j->id, queued ? "queued" : "computing");
        } else {
            continue;
        }
        job_fail(p, j, &err);
    }
    if (enter_pass(p))
        kvf_worker_wake(p->w); /* the engine has new work: no sleep before the next pass */
    if (p->n_engine > 0 && p->n_sending > 0)
        drain_sends(p); /* with no step to run, the loop's idle wait progresses them */
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
    p->n_backlog++;
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
static void h_remote_prefill(void *ctx, kvf_rpc_call *call, kvf_rpc_remote_prefill_req *rq)
{
    kvf_prefill *p = ctx;
    kvf_metric_add(p->m_requests, 1);
    pjob *j = calloc(1, sizeof *j);
    if (!j) {
        free(rq);
        kvf_rpc_call_finish(call, KVF_ERR_NOMEM, "prefill: out of memory");
        return;
    }
    j->p = p;
    j->call = call;
    j->rq = rq;
    j->id = rq->request_id;
    j->n = (int32_t)rq->n_token_ids;
    j->t_enqueue_ns = kvf_now_ns();
    int64_t now_wall = kvf_wall_ms();
    j->deadline_ns = j->t_enqueue_ns + (rq->deadline_unix_ms > 0
                                            ? (rq->deadline_unix_ms - now_wall) * 1000000LL
                                            : 30000LL * 1000000LL);
    atomic_fetch_add(&p->queued_tokens, (int64_t)rq->n_token_ids);
    if (kvf_worker_post(p->w, enqueue_job, j) != KVF_OK) {
        atomic_fetch_sub(&p->queued_tokens, (int64_t)rq->n_token_ids);
        job_free(j);
        kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "prefill: shutting down");
    }
}

static int64_t queued_tokens(void *ctx)
{
    kvf_prefill *p = ctx;
    return atomic_load(&p->queued_tokens);
}

/* Load: running = calls the engine computes or whose KV is being written; waiting = calls
 * queued in the engine or in the backlog. */
static void fill_load(void *ctx, kvf_worker_load *l)
{
    kvf_prefill *p = ctx;
    kvf_engine_stats es;
    kvf_engine_get_stats(engine_of(p), &es);
    l->running = es.running + p->n_sending;
    l->waiting = es.waiting + es.swapped + p->n_backlog;
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
    kvf_status st;
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
        (st = kvf_metrics_counter(m, "kvfleet_prefill_steps_total", lb, "engine steps that computed prompts", &p->m_steps, err)) ||
        (st = kvf_metrics_histogram(m, "kvfleet_prefill_step_seqs", lb, "prompts computed together in one engine step", seq_bounds, sizeof seq_bounds / sizeof seq_bounds[0], &p->m_step_seqs, err)) ||
        (st = kvf_metrics_gauge(m, "kvfleet_prefill_step_seqs_max", lb, "most prompts computed together in one engine step so far", &p->m_step_seqs_max, err)) ||
        (st = kvf_metrics_histogram(m, "kvfleet_prefill_queue_ms", lb, "time a RemotePrefill call waited for admission", ms_bounds, sizeof ms_bounds / sizeof ms_bounds[0], &p->m_queue_ms, err)) ||
        (st = kvf_rpc_serve_remote_prefill(kvf_worker_rpc_server(w), h_remote_prefill, p, err))) {
        kvf_prefill_destroy(p);
        return st;
    }
    kvf_worker_hooks h = {.ctx = p, .on_output = on_output, .on_shutdown = on_shutdown,
                          .on_tick = on_tick, .on_xfer_event = on_xfer_event,
                          .queued_prefill_tokens = queued_tokens, .fill_load = fill_load};
    kvf_worker_set_hooks(w, &h);
    *out = p;
    return KVF_OK;
}

void kvf_prefill_destroy(kvf_prefill *p)
{
    /* calls the loop never saw end with the worker; anything left here was answered */
    free(p);
}
