/*
 * Timestamps for the hot path. clock_gettime(CLOCK_MONOTONIC) costs ~30 ns in VMs, two per call
 * would be most of the budget, so on x86-64 with an invariant TSC we read the TSC and map it to
 * CLOCK_MONOTONIC through an anchor. The rate is measured against a baseline that grows with
 * the process (first anchor to latest), and any thread that finds the anchor older than
 * REANCHOR_NS takes a fresh clock_gettime pair, so the mapping's error shrinks with time
 * (microseconds at start, nanoseconds after seconds). Elsewhere: plain clock_gettime.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "gh_hook.h"

#define REANCHOR_NS 50000000ull /* 50 ms */

struct gh_tsc_anchor gh_anchor[2];
uint32_t gh_anchor_idx;
int gh_tsc_ok;
uint64_t gh_reanchor_ticks;
static uint64_t first_tsc, first_ns;
static int reanchoring;

#if defined(__x86_64__)
#include <x86intrin.h>

/* One (tsc, ns) pair with the TSC read on both sides of clock_gettime, midpoint taken: the
 * tightest of a few tries, so that a preemption between the reads (a loaded machine) cannot put
 * milliseconds of error into the anchor, nor, over the 2 ms first baseline, into the rate. */
static void pair(uint64_t *tsc, uint64_t *ns) {
  uint64_t best = UINT64_MAX;
  for (int i = 0; i < 5; i++) {
    uint64_t a = __rdtsc();
    uint64_t t = gh_now_ns();
    uint64_t b = __rdtsc();
    if (b - a < best) {
      best = b - a;
      *tsc = a + (b - a) / 2;
      *ns = t;
    }
  }
}

static int invariant_tsc(void) {
  FILE *f = fopen("/proc/cpuinfo", "re");
  if (f == NULL) return 0;
  char line[4096];
  int ok = 0;
  while (!ok && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "flags", 5) == 0) ok = strstr(line, " constant_tsc") && strstr(line, " nonstop_tsc");
  fclose(f);
  return ok;
}

static void publish(uint64_t tsc, uint64_t ns) {
  uint64_t dticks = tsc - first_tsc, dns = ns - first_ns;
  if (dticks == 0) return;
  uint64_t mult = (uint64_t)(((unsigned __int128)dns << 32) / dticks);
  uint32_t next = (__atomic_load_n(&gh_anchor_idx, __ATOMIC_RELAXED) + 1) & 1;
  __atomic_store_n(&gh_anchor[next].tsc, tsc, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_anchor[next].ns, ns, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_anchor[next].mult, mult, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_anchor_idx, next, __ATOMIC_RELEASE);
  __atomic_store_n(&gh_reanchor_ticks, (uint64_t)(((unsigned __int128)REANCHOR_NS << 32) / (mult ? mult : 1)),
                   __ATOMIC_RELAXED);
}

void gh_clock_init(void) {
  if (gh_tsc_ok || !invariant_tsc()) return;
  pair(&first_tsc, &first_ns);
  uint64_t tsc, ns;
  do pair(&tsc, &ns);
  while (ns - first_ns < 2000000); /* 2 ms of baseline for the first rate; once per process */
  publish(tsc, ns);
  __atomic_store_n(&gh_tsc_ok, 1, __ATOMIC_RELEASE);
}

uint64_t gh_tsc_reanchor(uint64_t tsc) {
  (void)tsc;
  uint64_t t, ns;
  pair(&t, &ns);
  int expect = 0;
  if (__atomic_compare_exchange_n(&reanchoring, &expect, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
    publish(t, ns);
    __atomic_store_n(&reanchoring, 0, __ATOMIC_RELEASE);
  }
  return ns;
}
#else
void gh_clock_init(void) {}
uint64_t gh_tsc_reanchor(uint64_t tsc) {
  (void)tsc;
  return gh_now_ns();
}
#endif
