/*
 * Monotonic time helpers shared by the fake libraries and the workload. CLOCK_MONOTONIC is
 * system-wide, so timestamps written by one rank into shared memory compare with another's.
 */
#ifndef GH_FK_TIME_H
#define GH_FK_TIME_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

static inline int64_t fk_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Absolute sleeps keep the modelled completion time exact even when the sleep is interrupted. */
static inline void fk_sleep_until(int64_t t_ns) {
  struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000LL), .tv_nsec = (long)(t_ns % 1000000000LL)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

static inline void fk_sleep_ns(int64_t d_ns) {
  if (d_ns > 0) fk_sleep_until(fk_now_ns() + d_ns);
}

#endif
