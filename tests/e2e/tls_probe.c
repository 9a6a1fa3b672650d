/* tls_probe.c: what an outsider (or a member) gets from a worker's gRPC port: calls Info,
 * Cancel and RemotePrefill on ADDR and prints one line per call, "<method> reached" (the
 * worker's handler ran: answered, or refused the request itself) or "<method> refused: <why>"
 * (the call never got past the connection: TLS). The RemotePrefill aims at the pool of the
 * decode worker at DECODE_ADDR, as the poisoning attack does (descriptor from its Info).
 *   tls_probe ADDR DECODE_ADDR [CERT KEY CA NAME]   (CA alone: a TLS client without a cert) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "proto/rpc.h"
#include "proto/worker.h"

static bool handshake_failed(kvf_status st)
{
    return st == KVF_ERR_PEER_LOST || st == KVF_ERR_TIMEOUT;
}

static void report(const char *method, kvf_status st, const kvf_err *e)
{
    if (handshake_failed(st))
        printf("%s refused: %s\n", method, e->msg);
    else
        printf("%s reached (%s)\n", method, st == KVF_OK ? "ok" : e->msg);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: tls_probe ADDR DECODE_ADDR [CERT KEY CA NAME]\n");
        return 2;
    }
    kvf_log_set_level(KVF_LOG_OFF);
    kvf_rpc_tls tls = {0};
    if (argc >= 7) {
        tls.cert_file = *argv[3] ? argv[3] : NULL;
        tls.key_file = *argv[4] ? argv[4] : NULL;
        tls.ca_file = argv[5];
        tls.server_name = argv[6];
    }
    kvf_rpc_channel_opts o = {.tls = argc >= 7 ? &tls : NULL};
    kvf_rpc_channel *ch = NULL, *dch = NULL;
    kvf_err e = {0};
    if (kvf_rpc_channel_create(argv[1], &o, &ch, &e) != KVF_OK ||
        kvf_rpc_channel_create(argv[2], &o, &dch, &e) != KVF_OK) {
        fprintf(stderr, "tls_probe: %s\n", e.msg);
        return 2;
    }
    kvf_rpc_buf req = {0}, resp = {0};

    /* Info of the decode worker: its pool's descriptor, the attacker's way in */
    kvf_rpc_info *info = NULL;
    kvf_rpc_info_req_encode(&req, &e);
    kvf_status st = kvf_rpc_unary(dch, KVF_RPC_WORKER_INFO, req.data, req.len, 5000, &resp, &e);
    if (st == KVF_OK)
        st = kvf_rpc_info_decode(resp.data, resp.len, &info, &e);
    report("info", st, &e);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);

    kvf_rpc_cancel_req c = {.request_id = "cmpl-victim"};
    kvf_rpc_cancel_req_encode(&c, &req, &e);
    st = kvf_rpc_unary(ch, KVF_RPC_WORKER_CANCEL, req.data, req.len, 5000, &resp, &e);
    report("cancel", st, &e);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);

    if (getenv("KVF_PROBE_NO_PREFILL")) { /* a member's probe: no write into the pool */
        free(info);
        kvf_rpc_channel_destroy(ch);
        kvf_rpc_channel_destroy(dch);
        return 0;
    }
    int32_t toks[16], blocks[1] = {0};
    for (int i = 0; i < 16; i++)
        toks[i] = 5 + i;
    kvf_rpc_remote_prefill_req rp = {
        .request_id = "cmpl-attack", .token_ids = toks, .n_token_ids = 16,
        .dst_block_ids = blocks, .n_dst_block_ids = 1, .transfer_id = 0x5eed,
        .cache_salt = "",
        .dst = info ? info->transport : (kvf_rpc_transport){.backend = "ucx"},
        .sampling = {.max_tokens = 1},
        .deadline_unix_ms = 0};
    if (info && info->has_kv_layout) {
        rp.dst_layout = info->kv_layout;
        rp.has_dst_layout = true;
    }
    if (kvf_rpc_remote_prefill_req_encode(&rp, &req, &e) == KVF_OK) {
        st = kvf_rpc_unary(ch, KVF_RPC_WORKER_REMOTE_PREFILL, req.data, req.len, 5000, &resp, &e);
        report("remote_prefill", st, &e);
    } else {
        printf("remote_prefill not sent: %s\n", e.msg);
    }
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);
    free(info);
    kvf_rpc_channel_destroy(ch);
    kvf_rpc_channel_destroy(dch);
    return 0;
}
