/* sample_ref.h: the rule of kvf_cuda_sample (cuda.h) written plainly on the host in double
 * precision, and the error measure both sides compare kernels with, shared by the GPU test
 * (test_ops.c) and the host emulation (host_ops_emu.cpp). Header-only C that also compiles as
 * C++. */
#ifndef KVF_TEST_SAMPLE_REF_H
#define KVF_TEST_SAMPLE_REF_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"

/* Largest |a - b| over the largest |b|. */
static inline double kvf_test_rel_err(const float *a, const float *b, int64_t n)
{
    double mx = 0, d = 0;
    for (int64_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs(b[i]));
        d = fmax(d, fabs((double)a[i] - b[i]));
    }
    return d / (mx > 0 ? mx : 1);
}

/* The rule of kvf_cuda_sample in double precision on the host; kept[vocab] gets the kept set. */
static inline int32_t kvf_test_sample_ref(const float *r, int64_t vocab, const kvf_cuda_sample_row *p, bool *kept)
{
    if (p->mask) { /* the ids the mask leaves out count as NaN: never kept */
        float *m = (float *)malloc((size_t)vocab * 4);
        for (int64_t j = 0; j < vocab; j++)
            m[j] = p->mask[j >> 5] >> (j & 31) & 1u ? r[j] : NAN;
        kvf_cuda_sample_row q = *p;
        q.mask = NULL;
        int32_t t = kvf_test_sample_ref(m, vocab, &q, kept);
        free(m);
        return t;
    }
    float mx = -INFINITY;
    for (int64_t j = 0; j < vocab; j++)
        mx = fmaxf(mx, r[j]);
    if (mx == INFINITY || mx == -INFINITY || 1.0f / p->temperature == INFINITY) { /* the argmax: the lowest id */
        int64_t first = 0;
        while (first < vocab && r[first] != mx)
            first++;
        for (int64_t j = 0; j < vocab; j++)
            kept[j] = j == first;
        return (int32_t)first;
    }
    float kth = -INFINITY;
    if (p->top_k > 0 && p->top_k < vocab) { /* the k-th largest value */
        float *c = (float *)malloc((size_t)vocab * 4);
        memcpy(c, r, (size_t)vocab * 4);
        for (int32_t i = 0; i < p->top_k; i++) { /* partial selection, small k in tests */
            int64_t b = i;
            for (int64_t j = i + 1; j < vocab; j++)
                if (c[j] > c[b] || (c[b] != c[b] && c[j] == c[j])) /* NaN ranks last */
                    b = j;
            float t = c[i];
            c[i] = c[b];
            c[b] = t;
        }
        kth = c[p->top_k - 1];
        free(c);
    }
    double z = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (r[j] >= kth)
            z += exp(((double)r[j] - mx) / p->temperature);
    float thr = kth;
    if (p->top_p < 1.0f) { /* the largest logit value whose kept mass reaches top_p * z */
        float best = kth;
        for (int64_t j = 0; j < vocab; j++) {
            if (r[j] < kth || r[j] <= best)
                continue;
            double m = 0;
            for (int64_t i = 0; i < vocab; i++)
                if (r[i] >= r[j])
                    m += exp(((double)r[i] - mx) / p->temperature);
            if (m >= p->top_p * z)
                best = r[j];
        }
        thr = best;
    }
    double zk = 0;
    for (int64_t j = 0; j < vocab; j++) {
        kept[j] = r[j] >= thr;
        if (kept[j])
            zk += exp(((double)r[j] - mx) / p->temperature);
    }
    double target = p->u * zk, acc = 0;
    int32_t last = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (kept[j]) {
            acc += exp(((double)r[j] - mx) / p->temperature);
            last = (int32_t)j;
            if (target < acc)
                return (int32_t)j;
        }
    return last;
}

#endif
