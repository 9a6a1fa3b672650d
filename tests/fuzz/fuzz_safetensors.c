/* fuzz_safetensors.c: fuzzes the safetensors header parser with whole file images. Any input
 * must parse or fail with a message; every tensor handed out must lie inside the input (its
 * first and last bytes are read, so an out-of-bounds view trips ASan). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_model_safetensors *st = NULL;
    kvf_err err = {0};
    if (kvf_model_safetensors_parse(data, size, "fuzz", &st, &err) != KVF_OK) {
        if (st || !err.msg[0])
            abort();
        return 0;
    }
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < kvf_model_safetensors_count(st); i++) {
        const kvf_model_tensor *t = kvf_model_safetensors_get(st, i);
        if (t->n_bytes < 0 || (const uint8_t *)t->data < data ||
            (const uint8_t *)t->data + t->n_bytes > data + size)
            abort();
        if (t->n_bytes > 0)
            sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->n_bytes - 1];
        if (kvf_model_safetensors_find(st, t->name) != t)
            abort();
    }
    (void)sink;
    kvf_model_safetensors_destroy(st);
    return 0;
}
