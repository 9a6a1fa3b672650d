/* worker.h: the Worker service of kvfleet.proto in kvfleet's own types: its method names, a plain
 * C struct per message, encoders from those structs and checked decoders into them, and typed
 * handler registration for servers. No protobuf-c type or header leaves proto/: roles fill and
 * read these structs, and this folder alone knows the wire format.
 *
 * Ownership: an encoder reads its struct (pointers borrowed) and fills a malloc()ed kvf_rpc_buf.
 * A decoder hands out one malloc()ed block holding the struct and every string and array it
 * points to: free() it. Decoders check every field a worker would otherwise trust (ids printable
 * and bounded, token and block ids non-negative, counts consistent, sampling in range): a refusal
 * is KVF_ERR_PARSE for bytes that are not the message, KVF_ERR_INVALID naming the field, its
 * value and what is allowed. Wire conventions are resolved here, once: a missing sampling block,
 * top_p 0 and n 0 read as "off" (top_p 1, n 1); the KV layout's dtype maps to kvf_dtype. */
#ifndef KVF_PROTO_WORKER_H
#define KVF_PROTO_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kv/layout.h"
#include "proto/rpc.h"

#define KVF_RPC_TRANSFER_TOKEN_BYTES 16 /* RemotePrefillRequest.transfer_token: 0 or this */
#define KVF_RPC_WORKER_INFO "/kvfleet.v1.Worker/Info"
#define KVF_RPC_WORKER_GENERATE "/kvfleet.v1.Worker/Generate"           /* server stream */
#define KVF_RPC_WORKER_REMOTE_PREFILL "/kvfleet.v1.Worker/RemotePrefill"
#define KVF_RPC_WORKER_WATCH_KV "/kvfleet.v1.Worker/WatchKv"            /* server stream */
#define KVF_RPC_WORKER_CANCEL "/kvfleet.v1.Worker/Cancel"
#define KVF_RPC_WORKER_HEALTH "/kvfleet.v1.Worker/Health"

/* Limits the decoders enforce (a message over 4 MiB is refused earlier, by gRPC). */
#define KVF_RPC_MAX_ID_LEN 256         /* request ids, router ids, cache salts */
#define KVF_RPC_MAX_STOP_TOKENS 64
#define KVF_RPC_MAX_N 64               /* sequences per prompt */
#define KVF_RPC_MAX_BIAS 1024          /* logit_bias entries */
#define KVF_RPC_MAX_LOGPROBS 20        /* top logprobs per position */
#define KVF_RPC_MAX_GUIDE_BYTES (256 * 1024) /* a guide's schema or regex text */
#define KVF_RPC_MAX_PROMPT_LPS 4096    /* prompt logprob rows per GenerateResponse */

typedef enum kvf_rpc_role {
    KVF_RPC_ROLE_UNSPECIFIED = 0,
    KVF_RPC_ROLE_PREFILL = 1,
    KVF_RPC_ROLE_DECODE = 2,
    KVF_RPC_ROLE_COLOCATED = 3,
} kvf_rpc_role;

typedef enum kvf_rpc_finish {
    KVF_RPC_FINISH_NONE = 0, /* more to come */
    KVF_RPC_FINISH_STOP = 1,
    KVF_RPC_FINISH_LENGTH = 2,
    KVF_RPC_FINISH_CANCELLED = 3,
    KVF_RPC_FINISH_ERROR = 4,
} kvf_rpc_finish;

typedef enum kvf_rpc_serving {
    KVF_RPC_SERVING_UNSPECIFIED = 0,
    KVF_RPC_SERVING = 1,
    KVF_RPC_NOT_SERVING = 2,
    KVF_RPC_DRAINING = 3,
} kvf_rpc_serving;

typedef enum kvf_rpc_kv_event_kind {
    KVF_RPC_KV_UNSPECIFIED = 0,
    KVF_RPC_KV_SNAPSHOT = 1, /* blocks held now; a snapshot may span several events */
    KVF_RPC_KV_STORED = 2,
    KVF_RPC_KV_REMOVED = 3,
    KVF_RPC_KV_CLEARED = 4,  /* every block dropped */
} kvf_rpc_kv_event_kind;

/* SamplingParams.guide.kind (proto/kvfleet.proto's Guide.Kind). */
typedef enum kvf_rpc_guide_kind {
    KVF_RPC_GUIDE_NONE = 0,
    KVF_RPC_GUIDE_JSON_SCHEMA = 1,
    KVF_RPC_GUIDE_REGEX = 2,
    KVF_RPC_GUIDE_CHOICE = 3, /* text: a JSON array of strings */
    KVF_RPC_GUIDE_JSON_OBJECT = 4,
} kvf_rpc_guide_kind;

typedef struct kvf_rpc_bias {
    int32_t id;  /* >= 0 (the vocabulary is the worker's to check) */
    float bias;  /* [-100, 100] */
} kvf_rpc_bias;

/* Sampling as the wire carries it, with its "off" values already resolved. */
typedef struct kvf_rpc_sampling {
    int32_t max_tokens;  /* 0: the worker's default */
    float temperature;   /* 0: greedy */
    float top_p;         /* (0, 1]; 1: off (the wire's 0 reads as 1) */
    int32_t top_k;       /* 0: off */
    uint64_t seed;
    int32_t n;           /* sequences per prompt, 1..KVF_RPC_MAX_N (the wire's 0 reads as 1) */
    bool ignore_eos;
    int32_t n_stop;
    int32_t stop_ids[KVF_RPC_MAX_STOP_TOKENS];
    float presence_penalty, frequency_penalty; /* [-2, 2] */
    float repetition_penalty; /* (0, 2]; 1: off (the wire's 0 reads as 1) */
    float min_p;              /* [0, 1] */
    int32_t min_tokens;       /* >= 0 */
    int32_t n_bias;
    kvf_rpc_bias bias[KVF_RPC_MAX_BIAS];
    bool logprobs;
    int32_t top_logprobs;     /* 0..KVF_RPC_MAX_LOGPROBS */
    bool prompt_logprobs;
    /* constrained decoding: kind, and its text (not NUL-terminated; borrowed from the decoded
     * message's block or the encoder's caller) */
    int32_t guide_kind;       /* kvf_rpc_guide_kind */
    const char *guide;        /* [guide_len] */
    size_t guide_len;         /* <= KVF_RPC_MAX_GUIDE_BYTES */
} kvf_rpc_sampling;

/* One position's log-probabilities (<= 0, or -inf): the token's own and the n_top largest. */
typedef struct kvf_rpc_logprob {
    float logprob;
    int32_t n_top;
    int32_t top_ids[KVF_RPC_MAX_LOGPROBS];
    float top_lps[KVF_RPC_MAX_LOGPROBS];
} kvf_rpc_logprob;

/* Greedy, n 1, top_p 1, repetition_penalty 1, everything else off. */
void kvf_rpc_sampling_default(kvf_rpc_sampling *s);

/* How a peer reaches a worker's KV pool: the transport backend's name and its opaque
 * descriptor (transport/ writes and reads the blob). */
typedef struct kvf_rpc_transport {
    const char *backend;
    const uint8_t *blob;
    size_t blob_len;
} kvf_rpc_transport;

typedef struct kvf_rpc_info {
    uint32_t protocol_version; /* KVF_RPC_PROTOCOL_VERSION (checked by the decoder) */
    kvf_rpc_role role;
    const char *model_id;
    int32_t block_size;        /* > 0, and equal to kv_layout's when it has one */
    bool has_kv_layout;
    kvf_kv_layout kv_layout;
    int64_t capacity_blocks;   /* blocks in the pool */
    kvf_rpc_transport transport;
    const char *worker_id;     /* stable name of the worker ("decode-0") */
    const char *software_version;
    int32_t max_n;             /* parallel samples per request; 0: not said */
} kvf_rpc_info;

typedef struct kvf_rpc_generate_req {
    const char *request_id;            /* required */
    const int32_t *token_ids;          /* [n_token_ids] the whole prompt (plus tokens already
                                        * streamed, on a retry) */
    size_t n_token_ids;                /* >= 1 */
    kvf_rpc_sampling sampling;
    const char *cache_salt;            /* "" for none */
    const char *prefill_addr;          /* host:port of a prefill worker; "" for none */
    int64_t deadline_unix_ms;          /* absolute wall clock; 0: none beyond gRPC's */
    int32_t n_prior_output_tokens;     /* on a retry: trailing token_ids output already */
} kvf_rpc_generate_req;

typedef struct kvf_rpc_usage {
    int32_t prompt_tokens, completion_tokens;
    int32_t cached_prompt_tokens;  /* served from the decode worker's prefix cache */
    int32_t remote_prefill_tokens; /* computed by a prefill worker */
} kvf_rpc_usage;

/* One message per decode step; the last of a sequence carries its finish reason and usage. */
typedef struct kvf_rpc_generate_resp {
    const int32_t *token_ids; /* [n_token_ids] */
    size_t n_token_ids;
    kvf_rpc_finish finish;
    bool has_usage;
    kvf_rpc_usage usage;
    int32_t index;            /* which of the n sequences */
    const kvf_rpc_logprob *logprobs; /* [n_token_ids] when sampling.logprobs, else NULL */
    const kvf_rpc_logprob *prompt_lps; /* [n_prompt_lps] rows for prompt tokens
                                        * prompt_lps_start.. (sampling.prompt_logprobs) */
    size_t n_prompt_lps;      /* <= KVF_RPC_MAX_PROMPT_LPS */
    int32_t prompt_lps_start; /* >= 1 when n_prompt_lps > 0 */
} kvf_rpc_generate_resp;

typedef struct kvf_rpc_remote_prefill_req {
    const char *request_id;          /* required */
    const int32_t *token_ids;        /* [n_token_ids], >= 1 */
    size_t n_token_ids;
    const int32_t *dst_block_ids;    /* [n_dst_block_ids] the decode worker's blocks for the
                                      * whole prompt, in order (at least the prompt's blocks at
                                      * dst_layout.block_size) */
    size_t n_dst_block_ids;
    int32_t dst_cached_blocks;       /* leading dst blocks the decode worker holds: not sent */
    kvf_rpc_transport dst;           /* the decode worker's pool (backend required) */
    uint64_t transfer_id;
    /* the transfer's capability (transport/xfer.h's kvf_xfer_token), all zero for none */
    uint8_t transfer_token[KVF_RPC_TRANSFER_TOKEN_BYTES];
    const char *cache_salt;          /* "" for none */
    kvf_rpc_sampling sampling;       /* for the first token */
    int64_t deadline_unix_ms;        /* 0: none */
    bool has_dst_layout;             /* must equal the prefill worker's layout */
    kvf_kv_layout dst_layout;
} kvf_rpc_remote_prefill_req;

typedef struct kvf_rpc_prefill_stats {
    int32_t prompt_tokens, cached_tokens, computed_tokens, blocks_sent;
    int64_t bytes_sent;
    double queue_ms, prefill_ms, transfer_ms;
} kvf_rpc_prefill_stats;

typedef struct kvf_rpc_remote_prefill_resp {
    int32_t first_token;
    bool has_first_logprob;        /* sampling.logprobs */
    kvf_rpc_logprob first_logprob;
    bool has_stats;
    kvf_rpc_prefill_stats stats;
} kvf_rpc_remote_prefill_resp;

typedef struct kvf_rpc_watch_req {
    const char *router_id;    /* "" for none */
    uint32_t load_interval_ms; /* 0: the worker's default */
} kvf_rpc_watch_req;

/* Where a worker keeps a block (KvEvent.tier). */
enum { KVF_RPC_TIER_POOL = 0, KVF_RPC_TIER_HOST = 1, KVF_RPC_TIER_DISK = 2 };

typedef struct kvf_rpc_kv_event {
    uint64_t seq;                 /* per worker, increasing by one per event */
    kvf_rpc_kv_event_kind kind;
    const uint64_t *block_hashes; /* [n] */
    const uint64_t *parent_hashes; /* [n] or NULL (REMOVED events carry none) */
    size_t n;
    int32_t block_size;
    const char *model_id;
    bool snapshot_done;           /* the last event of a snapshot */
    int32_t tier;                 /* SNAPSHOT/STORED: KVF_RPC_TIER_* of every block; a STORED of a
                                     held hash moves it there */
} kvf_rpc_kv_event;

typedef struct kvf_rpc_load {
    int32_t running, waiting;
    int64_t active_blocks, free_blocks, total_blocks;
    int64_t queued_prefill_tokens;
    double prefill_ms_mean, prefill_ms_p90, prefill_tokens_per_s;
    int64_t unix_ms;
    /* measured seconds to promote one block from the host / disk tier (0: none measured) */
    double host_promote_s_per_block, disk_promote_s_per_block;
} kvf_rpc_load;

/* A WatchKv stream message: a KV event or a load report. */
typedef struct kvf_rpc_watch_msg {
    bool is_load;
    kvf_rpc_kv_event event; /* when !is_load */
    kvf_rpc_load load;      /* when is_load */
} kvf_rpc_watch_msg;

typedef struct kvf_rpc_cancel_req {
    const char *request_id; /* required */
} kvf_rpc_cancel_req;

typedef struct kvf_rpc_cancel_resp {
    bool found;
} kvf_rpc_cancel_resp;

typedef struct kvf_rpc_health {
    kvf_rpc_serving status;
    const char *detail;
} kvf_rpc_health;

/* ---- encoders (any side) ------------------------------------------------------------------- */
/* Info and Health requests carry no field: their encoders take none. */
kvf_status kvf_rpc_info_req_encode(kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_health_req_encode(kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_info_encode(const kvf_rpc_info *m, kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_generate_req_encode(const kvf_rpc_generate_req *m, kvf_rpc_buf *out,
                                       kvf_err *err);
kvf_status kvf_rpc_generate_resp_encode(const kvf_rpc_generate_resp *m, kvf_rpc_buf *out,
                                        kvf_err *err);
kvf_status kvf_rpc_remote_prefill_req_encode(const kvf_rpc_remote_prefill_req *m,
                                             kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_remote_prefill_resp_encode(const kvf_rpc_remote_prefill_resp *m,
                                              kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_watch_req_encode(const kvf_rpc_watch_req *m, kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_watch_msg_encode(const kvf_rpc_watch_msg *m, kvf_rpc_buf *out, kvf_err *err);
kvf_status kvf_rpc_cancel_req_encode(const kvf_rpc_cancel_req *m, kvf_rpc_buf *out,
                                     kvf_err *err);
kvf_status kvf_rpc_cancel_resp_encode(const kvf_rpc_cancel_resp *m, kvf_rpc_buf *out,
                                      kvf_err *err);
kvf_status kvf_rpc_health_encode(const kvf_rpc_health *m, kvf_rpc_buf *out, kvf_err *err);

/* ---- checked decoders (*out: one malloc()ed block; free() it) ------------------------------ */
/* Requests, run by a worker on what a client sent (servers get them through the typed
 * registration below; these are for tests and fuzzing). Info and Health requests only check
 * that the bytes are the (empty) message. */
kvf_status kvf_rpc_info_req_decode(const uint8_t *data, size_t len, kvf_err *err);
kvf_status kvf_rpc_health_req_decode(const uint8_t *data, size_t len, kvf_err *err);
kvf_status kvf_rpc_generate_req_decode(const uint8_t *data, size_t len,
                                       kvf_rpc_generate_req **out, kvf_err *err);
kvf_status kvf_rpc_remote_prefill_req_decode(const uint8_t *data, size_t len,
                                             kvf_rpc_remote_prefill_req **out, kvf_err *err);
kvf_status kvf_rpc_watch_req_decode(const uint8_t *data, size_t len, kvf_rpc_watch_req **out,
                                    kvf_err *err);
kvf_status kvf_rpc_cancel_req_decode(const uint8_t *data, size_t len, kvf_rpc_cancel_req **out,
                                     kvf_err *err);
/* Responses, run by routers and decode workers on what a worker answered. Info is refused
 * (KVF_ERR_UNSUPPORTED) when its protocol_version is not KVF_RPC_PROTOCOL_VERSION, and
 * (KVF_ERR_INVALID) when its block size or layout is not positive or they disagree. */
kvf_status kvf_rpc_info_decode(const uint8_t *data, size_t len, kvf_rpc_info **out,
                               kvf_err *err);
kvf_status kvf_rpc_generate_resp_decode(const uint8_t *data, size_t len,
                                        kvf_rpc_generate_resp **out, kvf_err *err);
kvf_status kvf_rpc_remote_prefill_resp_decode(const uint8_t *data, size_t len,
                                              kvf_rpc_remote_prefill_resp **out, kvf_err *err);
kvf_status kvf_rpc_watch_msg_decode(const uint8_t *data, size_t len, kvf_rpc_watch_msg **out,
                                    kvf_err *err);
kvf_status kvf_rpc_cancel_resp_decode(const uint8_t *data, size_t len,
                                      kvf_rpc_cancel_resp **out, kvf_err *err);
kvf_status kvf_rpc_health_decode(const uint8_t *data, size_t len, kvf_rpc_health **out,
                                 kvf_err *err);

/* ---- typed handlers (servers) -------------------------------------------------------------- */
/* Each registers one Worker method on s with its decoder: the layer decodes and checks the
 * request before the handler runs, and a request that fails ends the call with that error
 * (logged at debug) without reaching the handler. Register before kvf_rpc_server_start.
 *
 * Unary handlers fill the response struct (its pointers borrowed until the handler returns;
 * the layer encodes it) or return a status with err. Streaming handlers own the call (as
 * kvf_rpc_stream_fn says) and the decoded request: free() it. RemotePrefill is unary on the wire
 * (kvfleet.proto) but served as a stream so its answer can come later from another thread: its
 * handler sends exactly one message (kvf_rpc_call_send_remote_prefill) and then finishes with
 * KVF_OK, or finishes with an error and sends nothing. */
typedef kvf_status (*kvf_rpc_info_fn)(void *ctx, kvf_rpc_call *call, kvf_rpc_info *resp,
                                      kvf_err *err);
typedef kvf_status (*kvf_rpc_health_fn)(void *ctx, kvf_rpc_call *call, kvf_rpc_health *resp,
                                        kvf_err *err);
typedef kvf_status (*kvf_rpc_cancel_fn)(void *ctx, kvf_rpc_call *call,
                                        const kvf_rpc_cancel_req *req, kvf_rpc_cancel_resp *resp,
                                        kvf_err *err);
typedef void (*kvf_rpc_generate_fn)(void *ctx, kvf_rpc_call *call, kvf_rpc_generate_req *req);
typedef void (*kvf_rpc_remote_prefill_fn)(void *ctx, kvf_rpc_call *call,
                                          kvf_rpc_remote_prefill_req *req);
typedef void (*kvf_rpc_watch_fn)(void *ctx, kvf_rpc_call *call, kvf_rpc_watch_req *req);

kvf_status kvf_rpc_serve_info(kvf_rpc_server *s, kvf_rpc_info_fn fn, void *ctx, kvf_err *err);
kvf_status kvf_rpc_serve_health(kvf_rpc_server *s, kvf_rpc_health_fn fn, void *ctx,
                                kvf_err *err);
kvf_status kvf_rpc_serve_cancel(kvf_rpc_server *s, kvf_rpc_cancel_fn fn, void *ctx,
                                kvf_err *err);
kvf_status kvf_rpc_serve_generate(kvf_rpc_server *s, kvf_rpc_generate_fn fn, void *ctx,
                                  kvf_err *err);
kvf_status kvf_rpc_serve_remote_prefill(kvf_rpc_server *s, kvf_rpc_remote_prefill_fn fn,
                                        void *ctx, kvf_err *err);
kvf_status kvf_rpc_serve_watch(kvf_rpc_server *s, kvf_rpc_watch_fn fn, void *ctx, kvf_err *err);

/* Sends one message on a streaming call (kvf_rpc_call_send after encoding). */
kvf_status kvf_rpc_call_send_generate(kvf_rpc_call *c, const kvf_rpc_generate_resp *m,
                                      kvf_err *err);
kvf_status kvf_rpc_call_send_remote_prefill(kvf_rpc_call *c,
                                            const kvf_rpc_remote_prefill_resp *m, kvf_err *err);
kvf_status kvf_rpc_call_send_watch(kvf_rpc_call *c, const kvf_rpc_watch_msg *m, kvf_err *err);

#endif
