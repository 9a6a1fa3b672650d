/* attn.cu: paged attention kernels over the block-major KV pool and their launcher
 * (cuda/attn.h). One CTA serves (token, KV head, up to 8 of its query heads, one context
 * partition of 64-256 positions); a prefill chunk's tokens are served in tiles of up to 16
 * (token, query head) rows (64 on the tensor cores) that share each K/V row they load; a reduce
 * kernel merges the partitions. The host checks and a plain-C reference of the algorithm are in
 * attn_ref.c. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

extern "C" {
#include "cuda/attn.h"
#include "cuda/attn_ref.h"
#include "cuda/cuda.h"
}

/* Algorithm (for every token t, query head h of KV head kvh, visible range [lo, pos]):
 *  1. partition kernel, grid (n_tokens, n_kv_heads * head chunks, parts): the CTA of partition
 *     p takes positions [max(p*len, lo), min((p+1)*len, pos+1)) (len: attn_ref.h's part_len,
 *     64..256 from n_tokens, n_heads and max_ctx); it exits at once when that is empty, so
 *     the grid depends only on (n_tokens, n_heads, max_ctx). It loads each K row
 *     once for all its query heads (GQA), scores them against q * scale * k_scale * log2(e)
 *     into shared memory, takes the partition's max m and sum l of 2^(s - m), then loads each
 *     V row once and accumulates; the output is divided by l and multiplied by v_scale.
 *  2. reduce kernel (only when parts > 1): out = sum_p w_p o_p / sum_p w_p,
 *     w_p = l_p * 2^(m_p - max m); a block of 256 threads per (token, head) takes all the
 *     partitions at once (attn_reduce_kernel).
 * Threads: 128 per CTA; a row of head_dim elements is read by HD_PAD/8 adjacent threads, 8
 * elements each (16 bytes for f16/bf16, 2 x 16 for f32, 8 for fp8), 4 rows in flight per
 * thread. HD_PAD is head_dim rounded up to a power of two (48 -> 64, 80 and 96 -> 128) so the
 * shuffle trees stay power-of-two; the threads whose 8 columns lie at or past head_dim ("pad
 * lanes") load nothing, hold zeros and store nothing (48 idles 2 of 8 lanes per row, 80 idles
 * 6 of 16, 96 idles 4 of 16). For the powers of two 16..256 HD_PAD == HD and the pad tests
 * fold away at compile time.
 * A step with prefill chunks (0 < n_seqs < n_tokens) runs the tile kernel instead for the
 * chunks' tokens, on its own split (kvf_cuda_attention_tile_part_len: partitions of 256
 * positions or more, only as many as the GPU needs to be busy, so a long prefill writes little
 * or no workspace); its decode tokens (alone in their sequence) stay on the partition kernel,
 * one CTA row and one workspace row per sequence (attn_plan):
 *  3. tile kernel, grid (n_tokens, n_kv_heads * head chunks, parts): a tile is up to
 *     QT = 16 / GC consecutive tokens of one sequence at consecutive positions, aligned so that
 *     a position that is a multiple of QT starts one; the CTA
 *     of a tile's first token serves its QT x GC (token, query head) rows, every other CTA of
 *     the tile returns. For each pass of KT positions of its partition (the union of the rows'
 *     visible ranges) it loads K into shared memory once for all 16 rows, scores them (causal
 *     and window masks per row), updates each row's running max and sum (online softmax, base
 *     2), loads V over K and accumulates; at the end it writes what the partition kernel writes
 *     for each row whose own range meets the partition (output / sum * v_scale, and m, l when
 *     split), so the reduce and the workspace layout are shared. Each K/V row is read once per
 *     tile instead of once per token. With f16/bf16 KV at head_dim 64 or 128 the mma tile kernel
 *     does the same on the tensor cores, 64 rows per CTA (attn_mma_kernel, below).
 * With decode_kernel MMA (f16, bf16 or fp8 KV at head_dim 64 or 128), attn_dec_kernel takes the
 * partition kernel's place in step 1: same grid, split and outputs, on the tensor cores. */

namespace {

constexpr int ATTN_PART_MAX = KVF_CUDA_ATTN_PART_MAX;
constexpr int ATTN_GMAX = KVF_CUDA_ATTN_HEADS_PER_CTA;
constexpr int ATTN_NT = 128; /* threads per CTA */
constexpr int ATTN_NW = ATTN_NT / 32;
constexpr int ATTN_EPT = 8;    /* row elements per thread */
constexpr int ATTN_UNROLL = 4; /* rows in flight per thread */
constexpr unsigned ATTN_FULL = 0xffffffffu;

/* head_dim rounded up to the power of two its thread group covers (16..256) */
constexpr int attn_hd_pad(int hd)
{
    return hd <= 16 ? 16 : hd <= 32 ? 32 : hd <= 64 ? 64 : hd <= 128 ? 128 : 256;
}

/* Everything a kernel needs, by value. Pointers are device memory. */
struct attn_args {
    const float *q;
    float *out;
    const uint8_t *pool;
    const int32_t *tok_seq, *tok_pos, *block_tables;
    float *ws_o, *ws_m, *ws_l; /* attn_ref.h's workspace layout; NULL when parts == 1 */
    int64_t block_bytes, slab_bytes, layer_off;
    int32_t n_tokens, n_heads, n_kv_heads, group, chunks, max_blocks, max_ctx, parts, window;
    int32_t log2_bs, part_len;
    int32_t gc;    /* query heads per CTA: ng <= gc of them real (1, 2, 4 or 8) */
    float q_mul, v_mul;
    /* a step with prefill chunks (attn_ref.h): 0 this launch serves every token; 1 the tokens
     * alone in their sequence (the partition kernel and its reduce: blockIdx.x is a sequence,
     * and so is the workspace row); 2 every other token (a tile kernel and its reduce) */
    int32_t lone;
    int32_t n_seqs;
    int32_t *seq_count, *seq_tok; /* per sequence: its tokens in the step, and one of them */
};

/* Whether token t is alone in its sequence in a step with prefill chunks (a decode token). */
__device__ __forceinline__ bool attn_alone(const attn_args &a, int t)
{
    const int s = a.tok_seq[t];
    return s >= 0 && s < a.n_seqs && a.seq_count[s] == 1;
}

/* The token a CTA or reduce block of blockIdx.x serves, or -1: blockIdx.x itself, or with
 * lone 1 the token of sequence blockIdx.x when that is its only one; with lone 2 a token alone
 * in its sequence is left to the lone launch. */
__device__ __forceinline__ int attn_token(const attn_args &a)
{
    const int x = blockIdx.x;
    if (a.lone == 1)
        return a.seq_count[x] == 1 ? a.seq_tok[x] : -1;
    if (a.lone == 2 && attn_alone(a, x))
        return -1;
    return x;
}

/* Loading 8 elements of a row (one thread's share) and turning them into floats. */
template <kvf_dtype DT> struct attn_io;

template <> struct attn_io<KVF_DTYPE_F32> {
    struct raw {
        float4 a, b;
    };
    static constexpr int ES = 4;
    static __device__ __forceinline__ raw load(const uint8_t *p)
    {
        raw r;
        r.a = __ldg(reinterpret_cast<const float4 *>(p));
        r.b = __ldg(reinterpret_cast<const float4 *>(p + 16));
        return r;
    }
    static __device__ __forceinline__ void cvt(const raw &r, float (&f)[ATTN_EPT])
    {
        f[0] = r.a.x, f[1] = r.a.y, f[2] = r.a.z, f[3] = r.a.w;
        f[4] = r.b.x, f[5] = r.b.y, f[6] = r.b.z, f[7] = r.b.w;
    }
};

template <> struct attn_io<KVF_DTYPE_F16> {
    typedef uint4 raw;
    static constexpr int ES = 2;
    static __device__ __forceinline__ raw load(const uint8_t *p)
    {
        return __ldg(reinterpret_cast<const uint4 *>(p));
    }
    static __device__ __forceinline__ float2 pair(unsigned w)
    {
        __half2_raw hr;
        hr.x = (unsigned short)(w & 0xffffu);
        hr.y = (unsigned short)(w >> 16);
        return __half22float2(__half2(hr));
    }
    static __device__ __forceinline__ void cvt(const raw &r, float (&f)[ATTN_EPT])
    {
        float2 a = pair(r.x), b = pair(r.y), c = pair(r.z), d = pair(r.w);
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
        f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
    }
};

template <> struct attn_io<KVF_DTYPE_BF16> {
    typedef uint4 raw;
    static constexpr int ES = 2;
    static __device__ __forceinline__ raw load(const uint8_t *p)
    {
        return __ldg(reinterpret_cast<const uint4 *>(p));
    }
    /* exact: a bf16 is the top half of an f32 */
    static __device__ __forceinline__ void cvt(const raw &r, float (&f)[ATTN_EPT])
    {
        f[0] = __uint_as_float(r.x << 16), f[1] = __uint_as_float(r.x & 0xffff0000u);
        f[2] = __uint_as_float(r.y << 16), f[3] = __uint_as_float(r.y & 0xffff0000u);
        f[4] = __uint_as_float(r.z << 16), f[5] = __uint_as_float(r.z & 0xffff0000u);
        f[6] = __uint_as_float(r.w << 16), f[7] = __uint_as_float(r.w & 0xffff0000u);
    }
};

template <> struct attn_io<KVF_DTYPE_FP8_E4M3> {
    typedef uint2 raw;
    static constexpr int ES = 1;
    static __device__ __forceinline__ raw load(const uint8_t *p)
    {
        return __ldg(reinterpret_cast<const uint2 *>(p));
    }
    /* exact: every e4m3 value is a half; the low byte is the first element */
    static __device__ __forceinline__ float2 pair(unsigned w)
    {
        __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
        return __half22float2(__half2(hr));
    }
    static __device__ __forceinline__ void cvt(const raw &r, float (&f)[ATTN_EPT])
    {
        float2 a = pair(r.x), b = pair(r.x >> 16), c = pair(r.y), d = pair(r.y >> 16);
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
        f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
    }
};

/* The visible range of a token: [lo, pos]. */
__device__ __forceinline__ int attn_lo(int pos, int window)
{
    return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

/* Starts the loads of this thread's share of rows first, first + NG, ... (ATTN_UNROLL of them,
 * partition-relative) at byte offset off inside each position's block; rows at or past n, and
 * every row of a pad lane (live false: its columns are past head_dim), read nothing and
 * convert to zeros. */
template <kvf_dtype DT, int NG, int ROW>
__device__ __forceinline__ void attn_load_rows(const attn_args &a, const int32_t *blk_s, int p0,
                                               int b0, int n, int first, int64_t off, bool live,
                                               typename attn_io<DT>::raw (&raw)[ATTN_UNROLL])
{
    const int bs = 1 << a.log2_bs;
#pragma unroll
    for (int u = 0; u < ATTN_UNROLL; u++) {
        const int i = first + u * NG;
        raw[u] = typename attn_io<DT>::raw();
        if (live && i < n) {
            const int p = p0 + i;
            const int64_t blk = blk_s[(p >> a.log2_bs) - b0];
            raw[u] = attn_io<DT>::load(a.pool + blk * a.block_bytes + off +
                                       (int64_t)(p & (bs - 1)) * ROW);
        }
    }
}

/* A partition kernel's CTA (token blockIdx.x, or with lone 1 the token of sequence
 * blockIdx.x; KV head and head chunk blockIdx.y; partition blockIdx.z): see attn_part_begin. */
struct attn_part {
    int kvh, ng;     /* KV head, and the chunk's real query heads (<= gc) */
    int p0, n;       /* the partition's visible positions: p0 .. p0 + n - 1 */
    int b0;          /* the block of position p0 (blk_s[i] is block b0 + i) */
    int nb;          /* blocks the partition touches: b0 .. b0 + nb - 1 */
    const int32_t *bt; /* the token's sequence's block table */
    int64_t th0, w0; /* (token, first head of the chunk) as a row of q and out; as a workspace
                      * row (by token, or by sequence with lone 1: blockIdx.x either way) */
};

/* A partition's block ids per thread: nb <= ATTN_PART_MAX + 1 over the CTA's threads. */
constexpr int ATTN_BT_REGS = (ATTN_PART_MAX + 1 + ATTN_NT - 1) / ATTN_NT;

/* Issues the loads of the partition's block ids into registers, so a kernel can issue its query
 * loads before they arrive (both wait out one memory latency together, not one after the other);
 * attn_part_blocks_store then puts them in blk_s (the caller syncs before reading it). */
__device__ __forceinline__ void attn_part_blocks_load(const attn_part &w,
                                                      int32_t (&bv)[ATTN_BT_REGS])
{
#pragma unroll
    for (int k = 0; k < ATTN_BT_REGS; k++) {
        const int i = threadIdx.x + k * ATTN_NT;
        bv[k] = i < w.nb ? w.bt[w.b0 + i] : 0;
    }
}

__device__ __forceinline__ void attn_part_blocks_store(const attn_part &w,
                                                       const int32_t (&bv)[ATTN_BT_REGS],
                                                       int32_t *blk_s)
{
#pragma unroll
    for (int k = 0; k < ATTN_BT_REGS; k++) {
        const int i = threadIdx.x + k * ATTN_NT;
        if (i < w.nb)
            blk_s[i] = bv[k];
    }
}

/* The start of a partition kernel's CTA of gc heads and head_dim hd: false when it has nothing
 * to do (another launch serves the token, the token is outside [0, max_ctx), or it sees nothing
 * of the partition; the reduce skips such partitions). An unsplit call's token outside
 * [0, max_ctx) gets its zeros here (the reduce writes them when split). The partition's
 * block ids are the caller's to load (attn_part_blocks_load). */
__device__ __forceinline__ bool attn_part_begin(const attn_args &a, int gc, int hd, attn_part &w)
{
    const int t = attn_token(a), part = blockIdx.z, tid = threadIdx.x;
    if (t < 0)
        return false; /* another launch of this step serves it */
    w.kvh = blockIdx.y / a.chunks;
    const int g0 = (blockIdx.y % a.chunks) * ATTN_GMAX;
    w.ng = min(gc, a.group - g0);
    w.th0 = (int64_t)t * a.n_heads + (int64_t)w.kvh * a.group + g0;
    w.w0 = (int64_t)blockIdx.x * a.n_heads + (int64_t)w.kvh * a.group + g0;
    const int pos = a.tok_pos[t];
    const int seq = a.tok_seq[t]; /* loaded beside pos (token t's entry exists either way) */
    if (pos < 0 || pos >= a.max_ctx) { /* outside the contract: zeros, never a wild read */
        if (a.parts == 1)
            for (int i = tid; i < w.ng * hd; i += ATTN_NT)
                a.out[w.th0 * hd + i] = 0.0f;
        return false;
    }
    const int lo = attn_lo(pos, a.window);
    w.p0 = max(part * a.part_len, lo);
    const int p1 = min((part + 1) * a.part_len, pos + 1);
    if (w.p0 >= p1)
        return false; /* nothing visible here */
    w.n = p1 - w.p0;
    w.b0 = w.p0 >> a.log2_bs;
    w.nb = ((p1 - 1) >> a.log2_bs) - w.b0 + 1;
    w.bt = a.block_tables + (int64_t)seq * a.max_blocks;
    return true;
}

/* One CTA: token blockIdx.x, KV head and head chunk blockIdx.y, partition blockIdx.z; GC query
 * heads' worth of registers (the chunk's ng <= GC heads are real). */
template <int HD, kvf_dtype DT, int GC>
__global__ void __launch_bounds__(ATTN_NT) attn_part_kernel(const attn_args a)
{
    typedef attn_io<DT> io;
    constexpr int HD_PAD = attn_hd_pad(HD);
    constexpr int TG = HD_PAD / ATTN_EPT; /* threads per row: 2..32, a power of two */
    constexpr int NG = ATTN_NT / TG;      /* rows per pass */
    constexpr int ROW = HD * io::ES;      /* bytes per row */
    static_assert(TG >= 2 && TG <= 32 && (TG & (TG - 1)) == 0, "head_dim must be 16..256");
    static_assert(HD % ATTN_EPT == 0 && HD <= HD_PAD && 2 * HD > HD_PAD,
                  "head_dim must be a multiple of 8 above half its padded size");
    static_assert(GC * HD <= GC * ATTN_PART_MAX, "the cross-warp sums reuse the score buffer");
    static_assert((GC * HD + GC * ATTN_PART_MAX + ATTN_PART_MAX + 1 + 2 * GC) * 4 <= 48 * 1024,
                  "static shared memory is capped at 48 KiB");
    __shared__ __align__(16) float q_s[GC * HD];
    __shared__ float s_s[GC * ATTN_PART_MAX]; /* scores, then weights, then cross-warp sums */
    __shared__ int32_t blk_s[ATTN_PART_MAX + 1];
    __shared__ float m_s[GC], l_s[GC];

    attn_part c;
    if (!attn_part_begin(a, GC, HD, c))
        return;
    const int part = blockIdx.z, tid = threadIdx.x, ng = c.ng, n = c.n, p0 = c.p0, b0 = c.b0;
    const int64_t th0 = c.th0, w0 = c.w0;
    const int bs = 1 << a.log2_bs, kvh = c.kvh;
    int32_t bv[ATTN_BT_REGS];
    attn_part_blocks_load(c, bv); /* in flight while the query loads below are */
    for (int i = tid; i < GC * HD; i += ATTN_NT)
        q_s[i] = i / HD < ng ? a.q[th0 * HD + i] * a.q_mul : 0.0f;
    attn_part_blocks_store(c, bv, blk_s);
    __syncthreads();

    const int grp = tid / TG, r = tid % TG, warp = tid / 32, lane = tid % 32;
    /* false only for pad lanes (columns r*8.. at or past head_dim); constant true if HD_PAD == HD */
    const bool live = HD == HD_PAD || r * ATTN_EPT < HD;
    const int64_t row_off = a.layer_off + (int64_t)kvh * bs * ROW + r * ATTN_EPT * io::ES;

    /* 1. scores: s[g][i] = q[g] . k[p0 + i] (base-2 logits) */
    {
        float qr[GC][ATTN_EPT];
#pragma unroll
        for (int g = 0; g < GC; g++) {
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f), y = x; /* a pad lane's q is 0 */
            if (live) {
                const float4 *q4 = reinterpret_cast<const float4 *>(q_s + g * HD + r * ATTN_EPT);
                x = q4[0], y = q4[1];
            }
            qr[g][0] = x.x, qr[g][1] = x.y, qr[g][2] = x.z, qr[g][3] = x.w;
            qr[g][4] = y.x, qr[g][5] = y.y, qr[g][6] = y.z, qr[g][7] = y.w;
        }
        for (int base = 0; base < n; base += NG * ATTN_UNROLL) { /* same trip count everywhere */
            typename io::raw raw[ATTN_UNROLL];
            attn_load_rows<DT, NG, ROW>(a, blk_s, p0, b0, n, base + grp, row_off, live, raw);
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) {
                const int i = base + u * NG + grp;
                float kf[ATTN_EPT];
                io::cvt(raw[u], kf);
                float dot[GC];
#pragma unroll
                for (int g = 0; g < GC; g++) {
                    float d = 0.0f;
#pragma unroll
                    for (int e = 0; e < ATTN_EPT; e++)
                        d = fmaf(qr[g][e], kf[e], d);
                    dot[g] = d;
                }
#pragma unroll
                for (int g = 0; g < GC; g++)
#pragma unroll
                    for (int o = TG / 2; o > 0; o >>= 1)
                        dot[g] += __shfl_xor_sync(ATTN_FULL, dot[g], o);
                if (r == 0 && i < n)
#pragma unroll
                    for (int g = 0; g < GC; g++)
                        if (g < ng)
                            s_s[g * ATTN_PART_MAX + i] = dot[g];
            }
        }
    }
    __syncthreads();

    /* 2. per head: m = max s, w = 2^(s - m) in place, l = sum w */
    for (int g = warp; g < ng; g += ATTN_NW) {
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32)
            m = fmaxf(m, s_s[g * ATTN_PART_MAX + i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(ATTN_FULL, m, o));
        float l = 0.0f;
        for (int i = lane; i < n; i += 32) {
            float w = exp2f(s_s[g * ATTN_PART_MAX + i] - m);
            s_s[g * ATTN_PART_MAX + i] = w;
            l += w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            l += __shfl_xor_sync(ATTN_FULL, l, o);
        if (lane == 0)
            m_s[g] = m, l_s[g] = l;
    }
    __syncthreads();

    /* 3. acc[g] = sum_i w[g][i] * v[p0 + i] over this thread's 8 columns */
    float acc[GC][ATTN_EPT];
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
        for (int e = 0; e < ATTN_EPT; e++)
            acc[g][e] = 0.0f;
    {
        const int64_t v_off = row_off + a.slab_bytes;
        for (int base = 0; base < n; base += NG * ATTN_UNROLL) {
            typename io::raw raw[ATTN_UNROLL];
            attn_load_rows<DT, NG, ROW>(a, blk_s, p0, b0, n, base + grp, v_off, live, raw);
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) {
                const int i = base + u * NG + grp;
                if (i >= n)
                    continue;
                float vf[ATTN_EPT];
                io::cvt(raw[u], vf);
#pragma unroll
                for (int g = 0; g < GC; g++) {
                    const float w = g < ng ? s_s[g * ATTN_PART_MAX + i] : 0.0f;
#pragma unroll
                    for (int e = 0; e < ATTN_EPT; e++)
                        acc[g][e] = fmaf(w, vf[e], acc[g][e]);
                }
            }
        }
    }
    /* the row groups of a warp hold the same columns: sum them into lanes 0..TG-1 */
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
        for (int e = 0; e < ATTN_EPT; e++)
#pragma unroll
            for (int o = TG; o < 32; o <<= 1)
                acc[g][e] += __shfl_xor_sync(ATTN_FULL, acc[g][e], o);
    __syncthreads(); /* everyone is done reading the weights: s_s becomes the sums */
    float *red = s_s;
    for (int w = 0; w < ATTN_NW; w++) { /* warps add in order: a fixed summation order */
        if (warp == w && lane < TG && live) /* lane < TG: r == lane; pad lanes store nothing */
#pragma unroll
            for (int g = 0; g < GC; g++)
#pragma unroll
                for (int e = 0; e < ATTN_EPT; e++) {
                    const int j = g * HD + lane * ATTN_EPT + e;
                    red[j] = (w == 0 ? 0.0f : red[j]) + acc[g][e];
                }
        __syncthreads();
    }

    /* 4. the partition's output (normalised by its own sum), its max and sum */
    for (int i = tid; i < ng * HD; i += ATTN_NT) {
        const int g = i / HD;
        const float o = red[i] * (a.v_mul / l_s[g]);
        if (a.parts == 1)
            a.out[th0 * HD + i] = o;
        else
            a.ws_o[((w0 + g) * a.parts + part) * HD + i % HD] = o;
    }
    if (a.parts > 1 && tid < ng) {
        a.ws_m[(w0 + tid) * a.parts + part] = m_s[tid];
        a.ws_l[(w0 + tid) * a.parts + part] = l_s[tid];
    }
}

constexpr int ATTN_TILE_ROWS = KVF_CUDA_ATTN_TILE_ROWS; /* (token, query head) rows of a tile */

/* K/V positions per pass of the tile kernel: about 4096 floats of shared memory */
constexpr int attn_tile_kt(int hd)
{
    return hd <= 64 ? 64 : hd <= 128 ? 32 : 16;
}

/* Loads positions k0 .. k0 + kn - 1 of the sequence whose block table is bt, of one K or V
 * slab (byte offset off in each block: layer, part, KV head), into rows of kv_s as floats (row
 * stride KS); rows kn .. KT - 1 become zeros, so nothing past the range is read. A partition
 * can be long, so block ids are read from the table per row (one int per 16 threads' loads). */
template <int HD, kvf_dtype DT, int KT, int KS>
__device__ __forceinline__ void attn_tile_load(const attn_args &a, const int32_t *bt, int k0,
                                               int kn, int64_t off, float *kv_s)
{
    typedef attn_io<DT> io;
    constexpr int CPR = HD / ATTN_EPT; /* 8-element chunks per row */
    constexpr int ROW = HD * io::ES;
    const int bs = 1 << a.log2_bs;
    for (int c = threadIdx.x; c < KT * CPR; c += ATTN_NT) {
        const int row = c / CPR, ch = c % CPR;
        float f[ATTN_EPT];
        if (row < kn) {
            const int p = k0 + row;
            const int64_t blk = __ldg(bt + (p >> a.log2_bs));
            io::cvt(io::load(a.pool + blk * a.block_bytes + off + (int64_t)(p & (bs - 1)) * ROW +
                             ch * ATTN_EPT * io::ES),
                    f);
        } else {
#pragma unroll
            for (int e = 0; e < ATTN_EPT; e++)
                f[e] = 0.0f;
        }
        float4 *dst = reinterpret_cast<float4 *>(kv_s + row * KS + ch * ATTN_EPT);
        dst[0] = make_float4(f[0], f[1], f[2], f[3]);
        dst[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

/* Output element u of thread tid in the tile kernel: element tid + u * ATTN_NT of the
 * [rows][HD] output, as (row, column); written so that when HD divides the CTA the column is
 * visibly the same for every u. */
template <int HD> __device__ __forceinline__ int attn_tile_row(int tid, int u)
{
    return ATTN_NT % HD == 0 ? tid / HD + u * (ATTN_NT / HD) : (tid + u * ATTN_NT) / HD;
}

template <int HD> __device__ __forceinline__ int attn_tile_col(int tid, int u)
{
    return ATTN_NT % HD == 0 ? tid % HD : (tid + u * ATTN_NT) % HD;
}

/* Whether the visible range of the token at pos meets partition part (the reduce reads the
 * partitions that do, and a kernel writes exactly those). */
__device__ __forceinline__ bool attn_meets(const attn_args &a, int part, int pos)
{
    return max(part * a.part_len, attn_lo(pos, a.window)) < min((part + 1) * a.part_len, pos + 1);
}

/* A tile kernel's CTA: its tile, head chunk and partition (see attn_tile_begin). */
struct attn_tile {
    int pos0, nt;   /* the tile's tokens: t .. t + nt - 1, at positions pos0 .. pos0 + nt - 1 */
    int ia, ib;     /* the run of them inside [0, max_ctx): the others get zeros, left out */
    int kvh, ng;    /* KV head, and the chunk's real query heads (<= gc) */
    int p0, p1;     /* the positions of this partition some row sees */
    int64_t th0;    /* (token t, first head of the chunk) as a row of q and out */
    const int32_t *bt; /* the sequence's block table */
};

/* The start of a tile kernel's CTA (token blockIdx.x, head chunk blockIdx.y, partition
 * blockIdx.z) for tiles of `rows` (token, head) rows: false when it has nothing to do (the token
 * is alone in its sequence and another launch serves it, or is inside a tile an earlier CTA
 * serves, or every token is outside [0, max_ctx), or no row sees the partition; the reduce skips
 * such partitions). When the call is not split it writes the zeros
 * of the tile's tokens outside [0, max_ctx) (the reduce writes them when split). */
template <int HD>
__device__ __forceinline__ bool attn_tile_begin(const attn_args &a, int rows, attn_tile &tl)
{
    const int t = attn_token(a), part = blockIdx.z, tid = threadIdx.x;
    if (t < 0)
        return false; /* a decode token beside chunks: the partition kernel serves it */
    const int qt = rows / a.gc; /* tokens per tile */
    const int seq = a.tok_seq[t], pos0 = a.tok_pos[t];
    if (t > 0 && a.tok_seq[t - 1] == seq && a.tok_pos[t - 1] + 1 == pos0 && (pos0 & (qt - 1)) != 0)
        return false;
    int nt = 1;
    while (nt < qt && t + nt < a.n_tokens && a.tok_seq[t + nt] == seq &&
           a.tok_pos[t + nt] == pos0 + nt && ((pos0 + nt) & (qt - 1)) != 0)
        nt++;
    const int kvh = blockIdx.y / a.chunks, g0 = (blockIdx.y % a.chunks) * ATTN_GMAX;
    const int ng = min(a.gc, a.group - g0);
    const int64_t th0 = (int64_t)t * a.n_heads + (int64_t)kvh * a.group + g0;
    const int ia = (int)max((int64_t)0, -(int64_t)pos0);
    const int ib = (int)min((int64_t)nt - 1, (int64_t)a.max_ctx - 1 - pos0);
    if (a.parts == 1)
        for (int i = tid; i < nt * ng * HD; i += ATTN_NT) {
            const int ti = i / (ng * HD);
            if (ti < ia || ti > ib)
                a.out[(th0 + (int64_t)ti * a.n_heads) * HD + i % (ng * HD)] = 0.0f;
        }
    if (ia > ib)
        return false;
    tl.p0 = max(part * a.part_len, attn_lo(pos0 + ia, a.window));
    tl.p1 = min((part + 1) * a.part_len, pos0 + ib + 1);
    if (tl.p0 >= tl.p1)
        return false;
    tl.pos0 = pos0, tl.nt = nt, tl.ia = ia, tl.ib = ib, tl.kvh = kvh, tl.ng = ng, tl.th0 = th0;
    tl.bt = a.block_tables + (int64_t)seq * a.max_blocks;
    return true;
}

/* One CTA per tile (algorithm step 3): token blockIdx.x when it starts a tile, KV head and head
 * chunk blockIdx.y, partition blockIdx.z. Row r of the tile is (token r / gc, head r % gc). */
template <int HD, kvf_dtype DT>
__global__ void __launch_bounds__(ATTN_NT) attn_tile_kernel(const attn_args a)
{
    constexpr int R = ATTN_TILE_ROWS;
    constexpr int KT = attn_tile_kt(HD);
    /* row stride: float4 reads of 8 consecutive rows (a quarter warp) hit 32 distinct banks
     * (KS % 32 is 4 or 20) */
    constexpr int KS = HD + 4;
    constexpr int SU = R * KT / ATTN_NT; /* scores per thread, all at one position j */
    constexpr int OU = R * HD / ATTN_NT; /* output elements per thread */
    constexpr int TPR = ATTN_NT / R;     /* threads per row in the softmax update */
    static_assert(ATTN_NT % KT == 0 && KT % TPR == 0 && (R * HD) % ATTN_NT == 0 && KT % 4 == 0,
                  "tile shape");
    static_assert((R * HD + KT * KS + R * KT + R) * 4 <= 48 * 1024,
                  "static shared memory is capped at 48 KiB");
    __shared__ __align__(16) float q_s[R * HD];
    __shared__ __align__(16) float kv_s[KT * KS]; /* K, then V, of one pass */
    __shared__ __align__(16) float p_s[R * KT];   /* scores, then weights */
    __shared__ float c_s[R];        /* per row: the factor the pass rescales its output by */

    attn_tile tl;
    if (!attn_tile_begin<HD>(a, R, tl))
        return;
    const int part = blockIdx.z, tid = threadIdx.x, gc = a.gc;
    const int pos0 = tl.pos0, ia = tl.ia, ib = tl.ib, ng = tl.ng, p0 = tl.p0, p1 = tl.p1;
    const int64_t th0 = tl.th0;
    const int32_t *bt = tl.bt;
    for (int i = tid; i < R * HD; i += ATTN_NT) {
        const int r = i / HD, ti = r / gc, g = r % gc;
        q_s[i] = (ti >= ia && ti <= ib && g < ng)
                     ? a.q[(th0 + (int64_t)ti * a.n_heads + g) * HD + i % HD] * a.q_mul
                     : 0.0f;
    }

    /* this thread's scores: rows sr0 + u * (NT / KT), position j of each pass */
    const int j = tid % KT, sr0 = tid / KT;
    /* its softmax row, and that row's running max and sum (the same in all TPR threads) */
    const int mr = tid / TPR, mt = mr / gc;
    float m_run = -INFINITY, l_run = 0.0f;
    float o[OU];
#pragma unroll
    for (int u = 0; u < OU; u++)
        o[u] = 0.0f;
    const int64_t k_off = a.layer_off + (int64_t)tl.kvh * (1 << a.log2_bs) * HD * attn_io<DT>::ES;
    for (int k0 = p0; k0 < p1; k0 += KT) {
        const int kn = min(KT, p1 - k0);
        __syncthreads(); /* the last pass is done with kv_s and p_s (and q_s is in) */
        attn_tile_load<HD, DT, KT, KS>(a, bt, k0, kn, k_off, kv_s);
        __syncthreads();
        /* 1. scores, masked per row: position k0 + j is visible to token ti when
         * lo(pos) <= k0 + j <= pos */
        {
            float acc[SU];
#pragma unroll
            for (int u = 0; u < SU; u++)
                acc[u] = 0.0f;
            /* four columns per shared-memory read: the query rows are warp-uniform (a
             * broadcast), the K rows 32 distinct ones */
#pragma unroll 4
            for (int d = 0; d < HD; d += 4) {
                const float4 k = *reinterpret_cast<const float4 *>(kv_s + j * KS + d);
#pragma unroll
                for (int u = 0; u < SU; u++) {
                    const float *qrow = q_s + (sr0 + u * (ATTN_NT / KT)) * HD;
                    const float4 q = *reinterpret_cast<const float4 *>(qrow + d);
                    acc[u] = fmaf(q.w, k.w, fmaf(q.z, k.z, fmaf(q.y, k.y, fmaf(q.x, k.x, acc[u]))));
                }
            }
#pragma unroll
            for (int u = 0; u < SU; u++) {
                const int r = sr0 + u * (ATTN_NT / KT), ti = r / gc, pos = pos0 + ti;
                const int kp = k0 + j;
                const bool vis = j < kn && ti >= ia && ti <= ib && r % gc < ng && kp <= pos &&
                                 kp >= attn_lo(pos, a.window);
                p_s[r * KT + j] = vis ? acc[u] : -INFINITY;
            }
        }
        __syncthreads();
        /* 2. per row: new max, weights 2^(s - m) in place, sum; c_s = 2^(old m - new m) */
        {
            const int sub = tid % TPR;
            float mx = -INFINITY;
            for (int jj = sub; jj < KT; jj += TPR)
                mx = fmaxf(mx, p_s[mr * KT + jj]);
#pragma unroll
            for (int off = TPR / 2; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(ATTN_FULL, mx, off));
            const float m_new = fmaxf(m_run, mx);
            float sum = 0.0f;
            for (int jj = sub; jj < KT; jj += TPR) {
                const float s = p_s[mr * KT + jj];
                const float w = s == -INFINITY ? 0.0f : exp2f(s - m_new);
                p_s[mr * KT + jj] = w;
                sum += w;
            }
#pragma unroll
            for (int off = TPR / 2; off > 0; off >>= 1)
                sum += __shfl_xor_sync(ATTN_FULL, sum, off);
            const float corr = m_run == -INFINITY ? 0.0f : exp2f(m_run - m_new);
            l_run = l_run * corr + sum;
            m_run = m_new;
            if (sub == 0)
                c_s[mr] = corr;
        }
        __syncthreads(); /* scores read: kv_s may take V */
        attn_tile_load<HD, DT, KT, KS>(a, bt, k0, kn, k_off + a.slab_bytes, kv_s);
        __syncthreads();
        /* 3. o = o * c + sum_j w[j] * v[j]; when HD divides the CTA every element of a thread
         * is in one column, so each V element is loaded once for all of them */
#pragma unroll
        for (int u = 0; u < OU; u++)
            o[u] *= c_s[attn_tile_row<HD>(tid, u)];
        /* four positions per read of the weights (a broadcast: a warp's rows are one or two) */
#pragma unroll 2
        for (int jj = 0; jj < KT; jj += 4) {
            const int c0 = attn_tile_col<HD>(tid, 0);
            const float v00 = kv_s[jj * KS + c0], v01 = kv_s[(jj + 1) * KS + c0];
            const float v02 = kv_s[(jj + 2) * KS + c0], v03 = kv_s[(jj + 3) * KS + c0];
#pragma unroll
            for (int u = 0; u < OU; u++) {
                const int c = attn_tile_col<HD>(tid, u);
                const bool same = ATTN_NT % HD == 0; /* every u in column c0 */
                const float *vc = kv_s + jj * KS + c;
                const float v0 = same ? v00 : vc[0], v1 = same ? v01 : vc[KS];
                const float v2 = same ? v02 : vc[2 * KS], v3 = same ? v03 : vc[3 * KS];
                const float *wr = p_s + attn_tile_row<HD>(tid, u) * KT + jj;
                const float4 w = *reinterpret_cast<const float4 *>(wr);
                o[u] = fmaf(w.w, v3, fmaf(w.z, v2, fmaf(w.y, v1, fmaf(w.x, v0, o[u]))));
            }
        }
    }
    __syncthreads();
    if (tid % TPR == 0)
        c_s[mr] = l_run; /* c_s now holds each row's sum */
    __syncthreads();

    /* 4. for each row whose own range meets this partition: output / sum * v_scale, and its
     * max and sum when split */
#pragma unroll
    for (int u = 0; u < OU; u++) {
        const int r = attn_tile_row<HD>(tid, u), d = attn_tile_col<HD>(tid, u);
        const int ti = r / gc, g = r % gc;
        const int pos = pos0 + ti;
        if (ti < ia || ti > ib || g >= ng || !attn_meets(a, part, pos))
            continue;
        const int64_t th = th0 + (int64_t)ti * a.n_heads + g;
        const float v = o[u] * (a.v_mul / c_s[r]);
        if (a.parts == 1)
            a.out[th * HD + d] = v;
        else
            a.ws_o[(th * a.parts + part) * HD + d] = v;
    }
    if (a.parts > 1 && tid % TPR == 0) {
        const int pos = pos0 + mt, g = mr % gc;
        if (mt >= ia && mt <= ib && g < ng && attn_meets(a, part, pos)) {
            const int64_t th = th0 + (int64_t)mt * a.n_heads + g;
            a.ws_m[th * a.parts + part] = m_run;
            a.ws_l[th * a.parts + part] = l_run;
        }
    }
}

/* ---- step 3 on tensor cores: the mma tile kernel (f16 and bf16 KV, head_dim 64 and 128) ----
 * The same tiles, partitions and outputs as the tile kernel above, with ATTN_MMA_ROWS = 64 rows
 * per CTA: warp w serves rows 16w .. 16w + 15. Per pass of ATTN_MMA_KT = 64 positions the CTA
 * copies K and V (as stored, 16 bytes per cp.async) into shared memory; each warp computes its
 * 16 x 64 scores with mma.sync m16n8k16 (f32 accumulate), masks them, updates its rows' online
 * softmax in registers, and accumulates P . V with the same instruction. The queries and the
 * weights are f32 split into two 16-bit halves (x = hi + lo, each of the KV's type), both
 * multiplied by the same K or V fragment: the products keep about 16 bits of the f32 operand
 * (K and V are exact), so the result stays within the f32 kernels' tolerances at twice the
 * tensor-core work, which is not what bounds this kernel. */
constexpr int ATTN_MMA_ROWS = KVF_CUDA_ATTN_MMA_ROWS;
constexpr int ATTN_MMA_KT = 64;

/* whether the mma tile kernel serves (HD, DT) */
template <int HD, kvf_dtype DT> constexpr bool attn_mma_ok()
{
    return (HD == 64 || HD == 128) && (DT == KVF_DTYPE_F16 || DT == KVF_DTYPE_BF16);
}

/* A 16-bit value of the KV's type (DT: f16 or bf16) nearest x, as bits, and its value. */
template <kvf_dtype DT> __device__ __forceinline__ uint32_t attn_h16_bits(float x)
{
    if constexpr (DT == KVF_DTYPE_BF16) {
        uint32_t u = __float_as_uint(x); /* round to nearest even; x is finite */
        u += 0x7fffu + ((u >> 16) & 1u);
        return u >> 16;
    } else {
        return __half_as_ushort(__float2half_rn(x));
    }
}

template <kvf_dtype DT> __device__ __forceinline__ float attn_h16_value(uint32_t h)
{
    if constexpr (DT == KVF_DTYPE_BF16)
        return __uint_as_float(h << 16);
    else
        return __half2float(__ushort_as_half((unsigned short)h));
}

/* attn_h16_bits of x0 and x1 as a pair (x0 in the low half): on the GPU one cvt.rn of both (the
 * same rounding, to nearest even) */
template <kvf_dtype DT> __device__ __forceinline__ uint32_t attn_h16_pack2(float x0, float x1)
{
#ifdef KVF_CUDA_EMU_DEVICE
    return attn_h16_bits<DT>(x0) | (attn_h16_bits<DT>(x1) << 16);
#else
    if constexpr (DT == KVF_DTYPE_BF16) {
        const __nv_bfloat162_raw r = __floats2bfloat162_rn(x0, x1);
        return (uint32_t)r.x | ((uint32_t)r.y << 16);
    } else {
        const __half2_raw r = __floats2half2_rn(x0, x1);
        return (uint32_t)r.x | ((uint32_t)r.y << 16);
    }
#endif
}

/* x0, x1 (x0 in the low half) as a pair of hi halves and a pair of lo halves */
template <kvf_dtype DT>
__device__ __forceinline__ void attn_h16_split2(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
    hi = attn_h16_pack2<DT>(x0, x1);
    lo = attn_h16_pack2<DT>(x0 - attn_h16_value<DT>(hi & 0xffffu),
                            x1 - attn_h16_value<DT>(hi >> 16));
}

/* d += A . B, m16n8k16, f32 accumulate (fragment layouts: the PTX ISA's, as cuda_emu.h's
 * emulation spells out). KVF_CUDA_EMU_DEVICE: the host emulations (tests/unit/cuda/cuda_emu.h)
 * compile this file as C++ and stand in for the PTX here and in the cp.async helpers below. */
template <kvf_dtype DT>
__device__ __forceinline__ void attn_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
#ifdef KVF_CUDA_EMU_DEVICE
    const uint32_t b[2] = {b0, b1};
    emu::mma_16816(d, a, b, DT == KVF_DTYPE_BF16);
#else
    if constexpr (DT == KVF_DTYPE_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* zeros into N accumulator fragments */
template <int N> __device__ __forceinline__ void attn_frag_zero(float (&f)[N][4])
{
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            f[n][i] = 0.0f;
}

/* 16 bytes global -> shared without passing through registers (cp.async; sm_80+), and waiting
 * for all but the last `n` committed groups */
__device__ __forceinline__ void attn_cp16(void *dst, const void *src)
{
#ifdef KVF_CUDA_EMU_DEVICE
    emu::cp16(dst, src);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void attn_cp_commit()
{
#ifndef KVF_CUDA_EMU_DEVICE
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N> __device__ __forceinline__ void attn_cp_wait()
{
#ifndef KVF_CUDA_EMU_DEVICE
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* Starts copying positions k0 .. k0 + kn - 1 of one K or V slab (byte offset off in each
 * block) into rows of dst (row stride STR halves); rows kn .. KT - 1 become zeros, so a masked
 * position's V is 0, never stale bits. */
template <int HD, int STR>
__device__ __forceinline__ void attn_mma_load(const attn_args &a, const int32_t *bt, int k0, int kn,
                                              int64_t off, uint16_t *dst)
{
    constexpr int CPR = HD / 8; /* 16-byte chunks per row */
    const int bs = 1 << a.log2_bs;
    for (int c = threadIdx.x; c < ATTN_MMA_KT * CPR; c += ATTN_NT) {
        const int row = c / CPR, ch = c % CPR;
        uint16_t *d = dst + row * STR + ch * 8;
        if (row < kn) {
            const int p = k0 + row;
            const int64_t blk = __ldg(bt + (p >> a.log2_bs));
            attn_cp16(d, a.pool + blk * a.block_bytes + off + (int64_t)(p & (bs - 1)) * (HD * 2) +
                             ch * 16);
        } else {
            *reinterpret_cast<uint4 *>(d) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

/* One CTA per tile of ATTN_MMA_ROWS rows (see above); grid as the tile kernel's. */
template <int HD, kvf_dtype DT>
__global__ void __launch_bounds__(ATTN_NT) attn_mma_kernel(const attn_args a)
{
    static_assert(attn_mma_ok<HD, DT>(), "the mma tile kernel serves f16/bf16 at head_dim 64, 128");
    constexpr int KT = ATTN_MMA_KT;
    constexpr int STR = HD + 8; /* halves per shared row: a warp's fragment reads hit 32 banks */
    constexpr int NS = KT / 8;  /* score n-tiles per pass */
    constexpr int NO = HD / 8;  /* output n-tiles */
    constexpr int KQ = HD / 16; /* k-steps of q . k */
    static_assert(ATTN_MMA_ROWS == 16 * ATTN_NW, "a warp serves 16 rows");
    static_assert(2 * KT * STR * 2 <= 48 * 1024, "static shared memory is capped at 48 KiB");
    __shared__ __align__(16) uint16_t k_s[KT * STR];
    __shared__ __align__(16) uint16_t v_s[KT * STR];

    attn_tile tl; /* tiles of 64, 32, 16 or 8 tokens */
    if (!attn_tile_begin<HD>(a, ATTN_MMA_ROWS, tl))
        return;
    const int part = blockIdx.z, tid = threadIdx.x, gc = a.gc;
    const int pos0 = tl.pos0, nt = tl.nt, ia = tl.ia, ib = tl.ib, ng = tl.ng;
    const int p0 = tl.p0, p1 = tl.p1;
    const int64_t th0 = tl.th0;
    const int32_t *bt = tl.bt;

    /* this thread's two rows (h = 0: g, h = 1: g + 8 of its warp's 16), whether each is real,
     * its token's position and visible range start */
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
    bool rv[2];
    int rpos[2], rlo[2];
    int64_t rth[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = warp * 16 + g + 8 * h, ti = r / gc, gi = r % gc;
        rv[h] = ti >= ia && ti <= ib && ti < nt && gi < ng;
        rpos[h] = pos0 + ti;
        rlo[h] = attn_lo(rpos[h], a.window);
        rth[h] = th0 + (int64_t)ti * a.n_heads + gi;
    }
    /* whether any row of this warp is real (warp-uniform: the rows are 16w .. 16w + 15) */
    bool wv = false;
    for (int r = warp * 16; r < warp * 16 + 16; r++)
        wv = wv || (r / gc >= ia && r / gc <= ib && r / gc < nt && r % gc < ng);

    /* the scaled queries as A fragments, hi and lo: qh[ks][i] per the m16n8k16 layout */
    uint32_t qh[KQ][4], ql[KQ][4];
#pragma unroll
    for (int ks = 0; ks < KQ; ks++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = i & 1, d = ks * 16 + 2 * tq + (i >= 2 ? 8 : 0);
            float x0 = 0.0f, x1 = 0.0f;
            if (rv[h]) {
                const float *q = a.q + rth[h] * HD + d;
                x0 = q[0] * a.q_mul, x1 = q[1] * a.q_mul;
            }
            attn_h16_split2<DT>(x0, x1, qh[ks][i], ql[ks][i]);
        }

    float o[NO][4];
    attn_frag_zero(o);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const int64_t k_off = a.layer_off + (int64_t)tl.kvh * (1 << a.log2_bs) * HD * 2;

    for (int k0 = p0; k0 < p1; k0 += KT) {
        const int kn = min(KT, p1 - k0);
        __syncthreads(); /* the last pass is done with k_s and v_s */
        attn_mma_load<HD, STR>(a, bt, k0, kn, k_off, k_s);
        attn_cp_commit();
        attn_mma_load<HD, STR>(a, bt, k0, kn, k_off + a.slab_bytes, v_s);
        attn_cp_commit();
        attn_cp_wait<1>(); /* K is in (V may still be coming) */
        __syncthreads();
        float s[NS][4];
        attn_frag_zero(s);
        if (wv) {
            /* 1. scores: s = q . k over the pass's 64 positions */
#pragma unroll
            for (int ks = 0; ks < KQ; ks++)
#pragma unroll
                for (int n = 0; n < NS; n++) {
                    const uint16_t *kr = k_s + (n * 8 + g) * STR + ks * 16 + 2 * tq;
                    const uint32_t b0 = *reinterpret_cast<const uint32_t *>(kr);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t *>(kr + 8);
                    attn_mma<DT>(s[n], qh[ks], b0, b1);
                    attn_mma<DT>(s[n], ql[ks], b0, b1);
                }
            /* 2. masks, then per row the online softmax update (a row lives in the 4 lanes
             * of a quad: 16 of its 64 scores each) */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < NS; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int j = n * 8 + 2 * tq + e, kp = k0 + j;
                        const bool vis = rv[h] && j < kn && kp <= rpos[h] && kp >= rlo[h];
                        float &x = s[n][2 * h + e];
                        x = vis ? x : -INFINITY;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(ATTN_FULL, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(ATTN_FULL, mx, 2));
                const float m_new = fmaxf(m_run[h], mx);
                const float corr = m_run[h] == -INFINITY ? 0.0f : exp2f(m_run[h] - m_new);
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < NS; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float &x = s[n][2 * h + e];
                        x = x == -INFINITY ? 0.0f : exp2f(x - m_new);
                        sum += x;
                    }
                sum += __shfl_xor_sync(ATTN_FULL, sum, 1);
                sum += __shfl_xor_sync(ATTN_FULL, sum, 2);
                l_run[h] = l_run[h] * corr + sum;
                m_run[h] = m_new;
#pragma unroll
                for (int n = 0; n < NO; n++)
                    o[n][2 * h] *= corr, o[n][2 * h + 1] *= corr;
            }
        }
        attn_cp_wait<0>(); /* V is in */
        __syncthreads();
        if (wv) {
            /* 3. o += p . v: the scores' C fragments of n-tiles 2kk, 2kk + 1 are the A
             * fragment of positions 16kk .. 16kk + 15 */
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
                uint32_t ph[4], pl[4];
                attn_h16_split2<DT>(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);
                attn_h16_split2<DT>(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);
                attn_h16_split2<DT>(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);
                attn_h16_split2<DT>(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);
                const uint16_t *v0 = v_s + (kk * 16 + 2 * tq) * STR + g;
#pragma unroll
                for (int n = 0; n < NO; n++) {
                    const uint16_t *v = v0 + n * 8;
                    const uint32_t b0 = (uint32_t)v[0] | ((uint32_t)v[STR] << 16);
                    const uint32_t b1 = (uint32_t)v[8 * STR] | ((uint32_t)v[9 * STR] << 16);
                    attn_mma<DT>(o[n], ph, b0, b1);
                    attn_mma<DT>(o[n], pl, b0, b1);
                }
            }
        }
    }

    /* 4. for each real row whose own range meets this partition: output / sum * v_scale, and
     * its max and sum when split */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!rv[h] || !attn_meets(a, part, rpos[h]))
            continue;
        const float mul = a.v_mul / l_run[h];
        float *dst = a.parts == 1 ? a.out + rth[h] * HD : a.ws_o + (rth[h] * a.parts + part) * HD;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            const int d = n * 8 + 2 * tq;
            dst[d] = o[n][2 * h] * mul;
            dst[d + 1] = o[n][2 * h + 1] * mul;
        }
        if (a.parts > 1 && tq == 0) {
            a.ws_m[rth[h] * a.parts + part] = m_run[h];
            a.ws_l[rth[h] * a.parts + part] = l_run[h];
        }
    }
}

/* Decode on the tensor cores (attn_dec_kernel): the partition kernel's CTA, grid, split and
 * outputs, for f16, bf16 or fp8-e4m3 KV at head_dim 64 or 128, with the work of a K or V row
 * done by mma.sync instead of per-element FMAs and shuffle trees (per K+V row at head_dim 128,
 * bf16, the SIMT loops issue about 93 PTX instructions a warp and this one about 20
 * (bench/attn_ptx.py), so the loads, not instruction issue, should bound it). Each warp takes
 * groups of 16 positions of the partition (group i goes to warp i % 4) and keeps its own online
 * softmax; the 4 warps merge through shared memory at the end. Per group, with g = lane / 4 and
 * q = lane % 4:
 *  - scores S = Q . K^T as two m16n8k16 tiles (rows: the chunk's <= 8 heads, rows 8..15 zero;
 *    columns: 8 positions each). Lane (g, q) loads the K row of position 4(g/2) + 2j + g%2 of
 *    tile j, 16-byte chunks 4i + q: a warp's load covers 64 contiguous bytes of each of 8 rows.
 *    The k index of the mma is a permutation of the head dims, the same for Q and K, chosen so
 *    that each loaded word (two 16-bit values; an fp8 pair becomes one, exactly) is a B
 *    fragment as it stands: k-step ks reads the lane's words 2ks and 2ks + 1 (attn_dec_io).
 *    Queries are split hi + lo as in attn_mma_kernel. So lane (g, q) ends with head g's scores
 *    at positions 4q .. 4q + 3 of the group.
 *  - O^T += V^T . P^T as m16n8k16 tiles with rows = head dims (HD/16 tiles), columns = the 8
 *    heads, k = the group's 16 positions. The B fragment (P^T: positions 2q, 2q+1 and 2q+8,
 *    2q+9 of head g) is exactly the scores lane (g, q) holds, with the position order chosen
 *    above; the A fragment wants pairs of positions for one dim, so lane (g, q) loads its HD/8
 *    dims of the V rows of positions 4q .. 4q + 3 (a warp's load: 128 contiguous bytes of each
 *    of 4 rows, or all of an fp8 row) and pairs their halves up (word mb of the lane's dims gives
 *    tile mb's rows g and g + 8: its low and high halves). Lane (g, q) ends with heads 2q and
 *    2q + 1 over those dims, so the running max correction reaches it by a shuffle from the
 *    lanes of heads 2q and 2q + 1.
 * fp8 KV runs the f16 instruction: e4m3 converts to f16 exactly (k_scale is in the queries and
 * v_scale in the output, as everywhere). */
template <int HD, kvf_dtype DT> constexpr bool attn_dec_ok()
{
    return (HD == 64 || HD == 128) &&
           (DT == KVF_DTYPE_F16 || DT == KVF_DTYPE_BF16 || DT == KVF_DTYPE_FP8_E4M3);
}

/* word w (0..3) of a 16-byte load */
__device__ __forceinline__ uint32_t attn_u4_word(const uint4 &v, int w)
{
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

/* the low halves of x and y as a pair (x's first), and the high halves (one PRMT each) */
__device__ __forceinline__ uint32_t attn_lo_pair(uint32_t x, uint32_t y)
{
#ifdef KVF_CUDA_EMU_DEVICE
    return (x & 0xffffu) | (y << 16);
#else
    return __byte_perm(x, y, 0x5410);
#endif
}

__device__ __forceinline__ uint32_t attn_hi_pair(uint32_t x, uint32_t y)
{
#ifdef KVF_CUDA_EMU_DEVICE
    return (x >> 16) | (y & 0xffff0000u);
#else
    return __byte_perm(x, y, 0x7632);
#endif
}

/* What one lane of attn_dec_kernel loads of a K or V row and how it turns into mma words (two
 * 16-bit values of type MT, the first in the low half):
 *  K: KR 16-byte chunks 4i + q (i < KR); word j (j < HD/8) holds dims kdim(q, j), + 1.
 *  V: VR chunks (or, fp8 at head_dim 64, the 8 bytes at 8g); word mb (mb < HD/16) holds dims
 *     vdim(g, mb), + 1. */
template <int HD, kvf_dtype DT> struct attn_dec_io {
    static constexpr bool FP8 = DT == KVF_DTYPE_FP8_E4M3;
    static constexpr kvf_dtype MT = FP8 ? KVF_DTYPE_F16 : DT; /* the mma's input type */
    static constexpr int ES = FP8 ? 1 : 2;                     /* bytes per element */
    static constexpr int ROW = HD * ES;
    static constexpr int WPC = 16 / (2 * ES);       /* words per 16-byte chunk: 4 or 8 */
    static constexpr int KW = HD / 8, VW = HD / 16; /* words per lane per K, V row */
    static constexpr int KR = KW / WPC;
    static constexpr int VR = (VW + WPC - 1) / WPC;
    static_assert(KR >= 1 && KW % WPC == 0, "head_dim 64 or 128");

    /* two e4m3 bytes (the low one first) as two f16 */
    static __device__ __forceinline__ uint32_t fp8_pair(uint32_t w)
    {
        const __half2_raw h =
            __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
        return (uint32_t)h.x | ((uint32_t)h.y << 16);
    }
    /* word j of what raw[] holds (WPC words a chunk) */
    static __device__ __forceinline__ uint32_t word(const uint4 *raw, int j)
    {
        if constexpr (FP8)
            return fp8_pair(attn_u4_word(raw[j / 8], (j % 8) / 2) >> (16 * (j % 2)));
        else
            return attn_u4_word(raw[j / 4], j % 4);
    }
    static __device__ __forceinline__ int kdim(int q, int j)
    {
        return (4 * (j / WPC) + q) * 2 * WPC + 2 * (j % WPC);
    }
    static __device__ __forceinline__ int vdim(int g, int mb)
    {
        if constexpr (FP8)
            return (HD / 8) * g + 2 * mb;
        else
            return 8 * (g + 8 * (mb / 4)) + 2 * (mb % 4);
    }
    /* this lane's chunks of the K or V row at row */
    static __device__ __forceinline__ void load_k(const uint8_t *row, int q, uint4 (&raw)[KR])
    {
#pragma unroll
        for (int i = 0; i < KR; i++)
            raw[i] = __ldg(reinterpret_cast<const uint4 *>(row + (4 * i + q) * 16));
    }
    static __device__ __forceinline__ void load_v(const uint8_t *row, int g, uint4 (&raw)[VR])
    {
        if constexpr (FP8 && HD == 64) {
            const uint2 h = __ldg(reinterpret_cast<const uint2 *>(row + 8 * g));
            raw[0] = make_uint4(h.x, h.y, 0u, 0u);
        } else {
#pragma unroll
            for (int i = 0; i < VR; i++) /* 16-bit: chunks g, g + 8; fp8: chunk g */
                raw[i] = __ldg(reinterpret_cast<const uint4 *>(row + (g + 8 * i) * 16));
        }
    }
};

template <int HD, kvf_dtype DT>
__global__ void __launch_bounds__(ATTN_NT, 4) attn_dec_kernel(const attn_args a)
{
    static_assert(attn_dec_ok<HD, DT>(),
                  "the mma decode kernel serves f16, bf16 and fp8 KV at head_dim 64, 128");
    typedef attn_dec_io<HD, DT> io;
    constexpr kvf_dtype MT = io::MT;
    constexpr int ROW = io::ROW, KW = io::KW, MB = io::VW; /* MB: output tiles (head dims) */
    constexpr int GRP = 16;                                /* positions per group */
    __shared__ int32_t blk_s[ATTN_PART_MAX + 1];
    __shared__ __align__(16) uint4 q_s[2][KW / 4][32]; /* hi, lo; lane: its words 4i .. 4i + 3 */
    __shared__ __align__(16) float o_s[ATTN_NW][ATTN_GMAX][HD]; /* each warp's output */
    __shared__ float m_s[ATTN_NW][ATTN_GMAX], l_s[ATTN_NW][ATTN_GMAX];

    attn_part c;
    if (!attn_part_begin(a, ATTN_GMAX, HD, c))
        return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const int n = c.n, ng = c.ng, bs = 1 << a.log2_bs;
    int32_t bv[ATTN_BT_REGS];
    attn_part_blocks_load(c, bv); /* in flight while the query loads below are */

    /* the scaled query of head g at lane (g, q)'s K dims, as its A fragment words, hi and lo
     * (every warp's lane (g, q) reads the same: shared memory, not 32 registers a lane) */
    for (int x = tid; x < KW / 4 * 32; x += ATTN_NT) {
        const int i = x / 32, xg = (x % 32) / 4, xq = x % 4;
        uint32_t h[4], l[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            float x0 = 0.0f, x1 = 0.0f;
            if (xg < ng) {
                const float *qp = a.q + (c.th0 + xg) * HD + io::kdim(xq, 4 * i + w);
                x0 = qp[0] * a.q_mul, x1 = qp[1] * a.q_mul;
            }
            attn_h16_split2<MT>(x0, x1, h[w], l[w]);
        }
        q_s[0][i][x % 32] = make_uint4(h[0], h[1], h[2], h[3]);
        q_s[1][i][x % 32] = make_uint4(l[0], l[1], l[2], l[3]);
    }
    attn_part_blocks_store(c, bv, blk_s);
    __syncthreads(); /* blk_s, q_s */

    const int64_t k_off = a.layer_off + (int64_t)c.kvh * bs * ROW, v_off = k_off + a.slab_bytes;
    float o[MB][4];
    attn_frag_zero(o);
    float m_run = -INFINITY, l_run = 0.0f;
    const int n_grp = (n + GRP - 1) / GRP;
    for (int gi = warp; gi < n_grp; gi += ATTN_NW) {
        const int base = gi * GRP;
        /* K rows 4(g/2) + 2j + g%2 and V rows 4q .. 4q + 3 of the group; a position past n
         * loads the last one instead (no branch; its score is masked, so its weight is 0) */
        uint4 kr[2][io::KR], vr[4][io::VR];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int p = c.p0 + min(base + 4 * (g >> 1) + 2 * j + (g & 1), n - 1);
            io::load_k(a.pool + (int64_t)blk_s[(p >> a.log2_bs) - c.b0] * a.block_bytes + k_off +
                           (int64_t)(p & (bs - 1)) * ROW,
                       q, kr[j]);
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int p = c.p0 + min(base + 4 * q + r, n - 1);
            io::load_v(a.pool + (int64_t)blk_s[(p >> a.log2_bs) - c.b0] * a.block_bytes + v_off +
                           (int64_t)(p & (bs - 1)) * ROW,
                       g, vr[r]);
        }

        /* 1. scores of head g at positions 4q + 2j + e (s[j][e]; s[j][2..3] are rows 8..15) */
        float s[2][4];
        attn_frag_zero(s);
#pragma unroll
        for (int i = 0; i < KW / 4; i++) {
            const uint4 qh = q_s[0][i][lane], ql = q_s[1][i][lane];
#pragma unroll
            for (int h = 0; h < 2; h++) { /* k-step 2i + h: words 4i + 2h, 4i + 2h + 1 */
                const int w = 2 * h;
                const uint32_t ah[4] = {attn_u4_word(qh, w), 0u, attn_u4_word(qh, w + 1), 0u};
                const uint32_t al[4] = {attn_u4_word(ql, w), 0u, attn_u4_word(ql, w + 1), 0u};
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const uint32_t b0 = io::word(kr[j], 4 * i + w);
                    const uint32_t b1 = io::word(kr[j], 4 * i + w + 1);
                    attn_mma<MT>(s[j], ah, b0, b1);
                    attn_mma<MT>(s[j], al, b0, b1);
                }
            }
        }

        /* 2. the online softmax of head g (its 16 scores live in the lanes of quad g) */
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float &x = s[j][e];
                x = base + 4 * q + 2 * j + e < n ? x : -INFINITY;
                mx = fmaxf(mx, x);
            }
        mx = fmaxf(mx, __shfl_xor_sync(ATTN_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(ATTN_FULL, mx, 2)); /* finite: position base is in */
        const float m_new = fmaxf(m_run, mx);
        const float corr = m_run == -INFINITY ? 0.0f : exp2f(m_run - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float &x = s[j][e];
                x = x == -INFINITY ? 0.0f : exp2f(x - m_new);
                sum += x;
            }
        l_run = l_run * corr + sum; /* this lane's share; the quad adds them at the end */
        m_run = m_new;
        /* this lane's output columns are heads 2q and 2q + 1: their corrections */
        const float ca = __shfl_sync(ATTN_FULL, corr, 8 * q);
        const float cb = __shfl_sync(ATTN_FULL, corr, 8 * q + 4);
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
            o[mb][0] *= ca, o[mb][1] *= cb, o[mb][2] *= ca, o[mb][3] *= cb;

        /* 3. O^T += V^T . P^T: tile mb's rows g, g + 8 are the halves of this lane's word mb */
        uint32_t ph[2], pl[2];
        attn_h16_split2<MT>(s[0][0], s[0][1], ph[0], pl[0]);
        attn_h16_split2<MT>(s[1][0], s[1][1], ph[1], pl[1]);
#pragma unroll
        for (int mb = 0; mb < MB; mb++) {
            const uint32_t x0 = io::word(vr[0], mb), x1 = io::word(vr[1], mb);
            const uint32_t x2 = io::word(vr[2], mb), x3 = io::word(vr[3], mb);
            const uint32_t av[4] = {attn_lo_pair(x0, x1), attn_hi_pair(x0, x1),
                                    attn_lo_pair(x2, x3), attn_hi_pair(x2, x3)};
            attn_mma<MT>(o[mb], av, ph[0], ph[1]);
            attn_mma<MT>(o[mb], av, pl[0], pl[1]);
        }
    }

    /* 4. each warp's max, sum and output into shared memory (a warp without a group: -inf, 0,
     * zeros), then every CTA thread merges columns */
    l_run += __shfl_xor_sync(ATTN_FULL, l_run, 1);
    l_run += __shfl_xor_sync(ATTN_FULL, l_run, 2);
    if (q == 0)
        m_s[warp][g] = m_run, l_s[warp][g] = l_run;
#pragma unroll
    for (int mb = 0; mb < MB; mb++) {
        const int d = io::vdim(g, mb);
        o_s[warp][2 * q][d] = o[mb][0], o_s[warp][2 * q][d + 1] = o[mb][2];
        o_s[warp][2 * q + 1][d] = o[mb][1], o_s[warp][2 * q + 1][d + 1] = o[mb][3];
    }
    __syncthreads();
    const int part = blockIdx.z;
    for (int i = tid; i < ng * HD; i += ATTN_NT) {
        const int h = i / HD, d = i % HD;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATTN_NW; w++)
            mx = fmaxf(mx, m_s[w][h]);
        float l = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_NW; w++) {
            const float f = m_s[w][h] == -INFINITY ? 0.0f : exp2f(m_s[w][h] - mx);
            l += l_s[w][h] * f;
            acc += o_s[w][h][d] * f;
        }
        const float out = acc * (a.v_mul / l);
        if (a.parts == 1)
            a.out[(c.th0 + h) * HD + d] = out;
        else
            a.ws_o[((c.w0 + h) * a.parts + part) * HD + d] = out;
        if (a.parts > 1 && d == 0) {
            a.ws_m[(c.w0 + h) * a.parts + part] = mx;
            a.ws_l[(c.w0 + h) * a.parts + part] = l;
        }
    }
}

constexpr int ATTN_RED_NT = 256; /* the reduce's threads per block */
constexpr int ATTN_RED_NW = ATTN_RED_NT / 32;
constexpr int ATTN_RED_PRE = 4; /* partitions a reduce thread loads ahead (see below) */

/* v combined (max, or sum) over the reduce block; every thread gets the same result (the warps'
 * values in warp order). sh: ATTN_RED_NW floats of shared memory not in use. */
template <bool MAX> __device__ __forceinline__ float attn_red_all(float v, float *sh)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float x = __shfl_xor_sync(ATTN_FULL, v, o);
        v = MAX ? fmaxf(v, x) : v + x;
    }
    if (threadIdx.x % 32 == 0)
        sh[threadIdx.x / 32] = v;
    __syncthreads();
    v = sh[0];
    for (int w = 1; w < ATTN_RED_NW; w++)
        v = MAX ? fmaxf(v, sh[w]) : v + sh[w];
    return v;
}

/* V floats of a partition output at p (V = 4: p is 16-byte aligned) */
template <int V> __device__ __forceinline__ void attn_red_load(const float *p, float (&v)[V])
{
    if constexpr (V == 4) {
        const float4 x = __ldg(reinterpret_cast<const float4 *>(p));
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    } else {
        for (int e = 0; e < V; e++)
            v[e] = p[e];
    }
}

/* Merges the partitions of (token blockIdx.x, head blockIdx.y) (with lone 1: the token of
 * sequence blockIdx.x). All partitions at once, so a long context's hundred partitions cost a
 * few load latencies, not one per partition: the block takes the max of m and the sum of the
 * weights w_p over its threads, then thread tid sums w_p * o_p over the columns
 * [c V, c V + V), c = tid % (hd / V), of partitions pa + r, pa + r + R, ... (r = tid / (hd / V),
 * R rows of threads; the first ATTN_RED_PRE of them loaded before the max), and the rows' sums
 * meet in shared memory in row order. V = 4 where the partials and the output are 16-byte
 * aligned (attn_reduce_fn), else 1. */
template <int V> __global__ void __launch_bounds__(ATTN_RED_NT) attn_reduce_kernel(const attn_args a, int hd)
{
    __shared__ float red_s[2][ATTN_RED_NW];
    __shared__ float red_o[ATTN_RED_NT * V];
    const int t = attn_token(a), h = blockIdx.y, tid = threadIdx.x;
    if (t < 0)
        return;
    const int64_t th = (int64_t)t * a.n_heads + h;
    float *out = a.out + th * hd;
    const int pos = a.tok_pos[t];
    if (pos < 0 || pos >= a.max_ctx) {
        for (int d = tid; d < hd; d += ATTN_RED_NT)
            out[d] = 0.0f;
        return;
    }
    const int pa = attn_lo(pos, a.window) / a.part_len, pb = pos / a.part_len;
    const int64_t base = ((int64_t)blockIdx.x * a.n_heads + h) * a.parts; /* workspace row */
    const int cols = hd / V, rows = ATTN_RED_NT / cols, r = tid / cols, c = tid % cols;
    /* the first ATTN_RED_PRE partitions of this thread's row, loaded before the max and the
     * weights are known, so their latency is the max's */
    float pre[ATTN_RED_PRE][V];
#pragma unroll
    for (int u = 0; u < ATTN_RED_PRE; u++) {
        const int p = pa + r + u * rows;
        if (r < rows && p <= pb) {
            attn_red_load<V>(a.ws_o + (base + p) * hd + c * V, pre[u]);
        } else {
            for (int e = 0; e < V; e++)
                pre[u][e] = 0.0f;
        }
    }
    /* the max, then the sum of the weights (the first ATTN_RED_NT partitions' m and l loaded
     * together) */
    const bool own = pa + tid <= pb;
    const float m0 = own ? a.ws_m[base + pa + tid] : -INFINITY;
    const float l0 = own ? a.ws_l[base + pa + tid] : 0.0f;
    float mx = m0;
    for (int p = pa + tid + ATTN_RED_NT; p <= pb; p += ATTN_RED_NT)
        mx = fmaxf(mx, a.ws_m[base + p]);
    mx = attn_red_all<true>(mx, red_s[0]);
    float ws = own ? l0 * exp2f(m0 - mx) : 0.0f;
    for (int p = pa + tid + ATTN_RED_NT; p <= pb; p += ATTN_RED_NT)
        ws += a.ws_l[base + p] * exp2f(a.ws_m[base + p] - mx);
    const float wsum = attn_red_all<false>(ws, red_s[1]);
    if (r < rows) {
        float acc[V] = {};
#pragma unroll
        for (int u = 0; u < ATTN_RED_PRE; u++) {
            const int p = pa + r + u * rows;
            if (p <= pb) {
                const float w = a.ws_l[base + p] * exp2f(a.ws_m[base + p] - mx);
                for (int e = 0; e < V; e++)
                    acc[e] += w * pre[u][e];
            }
        }
        for (int p = pa + r + ATTN_RED_PRE * rows; p <= pb; p += rows) {
            const float w = a.ws_l[base + p] * exp2f(a.ws_m[base + p] - mx);
            float v[V];
            attn_red_load<V>(a.ws_o + (base + p) * hd + c * V, v);
            for (int e = 0; e < V; e++)
                acc[e] += w * v[e];
        }
        for (int e = 0; e < V; e++)
            red_o[tid * V + e] = acc[e];
    }
    __syncthreads();
    for (int d = tid; d < hd; d += ATTN_RED_NT) {
        float o = 0.0f;
        for (int rr = 0; rr < rows; rr++)
            o += red_o[rr * hd + d]; /* (rr * cols + d / V) * V + d % V */
        out[d] = o / wsum;
    }
}

typedef void (*attn_red_fn)(const attn_args, int);

/* The reduce kernel for a's partials and output: 16-byte loads where everything lines up. */
attn_red_fn attn_reduce_fn(const attn_args &a, int hd)
{
    const bool v4 = hd % 4 == 0 && reinterpret_cast<uintptr_t>(a.ws_o) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
    return v4 ? attn_reduce_kernel<4> : attn_reduce_kernel<1>;
}

/* A step with prefill chunks, first: per sequence, how many of the step's tokens are its and
 * one of them (one CTA; a sequence has at most a few thousand tokens in a step). */
__global__ void attn_count_kernel(const attn_args a)
{
    for (int s = threadIdx.x; s < a.n_seqs; s += blockDim.x)
        a.seq_count[s] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < a.n_tokens; t += blockDim.x) {
        const int s = a.tok_seq[t];
        if (s >= 0 && s < a.n_seqs) {
            atomicAdd(a.seq_count + s, 1);
            a.seq_tok[s] = t; /* read only where the count is 1: then this is the one */
        }
    }
}

typedef void (*attn_fn)(const attn_args);

template <int HD, kvf_dtype DT> attn_fn attn_pick_gc(int gc)
{
    switch (gc) {
    case 1:
        return attn_part_kernel<HD, DT, 1>;
    case 2:
        return attn_part_kernel<HD, DT, 2>;
    case 4:
        return attn_part_kernel<HD, DT, 4>;
    default:
        return attn_part_kernel<HD, DT, 8>;
    }
}

/* The partition kernel (tile false; the mma decode kernel instead when mma_dec and it serves
 * (HD, DT)) or a tile kernel (tile true; it takes gc at run time): the mma one where it serves
 * (HD, DT), else the f32 one. */
template <int HD, kvf_dtype DT> attn_fn attn_pick_kind(int gc, bool tile, bool mma_dec)
{
    if (!tile) {
        if constexpr (attn_dec_ok<HD, DT>())
            if (mma_dec)
                return attn_dec_kernel<HD, DT>;
        return attn_pick_gc<HD, DT>(gc);
    }
    if constexpr (attn_mma_ok<HD, DT>())
        return attn_mma_kernel<HD, DT>;
    else
        return attn_tile_kernel<HD, DT>;
}

template <int HD> attn_fn attn_pick_dtype(kvf_dtype dt, int gc, bool tile, bool mma_dec)
{
    switch (dt) {
    case KVF_DTYPE_F32:
        return attn_pick_kind<HD, KVF_DTYPE_F32>(gc, tile, mma_dec);
    case KVF_DTYPE_F16:
        return attn_pick_kind<HD, KVF_DTYPE_F16>(gc, tile, mma_dec);
    case KVF_DTYPE_BF16:
        return attn_pick_kind<HD, KVF_DTYPE_BF16>(gc, tile, mma_dec);
    case KVF_DTYPE_FP8_E4M3:
        return attn_pick_kind<HD, KVF_DTYPE_FP8_E4M3>(gc, tile, mma_dec);
    }
    return nullptr;
}

/* The kernel for (head_dim, dtype, heads per CTA rounded up to 1, 2, 4 or 8), the partition
 * kernel or (tile) the tile kernel; mma_dec: the decode kernel on the tensor cores where it
 * serves. NULL when none (kvf_cuda_attention_supports names the lists: keep the head_dims here
 * and there in step). */
attn_fn attn_pick(int hd, kvf_dtype dt, int gc, bool tile, bool mma_dec)
{
    switch (hd) {
    case 16:
        return attn_pick_dtype<16>(dt, gc, tile, mma_dec);
    case 32:
        return attn_pick_dtype<32>(dt, gc, tile, mma_dec);
    case 48: /* padded to 64 */
        return attn_pick_dtype<48>(dt, gc, tile, mma_dec);
    case 64:
        return attn_pick_dtype<64>(dt, gc, tile, mma_dec);
    case 80: /* padded to 128 */
        return attn_pick_dtype<80>(dt, gc, tile, mma_dec);
    case 96: /* padded to 128 */
        return attn_pick_dtype<96>(dt, gc, tile, mma_dec);
    case 128:
        return attn_pick_dtype<128>(dt, gc, tile, mma_dec);
    case 256:
        return attn_pick_dtype<256>(dt, gc, tile, mma_dec);
    }
    return nullptr;
}

/* Points a's partials at ws: rows (tokens or sequences) x heads x a->parts (attn_ref.h). */
void attn_set_ws(attn_args *a, float *ws, int32_t rows, int32_t hd)
{
    const size_t n_all = (size_t)rows * a->n_heads * a->parts;
    a->ws_o = ws;
    a->ws_m = ws + n_all * hd;
    a->ws_l = a->ws_m + n_all;
}

/* The kernels' arguments for checked parameters p (every token; the call's split, from w). */
attn_args attn_make_args(const kvf_cuda_attn_params *p, const kvf_cuda_attn_ws &w)
{
    const kvf_kv_layout *l = &p->layout;
    attn_args a = {};
    a.q = p->q;
    a.out = p->out;
    a.pool = static_cast<const uint8_t *>(p->pool);
    a.tok_seq = p->tok_seq;
    a.tok_pos = p->tok_pos;
    a.block_tables = p->block_tables;
    a.n_tokens = p->n_tokens;
    a.n_heads = p->n_heads;
    a.n_kv_heads = l->n_kv_heads;
    a.group = p->n_heads / l->n_kv_heads;
    a.chunks = (a.group + ATTN_GMAX - 1) / ATTN_GMAX;
    a.max_blocks = p->max_blocks;
    a.max_ctx = p->max_ctx;
    a.parts = w.parts;
    a.part_len = w.part_len;
    a.window = p->window;
    a.block_bytes = l->block_bytes;
    a.slab_bytes = kvf_kv_slab_bytes(l);
    a.layer_off = (int64_t)p->layer * 2 * a.slab_bytes;
    a.log2_bs = 0;
    while ((1 << a.log2_bs) < l->block_size)
        a.log2_bs++;
    /* the same float products as the reference (attn_ref.c) */
    const bool fp8 = l->dtype == KVF_DTYPE_FP8_E4M3;
    a.q_mul = p->scale * (fp8 ? p->k_scale : 1.0f) * 1.4426950408889634f;
    a.v_mul = fp8 ? p->v_scale : 1.0f;
    if (a.parts > 1)
        attn_set_ws(&a, p->workspace, p->n_tokens, l->head_dim);
    const int heads = a.group < ATTN_GMAX ? a.group : ATTN_GMAX;
    a.gc = heads <= 1 ? 1 : heads <= 2 ? 2 : heads <= 4 ? 4 : 8;
    return a;
}

/* One launch of a call: kernel fn (a CTA per (token or sequence, head chunk, partition)), the
 * reduce (fn NULL, reduce true), or the count (both NULL/false). */
struct attn_launch {
    attn_fn fn;
    bool reduce;
    attn_args a;
    unsigned gx, gy, gz, block;
};

/* The launches of checked parameters p, in order, into L; returns how many (0: no kernel for
 * the shape, a table out of step with kvf_cuda_attention_supports). A decode-only step: the
 * partition kernel (and the reduce when split). A step with prefill chunks: the count, a tile
 * kernel for the chunks' tokens (and its reduce), then the partition kernel for the tokens
 * alone in their sequence, one CTA row per sequence (and its reduce). */
int attn_plan(const kvf_cuda_attn_params *p, attn_launch (&L)[5])
{
    const kvf_kv_layout *l = &p->layout;
    const int hd = l->head_dim;
    kvf_cuda_attn_ws w;
    kvf_cuda_attention_ws(p->n_tokens, p->n_seqs, p->n_heads, hd, p->max_ctx, &w);
    const bool tiled = kvf_cuda_attention_tiled(p->n_tokens, p->n_seqs);
    attn_args a = attn_make_args(p, w);
    const int32_t dk = p->decode_kernel;
    const bool mma_dec = dk == KVF_BACKEND_ATTN_DECODE_MMA ||
                         (dk == KVF_BACKEND_ATTN_DECODE_AUTO && KVF_CUDA_ATTN_AUTO_MMA);
    const attn_fn part_fn = attn_pick(hd, l->dtype, a.gc, false, mma_dec);
    const attn_fn tile_fn = tiled ? attn_pick(hd, l->dtype, a.gc, true, false) : nullptr;
    if (!part_fn || (tiled && !tile_fn))
        return 0;
    const unsigned gy = (unsigned)(l->n_kv_heads * a.chunks), nh = (unsigned)p->n_heads;
    const unsigned nt = (unsigned)p->n_tokens, bs = (unsigned)ATTN_NT, rb = (unsigned)ATTN_RED_NT;
    int n = 0;
    if (!tiled) {
        L[n++] = {part_fn, false, a, nt, gy, (unsigned)a.parts, bs};
        if (a.parts > 1)
            L[n++] = {nullptr, true, a, nt, nh, 1u, rb};
        return n;
    }
    a.n_seqs = p->n_seqs;
    a.seq_count = reinterpret_cast<int32_t *>(p->workspace + w.count_off);
    a.seq_tok = a.seq_count + p->n_seqs;
    a.lone = 2;
    attn_args d = a; /* the lone tokens: the partition kernel's split, rows by sequence */
    d.lone = 1;
    d.parts = w.lone_parts;
    d.part_len = w.lone_part_len;
    d.ws_o = d.ws_m = d.ws_l = nullptr;
    if (d.parts > 1)
        attn_set_ws(&d, p->workspace + w.lone_off, p->n_seqs, hd);
    const unsigned ns = (unsigned)p->n_seqs;
    L[n++] = {nullptr, false, a, 1u, 1u, 1u, 256u};
    L[n++] = {tile_fn, false, a, nt, gy, (unsigned)a.parts, bs};
    if (a.parts > 1)
        L[n++] = {nullptr, true, a, nt, nh, 1u, rb};
    L[n++] = {part_fn, false, d, ns, gy, (unsigned)d.parts, bs};
    if (d.parts > 1)
        L[n++] = {nullptr, true, d, ns, nh, 1u, rb};
    return n;
}

} /* namespace */

/* KVF_ATTN_HOST_EMU: tests/unit/cuda/host_attn_emu.cpp includes this file to run the kernels
 * above on the host under emulated threads; it launches them itself. */
#ifndef KVF_ATTN_HOST_EMU
extern "C" kvf_status kvf_cuda_attention(const kvf_cuda_attn_params *p, void *stream, kvf_err *err)
{
    kvf_status st = kvf_cuda_attn_check(p, err);
    if (st != KVF_OK || p->n_tokens == 0)
        return st;
    const kvf_kv_layout *l = &p->layout;
    attn_launch L[5];
    const int n = attn_plan(p, L);
    if (n == 0) /* supports() passed, so this is a table out of step with it */
        return kvf_err_set(err, KVF_ERR_INTERNAL, "attn: no kernel for head_dim %d, dtype %s",
                           l->head_dim, kvf_dtype_name(l->dtype));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    for (int i = 0; i < n; i++) {
        const attn_args &a = L[i].a;
        const attn_fn fn = L[i].fn;
        const dim3 grid(L[i].gx, L[i].gy, L[i].gz);
        const unsigned block = L[i].block;
        if (fn)
            fn<<<grid, block, 0, s>>>(a);
        else if (L[i].reduce) {
            const attn_red_fn red = attn_reduce_fn(a, l->head_dim);
            red<<<grid, block, 0, s>>>(a, l->head_dim);
        }
        else
            attn_count_kernel<<<grid, block, 0, s>>>(a);
    }
    return kvf_cuda_status((int)cudaGetLastError(), "attn: kernel launch", err);
}
#endif /* KVF_ATTN_HOST_EMU */
