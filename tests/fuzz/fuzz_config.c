/* fuzz_config.c: fuzzes config.json parsing. Any input must parse or fail with a message; a
 * parsed config must satisfy the invariants the loader and the forward pass rely on. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_model_config c;
    kvf_err err = {0};
    if (kvf_model_config_parse((const char *)data, size, "fuzz/config.json", &c, &err) != KVF_OK) {
        if (!err.msg[0])
            abort();
        return 0;
    }
    if (c.dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
        c.n_heads % c.n_kv_heads != 0 || c.head_dim <= 0 || c.head_dim % 2 != 0 ||
        c.head_dim > KVF_MODEL_MAX_HEAD_DIM || c.vocab_size <= 0 || c.hidden_dim <= 0 ||
        c.n_eos < 0 || c.n_eos > KVF_MODEL_MAX_EOS || c.bos_id >= c.vocab_size)
        abort();
    for (int32_t i = 0; i < c.n_eos; i++)
        if (c.eos_ids[i] < 0 || c.eos_ids[i] >= c.vocab_size)
            abort();
    double f[KVF_MODEL_MAX_HEAD_DIM / 2], ps;
    kvf_model_config_rope_freqs(&c, f, &ps);
    for (int32_t i = 0; i < c.head_dim / 2; i++)
        if (!(f[i] > 0))
            abort();
    (void)kvf_model_config_n_params(&c);
    (void)kvf_model_config_window(&c, c.n_layers - 1);
    return 0;
}
