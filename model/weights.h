/* weights.h: writing models: gen-model presets, config.json from a kvf_model_config, and a
 * random-weight model.safetensors (streamed, deterministic for a seed), for `kvfleet gen-model`
 * and for tests. The tokenizer files are tokenizer.h's. */
#ifndef KVF_MODEL_WEIGHTS_H
#define KVF_MODEL_WEIGHTS_H

#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "model/config.h"

/* Fills *out with a preset: "tiny" (dim 64, 2 layers, 4/2 heads, ~0.1M parameters without the
 * embedding), "small" (dim 288, 6 layers, 6 heads, hidden 768: ~15M with a 32000 vocab),
 * "medium" (dim 768, 12 layers, 12 heads, hidden 2048: ~110M with a 32000 vocab), "1b" (dim
 * 2048, 16 layers, 32/8 heads of 64, hidden 8192, tied embeddings: ~1.0B with a 32000 vocab;
 * for GPU figures, written with --dtype bf16). */
kvf_status kvf_model_preset(const char *name, int32_t vocab_size, kvf_model_config *out,
                            kvf_err *err);

/* Writes c as a Hugging Face config.json (model_type, shapes, RoPE, window, biases, tying,
 * bos/eos, torch_dtype = dtype). */
kvf_status kvf_model_config_write(const char *path, const kvf_model_config *c, kvf_dtype dtype,
                                  kvf_err *err);

/* Writes every tensor c implies (names and shapes as model.c checks them) to path, in dtype
 * (f32, f16 or bf16), drawn from a fixed PRNG seeded with seed: projections uniform in
 * +-1/sqrt(fan_in), norms near 1, biases small. Streams row by row; never holds a whole
 * tensor. */
kvf_status kvf_model_weights_write_random(const char *path, const kvf_model_config *c,
                                          kvf_dtype dtype, uint64_t seed, kvf_err *err);

#endif
