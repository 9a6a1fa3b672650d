/* decode.c: the decode role's Generate stream. Decode-first (DESIGN.md s.1): look up the prefix
 * cache, then prefill locally (few uncached tokens, no hint, or the prefill worker is down) or
 * reserve the prompt's blocks and ask the hinted prefill worker to fill them, falling back to a
 * local prefill on any failure. Every path frees its blocks; blocks a prefill worker may still
 * write when decode gives up on it are held (kvf_engine_hold) until its answer or a deadline.
 * All state lives on the worker's loop thread; gRPC threads only post jobs. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "decode/decode.h"
#include "kv/hash.h"
#include "proto/worker.h"

#define PEER_DOWN_NS (2000LL * 1000000LL) /* a prefill worker that failed is skipped this long */

typedef struct dreq {
    uint64_t key;    /* unique per Generate call (cancel jobs find the request by it) */
    uint64_t eng_id; /* current engine id (a fallback takes a new one) */
    char id[KVF_RPC_MAX_ID_LEN + 1];
    kvf_rpc_call *call;
    int32_t *prompt, n_prompt;
    char *salt;
    char hint[256];
    kvf_engine_sampling samp;
    kvf_rpc_sampling wire_samp; /* as it came: passed on to the prefill worker */
    char *guide;                /* the guide's text that samp and wire_samp point at */
    int32_t n_prior;            /* GenerateRequest.n_prior_output_tokens */
    int n_done;
    int32_t completion_tokens, cached_tokens, remote_tokens;
    /* remote prefill in flight */
    bool remote, got_reply, got_xfer;
    bool rpc_sent;    /* the RemotePrefill call started: the prefill worker may write */
    bool writer_done; /* its answer came from the prefill worker: no byte can land any more */
    bool xfer_ok;     /* RECEIVED OK: the one write of the transfer has landed */
    int32_t first_token, n_blocks, n_cached_blocks;
    bool has_first_lp; /* the prefill worker sent the first token's log-probabilities */
    kvf_rpc_logprob first_lp;
    uint64_t tid;
    int64_t deadline_ns, t0_ns;
    int64_t deadline_wall_ms; /* GenerateRequest.deadline_unix_ms; 0: none */
    struct cancel_arg *cancel; /* the call's cancel callback argument */
    struct dreq *next;
} dreq;

/* Blocks of a given-up remote prefill, held until its writer is known to have stopped. */
typedef struct dhold {
    uint64_t tid;      /* transfer id = the engine id holding the blocks */
    int64_t until_ns;  /* the transfer's deadline plus --late-write-grace-ms */
    int64_t t0_ns;
    int32_t n_blocks;
    char id[KVF_RPC_MAX_ID_LEN + 1];
    struct dhold *next;
} dhold;

typedef struct pconn {
    char addr[256];
    kvf_rpc_channel *ch;
    int64_t down_until_ns;
    struct pconn *next;
} pconn;

struct kvf_decode {
    kvf_worker *w;
    dreq *reqs;
    pconn *peers;
    dhold *holds;
    uint64_t next_eng_id;
    atomic_uint_fast64_t next_key;
    kvf_metric *m_remote, *m_local, *m_fallback, *m_bytes, *m_requests, *m_cancelled,
        *m_tokens;
    kvf_metric *m_held_blocks, *m_hold_answer, *m_hold_deadline;
};

typedef struct reply {
    kvf_decode *d;
    uint64_t key, tid;
    kvf_status st;
    int32_t first_token;
    bool has_first_lp;
    kvf_rpc_logprob first_lp;
    int64_t bytes_sent;
    bool answered; /* the prefill worker itself answered (not a status made by gRPC here) */
    char msg[256];
} reply;

static void dreq_free(dreq *q)
{
    free(q->cancel);
    free(q->prompt);
    free(q->salt);
    free(q->guide);
    free(q);
}

static void unlink_req(kvf_decode *d, dreq *q)
{
    for (dreq **pp = &d->reqs; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            return;
        }
}

static kvf_rpc_finish finish_msg(kvf_engine_finish f)
{
    switch (f) {
    case KVF_ENGINE_FINISH_STOP: return KVF_RPC_FINISH_STOP;
    case KVF_ENGINE_FINISH_LENGTH: return KVF_RPC_FINISH_LENGTH;
    case KVF_ENGINE_FINISH_CANCELLED: return KVF_RPC_FINISH_CANCELLED;
    case KVF_ENGINE_FINISH_ERROR: return KVF_RPC_FINISH_ERROR;
    default: return KVF_RPC_FINISH_NONE;
    }
}

static void held_gauge(kvf_decode *d)
{
    kvf_engine_stats es;
    kvf_engine_get_stats(kvf_worker_engine(d->w), &es);
    kvf_metric_set(d->m_held_blocks, es.held_blocks);
}

/* Ends hold h (its writer answered, or its deadline passed, or shutdown): the blocks go back. */
static void hold_end(kvf_decode *d, dhold *h, const char *why)
{
    kvf_err err = {0};
    int32_t nb = 0;
    kvf_status st = kvf_engine_release_held(kvf_worker_engine(d->w), h->tid, &nb, &err);
    kvf_log(KVF_LOG_DEBUG, "decode: req %s: %d held blocks of transfer %llu released (%s%s) after "
            "%.1f ms", h->id, h->n_blocks, (unsigned long long)h->tid, why,
            st == KVF_OK ? "" : "; the engine's own deadline had released them",
            (double)(kvf_now_ns() - h->t0_ns) / 1e6);
    for (dhold **pp = &d->holds; *pp; pp = &(*pp)->next)
        if (*pp == h) {
            *pp = h->next;
            break;
        }
    free(h);
    held_gauge(d);
}

/* q's remote prefill is given up while the prefill worker may still write its blocks (a
 * one-sided put cannot be recalled): the engine keeps them referenced until the RemotePrefill
 * answer arrives (reply_job) or the transfer's deadline plus the grace passes (on_tick). The
 * RemotePrefill call is deliberately not cancelled: its answer is the proof that the write
 * ended. False when nothing was held (the caller frees the blocks). */
static bool hold_start(kvf_decode *d, dreq *q, uint64_t tid)
{
    const kvf_worker_cfg *cfg = kvf_worker_config(d->w);
    int64_t until = q->deadline_ns + (int64_t)cfg->late_write_grace_ms * 1000000LL;
    kvf_err err = {0};
    int32_t nb = 0;
    if (kvf_engine_hold(kvf_worker_engine(d->w), q->eng_id, until, &nb, &err) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "decode: req %s: hold: %s", q->id, err.msg);
        return false;
    }
    dhold *h = calloc(1, sizeof *h);
    if (!h) { /* untracked: the engine's own deadline (on_tick) still ends it */
        kvf_log(KVF_LOG_WARN, "decode: req %s: out of memory: %d blocks held until their "
                "deadline whatever the prefill worker answers", q->id, nb);
        held_gauge(d);
        return true;
    }
    h->tid = tid;
    h->until_ns = until;
    h->t0_ns = kvf_now_ns();
    h->n_blocks = nb;
    snprintf(h->id, sizeof h->id, "%s", q->id);
    h->next = d->holds;
    d->holds = h;
    held_gauge(d);
    kvf_log(KVF_LOG_INFO, "decode: req %s: remote prefill given up while %s may still write: "
            "holding %d blocks (transfer %llu) until its answer or %.0f ms from now", q->id,
            q->hint, nb, (unsigned long long)tid, (double)(until - h->t0_ns) / 1e6);
    return true;
}

/* Stops whatever the engine and transport hold for q. Its blocks go back to the pool now,
 * unless a prefill worker may still be writing them: then they are held (hold_start). */
static void release(kvf_decode *d, dreq *q)
{
    kvf_err err = {0};
    bool may_write = q->remote && q->rpc_sent && !q->writer_done && !q->xfer_ok;
    uint64_t held_tid = q->rpc_sent ? (uint64_t)q->eng_id : 0;
    if (q->remote && q->tid && !q->got_xfer) {
        uint64_t tid = q->tid;
        q->tid = 0; /* the CANCELLED event that follows matches nobody */
        kvf_xfer_cancel(kvf_worker_xfer(d->w), tid, &err);
    }
    q->rpc_sent = false;
    if (q->eng_id && may_write && hold_start(d, q, held_tid)) {
        q->eng_id = 0;
    } else if (q->eng_id) {
        kvf_status st = kvf_engine_cancel(kvf_worker_engine(d->w), q->eng_id, &err);
        if (st != KVF_OK && st != KVF_ERR_NOT_FOUND)
            kvf_log(KVF_LOG_WARN, "decode: req %s: cancel: %s", q->id, err.msg);
        q->eng_id = 0;
    }
    q->remote = false;
}

/* Ends q's call with st (after releasing it) and forgets q. */
static void end_req(kvf_decode *d, dreq *q, kvf_status st, const char *msg)
{
    release(d, q);
    unlink_req(d, q);
    kvf_rpc_call_finish(q->call, st, msg);
    kvf_log(st == KVF_OK ? KVF_LOG_DEBUG : KVF_LOG_INFO, "decode: req %s: ended (%s%s%s) after %d tokens in %.1f ms",
            q->id, kvf_status_name(st), msg ? ": " : "", msg ? msg : "", q->completion_tokens,
            (double)(kvf_now_ns() - q->t0_ns) / 1e6);
    dreq_free(q);
}

static dreq *find_key(kvf_decode *d, uint64_t key)
{
    for (dreq *q = d->reqs; q; q = q->next)
        if (q->key == key)
            return q;
    return NULL;
}

static void start_local(kvf_decode *d, dreq *q)
{
    kvf_err err = {0};
    kvf_engine_request er = {.id = ++d->next_eng_id, .prompt = q->prompt, .n_prompt = q->n_prompt,
                             .cache_salt = q->salt, .sampling = q->samp,
                             .n_prior_output = q->n_prior};
    kvf_status st = kvf_engine_add(kvf_worker_engine(d->w), &er, &err);
    if (st != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "decode: req %s: %s", q->id, err.msg);
        end_req(d, q, st, err.msg);
        return;
    }
    q->eng_id = er.id;
    kvf_metric_add(d->m_local, 1);
    kvf_log(KVF_LOG_DEBUG, "decode: req %s: local prefill of %d tokens (engine req %llu)", q->id,
            q->n_prompt, (unsigned long long)er.id);
}

static void fallback(kvf_decode *d, dreq *q, const char *why)
{
    kvf_log(KVF_LOG_WARN, "decode: req %s: remote prefill on %s failed (%s); prefilling locally",
            q->id, q->hint, why);
    release(d, q);
    q->remote_tokens = 0;
    kvf_metric_add(d->m_fallback, 1);
    start_local(d, q);
}

static pconn *peer_get(kvf_decode *d, const char *addr)
{
    for (pconn *p = d->peers; p; p = p->next)
        if (strcmp(p->addr, addr) == 0)
            return p;
    pconn *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    kvf_err err = {0};
    const kvf_worker_cfg *cfg = kvf_worker_config(d->w);
    kvf_rpc_channel_opts o = {.keepalive_ms = 1000,
                              .tls = kvf_rpc_tls_on(&cfg->tls) ? &cfg->tls : NULL};
    if (kvf_rpc_channel_create(addr, &o, &p->ch, &err) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "decode: prefill worker %s: %s", addr, err.msg);
        free(p);
        return NULL;
    }
    p->next = d->peers;
    d->peers = p;
    return p;
}

static void peer_mark_down(kvf_decode *d, const char *addr)
{
    for (pconn *p = d->peers; p; p = p->next)
        if (strcmp(p->addr, addr) == 0)
            p->down_until_ns = kvf_now_ns() + PEER_DOWN_NS;
}

static void maybe_done(kvf_decode *d, dreq *q)
{
    if (!q->remote || !q->got_reply || !q->got_xfer)
        return;
    kvf_err err = {0};
    kvf_status st = kvf_engine_remote_done(kvf_worker_engine(d->w), q->eng_id, q->first_token, &err);
    if (st != KVF_OK) {
        fallback(d, q, err.msg);
        return;
    }
    const kvf_kv_layout *l = kvf_worker_layout(d->w);
    kvf_metric_add(d->m_remote, 1);
    kvf_metric_add(d->m_bytes, (double)(q->n_blocks - q->n_cached_blocks) * (double)l->block_bytes);
    kvf_log(KVF_LOG_DEBUG, "decode: req %s: remote prefill done: %d of %d blocks received in %.1f ms",
            q->id, q->n_blocks - q->n_cached_blocks, q->n_blocks,
            (double)(kvf_now_ns() - q->t0_ns) / 1e6);
    q->remote = false;
    q->tid = 0;
}

static void reply_job(kvf_worker *w, void *arg)
{
    reply *r = arg;
    kvf_decode *d = r->d;
    dreq *q = find_key(d, r->key);
    if (q && q->remote && q->tid == r->tid) {
        q->writer_done = r->answered;
        if (r->st != KVF_OK) {
            if (r->st == KVF_ERR_PEER_LOST || r->st == KVF_ERR_UNSUPPORTED)
                peer_mark_down(d, q->hint);
            fallback(d, q, r->msg);
        } else {
            q->got_reply = true;
            q->first_token = r->first_token;
            q->has_first_lp = r->has_first_lp;
            q->first_lp = r->first_lp;
            maybe_done(d, q);
        }
    } else {
        /* the answer for blocks held after decode gave up: only the prefill worker's own answer
         * proves its write ended; a status made here (DEADLINE_EXCEEDED, UNAVAILABLE for a lost
         * connection) does not, and the hold waits for its deadline */
        for (dhold *h = d->holds; h; h = h->next)
            if (h->tid == r->tid) {
                if (r->answered) {
                    kvf_metric_add(d->m_hold_answer, 1);
                    hold_end(d, h, "the prefill worker answered");
                }
                break;
            }
    }
    free(r);
    (void)w;
}

/* On the channel's completion-queue thread: copy and hand to the loop. */
static void reply_cb(void *arg, kvf_status st, const uint8_t *resp, size_t len, const char *msg,
                     bool by_server)
{
    reply *r = arg;
    r->st = st;
    /* prefill.c answers only after its write's SENT event (OK or failed) or before it wrote; a
     * status gRPC made (deadline, lost connection, cancel) proves nothing of the write */
    r->answered = by_server;
    if (st == KVF_OK) {
        kvf_rpc_remote_prefill_resp *m = NULL;
        kvf_err err = {0};
        if (kvf_rpc_remote_prefill_resp_decode(resp, len, &m, &err) == KVF_OK) {
            r->first_token = m->first_token;
            r->has_first_lp = m->has_first_logprob;
            r->first_lp = m->first_logprob;
            r->bytes_sent = m->has_stats ? m->stats.bytes_sent : 0;
            free(m);
        } else {
            r->st = err.status ? err.status : KVF_ERR_PARSE;
            snprintf(r->msg, sizeof r->msg, "%.200s", err.msg);
        }
    } else {
        snprintf(r->msg, sizeof r->msg, "%.200s", msg ? msg : kvf_status_str(st));
    }
    if (kvf_worker_post(r->d->w, reply_job, r) != KVF_OK)
        free(r);
}

/* Reserves q's blocks and sends RemotePrefill; false when it could not start (q untouched
 * apart from the engine entry it released). */
static bool start_remote(kvf_decode *d, dreq *q, pconn *p)
{
    kvf_worker *w = d->w;
    kvf_engine *e = kvf_worker_engine(w);
    const kvf_kv_layout *l = kvf_worker_layout(w);
    const kvf_worker_cfg *cfg = kvf_worker_config(w);
    kvf_err err = {0};
    int32_t cap = (int32_t)kvf_kv_blocks_for(q->n_prompt, l->block_size);
    int32_t *blocks = malloc((size_t)cap * sizeof *blocks);
    if (!blocks)
        return false;
    int64_t n_cached = 0;
    int32_t nb = 0;
    kvf_engine_request er = {.id = ++d->next_eng_id, .prompt = q->prompt, .n_prompt = q->n_prompt,
                             .cache_salt = q->salt, .sampling = q->samp,
                             .n_prior_output = q->n_prior};
    kvf_status st = kvf_engine_add_remote(e, &er, blocks, cap, &nb, &n_cached, &err);
    if (st != KVF_OK) {
        kvf_log(KVF_LOG_INFO, "decode: req %s: no remote prefill: %s", q->id, err.msg);
        free(blocks);
        return false;
    }
    q->eng_id = er.id;
    q->remote = true;
    q->got_reply = q->got_xfer = false;
    q->rpc_sent = q->writer_done = q->xfer_ok = false;
    q->n_blocks = nb;
    q->n_cached_blocks = (int32_t)(n_cached / l->block_size);
    q->cached_tokens = (int32_t)n_cached;
    q->remote_tokens = q->n_prompt - (int32_t)n_cached;
    q->tid = er.id;
    q->deadline_ns = kvf_now_ns() + (int64_t)cfg->prefill_timeout_ms * 1000000LL;
    /* the transfer's capability: only a notice carrying it completes the transfer */
    kvf_xfer_token token = {{0}};
    if (q->n_cached_blocks >= nb) {
        q->got_xfer = true; /* nothing to receive: the prefill worker writes nothing */
    } else if ((st = kvf_xfer_token_new(&token, &err)) != KVF_OK ||
               (st = kvf_xfer_expect_token(kvf_worker_xfer(w), q->tid, &token,
                                           blocks + q->n_cached_blocks,
                                           (size_t)(nb - q->n_cached_blocks), q->deadline_ns,
                                           &err)) != KVF_OK) {
        /* the blocks the prefill worker writes: ucx through a pinned mirror (--device cuda
         * --xfer-gpu-staging) copies them into device memory before RECEIVED */
        kvf_log(KVF_LOG_WARN, "decode: req %s: transfer %llu: %s", q->id,
                (unsigned long long)q->tid, err.msg);
        q->tid = 0;
        release(d, q);
        free(blocks);
        return false;
    }

    /* the RemotePrefill request */
    size_t desc_len;
    const uint8_t *desc = kvf_worker_xfer_desc(w, &desc_len);
    kvf_rpc_remote_prefill_req rq = {
        .request_id = q->id, .token_ids = q->prompt, .n_token_ids = (size_t)q->n_prompt,
        .dst_block_ids = blocks, .n_dst_block_ids = (size_t)nb,
        .dst_cached_blocks = q->n_cached_blocks,
        .dst = {.backend = kvf_xfer_backend_name(kvf_worker_xfer(w)), .blob = desc,
                .blob_len = desc_len},
        .transfer_id = q->tid, .cache_salt = q->salt ? q->salt : "", .sampling = q->wire_samp,
        .deadline_unix_ms = kvf_wall_ms() + cfg->prefill_timeout_ms, .has_dst_layout = true,
        .dst_layout = *l};
    _Static_assert(sizeof rq.transfer_token == sizeof token.b, "token sizes");
    memcpy(rq.transfer_token, token.b, sizeof token.b);
    kvf_rpc_buf buf = {0};
    st = kvf_rpc_remote_prefill_req_encode(&rq, &buf, &err);
    free(blocks);
    reply *r = calloc(1, sizeof *r);
    if (st == KVF_OK && r) {
        r->d = d;
        r->key = q->key;
        r->tid = q->tid;
        st = kvf_rpc_unary_async(p->ch, KVF_RPC_WORKER_REMOTE_PREFILL, buf.data, buf.len,
                                 cfg->prefill_timeout_ms, reply_cb, r, &err);
        if (st != KVF_OK)
            free(r);
        else
            q->rpc_sent = true;
    } else {
        free(r);
        if (st == KVF_OK)
            st = KVF_ERR_NOMEM;
    }
    kvf_rpc_buf_free(&buf);
    if (st != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "decode: req %s: RemotePrefill to %s: %s", q->id, q->hint, err.msg);
        release(d, q);
        return false;
    }
    kvf_log(KVF_LOG_DEBUG, "decode: req %s: remote prefill on %s: %d tokens, %d of %d blocks cached "
            "here (engine req and transfer %llu)", q->id, q->hint, q->n_prompt, q->n_cached_blocks, nb,
            (unsigned long long)q->tid);
    return true;
}

static void start_job(kvf_worker *w, void *arg)
{
    dreq *q = arg;
    kvf_decode *d = NULL;
    /* the decode object rides in q->next until the request is linked */
    d = (kvf_decode *)q->next;
    q->next = d->reqs;
    d->reqs = q;
    q->t0_ns = kvf_now_ns();
    if (kvf_rpc_call_is_cancelled(q->call)) {
        end_req(d, q, KVF_ERR_CANCELLED, "cancelled before it started");
        return;
    }
    const kvf_worker_cfg *cfg = kvf_worker_config(w);
    const kvf_kv_layout *l = kvf_worker_layout(w);
    /* prompt log-probabilities come from a local prefill (the engine computes them token by
     * token); a prefill worker sends only the first token's. A resumed stream (output already
     * streamed, n_prior) prefills here too: its next draw, penalty counts and guide go on from
     * that output, which a prefill worker would not know. */
    if (q->hint[0] && q->samp.n == 1 && !q->samp.prompt_logprobs && q->n_prior == 0) {
        const char *mid = kvf_worker_model_id(w);
        uint64_t root = kvf_kv_hash_root(mid, q->salt, q->salt ? strlen(q->salt) : 0);
        int32_t hit = kvf_kv_prefix_probe(kvf_worker_pool(w), root, q->prompt, q->n_prompt);
        int64_t uncached = q->n_prompt - (int64_t)hit * l->block_size;
        int32_t thr = cfg->local_prefill_max_tokens;
        pconn *p = (thr == 0 || uncached > thr) ? peer_get(d, q->hint) : NULL;
        if (p && p->down_until_ns > kvf_now_ns()) {
            kvf_log(KVF_LOG_INFO, "decode: req %s: prefill worker %s is down; prefilling locally",
                    q->id, q->hint);
            kvf_metric_add(d->m_fallback, 1);
        } else if (p && start_remote(d, q, p)) {
            return;
        }
    }
    start_local(d, q);
}

typedef struct cancel_arg {
    kvf_decode *d;
    uint64_t key;
} cancel_arg;

static void cancel_job(kvf_worker *w, void *arg)
{
    cancel_arg c = *(cancel_arg *)arg;
    free(arg);
    dreq *q = find_key(c.d, c.key);
    if (q) {
        kvf_metric_add(c.d->m_cancelled, 1);
        end_req(c.d, q, KVF_ERR_CANCELLED, "cancelled by the client");
    }
    (void)w;
}

/* Completion-queue thread: hand a copy of (decode, key) to the loop; the request may be gone
 * by the time the job runs, and is then simply not found. */
static void on_call_cancel(void *arg)
{
    cancel_arg *c = malloc(sizeof *c);
    if (!c)
        return;
    *c = *(cancel_arg *)arg;
    if (kvf_worker_post(c->d->w, cancel_job, c) != KVF_OK)
        free(c);
}

/* ---- hooks ------------------------------------------------------------------------------ */

/* Sends rows at..at+n of an output's prompt log-probabilities (prompt tokens at+1..). */
static kvf_status send_prompt_lps(dreq *q, const kvf_engine_output *o, int32_t at, int32_t n,
                                  kvf_err *err)
{
    int32_t w = 1 + q->samp.top_logprobs; /* entries per row: the token's own, then the top */
    kvf_rpc_logprob *rows = malloc((size_t)n * sizeof *rows);
    if (!rows)
        return kvf_err_set(err, KVF_ERR_NOMEM, "decode: req %s: no memory for %d prompt "
                           "logprob rows", q->id, n);
    for (int32_t i = 0; i < n; i++) {
        const kvf_engine_logprob *e = o->prompt_lps + (size_t)(at + i) * (size_t)w;
        rows[i] = (kvf_rpc_logprob){.logprob = e[0].logprob};
        for (int32_t k = 1; k < w && k <= KVF_RPC_MAX_LOGPROBS && e[k].id >= 0; k++) { /* -1 pads */
            rows[i].top_ids[k - 1] = e[k].id;
            rows[i].top_lps[k - 1] = e[k].logprob;
            rows[i].n_top = k;
        }
    }
    kvf_rpc_generate_resp r = {.index = 0, .prompt_lps = rows, .n_prompt_lps = (size_t)n,
                               .prompt_lps_start = at + 1};
    kvf_status st = kvf_rpc_call_send_generate(q->call, &r, err);
    free(rows);
    return st;
}

static void on_output(void *ctx, const kvf_engine_output *o)
{
    kvf_decode *d = ctx;
    dreq *q = NULL;
    for (dreq *x = d->reqs; x; x = x->next)
        if (x->eng_id == o->id && !x->remote) {
            q = x;
            break;
        }
    if (!q)
        return; /* a cancelled or abandoned engine id */
    if (q->remote_tokens == 0 && q->completion_tokens == 0 && o->n_cached > q->cached_tokens)
        q->cached_tokens = (int32_t)o->n_cached; /* a local prefill: what this worker's own prefix
                                                  * cache served (usage.cached_tokens); from the
                                                  * output, as a request that ends on its first
                                                  * token is gone from the engine already */
    kvf_err err = {0};
    kvf_status st = KVF_OK;
    /* prompt log-probabilities first, in messages of their own */
    for (int32_t at = 0; o->prompt_lps && at < o->n_prompt_lps && st == KVF_OK;) {
        int32_t n = o->n_prompt_lps - at < KVF_RPC_MAX_PROMPT_LPS ? o->n_prompt_lps - at
                                                                  : KVF_RPC_MAX_PROMPT_LPS;
        st = send_prompt_lps(q, o, at, n, &err);
        at += n;
    }
    if (st != KVF_OK) {
        kvf_metric_add(d->m_cancelled, 1);
        end_req(d, q, st == KVF_ERR_CANCELLED ? KVF_ERR_CANCELLED : st, err.msg);
        return;
    }
    kvf_rpc_generate_resp r = {.index = o->index, .finish = finish_msg(o->finish)};
    int32_t tok = o->token;
    kvf_rpc_logprob lp;
    if (tok >= 0) {
        r.n_token_ids = 1;
        r.token_ids = &tok;
        if (q->samp.logprobs) {
            /* a remote prefill's first token was drawn there, with its log-probabilities */
            if (o->index == 0 && o->n_generated == 1 && q->has_first_lp)
                lp = q->first_lp;
            else
                kvf_worker_logprob(o, &lp);
            if (lp.logprob == lp.logprob) /* NaN: none known (the wire says so by leaving it out) */
                r.logprobs = &lp;
        }
        q->completion_tokens++;
        kvf_metric_add(d->m_tokens, 1);
    }
    bool last = false;
    if (o->finish != KVF_ENGINE_FINISH_NONE) {
        q->n_done++;
        last = q->n_done >= q->samp.n;
        r.has_usage = true;
        r.usage = (kvf_rpc_usage){.prompt_tokens = q->n_prompt,
                                  .completion_tokens = q->completion_tokens,
                                  .cached_prompt_tokens = q->cached_tokens,
                                  .remote_prefill_tokens = q->remote_tokens};
    }
    st = kvf_rpc_call_send_generate(q->call, &r, &err);
    if (st != KVF_OK) {
        kvf_metric_add(d->m_cancelled, 1);
        end_req(d, q, st == KVF_ERR_CANCELLED ? KVF_ERR_CANCELLED : st, err.msg);
        return;
    }
    if (last) {
        q->eng_id = 0; /* finished: nothing to cancel */
        end_req(d, q, o->finish == KVF_ENGINE_FINISH_ERROR ? KVF_ERR_INTERNAL : KVF_OK,
                o->finish == KVF_ENGINE_FINISH_ERROR ? "engine error (see the decode log)" : NULL);
    }
}

static void on_xfer_event(void *ctx, const kvf_xfer_event *ev)
{
    kvf_decode *d = ctx;
    if (ev->kind != KVF_XFER_RECEIVED)
        return;
    for (dreq *q = d->reqs; q; q = q->next) {
        if (!q->remote || q->tid != ev->id)
            continue;
        if (ev->status == KVF_OK) {
            q->got_xfer = true;
            q->xfer_ok = true;
            maybe_done(d, q);
        } else {
            q->tid = 0;
            q->got_xfer = true; /* the expectation is over */
            fallback(d, q, kvf_status_str(ev->status));
        }
        return;
    }
}

static void on_tick(void *ctx)
{
    kvf_decode *d = ctx;
    int64_t now = kvf_now_ns();
    for (dreq *q = d->reqs, *next; q; q = next) {
        next = q->next;
        if (q->deadline_wall_ms > 0 && kvf_wall_ms() > q->deadline_wall_ms) {
            kvf_metric_add(d->m_cancelled, 1);
            end_req(d, q, KVF_ERR_TIMEOUT, "the request's deadline_unix_ms passed");
        } else if (q->remote && now > q->deadline_ns) {
            fallback(d, q, "timed out");
        }
    }
    for (dhold *h = d->holds, *next; h; h = next) {
        next = h->next;
        if (now >= h->until_ns) {
            kvf_metric_add(d->m_hold_deadline, 1);
            hold_end(d, h, "its deadline passed with no answer from the prefill worker");
        }
    }
    /* holds decode could not track (out of memory) end by the engine's deadline alone */
    int32_t n = kvf_engine_release_expired(kvf_worker_engine(d->w), now);
    if (n > 0) {
        kvf_metric_add(d->m_hold_deadline, n);
        held_gauge(d);
    }
}

static void on_shutdown(void *ctx)
{
    kvf_decode *d = ctx;
    while (d->reqs)
        end_req(d, d->reqs, KVF_ERR_CANCELLED, "decode worker shutting down");
    /* the pool goes away with the process: nothing is handed out again */
    while (d->holds)
        hold_end(d, d->holds, "decode worker shutting down");
    kvf_engine_release_expired(kvf_worker_engine(d->w), INT64_MAX);
    for (pconn *p = d->peers, *n; p; p = n) {
        n = p->next;
        kvf_rpc_channel_destroy(p->ch);
        free(p);
    }
    d->peers = NULL;
}

/* ---- handlers ------------------------------------------------------------------------------ */

static void h_generate(void *ctx, kvf_rpc_call *call, kvf_rpc_generate_req *m)
{
    kvf_decode *d = ctx;
    dreq *q = calloc(1, sizeof *q);
    if (!q || !(q->prompt = malloc(m->n_token_ids * sizeof *q->prompt)) ||
        (m->cache_salt[0] && !(q->salt = strdup(m->cache_salt))) ||
        (m->sampling.guide_len && !(q->guide = malloc(m->sampling.guide_len)))) {
        kvf_rpc_call_finish(call, KVF_ERR_NOMEM, "decode: out of memory");
        if (q)
            dreq_free(q);
        free(m);
        return;
    }
    q->key = atomic_fetch_add(&d->next_key, 1) + 1;
    q->call = call;
    snprintf(q->id, sizeof q->id, "%s", m->request_id);
    q->n_prompt = (int32_t)m->n_token_ids;
    q->deadline_wall_ms = m->deadline_unix_ms;
    memcpy(q->prompt, m->token_ids, m->n_token_ids * sizeof *q->prompt);
    snprintf(q->hint, sizeof q->hint, "%s", m->prefill_addr);
    q->n_prior = m->n_prior_output_tokens;
    q->wire_samp = m->sampling;
    if (q->guide) /* the message's block goes now: both copies point at q's */
        memcpy(q->guide, m->sampling.guide, m->sampling.guide_len);
    q->wire_samp.guide = q->guide; /* NULL for a guide without text */
    kvf_worker_sampling(d->w, &q->wire_samp, &q->samp);
    free(m);
    if (q->samp.n > KVF_ENGINE_MAX_N) {
        char msg[400];
        snprintf(msg, sizeof msg, "decode: req %s: sampling.n %d is above %d", q->id, q->samp.n,
                 KVF_ENGINE_MAX_N);
        kvf_rpc_call_finish(call, KVF_ERR_INVALID, msg);
        dreq_free(q);
        return;
    }
    kvf_metric_add(d->m_requests, 1);
    kvf_log(KVF_LOG_DEBUG, "decode: req %s: %d prompt tokens, max_tokens %d, prefill hint %s", q->id,
            q->n_prompt, q->samp.max_tokens, q->hint[0] ? q->hint : "(none)");
    /* the cancel callback's argument lives until the call is finished (end_req) */
    q->cancel = malloc(sizeof *q->cancel);
    if (!q->cancel) {
        kvf_rpc_call_finish(call, KVF_ERR_NOMEM, "decode: out of memory");
        dreq_free(q);
        return;
    }
    q->cancel->d = d;
    q->cancel->key = q->key;
    q->next = (dreq *)d; /* start_job links it */
    kvf_rpc_call_on_cancel(call, on_call_cancel, q->cancel);
    if (kvf_worker_post(d->w, start_job, q) != KVF_OK) {
        kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "decode: shutting down");
        dreq_free(q);
    }
}

typedef struct cancel_rpc {
    kvf_decode *d;
    const char *id;
    bool found;
} cancel_rpc;

static void cancel_rpc_job(kvf_worker *w, void *arg)
{
    cancel_rpc *c = arg;
    for (dreq *q = c->d->reqs; q; q = q->next)
        if (strcmp(q->id, c->id) == 0) {
            c->found = true;
            kvf_metric_add(c->d->m_cancelled, 1);
            end_req(c->d, q, KVF_ERR_CANCELLED, "cancelled by a Cancel call");
            break;
        }
    (void)w;
}

static kvf_status h_cancel(void *ctx, kvf_rpc_call *call, const kvf_rpc_cancel_req *m,
                           kvf_rpc_cancel_resp *resp, kvf_err *err)
{
    kvf_decode *d = ctx;
    cancel_rpc c = {.d = d, .id = m->request_id};
    if (kvf_worker_call(d->w, cancel_rpc_job, &c) != KVF_OK)
        return kvf_err_set(err, KVF_ERR_CANCELLED, "decode: shutting down");
    resp->found = c.found;
    (void)call;
    return KVF_OK;
}

kvf_status kvf_decode_create(kvf_worker *w, kvf_decode **out, kvf_err *err)
{
    if (kvf_worker_role_of(w) != KVF_WORKER_DECODE)
        return kvf_err_set(err, KVF_ERR_INVALID, "decode: the worker was not created as a decode worker");
    kvf_decode *d = calloc(1, sizeof *d);
    if (!d)
        return kvf_err_set(err, KVF_ERR_NOMEM, "decode: out of memory");
    d->w = w;
    kvf_metrics *m = kvf_worker_metrics(w);
    const char *lb = "role=\"decode\"";
    kvf_status st;
    if ((st = kvf_metrics_counter(m, "kvfleet_decode_remote_prefills_total", lb,
                                  "prompts prefilled by a prefill worker", &d->m_remote, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_local_prefills_total", lb,
                                  "prompts prefilled here (fallbacks included)", &d->m_local, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_prefill_fallbacks_total", lb,
                                  "remote prefills abandoned for a local one", &d->m_fallback, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_kv_bytes_received_total", lb,
                                  "KV bytes written into this pool by prefill workers", &d->m_bytes, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_requests_total", lb, "Generate calls",
                                  &d->m_requests, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_cancelled_total", lb,
                                  "Generate calls cancelled or abandoned by the client", &d->m_cancelled, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_generated_tokens_total", lb, "tokens streamed",
                                  &d->m_tokens, err)) ||
        (st = kvf_metrics_gauge(m, "kvfleet_decode_held_blocks", lb, "blocks of given-up remote "
                                "prefills held until the prefill worker can no longer write them",
                                &d->m_held_blocks, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_holds_released_total",
                                  "role=\"decode\",by=\"answer\"", "holds of given-up remote "
                                  "prefills released, by what ended them", &d->m_hold_answer, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_decode_holds_released_total",
                                  "role=\"decode\",by=\"deadline\"", "holds of given-up remote "
                                  "prefills released, by what ended them", &d->m_hold_deadline, err))) {
        free(d);
        return st;
    }
    kvf_rpc_server *s = kvf_worker_rpc_server(w);
    if ((st = kvf_rpc_serve_generate(s, h_generate, d, err)) != KVF_OK ||
        (st = kvf_rpc_serve_cancel(s, h_cancel, d, err)) != KVF_OK) {
        free(d);
        return st;
    }
    kvf_worker_hooks h = {.ctx = d, .on_output = on_output, .on_xfer_event = on_xfer_event,
                          .on_tick = on_tick, .on_shutdown = on_shutdown};
    kvf_worker_set_hooks(w, &h);
    *out = d;
    return KVF_OK;
}

void kvf_decode_destroy(kvf_decode *d)
{
    if (!d)
        return;
    /* the worker's last loop pass (on_shutdown) ended every request and channel */
    free(d);
}
