/*
 * Overhead driver for bench/hook_overhead: ns per ncclAllReduce call against whatever NCCL the
 * loader finds (the fake in no-op mode), median over repeats. Run once plain, once preloaded.
 * Between repeats (untimed) it plays the agent and marks the ring consumed, so every timed call
 * takes the full recording path rather than the cheaper drop path of a full ring.
 * Prints one line: "<median ns/call> <min ns/call> <records dropped>".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "nccl_abi.h"
#include "ring_view.h"

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  long calls = argc > 1 ? atol(argv[1]) : 50000;
  int repeats = argc > 2 ? atoi(argv[2]) : 15;
  if (calls < 1 || repeats < 1 || repeats > 1000) return 2;
  ncclUniqueId id;
  ncclComm_t comm;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) {
    fprintf(stderr, "bench_calls: NCCL init failed\n");
    return 1;
  }
  double *per = malloc(sizeof(double) * (size_t)repeats);
  float buf[16] = {0};
  for (long i = 0; i < calls / 10; i++) ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, comm, NULL);
  struct ring_view v;
  int hooked = getenv("LD_PRELOAD") != NULL && ring_open(&v, getenv("GREYHOUND_JOB_ID"), 0);
  for (int r = 0; r < repeats; r++) {
    if (hooked) __atomic_store_n(&v.h->consumed, __atomic_load_n(&v.h->head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
    uint64_t t0 = now_ns();
    for (long i = 0; i < calls; i++) ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, comm, NULL);
    per[r] = (double)(now_ns() - t0) / (double)calls;
  }
  qsort(per, (size_t)repeats, sizeof *per, cmp);
  printf("%.3f %.3f %llu\n", per[repeats / 2], per[0], hooked ? (unsigned long long)v.h->dropped : 0ull);
  ncclCommDestroy(comm);
  free(per);
  return 0;
}
