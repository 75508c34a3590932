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

/* Until a TSC anchor is published (or for good, without an invariant TSC): ticks 0, so every stamp
 * takes clock_gettime. Two anchors alternate, so a new one is written while readers use the other. */
static const struct gh_tsc_anchor none;
const struct gh_tsc_anchor *gh_anchor_now = &none;

#if defined(__x86_64__)
#include <x86intrin.h>

static struct gh_tsc_anchor anchors[2];
static int tsc_ok, reanchoring;
static uint64_t first_tsc, first_ns;

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
  const struct gh_tsc_anchor *now = __atomic_load_n(&gh_anchor_now, __ATOMIC_RELAXED);
  struct gh_tsc_anchor *next = now == &anchors[0] ? &anchors[1] : &anchors[0];
  __atomic_store_n(&next->tsc, tsc, __ATOMIC_RELAXED);
  __atomic_store_n(&next->ns, ns, __ATOMIC_RELAXED);
  __atomic_store_n(&next->mult, mult, __ATOMIC_RELAXED);
  __atomic_store_n(&next->ticks, (uint64_t)(((unsigned __int128)REANCHOR_NS << 32) / (mult ? mult : 1)),
                   __ATOMIC_RELAXED);
  __atomic_store_n(&gh_anchor_now, next, __ATOMIC_RELEASE);
}

void gh_clock_init(void) {
  if (tsc_ok || !invariant_tsc()) return;
  pair(&first_tsc, &first_ns);
  uint64_t tsc, ns;
  do pair(&tsc, &ns);
  while (ns - first_ns < 2000000); /* 2 ms of baseline for the first rate; once per process */
  publish(tsc, ns);
  __atomic_store_n(&tsc_ok, 1, __ATOMIC_RELEASE);
}

/* The anchor is older than REANCHOR_NS (or the TSC went backwards): a fresh clock_gettime pair, which
 * one thread publishes as the next anchor. This stamp keeps its TSC read and the old rate (the return
 * stamp's few ticks are converted with it). No TSC anchor: clock_gettime, and so the return stamp. */
uint64_t gh_clock_slow(struct gh_stamp *k, uint64_t tsc) {
  const struct gh_tsc_anchor *a = __atomic_load_n(&gh_anchor_now, __ATOMIC_ACQUIRE);
  if (a == &none) {
    k->tsc = k->mult = k->ticks = 0;
    return gh_now_ns();
  }
  k->tsc = tsc;
  k->mult = __atomic_load_n(&a->mult, __ATOMIC_RELAXED);
  k->ticks = __atomic_load_n(&a->ticks, __ATOMIC_RELAXED);
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
uint64_t gh_clock_slow(struct gh_stamp *k, uint64_t tsc) {
  (void)tsc;
  k->tsc = k->mult = k->ticks = 0;
  return gh_now_ns();
}
#endif

/* A return stamp the enter stamp's anchor cannot serve (too late, no TSC): a fresh stamp, never
 * before the enter stamp. */
uint64_t gh_clock_late(uint64_t ns0) {
  struct gh_stamp k;
  uint64_t ns = gh_clock_enter(&k);
  return ns > ns0 ? ns : ns0;
}
