/* request.c: the life of one generation request in the router, in the order it is lived:
 * the prompt (chat template, tokens, block hashes), picking decode and prefill workers, opening
 * Generate, each streamed message (detokenized, stop strings, SSE), the end (done, failed,
 * client gone) with usage, and retrying on another decode worker when one fails before the
 * first token (or mid-stream with one sequence). Everything runs on the HTTP loop thread, woken
 * by the Generate stream, except step 1 (parse, chat template, tokens), which runs on the prep
 * threads (step 0); the replies' bytes on the wire are http.c's, the pools watch.c's. */
#include "router/request.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "kv/hash.h"
#include "proto/worker.h"

/* One sequence of a request (n > 1 gives several): its tokens, their text so far, and how much
 * of both the client has been sent. */
/* A stream must have been quiet this long before its silent decode worker's loss moves it. */
#define SILENT_STREAM_NS 1000000000LL

typedef struct seq_state {
    kvf_text_detok *detok;
    kvf_sbuf text;
    size_t emitted;      /* text bytes already sent (streaming) */
    int32_t *ids;
    size_t n_ids, cap, ids_emitted;
    kvf_rpc_logprob *lps; /* [cap] with ids, when the request asks for logprobs */
    int64_t *offs;        /* [cap]: where each token's text starts, in characters */
    int64_t chars;        /* characters in text (counted as it grows) */
    size_t counted;       /* text bytes counted into chars */
    kvf_router_oai_finish finish;
    bool done, first_sent;
} seq_state;

/* The requests of one completions call with a list of prompts: one request per prompt, each
 * with its own Generate, answered together (choices prompt * n + i) once every one has ended. */
typedef struct rq_group {
    kvf_router_client *client;
    int32_t n, n_prepped, n_done, n_live; /* members; prepared; ended; not yet freed */
    bool failed, gone;                   /* answered with an error; the client left */
    struct rq_group *prev, *next;        /* the reqs' list of groups */
    kvf_router_req *m[];                 /* [n] by prompt index; NULL once freed */
} rq_group;

struct kvf_router_req {
    kvf_router_reqs *rs;
    rq_group *group;   /* NULL for a request of one prompt */
    kvf_router_client *client; /* set once in flight; answered at the end */
    char id[80];
    char tenant[80];   /* the API key's tenant, "" when the router has no keys */
    kvf_router_oai_req oai;
    int32_t *prompt;
    size_t n_prompt;
    uint64_t *hashes;
    size_t n_blocks;
    int32_t max_tokens;
    int32_t n_return;       /* choices answered: oai.n, unless best_of drew more */
    char *echo_text;        /* echo: the prompt's text, leading every choice */
    size_t echo_len;
    kvf_rpc_logprob *prompt_lps; /* echo with logprobs: [n_prompt], row 0 unused */
    bool have_prompt_lps;
    seq_state *seqs;
    kvf_rpc_stream *stream;
    kvf_router_wake wake;
    int32_t worker, prefill;
    int64_t prefill_tokens; /* queued on the prefill worker until the first token */
    int attempts;
    bool unsendable; /* its GenerateRequest could not be encoded (never a worker's fault) */
    bool got_token, client_gone, started;
    int64_t created;
    double t0;
    int64_t cached_tokens;
    uint32_t overlap; /* prompt blocks the index says the decode worker holds */
    int64_t next_peek_ns;
    int64_t last_msg_ns; /* when the current attempt opened or last sent a message */
    size_t max_stop;
    kvf_router_toolcall_format tool_fmt; /* the answers' tool-call parser (none: no tools) */
    kvf_router_req *prev, *next; /* the list in flight, or the list being prepared */
    /* Being prepared (step 0): the body and kind in, the status and error out. The prep thread
     * owns the request from the queue until it is on the done list; the loop only sets gone. */
    char *body;
    size_t body_len;
    kvf_router_oai_kind kind;
    int32_t prompt_index;      /* of the request's list of prompts (0 for a lone prompt) */
    kvf_status prep_st;
    kvf_router_oai_error prep_e;
    atomic_bool gone;          /* the client left: the prep thread may skip the work */
    kvf_router_req *qnext;     /* the prep queue, or the done list */
    /* A prep job (kvf_router_reqs_start_job) instead of a generation: answered with job_out
     * once the prep thread ran it; NULL for generation requests. */
    const kvf_router_prep_job *job;
    kvf_sbuf job_out;
};

struct kvf_router_reqs {
    kvf_router_reqs_cfg cfg;
    kvf_router_req *head; /* in flight: Generate open, client not yet answered */
    int64_t n;
    int32_t inflight[KVF_ROUTER_MAX_WORKERS];        /* decode requests we hold open */
    int64_t prefill_queued[KVF_ROUTER_MAX_WORKERS];  /* prompt tokens sent to each prefill worker */
    uint64_t n_seeds;                                /* varies the seeds of unseeded requests */
    /* Step 0: requests being prepared (loop's list), the prep threads, their queue and what
     * they finished (under mu), and the wake-up that hands the finished ones to the loop. */
    kvf_router_req *prep;
    int64_t n_prep;
    rq_group *groups;
    int64_t n_open; /* started, not yet freed (kvf_router_reqs_open) */
    pthread_t *threads;
    int32_t n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvf_router_req *q_head, *q_tail, *done;
    bool stop;
    kvf_router_wake prep_wake;
    kvf_metric *m_retries, *m_disconnects, *m_gen_tokens, *m_prompt_tokens, *m_inflight, *m_ttft,
        *m_e2e;
};

static const kvf_router_worker *decode_worker(const kvf_router_req *r)
{
    return kvf_router_watch_worker(r->rs->cfg.watch, KVF_ROUTER_ROLE_DECODE, r->worker);
}

static const kvf_router_worker *prefill_worker(const kvf_router_req *r)
{
    return kvf_router_watch_worker(r->rs->cfg.watch, KVF_ROUTER_ROLE_PREFILL, r->prefill);
}

/* Frees a request that is not (or no longer) on the list, giving back what it counted on its
 * workers. */
static void rq_free(kvf_router_req *r)
{
    kvf_router_reqs *rs = r->rs;
    rq_group *g = r->group;
    if (g) { /* the group goes with its last member; only the first member counts as open */
        g->m[r->prompt_index] = NULL;
        if (--g->n_live == 0) {
            if (g->prev)
                g->prev->next = g->next;
            else
                rs->groups = g->next;
            if (g->next)
                g->next->prev = g->prev;
            free(g);
        }
    }
    if (!g || r->prompt_index == 0)
        rs->n_open--;
    if (r->stream)
        kvf_rpc_stream_destroy(r->stream);
    if (r->worker >= 0 && r->started)
        rs->inflight[r->worker]--;
    if (r->prefill >= 0 && r->prefill_tokens)
        rs->prefill_queued[r->prefill] -= r->prefill_tokens;
    if (r->seqs)
        for (int32_t i = 0; i < r->oai.n; i++) {
            kvf_text_detok_destroy(r->seqs[i].detok);
            kvf_sbuf_fini(&r->seqs[i].text);
            free(r->seqs[i].ids);
            free(r->seqs[i].lps);
            free(r->seqs[i].offs);
        }
    free(r->seqs);
    free(r->body); /* a list's first member keeps it until its siblings are made */
    r->body = NULL;
    free(r->echo_text);
    free(r->prompt_lps);
    free(r->prompt);
    free(r->hashes);
    kvf_sbuf_fini(&r->job_out);
    kvf_router_oai_req_fini(&r->oai);
    free(r);
}

/* Takes an answered request off the list. */
static void unlink_rq(kvf_router_req *r)
{
    kvf_router_reqs *rs = r->rs;
    if (r->prev)
        r->prev->next = r->next;
    else if (rs->head == r)
        rs->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    rs->n--;
    kvf_metric_set(rs->m_inflight, (double)rs->n);
}

/* ---------------------------------------------------------------------------------------- */
/* 1. The prompt                                                                             */

/* Tokenizes the prompt of a parsed request into r->prompt (a chat through the template; token
 * ids as they are, checked against the vocabulary). */
static kvf_status build_prompt(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_oai_error *e)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_err err = {0};
    if (r->oai.prompt_ids) {
        int32_t vocab = c->tok ? kvf_text_tokenizer_vocab_size(c->tok) : c->vocab_size;
        if (vocab < c->vocab_size)
            vocab = c->vocab_size;
        for (size_t i = 0; i < r->oai.n_prompt_ids; i++)
            if (r->oai.prompt_ids[i] >= vocab)
                return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                                "'prompt'[%zu] is token id %d; this model's ids are 0 to %d",
                                                i, r->oai.prompt_ids[i], vocab - 1);
        r->prompt = r->oai.prompt_ids;
        r->n_prompt = r->oai.n_prompt_ids;
        r->oai.prompt_ids = NULL;
        return KVF_OK;
    }
    if (!c->tok)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        r->oai.kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", "no_tokenizer",
                                        "model '%s' has no tokenizer: send 'prompt' to /v1/completions as an array of token ids",
                                        c->served);
    char *text = NULL;
    size_t len = 0;
    bool add_special = true;
    if (r->oai.kind == KVF_ROUTER_OAI_CHAT) {
        if (!c->tmpl)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "no_chat_template",
                                            "model '%s' has no chat template: %s", c->served, c->tmpl_err);
        kvf_text_chat_request cr = {.messages = r->oai.messages, .add_generation_prompt = true,
                                     .extra = r->oai.chat_extra, .tools = r->oai.tools};
        bool raised = false;
        char buf[KVF_ERR_MSG_MAX];
        if (kvf_text_chat_template_render(c->tmpl, &cr, &text, &len, &raised, &err) != KVF_OK)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "%s%s",
                                            raised ? "" : "the model's chat template cannot render these messages: ",
                                            kvf_router_oai_template_error(err.msg, buf, sizeof buf));
        add_special = false; /* the template writes BOS itself */
    }
    const char *src = text ? text : r->oai.prompt_text;
    size_t src_len = text ? len : strlen(src);
    /* Every token covers at most max_prompt_bytes / max_len bytes: a longer prompt cannot fit
     * whatever its tokens, and is refused before the tokenizer spends time on it. */
    if (c->max_prompt_bytes > 0 && src_len > (size_t)c->max_prompt_bytes) {
        free(text);
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        r->oai.kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt",
                                        "context_length_exceeded",
                                        "This model's maximum context length is %d tokens. However, your %s is %zu bytes, "
                                        "more than %d tokens can hold (%lld bytes at most). Please reduce the prompt.",
                                        c->max_len, r->oai.kind == KVF_ROUTER_OAI_CHAT ? "chat" : "prompt", src_len,
                                        c->max_len, (long long)c->max_prompt_bytes);
    }
    kvf_status st = kvf_text_tokenizer_encode(c->tok, src, src_len, add_special,
                                               &r->prompt, &r->n_prompt, &err);
    free(text);
    if (st != KVF_OK)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        r->oai.kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", NULL, "%s", err.msg);
    return KVF_OK;
}

/* The cache salt the request's blocks are hashed with, here and on the workers: the client's
 * cache_salt (printable ASCII without spaces), and with API keys "t:TENANT/" before it, so two
 * tenants never share (or probe, through cached_tokens) each other's blocks whatever salt a
 * client sends; a tenant name has no '/', so no client salt can reach another tenant's. */
static kvf_status salt_request(kvf_router_req *r, kvf_router_oai_error *e)
{
    const char *own = r->oai.cache_salt ? r->oai.cache_salt : "";
    size_t n = strlen(own), room = KVF_RPC_MAX_ID_LEN - (r->tenant[0] ? strlen(r->tenant) + 3 : 0);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)own[i] < 0x21 || (unsigned char)own[i] > 0x7e)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "cache_salt", "invalid_value",
                                            "cache_salt has byte 0x%02x at %zu (allowed: printable ASCII "
                                            "without spaces)", (unsigned char)own[i], i);
    if (n > room)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "cache_salt", "invalid_value",
                                        "cache_salt is %zu bytes (at most %zu)", n, room);
    if (!r->tenant[0])
        return KVF_OK;
    size_t cap = strlen(r->tenant) + n + 4;
    char *salt = malloc(cap);
    if (!salt)
        return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    snprintf(salt, cap, "t:%s/%s", r->tenant, own);
    free(r->oai.cache_salt);
    r->oai.cache_salt = salt;
    return KVF_OK;
}

/* The vocabulary ids may use. */
static int32_t vocab_of(const kvf_router_reqs_cfg *c)
{
    int32_t vocab = c->tok ? kvf_text_tokenizer_vocab_size(c->tok) : c->vocab_size;
    return vocab < c->vocab_size ? c->vocab_size : vocab;
}

/* The sampling fields only the model can check (token ids), best_of, and echo's text. */
static kvf_status accept_sampling(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_oai_error *e)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    int32_t vocab = vocab_of(c);
    for (size_t i = 0; i < r->oai.n_bias; i++)
        if (r->oai.bias_ids[i] >= vocab)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "logit_bias", "invalid_value",
                                            "'logit_bias' names token id %d; this model's ids are 0 to %d",
                                            r->oai.bias_ids[i], vocab - 1);
    size_t n_eos = r->oai.ignore_eos ? 0 : c->n_eos;
    if (r->oai.n_stop_ids + n_eos > KVF_ROUTER_OAI_MAX_STOP_IDS)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop_token_ids", "invalid_value",
                                        "'stop_token_ids' has %zu ids; with this model's %zu end-of-sequence ids at most "
                                        "%zu are allowed", r->oai.n_stop_ids, n_eos,
                                        KVF_ROUTER_OAI_MAX_STOP_IDS > n_eos ? KVF_ROUTER_OAI_MAX_STOP_IDS - n_eos : 0);
    for (size_t i = 0; i < r->oai.n_stop_ids; i++)
        if (r->oai.stop_ids[i] >= vocab)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop_token_ids", "invalid_value",
                                            "'stop_token_ids' names token id %d; this model's ids are 0 to %d",
                                            r->oai.stop_ids[i], vocab - 1);
    if (r->oai.min_tokens > r->max_tokens)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "min_tokens", "invalid_value",
                                        "'min_tokens' is %d, above max_tokens (%d)", r->oai.min_tokens,
                                        r->max_tokens);
    r->n_return = r->oai.n;
    if (r->oai.best_of > r->oai.n) {
        int32_t max_n = kvf_router_fleet_max_n(c->fleet);
        if (max_n > 0 && r->oai.best_of > max_n)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "best_of", "invalid_value",
                                            "best_of is %d; the workers take at most %d parallel samples",
                                            r->oai.best_of, max_n);
        r->oai.n = r->oai.best_of; /* drawn; the n_return best are answered */
    }
    if (r->oai.logprobs && !c->tok)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "logprobs", "no_tokenizer",
                                        "'logprobs' show tokens as text and model '%s' has no tokenizer", c->served);
    if (r->oai.echo) {
        if (!c->tok)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "echo", "no_tokenizer",
                                            "'echo' needs a tokenizer and model '%s' has none", c->served);
        kvf_err err = {0};
        if (r->oai.prompt_text) {
            r->echo_len = strlen(r->oai.prompt_text);
            r->echo_text = strdup(r->oai.prompt_text);
        } else if (kvf_text_tokenizer_decode(c->tok, r->prompt, r->n_prompt, r->oai.skip_special_tokens,
                                             &r->echo_text, &r->echo_len, &err) != KVF_OK) {
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", NULL, "%s", err.msg);
        }
        if (!r->echo_text)
            return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        if (r->oai.logprobs && !(r->prompt_lps = calloc(r->n_prompt, sizeof *r->prompt_lps)))
            return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    return KVF_OK;
}

/* Tools are honoured or refused: a template that never mentions them would drop them, and
 * without a tool-call parser "auto" could never answer tool_calls (vLLM refuses it the same way
 * without --tool-call-parser); tool_choice "none" only needs the template. */
static kvf_status check_tools(const kvf_router_reqs *rs, const kvf_router_req *r, kvf_router_oai_error *e)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    if (r->oai.kind != KVF_ROUTER_OAI_CHAT || !json_array_size(r->oai.tools) || !c->tmpl)
        return KVF_OK;
    if (!strstr(kvf_text_chat_template_text(c->tmpl), "tools"))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tools", "unsupported_parameter",
                                        "model '%s' has a chat template that does not render tools",
                                        c->served);
    if (!r->oai.tool_choice_none && !r->oai.tool_required && !r->oai.tool_forced &&
        c->tool_parser == KVF_ROUTER_TOOLCALL_NONE)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tool_choice", "unsupported_value",
                                        "tool_choice \"auto\" needs a tool-call parser and this router has none "
                                        "(start it with --tool-call-parser hermes or llama3_json); \"none\" works");
    return KVF_OK;
}

/* A chat with tools (tool_choice not "none") has its answers parsed for tool calls in the
 * router's format. Hermes tags may be special tokens in some vocabularies: their text is kept
 * (skip_special_tokens off), as vLLM's hermes parser does; the stop token's text never shows
 * (handle_msg). */
static void pick_tool_parser(const kvf_router_reqs *rs, kvf_router_req *r)
{
    r->tool_fmt = KVF_ROUTER_TOOLCALL_NONE;
    if (r->oai.kind != KVF_ROUTER_OAI_CHAT || !json_array_size(r->oai.tools) || r->oai.tool_choice_none)
        return;
    r->tool_fmt = rs->cfg.tool_parser;
    if (r->oai.tool_required || r->oai.tool_forced) /* the guide made the output a call */
        r->tool_fmt = KVF_ROUTER_TOOLCALL_FORCED;
    if (r->tool_fmt == KVF_ROUTER_TOOLCALL_HERMES)
        r->oai.skip_special_tokens = false;
}

/* Parses and checks the request, builds its prompt and settles max_tokens and the longest stop
 * string. Fills e (a 4xx) when the request cannot be served as it is. */
static kvf_status accept_request(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_oai_kind kind,
                                 const char *body, size_t len, kvf_router_oai_error *e)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    if (kvf_router_oai_parse_at(kind, body, len, r->prompt_index, &r->oai, e) != KVF_OK)
        return KVF_ERR_INVALID;
    if (strcmp(r->oai.model, c->served) != 0)
        return kvf_router_oai_error_set(e, 404, "invalid_request_error", "model", "model_not_found",
                                        "The model '%s' does not exist; this server serves '%s'", r->oai.model,
                                        c->served);
    if (salt_request(r, e) != KVF_OK)
        return KVF_ERR_INVALID;
    int32_t max_n = kvf_router_fleet_max_n(c->fleet);
    if (max_n > 0 && r->oai.n > max_n)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "n", "invalid_value",
                                        "n is %d; the workers take at most %d parallel samples", r->oai.n, max_n);
    if (r->oai.n_stop && !c->tok)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop", "no_tokenizer",
                                        "'stop' strings need a tokenizer and model '%s' has none", c->served);
    if (check_tools(rs, r, e) != KVF_OK || build_prompt(rs, r, e) != KVF_OK)
        return KVF_ERR_INVALID;
    if (r->n_prompt == 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                        "the prompt is empty after tokenization");
    int64_t room = (int64_t)c->max_len - (int64_t)r->n_prompt;
    r->max_tokens = r->oai.max_tokens ? r->oai.max_tokens
                    : kind == KVF_ROUTER_OAI_COMPLETIONS ? 16 : (int32_t)(room > 0 ? room : 1);
    if ((int64_t)r->n_prompt + r->max_tokens > c->max_len)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", "context_length_exceeded",
                                        "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                                        "(%zu in the prompt, %d in the completion). Please reduce the prompt or max_tokens.",
                                        c->max_len, (long long)r->n_prompt + r->max_tokens, r->n_prompt, r->max_tokens);
    for (size_t i = 0; i < r->oai.n_stop; i++)
        if (strlen(r->oai.stop[i]) > r->max_stop)
            r->max_stop = strlen(r->oai.stop[i]);
    pick_tool_parser(rs, r);
    return accept_sampling(rs, r, e);
}

/* The prompt's block hashes, in the fleet's one block size, for the policies that look at the
 * index (cheap: one pass over the prompt). None under round-robin, or before any worker. */
static void hash_prompt(kvf_router_reqs *rs, kvf_router_req *r)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    int32_t bs = kvf_router_fleet_block_size(c->fleet);
    if (!kvf_router_watch_pool(c->watch, KVF_ROUTER_ROLE_DECODE) || c->policy == KVF_ROUTER_POLICY_ROUND_ROBIN ||
        bs <= 0 || !(r->hashes = malloc((r->n_prompt / (size_t)bs + 1) * sizeof *r->hashes)))
        return;
    const char *salt = r->oai.cache_salt ? r->oai.cache_salt : "";
    const char *model = kvf_router_watch_worker(c->watch, KVF_ROUTER_ROLE_DECODE, 0)->model_id;
    uint64_t root = kvf_kv_hash_root(model, salt, strlen(salt));
    r->n_blocks = kvf_kv_hash_blocks(root, r->prompt, r->n_prompt, bs, r->hashes);
}

/* ---------------------------------------------------------------------------------------- */
/* 2. Picking the workers                                                                    */

/* Picks a decode worker (and a prefill worker when there are any) for r. Fills e with 503 (none
 * healthy) or 429 (all saturated) and returns its retry-after in *retry_out. */
static kvf_status pick_workers(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_oai_error *e,
                               int *retry_out)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_router_watch *wt = c->watch;
    kvf_router_watch_sync(wt);
    double now = kvf_now_s();
    kvf_router_pool *dpool = kvf_router_watch_pool(wt, KVF_ROUTER_ROLE_DECODE);
    kvf_router_pool *ppool = kvf_router_watch_pool(wt, KVF_ROUTER_ROLE_PREFILL);
    if (!dpool || kvf_router_watch_n_in_pool(wt, KVF_ROUTER_ROLE_DECODE) == 0) {
        *retry_out = 5;
        return kvf_router_oai_error_set(e, 503, "server_error", NULL, "no_worker",
                                        "no decode worker is ready; retry later");
    }
    /* Decode load: what we hold open there, or its own report when that says more. */
    bool free_one = false;
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        if (!kvf_router_watch_in_pool(wt, KVF_ROUTER_ROLE_DECODE, i))
            continue;
        kvf_router_load l = {0, (double)rs->inflight[i]}, rep;
        if (kvf_router_watch_load(wt, KVF_ROUTER_ROLE_DECODE, i, &rep)) {
            l.queued_prefill_tokens = rep.queued_prefill_tokens;
            if (rep.decode_load > l.decode_load)
                l.decode_load = rep.decode_load;
        }
        kvf_router_pool_load_set(dpool, i, &l, now);
        kvf_router_pool_worker_limits(dpool, i, 0, (double)c->max_inflight);
        free_one |= rs->inflight[i] < c->max_inflight;
    }
    if (!free_one) {
        *retry_out = 1;
        return kvf_router_oai_error_set(e, 429, "rate_limit_error", NULL, "workers_saturated",
                                        "every decode worker has %d requests in flight; retry later",
                                        c->max_inflight);
    }
    kvf_router_request req = {.hashes = r->hashes, .n_blocks = r->n_blocks,
                              .n_tokens = (int64_t)r->n_prompt, .session_key = NULL};
    kvf_router_decision d;
    kvf_err err = {0};
    if (kvf_router_pool_pick(dpool, &req, now, &d, &err) != KVF_OK || rs->inflight[d.worker] >= c->max_inflight) {
        *retry_out = 1;
        if (err.msg[0])
            kvf_log(KVF_LOG_INFO, "router: req %s: no decode worker: %s", r->id, err.msg);
        return kvf_router_oai_error_set(e, 429, "rate_limit_error", NULL, "workers_saturated",
                                        "no decode worker can take the request now; retry later");
    }
    r->worker = d.worker;
    r->overlap = d.overlap_blocks;
    r->prefill = -1;
    /* A prefill worker when there are any: queued prompt tokens, ours or reported. */
    if (ppool && kvf_router_watch_n_in_pool(wt, KVF_ROUTER_ROLE_PREFILL) > 0) {
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
            if (kvf_router_watch_in_pool(wt, KVF_ROUTER_ROLE_PREFILL, i)) {
                kvf_router_load l = {rs->prefill_queued[i], 0}, rep;
                if (kvf_router_watch_load(wt, KVF_ROUTER_ROLE_PREFILL, i, &rep) &&
                    rep.queued_prefill_tokens > l.queued_prefill_tokens)
                    l.queued_prefill_tokens = rep.queued_prefill_tokens;
                kvf_router_pool_load_set(ppool, i, &l, now);
            }
        kvf_router_decision p;
        if (kvf_router_pool_pick(ppool, &req, now, &p, &err) == KVF_OK)
            r->prefill = p.worker;
    }
    return KVF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* 3. The Generate call                                                                      */

/* Opens Generate on r->worker, with r->prefill as the hint. */
static kvf_status open_stream(kvf_router_reqs *rs, kvf_router_req *r, kvf_err *err)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_rpc_generate_req g = {0};
    kvf_rpc_sampling *sp = &g.sampling;
    kvf_rpc_sampling_default(sp);
    g.request_id = r->id;
    g.n_token_ids = r->n_prompt;
    g.token_ids = r->prompt;
    sp->max_tokens = r->max_tokens;
    /* A resubmission after tokens were streamed (one sequence): prompt + those tokens, and the
     * rest of the budget, so the client's stream goes on where it stopped. */
    int32_t *joined = NULL;
    size_t prior = r->seqs && r->oai.n == 1 ? r->seqs[0].n_ids : 0;
    if (prior) {
        joined = malloc((r->n_prompt + prior) * sizeof *joined);
        if (!joined)
            return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
        memcpy(joined, r->prompt, r->n_prompt * sizeof *joined);
        memcpy(joined + r->n_prompt, r->seqs[0].ids, prior * sizeof *joined);
        g.token_ids = joined;
        g.n_token_ids = r->n_prompt + prior;
        g.n_prior_output_tokens = (int32_t)prior;
        sp->max_tokens = r->max_tokens - (int32_t)prior;
    }
    sp->temperature = (float)r->oai.temperature;
    sp->top_p = (float)r->oai.top_p;
    sp->top_k = r->oai.top_k;
    sp->seed = r->oai.has_seed ? r->oai.seed : (uint64_t)kvf_now_ns() ^ rs->n_seeds++;
    sp->n = r->oai.n;
    sp->ignore_eos = r->oai.ignore_eos;
    for (size_t i = 0; !r->oai.ignore_eos && i < c->n_eos && i < KVF_RPC_MAX_STOP_TOKENS; i++)
        sp->stop_ids[sp->n_stop++] = c->eos_ids[i];
    for (size_t i = 0; i < r->oai.n_stop_ids && sp->n_stop < KVF_RPC_MAX_STOP_TOKENS; i++)
        sp->stop_ids[sp->n_stop++] = r->oai.stop_ids[i];
    sp->presence_penalty = (float)r->oai.presence_penalty;
    sp->frequency_penalty = (float)r->oai.frequency_penalty;
    sp->repetition_penalty = (float)r->oai.repetition_penalty;
    sp->min_p = (float)r->oai.min_p;
    sp->min_tokens = r->oai.min_tokens > (int32_t)prior ? r->oai.min_tokens - (int32_t)prior : 0;
    for (size_t i = 0; i < r->oai.n_bias && i < KVF_RPC_MAX_BIAS; i++)
        sp->bias[sp->n_bias++] = (kvf_rpc_bias){.id = r->oai.bias_ids[i], .bias = r->oai.bias_vals[i]};
    /* best_of ranks the samples by their cumulative logprob */
    sp->logprobs = r->oai.logprobs || r->n_return < r->oai.n;
    sp->top_logprobs = r->oai.top_logprobs;
    sp->prompt_logprobs = r->prompt_lps && !r->have_prompt_lps;
    sp->guide_kind = r->oai.guide_kind; /* the same numbers (text/guide.h, proto/worker.h) */
    sp->guide = r->oai.guide;
    sp->guide_len = r->oai.guide_len;
    g.cache_salt = r->oai.cache_salt ? r->oai.cache_salt : "";
    if (r->prefill >= 0)
        g.prefill_addr = prefill_worker(r)->address;
    if (c->request_timeout_ms > 0)
        g.deadline_unix_ms = kvf_wall_ms() + c->request_timeout_ms;
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_generate_req_encode(&g, &b, err);
    free(joined);
    if (st != KVF_OK) {
        r->unsendable = true; /* the request's fault, not the worker's */
        return st;
    }
    int64_t to = c->request_timeout_ms > 0 ? c->request_timeout_ms : KVF_RPC_NO_DEADLINE;
    st = kvf_rpc_stream_open(decode_worker(r)->channel, KVF_RPC_WORKER_GENERATE, b.data, b.len, to,
                             &r->stream, err);
    kvf_rpc_buf_free(&b);
    if (st != KVF_OK)
        return st;
    kvf_rpc_stream_notify(r->stream, kvf_router_wake_notify, &r->wake);
    r->last_msg_ns = kvf_now_ns();
    r->attempts++;
    r->started = true;
    rs->inflight[r->worker]++;
    if (r->prefill >= 0 && !r->prefill_tokens) {
        r->prefill_tokens = (int64_t)r->n_prompt;
        rs->prefill_queued[r->prefill] += r->prefill_tokens;
    }
    kvf_log(KVF_LOG_INFO, "router: req %s: %zu prompt tokens -> decode %s (%u blocks cached there)%s%s (attempt %d)",
            r->id, r->n_prompt, decode_worker(r)->address, r->overlap, r->prefill >= 0 ? ", prefill " : "",
            r->prefill >= 0 ? prefill_worker(r)->address : "", r->attempts);
    return KVF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* 4. A new request: steps 1 to 3, then it waits for its stream                              */

/* Step 0: the prep threads. Each takes a request off the queue, parses it, applies the chat
 * template and tokenizes (step 1, which reads only the model's immutable pieces and the request),
 * puts it on the done list and wakes the loop, which goes on from step 1's end (start_prepared). */
static void *prep_main(void *arg)
{
    kvf_router_reqs *rs = arg;
    pthread_mutex_lock(&rs->mu);
    for (;;) {
        while (!rs->stop && !rs->q_head)
            pthread_cond_wait(&rs->cv, &rs->mu);
        if (rs->stop)
            break;
        kvf_router_req *r = rs->q_head;
        rs->q_head = r->qnext;
        if (!rs->q_head)
            rs->q_tail = NULL;
        pthread_mutex_unlock(&rs->mu);
        if (atomic_load(&r->gone))
            r->prep_st = KVF_ERR_CANCELLED; /* the loop answers nobody: the client left */
        else if (r->job)
            r->prep_st = r->job->run(&rs->cfg, r->body, r->body_len, &r->job_out, &r->prep_e);
        else
            r->prep_st = accept_request(rs, r, r->kind, r->body, r->body_len, &r->prep_e);
        if (r->group || r->prep_st != KVF_OK || r->oai.n_prompts <= 1) { /* else the list's */
            free(r->body);                                               /* other prompts */
            r->body = NULL;                                              /* parse it again */
        }
        pthread_mutex_lock(&rs->mu);
        r->qnext = rs->done;
        rs->done = r;
        pthread_mutex_unlock(&rs->mu);
        kvf_router_wake_notify(&rs->prep_wake);
        pthread_mutex_lock(&rs->mu);
    }
    pthread_mutex_unlock(&rs->mu);
    return NULL;
}

/* The most requests being prepared at once; more get 503 (each holds its body until then). */
#define MAX_PREP 256

/* A generation request (job NULL) or a prep job for client's body (copied), not yet queued;
 * NULL when out of memory. */
static kvf_router_req *rq_new(kvf_router_reqs *rs, kvf_router_client *client, kvf_router_oai_kind kind,
                              const kvf_router_prep_job *job, const char *id, const char *tenant,
                              const char *body, size_t len)
{
    kvf_router_req *r = calloc(1, sizeof *r);
    if (!r || !(r->body = malloc(len + 1))) {
        free(r);
        return NULL;
    }
    r->rs = rs;
    r->wake.h = rs->cfg.h;
    r->worker = r->prefill = -1;
    r->t0 = kvf_now_s();
    r->created = kvf_wall_ms() / 1000;
    snprintf(r->id, sizeof r->id, "%s", id);
    snprintf(r->tenant, sizeof r->tenant, "%s", tenant ? tenant : "");
    memcpy(r->body, body, len);
    r->body[len] = 0;
    r->body_len = len;
    r->kind = kind;
    r->job = job;
    kvf_sbuf_init(&r->job_out);
    r->client = client;
    return r;
}

/* On the loop's list of requests being prepared (a client that leaves marks it gone), and on
 * the prep queue. */
static void rq_enqueue(kvf_router_reqs *rs, kvf_router_req *r)
{
    r->next = rs->prep;
    if (rs->prep)
        rs->prep->prev = r;
    rs->prep = r;
    rs->n_prep++;
    pthread_mutex_lock(&rs->mu);
    if (rs->q_tail)
        rs->q_tail->qnext = r;
    else
        rs->q_head = r;
    rs->q_tail = r;
    pthread_cond_signal(&rs->cv);
    pthread_mutex_unlock(&rs->mu);
}

/* Queues a generation request (job NULL) or a prep job, or answers 503 / 500 at once. */
static void prep_start(kvf_router_reqs *rs, kvf_router_client *client, kvf_router_oai_kind kind,
                       const kvf_router_prep_job *job, const char *id, const char *tenant,
                       const char *body, size_t len)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_router_oai_error e;
    if (rs->n_prep >= MAX_PREP) {
        kvf_router_oai_error_set(&e, 503, "server_error", NULL, "overloaded",
                                 "%d requests are being tokenized already; retry later", MAX_PREP);
        kvf_router_http_send_error(c->h, client, id, &e, 1);
        return;
    }
    kvf_router_req *r = rq_new(rs, client, kind, job, id, tenant, body, len);
    if (!r) {
        kvf_router_oai_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        kvf_router_http_send_error(c->h, client, id, &e, 0);
        return;
    }
    rs->n_open++;
    kvf_router_client_on_close(c->h, client, r);
    rq_enqueue(rs, r);
}

void kvf_router_reqs_start(kvf_router_reqs *rs, kvf_router_client *client, kvf_router_oai_kind kind,
                           const char *id, const char *tenant, const char *body, size_t len)
{
    prep_start(rs, client, kind, NULL, id, tenant, body, len);
}

void kvf_router_reqs_start_job(kvf_router_reqs *rs, kvf_router_client *client, const kvf_router_prep_job *job,
                               const char *id, const char *body, size_t len)
{
    prep_start(rs, client, KVF_ROUTER_OAI_COMPLETIONS, job, id, NULL, body, len);
}

/* Loop thread: a prep job's answer (its JSON, or its error), and r freed. */
static void answer_job(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_client *client)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_router_client_on_close(c->h, client, NULL);
    if (r->prep_st == KVF_OK) {
        kvf_log(KVF_LOG_DEBUG, "router: req %s: %s answered (%zu bytes)", r->id, r->job->name, r->job_out.len);
        kvf_router_http_send_json(c->h, client, 200, r->id, r->job_out.data ? r->job_out.data : "{}",
                                  r->job_out.data ? r->job_out.len : 2);
    } else {
        kvf_router_http_send_error(c->h, client, r->id, &r->prep_e, 0);
    }
    rq_free(r);
}

/* Step 1's end to step 3 for a prepared request: its workers, its sequences, Generate open.
 * Fills e (and *retry_after) when it cannot start. */
static kvf_status launch(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_oai_error *e, int *retry_after)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_metric_add(rs->m_prompt_tokens, (double)r->n_prompt);
    kvf_router_watch_sync(c->watch);
    hash_prompt(rs, r);

    /* The workers, and each sequence's text. */
    if (pick_workers(rs, r, e, retry_after) != KVF_OK)
        return KVF_ERR_BUSY;
    r->seqs = calloc((size_t)r->oai.n, sizeof *r->seqs);
    if (!r->seqs)
        return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    kvf_err err = {0};
    for (int32_t i = 0; i < r->oai.n; i++) {
        kvf_sbuf_init(&r->seqs[i].text);
        if (c->tok && kvf_text_detok_create(c->tok, r->oai.skip_special_tokens, &r->seqs[i].detok, &err) != KVF_OK)
            return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "%s", err.msg);
    }

    /* Open Generate, trying other decode workers when one cannot even start the call. */
    for (;;) {
        if (open_stream(rs, r, &err) == KVF_OK)
            return KVF_OK;
        if (r->unsendable) { /* no worker would take it: say so, and mark none failed */
            kvf_log(KVF_LOG_WARN, "router: req %s: %s", r->id, err.msg);
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_value",
                                            "the request cannot be sent to a worker: %s", err.msg);
        }
        kvf_router_fleet_mark_failed(c->fleet, KVF_ROUTER_ROLE_DECODE, r->worker);
        if (++r->attempts >= c->max_attempts || pick_workers(rs, r, e, retry_after) != KVF_OK) {
            if (r->attempts >= c->max_attempts) {
                kvf_log(KVF_LOG_WARN, "router: req %s: %s", r->id, err.msg);
                kvf_router_oai_error_set(e, 503, "server_error", NULL, "worker_failed",
                                         "no decode worker could be reached (request %s)", r->id);
            }
            *retry_after = 1;
            return KVF_ERR_BUSY;
        }
    }
}

/* In flight: the stream's messages wake the pump, the client's leaving too. */
static void go_in_flight(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_client *client)
{
    r->client = client;
    r->prev = NULL;
    r->next = rs->head;
    if (rs->head)
        rs->head->prev = r;
    rs->head = r;
    rs->n++;
    kvf_metric_set(rs->m_inflight, (double)rs->n);
}

/* Frees every member of g still held (and g with the last). */
static void group_free(rq_group *g)
{
    for (int32_t i = 0, n = g->n; i < n; i++) /* g is freed with its last member */
        if (g->m[i]) {
            kvf_router_req *m = g->m[i];
            bool last = g->n_live == 1;
            free(m->body);
            m->body = NULL;
            rq_free(m);
            if (last)
                return;
        }
}

/* The first member r of a list of prompts is prepared: the others are made from the same body
 * (each parses it for its own prompt) and queued; r waits for them (group_prepared). */
static kvf_status group_spawn(kvf_router_reqs *rs, kvf_router_req *r, kvf_router_client *client,
                              kvf_router_oai_error *e)
{
    int32_t n = r->oai.n_prompts;
    rq_group *g = calloc(1, sizeof *g + (size_t)n * sizeof g->m[0]);
    if (!g)
        return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    g->client = client;
    g->n = n;
    g->n_prepped = 1;
    g->n_live = 1;
    g->m[0] = r;
    r->group = g;
    g->next = rs->groups;
    if (rs->groups)
        rs->groups->prev = g;
    rs->groups = g;
    for (int32_t p = 1; p < n; p++) {
        char id[96];
        snprintf(id, sizeof id, "%s-p%d", r->id, p);
        kvf_router_req *m = rq_new(rs, client, r->kind, NULL, id, r->tenant, r->body, r->body_len);
        if (!m) {
            g->n = p; /* the members made so far are waited for, then the error answered */
            kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            r->prep_st = KVF_ERR_NOMEM;
            r->prep_e = *e;
            break;
        }
        m->group = g;
        m->prompt_index = p;
        m->created = r->created;
        m->t0 = r->t0;
        g->m[p] = m;
        g->n_live++;
        rq_enqueue(rs, m);
    }
    free(r->body);
    r->body = NULL;
    return KVF_OK;
}

static void send_err(kvf_router_reqs *rs, kvf_router_client *client, bool sse, const char *id,
                     const kvf_router_oai_error *e, int retry_after);

/* A member of g is prepared. Once all are: the first refusal answers for all, else every
 * member starts (any that cannot fails the whole request), then the stream starts once. */
static void group_prepared(kvf_router_reqs *rs, kvf_router_req *r)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    rq_group *g = r->group;
    if (r != g->m[0] && ++g->n_prepped < g->n)
        return;
    if (r == g->m[0] && g->n_prepped < g->n)
        return;
    kvf_router_req *r0 = g->m[0];
    bool gone = false;
    const kvf_router_req *bad = NULL;
    for (int32_t i = 0; i < g->n; i++) {
        gone |= g->m[i]->client_gone || atomic_load(&g->m[i]->gone);
        if (!bad && g->m[i]->prep_st != KVF_OK)
            bad = g->m[i];
    }
    kvf_router_oai_error e;
    int retry_after = 0;
    if (gone) {
        kvf_router_client_on_close(c->h, g->client, NULL);
        kvf_log(KVF_LOG_INFO, "router: req %s: client went away before its prompts were tokenized", r0->id);
        kvf_metric_add(rs->m_disconnects, 1);
        kvf_router_client_send_gone(g->client, false);
        group_free(g);
        return;
    }
    if (bad) {
        e = bad->prep_e;
        goto fail;
    }
    for (int32_t i = 0; i < g->n; i++)
        if (launch(rs, g->m[i], &e, &retry_after) != KVF_OK) {
            for (int32_t k = 0; k < i; k++)
                kvf_rpc_stream_cancel(g->m[k]->stream);
            goto fail;
        }
    for (int32_t i = 0; i < g->n; i++)
        go_in_flight(rs, g->m[i], g->client);
    if (r0->oai.stream)
        kvf_router_client_sse_start(c->h, g->client, r0->id);
    return;
fail:
    kvf_router_client_on_close(c->h, g->client, NULL);
    kvf_router_http_send_error(c->h, g->client, r0->id, &e, retry_after);
    group_free(g);
}

/* Loop thread: a prep thread finished r (off the prep list now). Steps 1 (the end) to 3, then
 * it waits for its stream. */
static void start_prepared(kvf_router_reqs *rs, kvf_router_req *r)
{
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_router_client *client = r->client;
    kvf_router_oai_error e;
    int retry_after = 0;
    r->client = NULL; /* in flight only once Generate is open */
    if (r->group) {
        group_prepared(rs, r);
        return;
    }
    if (r->client_gone) {
        kvf_router_client_on_close(c->h, client, NULL);
        kvf_log(KVF_LOG_INFO, "router: req %s: client went away before its prompt was tokenized", r->id);
        kvf_metric_add(rs->m_disconnects, 1);
        kvf_router_client_send_gone(client, false);
        rq_free(r);
        return;
    }
    if (r->job) {
        answer_job(rs, r, client);
        return;
    }
    if (r->prep_st != KVF_OK) {
        e = r->prep_e;
        goto fail;
    }
    if (r->oai.n_prompts > 1) {
        if (rs->n_prep + r->oai.n_prompts - 1 > MAX_PREP) { /* each prompt is parsed on its own */
            kvf_router_oai_error_set(&e, 503, "server_error", NULL, "overloaded",
                                     "%d requests are being tokenized already; retry later", MAX_PREP);
            retry_after = 1;
            goto fail;
        }
        if (group_spawn(rs, r, client, &e) != KVF_OK)
            goto fail;
        group_prepared(rs, r);
        return;
    }
    if (launch(rs, r, &e, &retry_after) != KVF_OK)
        goto fail;
    go_in_flight(rs, r, client);
    if (r->oai.stream)
        kvf_router_client_sse_start(c->h, client, r->id);
    return;
fail:
    kvf_router_client_on_close(c->h, client, NULL);
    kvf_router_http_send_error(c->h, client, r->id, &e, retry_after);
    free(r->body);
    r->body = NULL;
    rq_free(r);
}

/* Takes r off the list of requests being prepared. */
static void unlink_prep(kvf_router_reqs *rs, kvf_router_req *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else if (rs->prep == r)
        rs->prep = r->next;
    if (r->next)
        r->next->prev = r->prev;
    r->prev = r->next = NULL;
    rs->n_prep--;
}

/* Loop thread: starts the requests the prep threads finished, oldest first. */
static void prep_collect(kvf_router_reqs *rs)
{
    pthread_mutex_lock(&rs->mu);
    kvf_router_req *d = rs->done, *fifo = NULL;
    rs->done = NULL;
    pthread_mutex_unlock(&rs->mu);
    while (d) { /* the done list is newest first */
        kvf_router_req *n = d->qnext;
        d->qnext = fifo;
        fifo = d;
        d = n;
    }
    while (fifo) {
        kvf_router_req *r = fifo;
        fifo = r->qnext;
        r->qnext = NULL;
        unlink_prep(rs, r);
        start_prepared(rs, r);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* 5. Streamed messages: tokens, text, stop strings, SSE chunks                              */

/* Grows s's token arrays (and their logprobs and text offsets, when asked for) to cap. */
static bool seq_grow(kvf_router_req *r, seq_state *s, size_t cap)
{
    int32_t *ids = realloc(s->ids, cap * sizeof *ids);
    if (!ids)
        return false;
    s->ids = ids;
    if (r->oai.logprobs || r->n_return < r->oai.n) {
        kvf_rpc_logprob *l = realloc(s->lps, cap * sizeof *l);
        if (!l)
            return false;
        s->lps = l;
    }
    if (r->oai.logprobs) {
        int64_t *o = realloc(s->offs, cap * sizeof *o);
        if (!o)
            return false;
        s->offs = o;
    }
    s->cap = cap;
    return true;
}

/* Characters (code points) in s's text so far. */
static int64_t text_chars(seq_state *s)
{
    if (s->counted > s->text.len) /* cut at a stop string */
        s->counted = 0, s->chars = 0;
    for (; s->counted < s->text.len; s->counted++)
        s->chars += ((unsigned char)s->text.data[s->counted] & 0xC0) != 0x80;
    return s->chars;
}

static int64_t bytes_chars(const uint8_t *b, size_t n)
{
    int64_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += (b[i] & 0xC0) != 0x80;
    return c;
}

/* One position for the answer's logprobs: token id's bytes, and l's values. */
static void oai_lp(const kvf_text_tokenizer *tok, int32_t id, const kvf_rpc_logprob *l,
                   kvf_router_oai_lp *out)
{
    memset(out, 0, sizeof *out);
    out->bytes = kvf_text_tokenizer_token_bytes(tok, id, &out->len);
    out->logprob = l ? l->logprob : NAN;
    out->n_top = l ? l->n_top : 0;
    for (int32_t k = 0; k < out->n_top && k < KVF_ROUTER_OAI_MAX_LOGPROBS; k++) {
        out->top_bytes[k] = kvf_text_tokenizer_token_bytes(tok, l->top_ids[k], &out->top_len[k]);
        out->top_lp[k] = l->top_lps[k];
    }
}

/* The logprobs object of tokens [from, to) of s, after the prompt's (echo) when with_prompt;
 * NULL when the request did not ask for them. The caller drops the reference. */
static json_t *seq_lps(const kvf_router_req *r, const seq_state *s, size_t from, size_t to,
                       bool with_prompt)
{
    const kvf_text_tokenizer *tok = r->rs->cfg.tok;
    if (!r->oai.logprobs || !tok)
        return NULL;
    json_t *lp = NULL;
    kvf_router_oai_lp x;
    int64_t base = 0;
    if (r->echo_text && r->prompt_lps) {
        for (size_t i = 0; i < r->n_prompt; i++) {
            oai_lp(tok, r->prompt[i], i ? &r->prompt_lps[i] : NULL, &x);
            if (with_prompt)
                kvf_router_oai_lp_append(r->oai.kind, &lp, &x, base);
            base += bytes_chars(x.bytes, x.len);
        }
    } else if (r->echo_text) {
        base = bytes_chars((const uint8_t *)r->echo_text, r->echo_len);
    }
    for (size_t k = from; k < to; k++) {
        oai_lp(tok, s->ids[k], s->lps ? &s->lps[k] : NULL, &x);
        kvf_router_oai_lp_append(r->oai.kind, &lp, &x, base + (s->offs ? s->offs[k] : 0));
    }
    return lp;
}

/* The end of the text that is safe to send: not inside a possible stop string's start and not
 * inside a UTF-8 character. */
static size_t safe_end(const kvf_router_req *r, const seq_state *s)
{
    size_t end = s->text.len;
    if (s->done)
        return end;
    if (r->max_stop > 1)
        end = end > r->max_stop - 1 ? end - (r->max_stop - 1) : 0;
    while (end > s->emitted && end < s->text.len && ((unsigned char)s->text.data[end] & 0xC0) == 0x80)
        end--;
    if (r->tool_fmt != KVF_ROUTER_TOOLCALL_NONE) {
        size_t tc = kvf_router_toolcall_safe_len(r->tool_fmt, s->text.data, s->text.len, s->emitted);
        end = tc < end ? tc : end;
    }
    return end < s->emitted ? s->emitted : end;
}

/* The answer's id: cmpl-<request id> or chatcmpl-<request id>. */
static void answer_id(const kvf_router_req *r, char *out, size_t cap)
{
    const kvf_router_req *r0 = r->group && r->group->m[0] ? r->group->m[0] : r; /* one id for all */
    snprintf(out, cap, "%s-%s", r->oai.kind == KVF_ROUTER_OAI_CHAT ? "chatcmpl" : "cmpl", r0->id);
}

static void send_chunk(kvf_router_req *r, const kvf_router_oai_choice *c, size_t n,
                       const kvf_router_oai_usage *u)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    char id[96];
    answer_id(r, id, sizeof id);
    kvf_router_oai_chunk_sse(r->oai.kind, id, r->rs->cfg.served, r->created, c, n, u,
                             r->oai.include_usage, &b);
    kvf_router_client_sse_send(r->client, b.data, b.len);
    kvf_sbuf_fini(&b);
}

/* The tool calls of a finished sequence (none when the request has no parser or the text holds
 * no well-formed call; with parallel_tool_calls false only the first), with their ids. */
typedef struct seq_calls {
    kvf_router_toolcall_result res;
    char (*ids)[32];
} seq_calls;

static void seq_calls_find(const kvf_router_req *r, int32_t idx, seq_calls *out)
{
    memset(out, 0, sizeof *out);
    const seq_state *s = &r->seqs[idx];
    if (r->tool_fmt == KVF_ROUTER_TOOLCALL_NONE)
        return;
    kvf_status st = r->tool_fmt == KVF_ROUTER_TOOLCALL_FORCED
                        ? kvf_router_toolcall_parse_forced(r->oai.tool_forced, s->text.data, s->text.len, &out->res)
                        : kvf_router_toolcall_parse(r->tool_fmt, s->text.data, s->text.len, &out->res);
    if (st != KVF_OK)
        return;
    while (!r->oai.parallel_tool_calls && out->res.n_calls > 1) {
        kvf_router_toolcall *c = &out->res.calls[--out->res.n_calls];
        free(c->name);
        free(c->arguments);
    }
    if (out->res.n_calls && !(out->ids = calloc(out->res.n_calls, sizeof *out->ids))) {
        kvf_router_toolcall_result_fini(&out->res);
        return;
    }
    for (size_t k = 0; k < out->res.n_calls; k++)
        kvf_router_toolcall_id(r->id, idx, k, out->ids[k]);
}

static void seq_calls_fini(seq_calls *sc)
{
    kvf_router_toolcall_result_fini(&sc->res);
    free(sc->ids);
}

/* A finished choice whose text held tool calls: its content is the text before them (from
 * `from` on, for the last chunk of a stream), finish_reason "tool_calls" unless "length" (or
 * "stop" for a function the client named in tool_choice, as OpenAI answers). */
static void choice_with_calls(kvf_router_oai_choice *c, const seq_calls *sc, size_t from,
                              bool forced_named)
{
    if (!sc->res.n_calls)
        return;
    c->text_len = sc->res.content_len > from ? sc->res.content_len - from : 0;
    c->content_null = !sc->res.content;
    c->tool_calls = sc->res.calls;
    c->tool_call_ids = (const char (*)[32])sc->ids;
    c->n_tool_calls = sc->res.n_calls;
    if (c->finish == KVF_ROUTER_OAI_FINISH_STOP && !forced_named)
        c->finish = KVF_ROUTER_OAI_FINISH_TOOL_CALLS;
}

/* Sends what sequence idx has that the client has not seen (streaming). */
static void emit_seq(kvf_router_req *r, int32_t idx)
{
    seq_state *s = &r->seqs[idx];
    if (r->prompt_lps && !r->have_prompt_lps && r->n_prompt > 1 && !s->first_sent && !s->done)
        return; /* echo: the first chunk carries the prompt's logprobs, which index 0 brings */
    size_t end = safe_end(r, s);
    if (end == s->emitted && s->ids_emitted == s->n_ids && !s->done)
        return;
    kvf_router_oai_choice c = {
        .index = idx + r->oai.prompt_index * r->n_return,
        .text = s->text.data ? s->text.data + s->emitted : "",
        .text_len = end - s->emitted,
        .token_ids = s->ids ? s->ids + s->ids_emitted : NULL,
        .n_ids = s->n_ids - s->ids_emitted,
        .finish = s->done ? s->finish : KVF_ROUTER_OAI_FINISH_NONE,
        .first_chunk = !s->first_sent,
        .logprobs = seq_lps(r, s, s->ids_emitted, s->n_ids, !s->first_sent),
    };
    seq_calls sc = {0};
    if (s->done)
        seq_calls_find(r, idx, &sc);
    choice_with_calls(&c, &sc, s->emitted, r->oai.tool_forced != NULL);
    kvf_sbuf echo;
    kvf_sbuf_init(&echo);
    if (r->echo_text && !s->first_sent) { /* echo: the prompt leads the first chunk */
        kvf_sbuf_append(&echo, r->echo_text, r->echo_len);
        kvf_sbuf_append(&echo, c.text, c.text_len);
        c.text = echo.data ? echo.data : "";
        c.text_len = echo.len;
    }
    send_chunk(r, &c, 1, NULL);
    kvf_sbuf_fini(&echo);
    json_decref(c.logprobs);
    seq_calls_fini(&sc);
    s->first_sent = true;
    s->emitted = end;
    s->ids_emitted = s->n_ids;
}

/* Cuts sequence s's text at the first stop string that ends after byte `prev` (the text before
 * was searched already); true when one was found. */
static bool cut_at_stop(const kvf_router_req *r, seq_state *s, size_t prev)
{
    if (!r->oai.n_stop || s->text.len <= prev)
        return false;
    size_t from = prev > r->max_stop ? prev - r->max_stop : 0;
    int64_t pos = kvf_router_oai_find_stop(s->text.data, s->text.len, from, r->oai.stop, r->oai.n_stop);
    if (pos < 0)
        return false;
    s->text.len = (size_t)pos;
    s->text.data[pos] = 0;
    return true;
}

/* Ends sequence idx with reason f (a stop string in the detokenizer's last bytes wins). */
static void seq_finish(kvf_router_req *r, int32_t idx, kvf_router_oai_finish f)
{
    seq_state *s = &r->seqs[idx];
    if (s->done)
        return;
    size_t prev = s->text.len;
    if (s->detok) {
        kvf_err err = {0};
        kvf_text_detok_finish(s->detok, &s->text, &err);
    }
    if (cut_at_stop(r, s, prev))
        f = KVF_ROUTER_OAI_FINISH_STOP;
    s->finish = f;
    s->done = true;
    if (r->oai.stream && !r->client_gone)
        emit_seq(r, idx);
}

static bool all_done(const kvf_router_req *r)
{
    for (int32_t i = 0; i < r->oai.n; i++)
        if (!r->seqs[i].done)
            return false;
    return true;
}

/* How many of a message's tokens become text: all but an EOS that ended the sequence (its text,
 * "<|im_end|>" when special tokens are kept, is never part of the answer, as in vLLM). */
static size_t text_ids(const kvf_router_req *r, const kvf_rpc_generate_resp *m)
{
    if (m->finish != KVF_RPC_FINISH_STOP || !m->n_token_ids || r->oai.ignore_eos)
        return m->n_token_ids;
    for (size_t i = 0; i < r->rs->cfg.n_eos; i++)
        if (m->token_ids[m->n_token_ids - 1] == r->rs->cfg.eos_ids[i])
            return m->n_token_ids - 1;
    return m->n_token_ids;
}

/* Applies one GenerateResponse: its tokens join their sequence, become text, are checked for
 * stop strings and (streaming) go to the client. */
static void handle_msg(kvf_router_req *r, const kvf_rpc_generate_resp *m)
{
    kvf_router_reqs *rs = r->rs;
    if (m->has_usage && m->usage.cached_prompt_tokens > r->cached_tokens)
        r->cached_tokens = m->usage.cached_prompt_tokens;
    if (m->index < 0 || m->index >= r->oai.n) {
        kvf_log(KVF_LOG_WARN, "router: req %s: decode sent sequence index %d of %d", r->id, m->index, r->oai.n);
        return;
    }
    if (m->n_prompt_lps && r->prompt_lps && !r->have_prompt_lps) {
        for (size_t i = 0; i < m->n_prompt_lps; i++) {
            size_t pos = (size_t)m->prompt_lps_start + i;
            if (pos < r->n_prompt)
                r->prompt_lps[pos] = m->prompt_lps[i];
            if (pos + 1 >= r->n_prompt)
                r->have_prompt_lps = true;
        }
    }
    seq_state *s = &r->seqs[m->index];
    if (m->n_token_ids && !r->got_token) {
        r->got_token = true;
        kvf_metric_observe(rs->m_ttft, kvf_now_s() - r->t0);
        if (r->prefill >= 0 && r->prefill_tokens) {
            rs->prefill_queued[r->prefill] -= r->prefill_tokens;
            r->prefill_tokens = 0;
        }
    }
    if (s->done)
        return;
    if (s->n_ids + m->n_token_ids > s->cap && !seq_grow(r, s, (s->n_ids + m->n_token_ids) * 2 + 16))
        return;
    size_t prev = s->text.len, first = s->n_ids;
    if (m->n_token_ids)
        memcpy(s->ids + s->n_ids, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    s->n_ids += m->n_token_ids;
    kvf_metric_add(rs->m_gen_tokens, (double)m->n_token_ids);
    for (size_t k = 0; s->lps && k < m->n_token_ids; k++)
        s->lps[first + k] = m->logprobs ? m->logprobs[k] : (kvf_rpc_logprob){.logprob = NAN};
    /* with logprobs, one token at a time: each token's text offset is the text before it */
    size_t n_text = text_ids(r, m), step = s->offs ? 1 : n_text;
    for (size_t k = 0; s->detok && k < n_text; k += step) {
        if (s->offs)
            s->offs[first + k] = text_chars(s);
        kvf_err err = {0};
        if (kvf_text_detok_feed(s->detok, m->token_ids + k, step, &s->text, &err) != KVF_OK)
            kvf_log(KVF_LOG_WARN, "router: req %s: %s", r->id, err.msg);
    }
    for (size_t k = n_text; s->offs && k < m->n_token_ids; k++) /* a final EOS: no text, at the end */
        s->offs[first + k] = text_chars(s);
    if (cut_at_stop(r, s, prev)) {
        s->finish = KVF_ROUTER_OAI_FINISH_STOP;
        s->done = true;
    }
    if (!s->done && m->finish != KVF_RPC_FINISH_NONE) {
        kvf_router_oai_finish f = m->finish == KVF_RPC_FINISH_STOP     ? KVF_ROUTER_OAI_FINISH_STOP
                                  : m->finish == KVF_RPC_FINISH_LENGTH ? KVF_ROUTER_OAI_FINISH_LENGTH
                                                                        : KVF_ROUTER_OAI_FINISH_ABORT;
        seq_finish(r, m->index, f);
        return;
    }
    if (r->oai.stream && !r->client_gone)
        emit_seq(r, m->index);
}

/* ---------------------------------------------------------------------------------------- */
/* 6. The end: done, failed, or the client gone                                              */

static kvf_router_oai_usage usage_of(const kvf_router_req *r)
{
    kvf_router_oai_usage u = {.prompt_tokens = (int64_t)r->n_prompt, .cached_tokens = r->cached_tokens};
    for (int32_t i = 0; i < r->oai.n; i++)
        u.completion_tokens += (int64_t)r->seqs[i].n_ids;
    return u;
}

/* Answered (or abandoned at shutdown): off the list and freed. */
static void rq_answered(kvf_router_req *r)
{
    unlink_rq(r);
    rq_free(r);
}

/* The samples to answer, best first when best_of drew more than n (highest cumulative
 * logprob; ties to the lower index), else in order. malloc'd; NULL when out of memory. */
static int32_t *best_order(const kvf_router_req *r)
{
    int32_t n = r->oai.n, *o = malloc((size_t)n * sizeof *o);
    double *sum = calloc((size_t)n, sizeof *sum);
    if (!o || !sum) {
        free(o);
        free(sum);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        o[i] = i;
        const seq_state *s = &r->seqs[i];
        for (size_t k = 0; s->lps && k < s->n_ids; k++)
            sum[i] += s->lps[k].logprob == s->lps[k].logprob ? (double)s->lps[k].logprob : -INFINITY;
    }
    if (r->n_return < n)
        for (int32_t i = 1; i < n; i++) /* insertion sort: n <= 64 */
            for (int32_t j = i; j > 0 && sum[o[j]] > sum[o[j - 1]]; j--) {
                int32_t t = o[j];
                o[j] = o[j - 1];
                o[j - 1] = t;
            }
    free(sum);
    return o;
}

/* Sends the end of a successful request (the last SSE events, or the whole answer) and frees it. */
static void answer_ok(kvf_router_req *const *ms, int32_t n_ms, kvf_router_client *client)
{
    kvf_router_req *r = ms[0];
    kvf_router_reqs *rs = r->rs;
    kvf_router_oai_usage u = {0};
    for (int32_t k = 0; k < n_ms; k++) {
        kvf_router_oai_usage x = usage_of(ms[k]);
        u.prompt_tokens += x.prompt_tokens;
        u.completion_tokens += x.completion_tokens;
        u.cached_tokens += x.cached_tokens;
    }
    if (r->oai.stream) {
        if (r->oai.include_usage)
            send_chunk(r, NULL, 0, &u);
        kvf_router_client_sse_send(client, "data: [DONE]\n\n", 14);
        kvf_router_http_sse_end(rs->cfg.h, client, 200);
    } else {
        int32_t per = r->n_return, n = per * n_ms;
        kvf_router_oai_choice *cs = calloc((size_t)n, sizeof *cs);
        kvf_sbuf *texts = calloc((size_t)n, sizeof *texts);
        seq_calls *calls = calloc((size_t)n, sizeof *calls);
        bool ok = cs && texts && calls;
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        for (int32_t k = 0; ok && k < n_ms; k++) {
            const kvf_router_req *m = ms[k];
            int32_t *order = best_order(m);
            ok = order != NULL;
            for (int32_t j = 0; ok && j < per; j++) {
                int32_t i = k * per + j;
                const seq_state *s = &m->seqs[order[j]];
                kvf_sbuf_init(&texts[i]);
                if (m->echo_text)
                    kvf_sbuf_append(&texts[i], m->echo_text, m->echo_len);
                kvf_sbuf_append(&texts[i], s->text.data ? s->text.data : "", s->text.len);
                cs[i] = (kvf_router_oai_choice){.index = i, .text = texts[i].data, .text_len = texts[i].len,
                                                .token_ids = s->ids, .n_ids = s->n_ids, .finish = s->finish,
                                                .logprobs = seq_lps(m, s, 0, s->n_ids, true)};
                seq_calls_find(m, order[j], &calls[i]);
                choice_with_calls(&cs[i], &calls[i], 0, r->oai.tool_forced != NULL);
            }
            free(order);
        }
        char id[96];
        answer_id(r, id, sizeof id);
        kvf_router_oai_answer_json(r->oai.kind, id, rs->cfg.served, r->created, cs, ok ? (size_t)n : 0, &u, &b);
        kvf_router_http_send_json(rs->cfg.h, client, 200, r->id, b.data ? b.data : "{}", b.len);
        kvf_sbuf_fini(&b);
        for (int32_t i = 0; cs && texts && i < n; i++) {
            kvf_sbuf_fini(&texts[i]);
            json_decref(cs[i].logprobs);
        }
        free(texts);
        for (int32_t i = 0; calls && i < n; i++)
            seq_calls_fini(&calls[i]);
        free(calls);
        free(cs);
    }
    kvf_metric_observe(rs->m_e2e, kvf_now_s() - r->t0);
    kvf_log(KVF_LOG_INFO, "router: req %s: done, %lld prompt + %lld completion tokens in %.1f ms%s",
            r->id, (long long)u.prompt_tokens, (long long)u.completion_tokens, (kvf_now_s() - r->t0) * 1e3,
            n_ms > 1 ? " (a list of prompts)" : "");
}

/* An error answer: an SSE error event and the end when streaming, else the error answer. */
static void send_err(kvf_router_reqs *rs, kvf_router_client *client, bool sse, const char *id,
                     const kvf_router_oai_error *e, int retry_after)
{
    if (sse) {
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        kvf_sbuf_puts(&b, "data: ");
        kvf_router_oai_error_json(e, &b);
        kvf_sbuf_puts(&b, "\n\ndata: [DONE]\n\n");
        kvf_router_client_sse_send(client, b.data, b.len);
        kvf_router_http_sse_end(rs->cfg.h, client, e->http_status);
        kvf_sbuf_fini(&b);
        kvf_log(KVF_LOG_WARN, "router: req %s: failed mid-stream: %s", id, e->message);
    } else {
        kvf_router_http_send_error(rs->cfg.h, client, id, e, retry_after);
    }
}

/* Every member of g but `except` (NULL: all) stops as if its client left: its Generate is
 * cancelled and it ends through finish_gone (one being prepared, through group_prepared). */
static void group_stop(rq_group *g, const kvf_router_req *except)
{
    for (int32_t i = 0; i < g->n; i++) {
        kvf_router_req *m = g->m[i];
        if (!m || m == except || m->client_gone)
            continue;
        m->client_gone = true;
        atomic_store(&m->gone, true);
        if (m->stream)
            kvf_rpc_stream_cancel(m->stream);
        kvf_router_wake_notify(&m->wake);
    }
}

/* A member of a group ended (off the list, kept): the last one answers for all and frees them. */
static void group_done(kvf_router_req *r)
{
    rq_group *g = r->group;
    kvf_router_reqs *rs = r->rs;
    unlink_rq(r);
    if (++g->n_done < g->n)
        return;
    if (!g->failed) /* a failed group's client was answered (and may be gone) already */
        kvf_router_client_on_close(rs->cfg.h, g->client, NULL);
    if (g->gone && !g->failed) {
        kvf_metric_add(rs->m_disconnects, 1);
        kvf_router_client_send_gone(g->client, g->m[0]->oai.stream);
    } else if (!g->failed) {
        answer_ok(g->m, g->n, g->client);
    }
    group_free(g);
}

/* Sends the end of a successful request (the last SSE events, or the whole answer) and frees it. */
static void finish_ok(kvf_router_req *r)
{
    if (r->group) {
        group_done(r);
        return;
    }
    kvf_router_client_on_close(r->rs->cfg.h, r->client, NULL);
    answer_ok(&r, 1, r->client);
    rq_answered(r);
}

/* Sends an error (an SSE error event when streaming, else the error answer) and frees r; in a
 * group, the first error answers for all and the others stop. */
static void finish_err(kvf_router_req *r, const kvf_router_oai_error *e, int retry_after)
{
    rq_group *g = r->group;
    if (g) {
        if (!g->failed && !g->gone) {
            kvf_router_client_on_close(r->rs->cfg.h, g->client, NULL);
            send_err(r->rs, g->client, r->oai.stream, g->m[0]->id, e, retry_after);
            g->failed = true;
            group_stop(r->group, r);
            for (int32_t i = 0; i < g->n; i++) /* answered: no member may touch it again */
                if (g->m[i])
                    g->m[i]->client = NULL;
            g->client = NULL;
        }
        group_done(r);
        return;
    }
    kvf_router_client_on_close(r->rs->cfg.h, r->client, NULL);
    send_err(r->rs, r->client, r->oai.stream, r->id, e, retry_after);
    rq_answered(r);
}

/* The client left: Generate cancelled (the decode worker frees the sequence), answer ended. */
static void finish_gone(kvf_router_req *r)
{
    kvf_log(KVF_LOG_INFO, "router: req %s: client went away; Generate cancelled", r->id);
    if (r->stream)
        kvf_rpc_stream_cancel(r->stream);
    if (r->group) {
        r->group->gone = true;
        group_stop(r->group, r);
        group_done(r);
        return;
    }
    kvf_router_client_on_close(r->rs->cfg.h, r->client, NULL);
    kvf_metric_add(r->rs->m_disconnects, 1);
    kvf_router_client_send_gone(r->client, r->oai.stream);
    rq_answered(r);
}

void kvf_router_req_client_left(kvf_router_req *r)
{
    if (r && r->group) { /* every member: the prepared ones answer through the group */
        r->group->gone = true;
        group_stop(r->group, NULL);
        return;
    }
    if (!r || r->client_gone)
        return;
    r->client_gone = true;
    atomic_store(&r->gone, true);
    if (r->stream)
        kvf_rpc_stream_cancel(r->stream);
    kvf_router_wake_notify(&r->wake); /* the pump answers it on the loop's next pass */
}

/* ---------------------------------------------------------------------------------------- */
/* 7. Retry on another decode worker                                                         */

static bool retryable(kvf_status st)
{
    return st == KVF_ERR_PEER_LOST || st == KVF_ERR_BUSY || st == KVF_ERR_FULL ||
           st == KVF_ERR_CANCELLED || st == KVF_ERR_INTERNAL;
}

/* The decode worker failed before the first token, or mid-stream with one sequence: go on with
 * another one. Returns false when the request was answered (and freed) instead. */
static bool retry(kvf_router_req *r, kvf_status why, const char *msg)
{
    kvf_router_reqs *rs = r->rs;
    const kvf_router_reqs_cfg *c = &rs->cfg;
    kvf_log(KVF_LOG_WARN, "router: req %s: decode %s failed after %zu tokens (%s: %s)", r->id,
            decode_worker(r)->address, r->seqs[0].n_ids, kvf_status_name(why), msg);
    kvf_rpc_stream_destroy(r->stream);
    r->stream = NULL;
    rs->inflight[r->worker]--;
    r->started = false;
    if (why == KVF_ERR_PEER_LOST)
        kvf_router_fleet_mark_failed(c->fleet, KVF_ROUTER_ROLE_DECODE, r->worker);
    kvf_router_watch_drop(c->watch, KVF_ROUTER_ROLE_DECODE, r->worker);
    kvf_router_oai_error e;
    int ra = 0;
    if (r->attempts >= c->max_attempts) {
        kvf_router_oai_error_set(&e, 503, "server_error", NULL, "worker_failed",
                                 "decode workers failed %d times (request %s)", r->attempts, r->id);
        finish_err(r, &e, 1);
        return false;
    }
    if (r->prefill >= 0 && r->prefill_tokens) {
        rs->prefill_queued[r->prefill] -= r->prefill_tokens;
        r->prefill_tokens = 0;
    }
    /* The pool may re-add the failed worker when the fleet still thinks it healthy: skip it. */
    int32_t failed = r->worker;
    for (int tries = 0; tries < 4; tries++) {
        if (pick_workers(rs, r, &e, &ra) != KVF_OK) {
            finish_err(r, &e, ra);
            return false;
        }
        if (r->worker != failed || kvf_router_watch_n_in_pool(c->watch, KVF_ROUTER_ROLE_DECODE) <= 1)
            break;
    }
    kvf_metric_add(rs->m_retries, 1);
    kvf_err err = {0};
    if (open_stream(rs, r, &err) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "router: req %s: %s", r->id, err.msg);
        kvf_router_oai_error_set(&e, 503, "server_error", NULL, "worker_failed",
                                 "no decode worker could be reached (request %s)", r->id);
        finish_err(r, &e, 1);
        return false;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* 8. The pump: what drives steps 5 to 7 whenever the stream or the client wakes the loop    */

/* A waiting plain request peeks at its client's socket every 20 ms (libevent does not always
 * report a client that leaves before the answer). */
static void peek_gone(kvf_router_req *r)
{
    int64_t now = kvf_now_ns();
    if (r->client_gone || r->oai.stream || now < r->next_peek_ns)
        return;
    r->next_peek_ns = now + 20000000;
    if (kvf_router_client_left(r->client))
        kvf_router_req_client_left(r);
}

/* Reads what the request's stream has; returns after the request is answered or idle. */
static void pump(kvf_router_req *r)
{
    peek_gone(r);
    for (;;) {
        if (r->client_gone) {
            finish_gone(r);
            return;
        }
        kvf_rpc_buf m = {0};
        bool done = false;
        kvf_err err = {0};
        kvf_status st = kvf_rpc_stream_read(r->stream, 0, &m, &done, &err);
        bool resumable = !r->got_token || (r->oai.n == 1 && !r->seqs[0].done);
        if (!done && st == KVF_ERR_TIMEOUT) {
            /* Nothing yet. A decode worker that leaves its health checks unanswered (stopped,
             * cut off, silent) would hold this stream to its deadline: move it now, as if the
             * worker were lost (the safety timer pumps every request, so this is noticed
             * within one health period and a timer tick). */
            /* Only a stream that is itself quiet moves (a worker still sending tokens is
             * not lost, however late its Health answers), and only when another decode worker
             * is healthy (else the move would fail the request that might still finish). */
            if (resumable && kvf_now_ns() - r->last_msg_ns >= SILENT_STREAM_NS &&
                kvf_router_fleet_silent(r->rs->cfg.fleet, KVF_ROUTER_ROLE_DECODE, r->worker) &&
                kvf_router_fleet_n_healthy(r->rs->cfg.fleet, KVF_ROUTER_ROLE_DECODE) > 0) {
                if (!retry(r, KVF_ERR_PEER_LOST, "its health checks go unanswered"))
                    return;
                continue;
            }
            return;
        }
        if (!done && st == KVF_OK) {
            r->last_msg_ns = kvf_now_ns();
            kvf_rpc_generate_resp *g = NULL;
            if (kvf_rpc_generate_resp_decode(m.data, m.len, &g, &err) != KVF_OK)
                kvf_log(KVF_LOG_WARN, "router: req %s: bad Generate message: %s", r->id, err.msg);
            else
                handle_msg(r, g);
            free(g);
            kvf_rpc_buf_free(&m);
            if (all_done(r)) {
                kvf_rpc_stream_cancel(r->stream); /* stop strings may end it before the worker */
                finish_ok(r);
                return;
            }
            continue;
        }
        /* The call is over. */
        if (st == KVF_OK) {
            for (int32_t i = 0; i < r->oai.n; i++)
                seq_finish(r, i, KVF_ROUTER_OAI_FINISH_LENGTH);
            finish_ok(r);
            return;
        }
        if (resumable && retryable(st)) {
            if (!retry(r, st, err.msg))
                return;
            continue;
        }
        kvf_router_oai_error e;
        int code = st == KVF_ERR_INVALID || st == KVF_ERR_LIMIT ? 400 : st == KVF_ERR_TIMEOUT ? 504 : 502;
        /* the worker's address and its RPC text go to the log, not to the client */
        kvf_log(KVF_LOG_WARN, "router: req %s: decode worker %s: %s", r->id, decode_worker(r)->address,
                err.msg[0] ? err.msg : kvf_status_str(st));
        kvf_router_oai_error_set(&e, code, code == 400 ? "invalid_request_error" : "server_error", NULL,
                                 NULL, code == 400 ? "the decode worker refused the request (request %s)"
                                                   : "the decode worker failed: %s (request %s)",
                                 code == 400 ? r->id : kvf_status_str(st), r->id);
        finish_err(r, &e, 0);
        return;
    }
}

void kvf_router_reqs_pump(kvf_router_reqs *rs, bool all)
{
    if (kvf_router_wake_take(&rs->prep_wake) || all)
        prep_collect(rs);
    for (kvf_router_req *r = rs->head, *next; r; r = next) {
        next = r->next; /* pump frees r at most, never another request */
        bool ready = kvf_router_wake_take(&r->wake);
        if (ready || all)
            pump(r);
    }
}

int64_t kvf_router_reqs_open(const kvf_router_reqs *rs)
{
    return rs ? rs->n_open : 0;
}

kvf_router_req *kvf_router_reqs_find(kvf_router_reqs *rs, const kvf_router_client *c)
{
    for (kvf_router_req *r = rs->head; r; r = r->next)
        if (r->client == c)
            return r;
    for (kvf_router_req *r = rs->prep; r; r = r->next)
        if (r->client == c)
            return r;
    for (rq_group *g = rs->groups; g; g = g->next) /* a member waiting for the others */
        if (g->client == c)
            for (int32_t i = 0; i < g->n; i++)
                if (g->m[i])
                    return g->m[i];
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* The set's life cycle                                                                      */

kvf_status kvf_router_reqs_create(const kvf_router_reqs_cfg *cfg, kvf_router_reqs **out,
                                  kvf_err *err)
{
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
    kvf_router_reqs *rs = calloc(1, sizeof *rs);
    if (!rs)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    rs->cfg = *cfg;
    kvf_metrics *m = cfg->metrics;
    kvf_status st;
    if ((st = kvf_metrics_counter(m, "kvfleet_router_retries_total", NULL,
                                  "requests moved to another decode worker (before the first token, or mid-stream with n = 1)",
                                  &rs->m_retries, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_client_disconnects_total", NULL,
                                  "requests cancelled because the client went away", &rs->m_disconnects, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_generated_tokens_total", NULL,
                                  "tokens streamed from decode workers", &rs->m_gen_tokens, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_prompt_tokens_total", NULL, "prompt tokens routed",
                                  &rs->m_prompt_tokens, err)) != KVF_OK ||
        (st = kvf_metrics_gauge(m, "kvfleet_router_requests_in_flight", NULL, "generation requests in flight",
                                &rs->m_inflight, err)) != KVF_OK ||
        (st = kvf_metrics_histogram(m, "kvfleet_router_ttft_seconds", NULL, "time to first token",
                                    lat, sizeof lat / sizeof lat[0], &rs->m_ttft, err)) != KVF_OK ||
        (st = kvf_metrics_histogram(m, "kvfleet_router_request_seconds", NULL, "whole request time",
                                    lat, sizeof lat / sizeof lat[0], &rs->m_e2e, err)) != KVF_OK) {
        free(rs);
        return st;
    }
    rs->prep_wake.h = cfg->h;
    pthread_mutex_init(&rs->mu, NULL);
    pthread_cond_init(&rs->cv, NULL);
    int32_t n = cfg->prep_threads > 0 ? cfg->prep_threads : 1;
    if (!(rs->threads = calloc((size_t)n, sizeof *rs->threads))) {
        kvf_router_reqs_destroy(rs);
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    }
    for (; rs->n_threads < n; rs->n_threads++)
        if (pthread_create(&rs->threads[rs->n_threads], NULL, prep_main, rs) != 0) {
            kvf_router_reqs_destroy(rs);
            return kvf_err_set(err, KVF_ERR_INTERNAL, "router: cannot start prep thread %d of %d", rs->n_threads + 1, n);
        }
    *out = rs;
    return KVF_OK;
}

void kvf_router_reqs_destroy(kvf_router_reqs *rs)
{
    if (!rs)
        return;
    pthread_mutex_lock(&rs->mu);
    rs->stop = true;
    pthread_cond_broadcast(&rs->cv);
    pthread_mutex_unlock(&rs->mu);
    for (int32_t i = 0; i < rs->n_threads; i++)
        pthread_join(rs->threads[i], NULL);
    free(rs->threads);
    /* Every request being prepared is on the prep list, queued, done or neither. */
    for (rq_group *g = rs->groups; g; g = g->next) /* a group's client once */
        if (g->client) {
            kvf_router_client_on_close(rs->cfg.h, g->client, NULL);
            kvf_router_client_abandon(g->client);
        }
    while (rs->prep) {
        kvf_router_req *r = rs->prep;
        unlink_prep(rs, r);
        if (!r->group) {
            kvf_router_client_on_close(rs->cfg.h, r->client, NULL);
            kvf_router_client_abandon(r->client);
        }
        rq_free(r); /* the body too */
    }
    while (rs->head) {
        kvf_router_req *r = rs->head;
        if (!r->group) {
            kvf_router_client_on_close(r->rs->cfg.h, r->client, NULL);
            kvf_router_client_abandon(r->client);
        }
        rq_answered(r);
    }
    while (rs->groups) /* what the groups still hold: members waiting, or ended */
        group_free(rs->groups);
    pthread_cond_destroy(&rs->cv);
    pthread_mutex_destroy(&rs->mu);
    free(rs);
}
