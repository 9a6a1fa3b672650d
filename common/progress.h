/* progress.h: progress on a terminal for long-running commands (model load, benchmarks, trace
 * replay). Redraws one stderr line at most ten times a second when stderr is a terminal, and
 * prints nothing otherwise; the command prints its own summary at the end. */
#ifndef KVF_COMMON_PROGRESS_H
#define KVF_COMMON_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvf_progress {
    char label[64];
    int64_t total, done;
    double t_start, t_last;
    bool tty;
} kvf_progress;

void kvf_progress_init(kvf_progress *p, const char *label, int64_t total);
void kvf_progress_update(kvf_progress *p, int64_t done);
void kvf_progress_finish(kvf_progress *p); /* clears the line */

#endif
