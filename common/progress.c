/* progress.c: a terminal progress line. */
#include "common/progress.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/time.h"

void kvf_progress_init(kvf_progress *p, const char *label, int64_t total)
{
    memset(p, 0, sizeof *p);
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total = total;
    p->t_start = p->t_last = kvf_now_s();
    p->tty = isatty(STDERR_FILENO) == 1;
}

void kvf_progress_update(kvf_progress *p, int64_t done)
{
    p->done = done;
    if (!p->tty)
        return;
    double now = kvf_now_s();
    if (now - p->t_last < 0.1 && done < p->total)
        return;
    p->t_last = now;
    double el = now - p->t_start;
    double rate = el > 0 ? (double)done / el : 0;
    if (p->total > 0) {
        double eta = rate > 0 ? (double)(p->total - done) / rate : 0;
        fprintf(stderr, "\r%s: %lld/%lld (%.0f%%) %.1f/s eta %.0fs   ", p->label,
                (long long)done, (long long)p->total, 100.0 * (double)done / (double)p->total,
                rate, eta);
    } else {
        fprintf(stderr, "\r%s: %lld %.1f/s   ", p->label, (long long)done, rate);
    }
    fflush(stderr);
}

void kvf_progress_finish(kvf_progress *p)
{
    if (p->tty) {
        fprintf(stderr, "\r%*s\r", 72, "");
        fflush(stderr);
    }
}
