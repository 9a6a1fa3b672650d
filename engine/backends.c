/* backends.c: the name table behind --device: each entry says how to get its backend and
 * whether it can run here; a build without CUDA still knows the name "cuda", to say why not. */
#include "engine/backends.h"

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#ifdef KVF_HAVE_CUDA
#include "cuda/cuda.h"
#endif

typedef struct backend_entry {
    const char *name;
    const kvf_backend *(*get)(void);        /* NULL: not in this build */
    bool (*available)(char *why, size_t n); /* NULL: always */
    const char *missing;                    /* why it is not in this build */
} backend_entry;

static const backend_entry backends[] = {
    {"cpu", kvf_model_backend_cpu, NULL, NULL},
#ifdef KVF_HAVE_CUDA
    {"cuda", kvf_cuda_backend, kvf_cuda_available, NULL},
#else
    {"cuda", NULL, NULL, "this kvfleet was built without CUDA (nvcc was not found when it was "
                         "configured)"},
#endif
};

kvf_status kvf_engine_backend_by_name(const char *name, const char *who, const kvf_backend **out,
                                      kvf_err *err)
{
    const char *n = name ? name : "cpu";
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
        const backend_entry *b = &backends[i];
        if (strcmp(b->name, n) != 0)
            continue;
        if (!b->get)
            return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "%s: --device %s: %s", who, n, b->missing);
        char why[256] = "";
        if (b->available && !b->available(why, sizeof why))
            return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "%s: --device %s: %s", who, n, why);
        *out = b->get();
        return KVF_OK;
    }
    return kvf_err_set(err, KVF_ERR_INVALID, "%s: --device=%s is not known (use cpu or cuda)", who, n);
}

kvf_status kvf_engine_attn_decode_pick(const char *name, const char *who, int32_t *out,
                                       kvf_err *err)
{
    const char *n = name ? name : "auto";
    int k = kvf_backend_attn_decode_parse(n, strlen(n));
    if (k < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --attn-decode=%s is not known (use auto, "
                           "simt or mma)", who, n);
    *out = k;
    return KVF_OK;
}
