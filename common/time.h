/* time.h: clocks. Monotonic for durations and deadlines, wall clock only for logs. */
#ifndef KVF_COMMON_TIME_H
#define KVF_COMMON_TIME_H

#include <stdint.h>

int64_t kvf_now_ns(void); /* CLOCK_MONOTONIC */
double kvf_now_s(void);   /* CLOCK_MONOTONIC in seconds */
int64_t kvf_wall_ms(void); /* CLOCK_REALTIME, ms since the epoch */
void kvf_sleep_ms(int64_t ms);

#endif
