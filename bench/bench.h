/* bench.h: the benchmarks behind `kvfleet bench <what>`, and the little they share: a timer and
 * the table/ratio printing every benchmark ends with. Each prints its table, the ratio to its
 * baseline measured in the same run, and a summary line. */
#ifndef KVF_BENCH_H
#define KVF_BENCH_H

#include <stddef.h>
#include <stdint.h>

int kvf_bench_kv_main(int argc, char **argv); /* bench/kv.c */
int kvf_bench_engine_main(int argc, char **argv); /* bench/engine.c */
int kvf_bench_xfer_main(int argc, char **argv); /* bench/xfer.c */
int kvf_bench_router_main(int argc, char **argv); /* bench/router.c */
int kvf_bench_serve_main(int argc, char **argv); /* bench/serve.c */
int kvf_bench_attn_main(int argc, char **argv); /* bench/attn.c */
int kvf_bench_sample_main(int argc, char **argv); /* bench/sample.c */
int kvf_bench_grammar_main(int argc, char **argv); /* bench/grammar.c */

/* Bytes per second of a plain sequential read of n bytes (the memory baseline several
 * benchmarks compare with); repeats until at least min_s seconds have passed. */
double kvf_bench_memread_bps(const void *buf, size_t n, double min_s);

#endif
