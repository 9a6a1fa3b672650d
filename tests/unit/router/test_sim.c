/* test_sim.c: the Mooncake trace reader (token expansion keeps the prefix structure, bad lines
 * are refused naming line and field), the LRU cache the simulated workers use, and the
 * simulator on a slice of the conversation trace from ../shared. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kv/hash.h"
#include "router/lru.h"
#include "router/sim.h"
#include "router/trace.h"
#include "testutil.h"

static const char *write_tmp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvf_router_trace_%d.jsonl", (int)getpid());
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

static void test_trace_expansion_keeps_prefixes(void **state)
{
    (void)state;
    const char *p = write_tmp(
        "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [4, 9, 12]}\n"
        "{\"timestamp\": 10, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [4, 9]}\n"
        "{\"timestamp\": 20, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [4, 10]}\n");
    kvf_router_trace t;
    kvf_err err = {0};
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &t, &err), KVF_OK);
    assert_int_equal(t.n_reqs, 3);
    assert_int_equal(t.reqs[0].n_blocks, 1100 / 16);
    assert_int_equal(t.reqs[1].n_blocks, 700 / 16);
    assert_true(t.reqs[1].t_s == 0.01);
    const uint64_t *a = t.hashes + t.reqs[0].first, *b = t.hashes + t.reqs[1].first,
                   *c = t.hashes + t.reqs[2].first;
    /* equal ids: equal hashes over the whole shared part (the partial block too) */
    for (int i = 0; i < t.reqs[1].n_blocks; i++)
        assert_true(a[i] == b[i]);
    /* the first trace block is shared with request 3, the second is not */
    for (int i = 0; i < 32; i++)
        assert_true(a[i] == c[i]);
    assert_true(a[32] != c[32]);
    /* the hashes are the workers' chained block hashes of the derived tokens */
    int32_t tok[16];
    kvf_router_trace_block_tokens(4, 0, 16, tok);
    assert_true(a[0] == kvf_kv_hash_block(kvf_kv_hash_root("m", NULL, 0), tok, 16));
    kvf_router_trace_fini(&t);
    /* max_requests */
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 2, &t, &err), KVF_OK);
    assert_int_equal(t.n_reqs, 2);
    kvf_router_trace_fini(&t);
    unlink(p);
}

static void test_trace_bad_lines_refused(void **state)
{
    (void)state;
    kvf_router_trace t;
    kvf_err err = {0};
    const char *p = write_tmp("{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [4, 9]}\n");
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &t, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, ":1:"));
    assert_non_null(strstr(err.msg, "\"hash_ids\" has 2 entries"));
    p = write_tmp("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n"
                  "{\"timestamp\": 5, \"input_length\": \"x\", \"output_length\": 5, \"hash_ids\": [1]}\n");
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, ":2:"));
    assert_non_null(strstr(err.msg, "input_length"));
    p = write_tmp("{\"timestamp\": 9, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n"
                  "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n");
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &t, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "backwards"));
    p = write_tmp("not json\n");
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &t, &err), KVF_ERR_PARSE);
    assert_int_equal(kvf_router_trace_load("/nonexistent/t.jsonl", "m", 16, 512, 0, &t, &err), KVF_ERR_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/t.jsonl"));
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 500, 0, &t, &err), KVF_ERR_INVALID);
    unlink(p);
}

/* The in-memory reader (the fuzz target's entry) gives what the file reader gives, and names
 * the buffer in its errors. */
static void test_trace_parse_from_memory(void **state)
{
    (void)state;
    const char *text = "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [4, 9, 12]}\n"
                       "{\"timestamp\": 10, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [4, 9]}";
    const char *p = write_tmp(text);
    kvf_router_trace a, b;
    kvf_err err = {0};
    assert_int_equal(kvf_router_trace_load(p, "m", 16, 512, 0, &a, &err), KVF_OK);
    assert_int_equal(kvf_router_trace_parse("mem", text, strlen(text), "m", 16, 512, 0, &b, &err), KVF_OK);
    assert_int_equal(a.n_reqs, b.n_reqs);
    assert_int_equal(a.n_hashes, b.n_hashes);
    assert_memory_equal(a.hashes, b.hashes, a.n_hashes * sizeof *a.hashes);
    kvf_router_trace_fini(&a);
    kvf_router_trace_fini(&b);
    unlink(p);
    /* a buffer is not a C string: the bytes after len are not read */
    assert_int_equal(kvf_router_trace_parse("mem", text, 40, "m", 16, 512, 0, &b, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "mem:1"));
    assert_int_equal(kvf_router_trace_parse("mem", "", 0, "m", 16, 512, 0, &b, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "no requests"));
    assert_int_equal(kvf_router_trace_parse("mem", text, strlen(text), "m", 16, 500, 0, &b, &err), KVF_ERR_INVALID);
    /* prompts shorter than one block: no hash, but an array to index (fuzz_trace's first find) */
    const char *tiny = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}";
    assert_int_equal(kvf_router_trace_parse("mem", tiny, strlen(tiny), "m", 16, 512, 0, &b, &err), KVF_OK);
    assert_int_equal(b.n_hashes, 0);
    assert_int_equal(b.reqs[0].n_blocks, 0);
    assert_non_null(b.hashes);
    kvf_router_trace_fini(&b);
    /* a timestamp too large for int64 is refused, not cast (fuzz_trace's second find) */
    const char *huge = "{\"timestamp\": 1e84, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}";
    assert_int_equal(kvf_router_trace_parse("mem", huge, strlen(huge), "m", 16, 512, 0, &b, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "timestamp"));
}

static void test_lru_order_pins_and_ttl(void **state)
{
    (void)state;
    kvf_router_lru *c;
    kvf_err err = {0};
    assert_int_equal(kvf_router_lru_create(3, &c, &err), KVF_OK);
    int ev;
    uint64_t old;
    int32_t e1 = kvf_router_lru_insert(c, 11, 1, 0, &ev, &old);
    int32_t e2 = kvf_router_lru_insert(c, 12, 1, 0, &ev, &old);
    int32_t e3 = kvf_router_lru_insert(c, 13, 1, 0, &ev, &old);
    /* all pinned: nothing can be added */
    assert_int_equal(kvf_router_lru_insert(c, 14, 1, 0, &ev, &old), -1);
    /* released tail first: the tail (13) becomes the oldest */
    kvf_router_lru_unpin(c, e3, 1);
    kvf_router_lru_unpin(c, e2, 1);
    kvf_router_lru_unpin(c, e1, 1);
    assert_true(kvf_router_lru_insert(c, 14, 0, 2, &ev, &old) >= 0);
    assert_int_equal(ev, 1);
    assert_true(old == 13);
    assert_int_equal(kvf_router_lru_find(c, 13), -1);
    /* a pinned entry is never evicted; touching makes an entry the newest */
    kvf_router_lru_pin(c, kvf_router_lru_find(c, 12));
    kvf_router_lru_touch(c, kvf_router_lru_find(c, 11), 3);
    assert_true(kvf_router_lru_insert(c, 15, 0, 4, &ev, &old) >= 0);
    assert_true(old == 14);
    assert_true(kvf_router_lru_find(c, 12) >= 0);
    /* pop by age: only entries stamped before the cut */
    assert_int_equal(kvf_router_lru_pop(c, 3.5, &old), 1);
    assert_true(old == 11);
    assert_int_equal(kvf_router_lru_pop(c, 3.5, &old), 0);
    assert_int_equal(kvf_router_lru_size(c), 2);
    kvf_router_lru_destroy(c);
    assert_int_equal(kvf_router_lru_create(0, &c, &err), KVF_ERR_INVALID);
}

static kvf_router_sim_result run_sim(const kvf_router_trace *t, bool fleet, kvf_router_policy pol)
{
    kvf_router_sim_cfg c;
    kvf_router_sim_cfg_default(&c);
    c.capacity_blocks = 1250;
    c.fleet_lru = fleet;
    c.pool.policy = pol;
    kvf_router_sim_result r;
    kvf_err err = {0};
    assert_int_equal(kvf_router_sim_run(t, &c, &r, &err), KVF_OK);
    return r;
}

static void test_sim_on_conversation_slice(void **state)
{
    (void)state;
    kvf_router_trace t;
    kvf_err err = {0};
    assert_int_equal(kvf_router_trace_load(kvf_test_shared_path("data/mooncake/conversation_trace.jsonl"),
                                           "mooncake", 16, 512, 1500, &t, &err), KVF_OK);
    assert_int_equal(t.n_reqs, 1500);
    kvf_router_sim_result fl = run_sim(&t, true, KVF_ROUTER_POLICY_KV);
    kvf_router_sim_result kv = run_sim(&t, false, KVF_ROUTER_POLICY_KV);
    kvf_router_sim_result rr = run_sim(&t, false, KVF_ROUTER_POLICY_ROUND_ROBIN);
    int64_t blocks = 0, tokens = 0;
    for (size_t i = 0; i < t.n_reqs; i++)
        blocks += t.reqs[i].n_blocks, tokens += t.reqs[i].n_tokens;
    kvf_router_sim_result *all[3] = {&fl, &kv, &rr};
    for (int i = 0; i < 3; i++) {
        kvf_router_sim_result *r = all[i];
        assert_int_equal(r->n_requests, 1500);
        assert_int_equal(r->blocks, blocks);
        assert_int_equal(r->tokens, tokens);
        assert_int_equal(r->tokens_hit, r->blocks_hit * 16);
        assert_true(r->hit_rate_blocks > 0 && r->hit_rate_blocks < 1);
        assert_true(r->hit_rate_trace_blocks <= r->hit_rate_blocks + 1e-9);
        assert_true(r->ttft_p50_s >= 0.02 && r->ttft_p99_s >= r->ttft_p50_s);
        assert_true(r->load_max_over_mean >= 1.0);
        int64_t computed = 0;
        for (int w = 0; w < 8; w++)
            computed += r->computed_tokens[w];
        assert_int_equal(computed, tokens - r->tokens_hit);
    }
    /* the prefix-aware router beats round-robin and stays near the shared-cache reference */
    assert_true(kv.hit_rate_blocks > rr.hit_rate_blocks * 1.5);
    assert_true(kv.hit_rate_blocks >= 0.85 * fl.hit_rate_blocks);
    assert_true(kv.load_max_over_mean < 1.5);
    /* the router's index mirrors the caches it was told about, and its fit found the model */
    assert_true(kv.index.n_blocks > 0);
    assert_int_equal(kv.index.gaps, 0);
    assert_true(kv.fitted_b_s > 4.9e-5 && kv.fitted_b_s < 5.1e-5);
    kvf_router_trace_fini(&t);
}

static kvf_router_sim_result run_cfg(const kvf_router_trace *t, const kvf_router_sim_cfg *c)
{
    kvf_router_sim_result r;
    kvf_err err = {0};
    assert_int_equal(kvf_router_sim_run(t, c, &r, &err), KVF_OK);
    return r;
}

/* The Zipf generator: deterministic for a seed, readable as a Mooncake trace, skewed (the
 * first prefix is the most common), bad sizes refused by name. */
static void test_synth_zipf_trace(void **state)
{
    (void)state;
    kvf_router_synth_cfg c;
    kvf_router_synth_cfg_default(&c);
    c.n_requests = 500;
    char *a, *b;
    size_t na, nb;
    kvf_err err = {0};
    assert_int_equal(kvf_router_synth_zipf(&c, &a, &na, &err), KVF_OK);
    assert_int_equal(kvf_router_synth_zipf(&c, &b, &nb, &err), KVF_OK);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(b);
    kvf_router_trace t;
    assert_int_equal(kvf_router_trace_parse("zipf", a, na, "m", 16, 512, 0, &t, &err), KVF_OK);
    free(a);
    assert_int_equal(t.n_reqs, 500);
    int first[8] = {0};
    uint64_t heads[8];
    int n_heads = 0;
    for (size_t i = 0; i < t.n_reqs; i++) {
        assert_int_equal(t.reqs[i].n_trace_blocks, 18);
        uint64_t h = t.hashes[t.reqs[i].first + 16 * 32 - 1]; /* the prefix's last block */
        int k = 0;
        while (k < n_heads && heads[k] != h)
            k++;
        if (k == n_heads) {
            assert_true(n_heads < 8);
            heads[n_heads++] = h;
        }
        first[k]++;
        /* the suffix is the request's own */
        if (i)
            assert_true(t.hashes[t.reqs[i].first + 17 * 32] != t.hashes[t.reqs[i - 1].first + 17 * 32]);
    }
    assert_true(n_heads >= 4);
    int mx = 0;
    for (int k = 0; k < n_heads; k++)
        mx = first[k] > mx ? first[k] : mx;
    assert_true(mx > 500 / 4); /* s = 1.2 over 8: the top prefix carries about 40% */
    kvf_router_trace_fini(&t);
    c.zipf_s = -1;
    assert_int_equal(kvf_router_synth_zipf(&c, &a, &na, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "zipf s -1"));
}

/* Bounded load (issue 22): on the skewed trace the kv policy without the bound piles the hot
 * prefix on its holder (the busiest worker computes > 1.2x the mean); with it, every worker stays
 * within 1.2x and the hit rate within 0.95x of the shared-cache reference. */
static void test_bounded_load_on_zipf(void **state)
{
    (void)state;
    kvf_router_synth_cfg sc;
    kvf_router_synth_cfg_default(&sc);
    char *text;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_router_synth_zipf(&sc, &text, &len, &err), KVF_OK);
    kvf_router_trace t;
    assert_int_equal(kvf_router_trace_parse("zipf", text, len, "mooncake", 16, 512, 0, &t, &err), KVF_OK);
    free(text);
    kvf_router_sim_cfg c;
    kvf_router_sim_cfg_default(&c);
    c.fleet_lru = true;
    kvf_router_sim_result fl = run_cfg(&t, &c);
    c.fleet_lru = false;
    c.pool.load_bound = 0;
    kvf_router_sim_result off = run_cfg(&t, &c);
    kvf_router_sim_cfg_default(&c);
    kvf_router_sim_result on = run_cfg(&t, &c);
    assert_true(off.load_max_over_mean > 1.2);
    assert_true(on.load_max_over_mean <= 1.2);
    assert_true(on.hit_rate_blocks >= 0.95 * fl.hit_rate_blocks);
    kvf_router_trace_fini(&t);
}

/* The same bound on both Mooncake traces (slices, a few seconds each). */
static void test_bounded_load_on_mooncake(void **state)
{
    (void)state;
    const char *names[2] = {"data/mooncake/conversation_trace.jsonl", "data/mooncake/synthetic_trace.jsonl"};
    for (int k = 0; k < 2; k++) {
        kvf_router_trace t;
        kvf_err err = {0};
        assert_int_equal(kvf_router_trace_load(kvf_test_shared_path(names[k]), "mooncake", 16, 512,
                                               4000, &t, &err), KVF_OK);
        kvf_router_sim_cfg c;
        kvf_router_sim_cfg_default(&c);
        c.fleet_lru = true;
        kvf_router_sim_result fl = run_cfg(&t, &c);
        c.fleet_lru = false;
        kvf_router_sim_result kv = run_cfg(&t, &c);
        print_message("%s: kv hit %.4f (%.3f x fleet-lru), load max/mean %.3f\n", names[k],
                      kv.hit_rate_blocks, kv.hit_rate_blocks / fl.hit_rate_blocks,
                      kv.load_max_over_mean);
        assert_true(kv.load_max_over_mean <= 1.2);
        assert_true(kv.hit_rate_blocks >= 0.95 * fl.hit_rate_blocks);
        kvf_router_trace_fini(&t);
    }
}

/* Tier mechanics on a handmade trace: one worker, one 16-token block per trace block, a pool of
 * 2 blocks, host 2, disk 2, requests far apart (each finished before the next):
 *   t=0 [1,2]  t=10 [3,4]: 2, 1 demoted to host   t=20 [5,6]: 4, 3 to host, 2, 1 on to disk
 *   t=30 [1,2]: two disk hits (promoted)           t=40 [5,6]: two host hits
 *   t=50 [7,8], t=60 [9,10]: the disk tier is full and drops its oldest
 * A promotion costs 1 s a block from host and 2 s from disk (16 bytes a block at 16 and 8 B/s). */
static void test_sim_tiers_on_handmade_trace(void **state)
{
    (void)state;
    const char *text =
        "{\"timestamp\": 0, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
        "{\"timestamp\": 10000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [3, 4]}\n"
        "{\"timestamp\": 20000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [5, 6]}\n"
        "{\"timestamp\": 30000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
        "{\"timestamp\": 40000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [5, 6]}\n"
        "{\"timestamp\": 50000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [7, 8]}\n"
        "{\"timestamp\": 60000, \"input_length\": 32, \"output_length\": 1, \"hash_ids\": [9, 10]}\n";
    kvf_router_trace t;
    kvf_err err = {0};
    assert_int_equal(kvf_router_trace_parse("tiers", text, strlen(text), "mooncake", 16, 16, 0, &t, &err), KVF_OK);
    kvf_router_sim_cfg c;
    kvf_router_sim_cfg_default(&c);
    c.n_workers = 1;
    c.capacity_blocks = 2;
    c.host_capacity_blocks = 2;
    c.disk_capacity_blocks = 2;
    c.kv_bytes_per_token = 1;
    c.host_bytes_per_s = 16;
    c.disk_bytes_per_s = 8;
    kvf_router_sim_result r = run_cfg(&t, &c);
    assert_int_equal(r.blocks, 14);
    assert_int_equal(r.blocks_hit_tier[0], 0);
    assert_int_equal(r.blocks_hit_tier[1], 2); /* [5,6] came back from host */
    assert_int_equal(r.blocks_hit_tier[2], 2); /* [1,2] came back from disk, below host */
    assert_int_equal(r.blocks_hit, 4);
    assert_int_equal(r.promoted_blocks, 4);
    assert_true(r.hit_rate_tier[1] == 2.0 / 14);
    /* capacity respected: the pool, host and disk hold 2 each, the rest was dropped */
    assert_int_equal(r.index.n_pairs, 6);
    assert_int_equal(r.dropped_blocks, 10 - 6);
    /* TTFT: five prefills of 32 tokens; [1,2] waits 2 x 2 s for disk, [5,6] 2 x 1 s for host */
    double cold = c.prefill_a_s + c.prefill_b_s * 32, warm = c.prefill_a_s;
    double want = (5 * cold + (warm + 4) + (warm + 2)) / 7;
    assert_true(fabs(r.ttft_mean_s - want) < 1e-9);
    /* without tiers nothing comes back */
    c.host_capacity_blocks = c.disk_capacity_blocks = 0;
    r = run_cfg(&t, &c);
    assert_int_equal(r.blocks_hit, 0);
    assert_int_equal(r.index.n_pairs, 2);
    /* a disk tier alone sits right under the pool */
    c.disk_capacity_blocks = 4;
    r = run_cfg(&t, &c);
    assert_int_equal(r.blocks_hit_tier[2], 4);
    /* bad sizes are refused by name */
    c.host_capacity_blocks = -1;
    assert_int_equal(kvf_router_sim_run(&t, &c, &r, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--host-capacity-blocks"));
    kvf_router_trace_fini(&t);
}

int main(void)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_expansion_keeps_prefixes),
        cmocka_unit_test(test_trace_bad_lines_refused),
        cmocka_unit_test(test_trace_parse_from_memory),
        cmocka_unit_test(test_lru_order_pins_and_ttl),
        cmocka_unit_test(test_sim_on_conversation_slice),
        cmocka_unit_test(test_synth_zipf_trace),
        cmocka_unit_test(test_bounded_load_on_zipf),
        cmocka_unit_test(test_bounded_load_on_mooncake),
        cmocka_unit_test(test_sim_tiers_on_handmade_trace),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
