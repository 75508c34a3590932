/*
 * Overhead driver for bench/hook_overhead: ns per ncclAllReduce call against whatever NCCL the
 * loader finds (the fake in no-op mode), median over repeats. Run once plain, once preloaded.
 * Calls go in batches of BATCH, each timed; between batches (untimed) it plays the agent and
 * marks the ring consumed, and waits for the hook's poller to retire the batch's completion
 * marks, so every timed call takes the full path: ring record and completion mark (a slot and an
 * event recorded), never the cheaper drop paths of a full ring or a full mark ring.
 * Mode "cuda" (argv[3]) times instead the two CUDA calls a completion mark makes
 * (cudaStreamIsCapturing, cudaEventRecord of a timing-free event on an idle stream), which the
 * hook's cost is reported without.
 * Every call goes through bench_call (not inlined) so that callgrind can count just it.
 * Prints one line: "<median ns/call> <min ns/call> <records dropped> <marks lost> <batches whose
 * marks did not retire in time> <calls made>" (calls made: 1 + calls/10 warm-up + the timed ones).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl_abi.h"
#include "ring_view.h"

#define BATCH 1000 /* below the hook's 1024 marks per communicator */

typedef int (*capturing_fn)(cudaStream_t, int *);
typedef int (*record_fn)(void *, cudaStream_t);
typedef int (*create_fn)(void **, unsigned);

static ncclComm_t comm;
static float buf[16];
static capturing_fn is_capturing;
static record_fn record;
static void *event;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

__attribute__((noinline)) void bench_call(void) { ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, comm, NULL); }

__attribute__((noinline)) void bench_cuda_calls(void) {
  int cap = 0;
  is_capturing(NULL, &cap);
  record(event, NULL);
}

/* Untimed: the agent consumed everything and the poller retired every mark. 0 when it did not
 * within a second (the next batch may then meet a fuller mark ring). */
static int settle(struct ring_view *v, struct gh_comm_entry *e) {
  __atomic_store_n(&v->h->consumed, __atomic_load_n(&v->h->head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  if (e == NULL) return 1;
  uint64_t end = now_ns() + 1000000000ull;
  while (__atomic_load_n(&e->gpu_calls_done, __ATOMIC_ACQUIRE) < __atomic_load_n(&e->calls_entered, __ATOMIC_ACQUIRE)) {
    if (now_ns() > end) return 0;
    struct timespec nap = {0, 50000};
    nanosleep(&nap, NULL);
  }
  return 1;
}

int main(int argc, char **argv) {
  long calls = argc > 1 ? atol(argv[1]) : 50000;
  int repeats = argc > 2 ? atoi(argv[2]) : 15;
  int cuda_mode = argc > 3 && strcmp(argv[3], "cuda") == 0;
  if (calls < 1 || repeats < 1 || repeats > 1000) return 2;
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) {
    fprintf(stderr, "bench_calls: NCCL init failed\n");
    return 1;
  }
  void (*call)(void) = bench_call;
  if (cuda_mode) {
    void *rt = dlopen("libcudart.so.12", RTLD_LAZY | RTLD_NOLOAD);
    create_fn create = rt != NULL ? (create_fn)dlsym(rt, "cudaEventCreateWithFlags") : NULL;
    is_capturing = rt != NULL ? (capturing_fn)dlsym(rt, "cudaStreamIsCapturing") : NULL;
    record = rt != NULL ? (record_fn)dlsym(rt, "cudaEventRecord") : NULL;
    if (create == NULL || is_capturing == NULL || record == NULL || create(&event, 0x2u) != 0) {
      fprintf(stderr, "bench_calls: no CUDA runtime in the process\n");
      return 1;
    }
    call = bench_cuda_calls;
  }
  double *per = malloc(sizeof(double) * (size_t)repeats);
  struct ring_view v;
  int hooked = getenv("LD_PRELOAD") != NULL && ring_open(&v, getenv("GREYHOUND_JOB_ID"), 0);
  struct gh_comm_entry *e = hooked ? &v.comms[0] : NULL;
  long late = 0;
  call(); /* hooked: starts the hook's poller, which makes the communicator's events */
  for (uint64_t end = now_ns() + 10000000000ull; hooked && now_ns() < end;) {
    if (__atomic_load_n(&e->gpu_marks, __ATOMIC_ACQUIRE) != 0) break;
    struct timespec nap = {0, 1000000};
    nanosleep(&nap, NULL);
  }
  for (long i = 0; i < calls / 10; i++) {
    if (hooked && i % BATCH == 0) settle(&v, e);
    call();
  }
  if (hooked) settle(&v, e);
  uint64_t lost0 = hooked ? __atomic_load_n(&e->gpu_marks_lost, __ATOMIC_ACQUIRE) : 0;
  for (int r = 0; r < repeats; r++) {
    uint64_t spent = 0;
    for (long done = 0; done < calls; done += BATCH) {
      long n = calls - done < BATCH ? calls - done : BATCH;
      if (hooked) late += !settle(&v, e);
      uint64_t t0 = now_ns();
      for (long i = 0; i < n; i++) call();
      spent += now_ns() - t0;
    }
    per[r] = (double)spent / (double)calls;
  }
  qsort(per, (size_t)repeats, sizeof *per, cmp);
  printf("%.3f %.3f %llu %llu %ld %ld\n", per[repeats / 2], per[0],
         hooked ? (unsigned long long)v.h->dropped : 0ull,
         hooked ? (unsigned long long)(__atomic_load_n(&e->gpu_marks_lost, __ATOMIC_ACQUIRE) - lost0) : 0ull, late,
         1 + calls / 10 + calls * repeats);
  ncclCommDestroy(comm);
  free(per);
  return 0;
}
