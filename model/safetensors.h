/* safetensors.h: reading safetensors files: one model.safetensors, or the shards named by a
 * model.safetensors.index.json, memory-mapped read-only. The header is bounds-checked against
 * the file before any tensor is handed out; deciding which tensors a model needs is model.c's. */
#ifndef KVF_MODEL_SAFETENSORS_H
#define KVF_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define KVF_MODEL_MAX_DIMS 8
#define KVF_MODEL_ST_MAX_HEADER (100u << 20) /* the format's own limit on the JSON header */

/* One tensor: a view into a mapping (or into the buffer given to _parse). */
typedef struct kvf_model_tensor {
    const char *name;   /* owned by the kvf_model_safetensors */
    int dtype;          /* a kvf_dtype (F32, F16, BF16, F8_E4M3), or -1 for other element types */
    char dtype_name[8]; /* as written in the file: "F32", "BF16", "I64", ... */
    int32_t n_dims;
    int64_t shape[KVF_MODEL_MAX_DIMS];
    int64_t n_elems;
    int64_t n_bytes;
    const void *data; /* n_bytes bytes; may be unaligned */
    int32_t shard;    /* which file it came from (0 for a single file) */
} kvf_model_tensor;

typedef struct kvf_model_safetensors kvf_model_safetensors;

/* Parses one safetensors image held in memory. buf is borrowed: it must outlive *out.
 * what names it in messages. Fails (never crashes) on a truncated file, a header length past
 * the end, bad JSON, an unknown dtype, a shape whose size disagrees with its data_offsets,
 * offsets outside the data, or a duplicate name. */
kvf_status kvf_model_safetensors_parse(const void *buf, size_t len, const char *what,
                                       kvf_model_safetensors **out, kvf_err *err);
/* Memory-maps one .safetensors file and parses it. */
kvf_status kvf_model_safetensors_open(const char *path, kvf_model_safetensors **out, kvf_err *err);
/* Opens a model directory: model.safetensors.index.json (every shard it names, each checked to
 * hold the tensors the index puts in it) when present, else model.safetensors. */
kvf_status kvf_model_safetensors_open_dir(const char *dir, kvf_model_safetensors **out,
                                          kvf_err *err);
void kvf_model_safetensors_destroy(kvf_model_safetensors *st);

size_t kvf_model_safetensors_count(const kvf_model_safetensors *st);
const kvf_model_tensor *kvf_model_safetensors_get(const kvf_model_safetensors *st, size_t i);
/* NULL when absent. */
const kvf_model_tensor *kvf_model_safetensors_find(const kvf_model_safetensors *st,
                                                   const char *name);
int32_t kvf_model_safetensors_n_shards(const kvf_model_safetensors *st);

/* "[64, 176]" into buf, for messages. */
const char *kvf_model_tensor_shape_str(const kvf_model_tensor *t, char *buf, size_t cap);

#endif
