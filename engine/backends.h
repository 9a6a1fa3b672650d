/* backends.h: the compute backends of this build by name (the --device flag of every command
 * that computes: the workers, generate, bench engine), and the decode-attention kernel names,
 * so a command picks cpu or cuda through the engine alone, without the RPC or transport layers.
 * A name table resolved once, as transport/ does for its backends. */
#ifndef KVF_ENGINE_BACKENDS_H
#define KVF_ENGINE_BACKENDS_H

#include <stdint.h>

#include "common/status.h"
#include "model/backend.h"

/* The backend called name (NULL: "cpu"): "cpu" always; "cuda" in builds with CUDA and when a
 * device can be used. Errors start with who ("generate", "decode") and name the flag:
 * `generate: --device=tpu is not known (use cpu or cuda)`, or why cuda cannot run here. */
kvf_status kvf_engine_backend_by_name(const char *name, const char *who, const kvf_backend **out,
                                      kvf_err *err);

/* The KVF_BACKEND_ATTN_DECODE_* value an --attn-decode name selects (NULL: auto). Errors start
 * with who. */
kvf_status kvf_engine_attn_decode_pick(const char *name, const char *who, int32_t *out,
                                       kvf_err *err);

#endif
