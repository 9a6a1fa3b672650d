/* host_graph_cache.c: the CUDA backend's graph policy (cuda/graph_cache.c) on the host: only
 * decode-only steps are recorded, a key is captured the second time in a row it is seen and
 * replayed afterwards, a disabled cache never records, the cache keeps at most
 * KVF_CUDA_MAX_GRAPHS graphs and drops the least recently used, clear drops them all. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "cuda/graph_cache.h"

static kvf_backend_step_key key(int32_t n, int32_t bucket, bool decode)
{
    kvf_backend_step_key k;
    memset(&k, 0, sizeof k);
    k.n_tokens = n;
    k.n_seqs = decode ? n : 1;
    k.ctx_bucket = bucket;
    k.decode_only = decode;
    k.kv_pool = (const void *)0x1000;
    return k;
}

static int dropped;
static void drop(void *exec)
{
    (void)exec;
    dropped++;
}

static void test_capture_then_replay(void **state)
{
    kvf_cuda_graph_cache g;
    memset(&g, 0, sizeof g);
    int32_t slot;
    kvf_backend_step_key p = key(40, 64, false), d = key(4, 64, true), d2 = key(4, 128, true);
    assert_int_equal(kvf_cuda_graph_plan(&g, &p, true, &slot), KVF_CUDA_STEP_EAGER);
    assert_int_equal(kvf_cuda_graph_plan(&g, &p, true, &slot), KVF_CUDA_STEP_EAGER); /* prefill: never */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, true, &slot), KVF_CUDA_STEP_EAGER); /* first sight */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, true, &slot), KVF_CUDA_STEP_CAPTURE);
    assert_null(kvf_cuda_graph_store(&g, &d, (void *)0x10, &slot));
    assert_int_equal(g.n, 1);
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, true, &slot), KVF_CUDA_STEP_REPLAY);
    assert_ptr_equal(g.exec[slot], (void *)0x10);
    /* another key between two sightings: still replayed (it is stored) */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d2, true, &slot), KVF_CUDA_STEP_EAGER);
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, true, &slot), KVF_CUDA_STEP_REPLAY);
    /* d2 was not seen twice in a row: not captured */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d2, true, &slot), KVF_CUDA_STEP_EAGER);
    /* a different pool is a different key */
    kvf_backend_step_key other = d;
    other.kv_pool = (const void *)0x2000;
    assert_int_equal(kvf_cuda_graph_plan(&g, &other, true, &slot), KVF_CUDA_STEP_EAGER);
    /* disabled: eager even for a stored key */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, false, &slot), KVF_CUDA_STEP_EAGER);
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, false, &slot), KVF_CUDA_STEP_EAGER);
    dropped = 0;
    kvf_cuda_graph_clear(&g, drop);
    assert_int_equal(dropped, 1);
    assert_int_equal(g.n, 0);
    /* after a clear the previous key is forgotten: first sight again */
    assert_int_equal(kvf_cuda_graph_plan(&g, &d, true, &slot), KVF_CUDA_STEP_EAGER);
}

static void test_lru_bound(void **state)
{
    kvf_cuda_graph_cache g;
    memset(&g, 0, sizeof g);
    int32_t slot;
    for (int32_t i = 0; i < KVF_CUDA_MAX_GRAPHS; i++) {
        kvf_backend_step_key k = key(i + 1, 64, true);
        assert_null(kvf_cuda_graph_store(&g, &k, (void *)(uintptr_t)(0x100 + i), &slot));
    }
    assert_int_equal(g.n, KVF_CUDA_MAX_GRAPHS);
    /* touch every key but n=1 (stored first) and n=2: n=1 is touched last of those two */
    for (int32_t i = 2; i < KVF_CUDA_MAX_GRAPHS; i++) {
        kvf_backend_step_key k = key(i + 1, 64, true);
        assert_int_equal(kvf_cuda_graph_plan(&g, &k, true, &slot), KVF_CUDA_STEP_REPLAY);
    }
    kvf_backend_step_key k1 = key(1, 64, true);
    assert_int_equal(kvf_cuda_graph_plan(&g, &k1, true, &slot), KVF_CUDA_STEP_REPLAY);
    /* a new graph evicts n=2, the least recently used */
    kvf_backend_step_key kn = key(99, 64, true);
    void *old = kvf_cuda_graph_store(&g, &kn, (void *)0x999, &slot);
    assert_ptr_equal(old, (void *)0x101);
    assert_int_equal(g.n, KVF_CUDA_MAX_GRAPHS);
    kvf_backend_step_key k2 = key(2, 64, true);
    assert_int_equal(kvf_cuda_graph_plan(&g, &k2, true, &slot), KVF_CUDA_STEP_EAGER);
    assert_int_equal(kvf_cuda_graph_plan(&g, &kn, true, &slot), KVF_CUDA_STEP_REPLAY);
    dropped = 0;
    kvf_cuda_graph_clear(&g, drop);
    assert_int_equal(dropped, KVF_CUDA_MAX_GRAPHS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_capture_then_replay),
        cmocka_unit_test(test_lru_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
