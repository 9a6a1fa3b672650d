/* prefill.c: the prefill role's RemotePrefill. On the worker's loop thread, one request at a
 * time: reuse this worker's own cached prefix, compute the rest of the prompt with the forward
 * pass into this pool, register the full blocks (KV events), write every block the decode worker
 * lacks into its blocks through the transport, wait for the acknowledgement, release the
 * sequence (full blocks stay cached) and answer with the first token. */
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

struct kvf_prefill {
    kvf_worker *w;
    int32_t fault_delay_ms;
    atomic_int_fast64_t queued_tokens;
    atomic_int queued_reqs; /* RemotePrefill calls waiting or running */
    ppeer *peers;            /* loop thread */
    float *logits;           /* [vocab], loop thread */
    kvf_engine_sampler sampler;
    kvf_metric *m_requests, *m_failed, *m_tokens, *m_cached, *m_bytes;
};

typedef struct pjob {
    const Kvfleet__V1__RemotePrefillRequest *rq;
    int64_t t_enqueue_ns;
    kvf_status st;
    kvf_err err;
    int32_t first_token;
    Kvfleet__V1__PrefillStats stats;
} pjob;

static kvf_xfer_peer *peer_get(kvf_prefill *p, const uint8_t *desc, size_t len, kvf_err *err)
{
    kvf_xfer *x = kvf_worker_xfer(p->w);
    for (ppeer **pp = &p->peers; *pp;) {
        ppeer *e = *pp;
        if (kvf_xfer_peer_status(e->peer) == KVF_ERR_PEER_LOST) {
            /* a decode worker gone (or restarted): forget it; connect again if it is this one */
            kvf_xfer_disconnect(x, e->peer);
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

typedef struct pjob_ctx {
    kvf_prefill *p;
    pjob *j;
} pjob_ctx;

/* The work of one RemotePrefill, on the loop thread; fills j (first token, stats) on success. */
static kvf_status run_prefill(kvf_prefill *p, pjob *j)
{
    kvf_worker *w = p->w;
    const Kvfleet__V1__RemotePrefillRequest *rq = j->rq;
    kvf_err *err = &j->err;
    const kvf_kv_layout *l = kvf_worker_layout(w);
    kvf_kv_pool *pool = kvf_worker_pool(w);
    const kvf_model *m = kvf_worker_model(w);
    const char *id = rq->request_id && *rq->request_id ? rq->request_id : "-";
    int64_t t0 = kvf_now_ns();
    j->stats.queue_ms = (double)(t0 - j->t_enqueue_ns) / 1e6;
    if (p->fault_delay_ms > 0)
        kvf_sleep_ms(p->fault_delay_ms);

    /* check what decode asks for against this worker */
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
        if (rq->token_ids[i] >= m->cfg.vocab_size)
            return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: token %d at index %d is "
                               "outside the vocabulary (0 to %d)", id, rq->token_ids[i], i,
                               m->cfg.vocab_size - 1);
    if (n > m->cfg.max_pos)
        return kvf_err_set(err, KVF_ERR_INVALID, "prefill: req %s: %d tokens exceed the model's "
                           "max_position_embeddings (%d)", id, n, m->cfg.max_pos);
    int64_t now_wall = kvf_wall_ms();
    int64_t deadline = kvf_now_ns() + (rq->deadline_unix_ms > 0
                                           ? (rq->deadline_unix_ms - now_wall) * 1000000LL
                                           : 30000LL * 1000000LL);
    if (deadline <= kvf_now_ns())
        return kvf_err_set(err, KVF_ERR_TIMEOUT, "prefill: req %s: its deadline passed while it was "
                           "queued (%.1f ms)", id, j->stats.queue_ms);
    kvf_xfer_peer *peer = NULL;
    if (rq->dst_cached_blocks < nb &&
        !(peer = peer_get(p, rq->dst->blob.data, rq->dst->blob.len, err)))
        return kvf_err_prefix(err, "prefill: req %s: decode's transport", id);

    /* own prefix cache, then compute the rest */
    const char *salt = rq->cache_salt && *rq->cache_salt ? rq->cache_salt : NULL;
    kvf_kv_seq seq;
    kvf_kv_seq_init(&seq, pool, kvf_kv_hash_root(kvf_worker_model_id(w), salt, salt ? strlen(salt) : 0));
    int64_t hit = 0;
    if ((st = kvf_kv_prefix_lookup(&seq, rq->token_ids, n - 1, &hit, err)) != KVF_OK ||
        (st = kvf_kv_seq_prepare_write(&seq, n - hit, err)) != KVF_OK) {
        kvf_kv_seq_fini(&seq);
        return kvf_err_prefix(err, "prefill: req %s", id);
    }
    kvf_model_fwd *fwd = kvf_worker_fwd(w);
    int32_t chunk = kvf_model_fwd_limits(fwd)->max_tokens;
    const Kvfleet__V1__SamplingParams *sp = rq->sampling;
    bool sample = sp && sp->temperature > 0;
    int32_t next = -1;
    for (int64_t pos = hit; pos < n && st == KVF_OK;) {
        int32_t take = (int32_t)(n - pos < chunk ? n - pos : chunk);
        bool last = pos + take == n;
        kvf_model_seq s = {.tokens = rq->token_ids + pos, .n_tokens = take, .start_pos = (int32_t)pos,
                           .block_table = seq.blocks, .n_blocks = seq.n_blocks};
        st = kvf_model_forward(fwd, &s, 1, kvf_kv_pool_base(pool), l->block_bytes ? kvf_kv_pool_bytes(pool) / l->block_bytes : 0,
                               last && sample ? p->logits : NULL, &next, err);
        pos += take;
    }
    if (st == KVF_OK && sample) {
        kvf_engine_rng rng;
        kvf_engine_rng_seed(&rng, sp->seed, 0);
        next = kvf_engine_sample(&p->sampler, p->logits, sp->temperature, sp->top_k,
                                 sp->top_p > 0 && sp->top_p < 1 ? sp->top_p : 1.0f, &rng);
    }
    if (st == KVF_OK)
        st = kvf_kv_seq_commit(&seq, rq->token_ids, n, err); /* STORED events for watchers */
    int64_t t1 = kvf_now_ns();
    j->stats.prefill_ms = (double)(t1 - t0) / 1e6;

    /* past the deadline decode has given up and may have handed its blocks to another
     * sequence: writing now would corrupt them */
    if (st == KVF_OK && kvf_now_ns() > deadline)
        st = kvf_err_set(err, KVF_ERR_TIMEOUT, "prefill: req %s: the deadline passed during the "
                         "prefill (%.1f ms); nothing was written", id, j->stats.prefill_ms);

    /* write the blocks decode lacks, then wait for its acknowledgement */
    int32_t n_pairs = 0;
    if (st == KVF_OK && peer) {
        kvf_xfer_pair *pairs = malloc((size_t)nb * sizeof *pairs);
        if (!pairs) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "prefill: out of memory");
        } else {
            for (int64_t i = rq->dst_cached_blocks; i < nb; i++)
                pairs[n_pairs++] = (kvf_xfer_pair){.src = seq.blocks[i], .dst = rq->dst_block_ids[i]};
            kvf_xfer *x = kvf_worker_xfer(w);
            st = kvf_xfer_write(x, peer, rq->transfer_id, pairs, (size_t)n_pairs, deadline, err);
            free(pairs);
            while (st == KVF_OK) {
                kvf_xfer_event ev;
                st = kvf_xfer_wait(x, &ev, deadline + 100000000LL, err);
                if (st == KVF_OK && ev.kind == KVF_XFER_SENT && ev.id == rq->transfer_id) {
                    if (ev.status != KVF_OK)
                        st = kvf_err_set(err, ev.status, "prefill: req %s: transfer %llu: %s", id,
                                         (unsigned long long)rq->transfer_id, kvf_status_str(ev.status));
                    break;
                }
            }
        }
    }
    kvf_err ferr = {0};
    if (kvf_kv_seq_free(&seq, &ferr) != KVF_OK)
        kvf_log(KVF_LOG_ERROR, "prefill: req %s: releasing its blocks: %s", id, ferr.msg);
    kvf_kv_seq_fini(&seq);
    if (st != KVF_OK)
        return err->msg[0] ? st : kvf_err_set(err, st, "prefill: req %s: %s", id, kvf_status_str(st));
    j->first_token = next;
    j->stats.prompt_tokens = n;
    j->stats.cached_tokens = (int32_t)hit;
    j->stats.computed_tokens = n - (int32_t)hit;
    j->stats.blocks_sent = n_pairs;
    j->stats.bytes_sent = (int64_t)n_pairs * l->block_bytes;
    j->stats.transfer_ms = (double)(kvf_now_ns() - t1) / 1e6;
    kvf_metric_add(p->m_tokens, n - (double)hit);
    kvf_metric_add(p->m_cached, (double)hit);
    kvf_metric_add(p->m_bytes, (double)j->stats.bytes_sent);
    kvf_log(KVF_LOG_DEBUG, "prefill: req %s: %d tokens (%lld cached here), %d blocks sent in %.1f ms + %.1f ms",
            id, n, (long long)hit, n_pairs, j->stats.prefill_ms, j->stats.transfer_ms);
    return KVF_OK;
}

static void run_job(kvf_worker *w, void *arg)
{
    pjob_ctx *c = arg;
    c->j->st = run_prefill(c->p, c->j);
    (void)w;
}

static kvf_status h_remote_prefill(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                                   kvf_rpc_buf *resp, kvf_err *err)
{
    kvf_prefill *p = ctx;
    Kvfleet__V1__RemotePrefillRequest *rq = NULL;
    kvf_status st = kvf_rpc_remote_prefill_request_decode(req, len, &rq, err);
    if (st != KVF_OK)
        return st;
    kvf_metric_add(p->m_requests, 1);
    Kvfleet__V1__PrefillStats init = KVFLEET__V1__PREFILL_STATS__INIT;
    pjob j = {.rq = rq, .t_enqueue_ns = kvf_now_ns(), .stats = init};
    pjob_ctx c = {.p = p, .j = &j};
    int64_t n = (int64_t)rq->n_token_ids;
    atomic_fetch_add(&p->queued_tokens, n);
    atomic_fetch_add(&p->queued_reqs, 1);
    kvf_worker_wake(p->w); /* the load report shows it waiting */
    st = kvf_worker_call(p->w, run_job, &c);
    atomic_fetch_sub(&p->queued_reqs, 1);
    atomic_fetch_sub(&p->queued_tokens, n);
    if (st != KVF_OK) {
        kvf_rpc_msg_free(rq);
        return kvf_err_set(err, KVF_ERR_CANCELLED, "prefill: shutting down");
    }
    if (j.st != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "%s", j.err.msg);
        kvf_metric_add(p->m_failed, 1);
        *err = j.err;
        kvf_rpc_msg_free(rq);
        return j.st;
    }
    Kvfleet__V1__RemotePrefillResponse r = KVFLEET__V1__REMOTE_PREFILL_RESPONSE__INIT;
    r.first_token = j.first_token;
    r.stats = &j.stats;
    st = kvf_rpc_msg_encode(&r, resp, err);
    kvf_rpc_msg_free(rq);
    (void)call;
    return st;
}

static int64_t queued_tokens(void *ctx)
{
    kvf_prefill *p = ctx;
    return atomic_load(&p->queued_tokens);
}

/* Load: one request runs at a time (on the loop thread); the others wait for it. */
static void fill_load(void *ctx, kvf_worker_load *l)
{
    kvf_prefill *p = ctx;
    int q = atomic_load(&p->queued_reqs);
    l->running = q > 0 ? 1 : 0;
    l->waiting = q > 1 ? q - 1 : 0;
}

static void on_shutdown(void *ctx)
{
    kvf_prefill *p = ctx;
    kvf_xfer *x = kvf_worker_xfer(p->w);
    for (ppeer *e = p->peers, *n; e; e = n) {
        n = e->next;
        kvf_xfer_disconnect(x, e->peer);
        free(e->desc);
        free(e);
    }
    p->peers = NULL;
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
    int32_t vocab = kvf_worker_model(w)->cfg.vocab_size;
    kvf_status st;
    if (!(p->logits = malloc((size_t)vocab * sizeof *p->logits))) {
        free(p);
        return kvf_err_set(err, KVF_ERR_NOMEM, "prefill: out of memory");
    }
    if ((st = kvf_engine_sampler_init(&p->sampler, vocab, err)) != KVF_OK) {
        free(p->logits);
        free(p);
        return st;
    }
    kvf_metrics *m = kvf_worker_metrics(w);
    const char *lb = "role=\"prefill\"";
    if ((st = kvf_metrics_counter(m, "kvfleet_prefill_requests_total", lb, "RemotePrefill calls", &p->m_requests, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_failed_total", lb, "RemotePrefill calls that failed", &p->m_failed, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_computed_tokens_total", lb, "prompt tokens computed", &p->m_tokens, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_cached_tokens_total", lb, "prompt tokens found in this worker's cache", &p->m_cached, err)) ||
        (st = kvf_metrics_counter(m, "kvfleet_prefill_kv_bytes_sent_total", lb, "KV bytes written to decode workers", &p->m_bytes, err)) ||
        (st = kvf_rpc_server_add_unary(kvf_worker_rpc_server(w), KVF_RPC_WORKER_REMOTE_PREFILL,
                                       h_remote_prefill, p, err))) {
        kvf_prefill_destroy(p);
        return st;
    }
    kvf_worker_hooks h = {.ctx = p, .on_shutdown = on_shutdown, .queued_prefill_tokens = queued_tokens,
                          .fill_load = fill_load};
    kvf_worker_set_hooks(w, &h);
    *out = p;
    return KVF_OK;
}

void kvf_prefill_destroy(kvf_prefill *p)
{
    if (!p)
        return;
    kvf_engine_sampler_fini(&p->sampler);
    free(p->logits);
    free(p);
}
