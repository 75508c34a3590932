/*
 * ProcessGroupNCCL's watchdog, as the workload models it (see watchdog.h). As PyTorch does, the
 * training thread stamps a work before the NCCL call and hands it to the watchdog after the call
 * returned (ProcessGroupNCCL::collective: initWork, the NCCL call, the end event, workEnqueue),
 * through a single-producer ring; every WATCH_NS (PyTorch's loop sleeps 100 ms) the watchdog looks
 * at the works it holds, oldest first, and checks each one's timeout before its completion, as
 * watchdogHandler does (checkTimeout, then isCompleted): a work stamped longer ago than the
 * timeout trips it even if the GPU has just finished it, so a call the host was parked in for
 * longer than the timeout takes the rank down right after the pause. Then: print what timed out,
 * abort every communicator (ncclCommAbort, so that the peers' operations fail too) and end the
 * process with status 134, as PyTorch's std::abort() would (SIGABRT). Works are retired in
 * order: NCCL completes one stream's work in order, and every work here is on the default stream.
 */
#include "watchdog.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "../fake/cuda_fake.h"
#include "../fake/fk_time.h"

#define WORKS 1024 /* power of two */
#define WATCH_NS 100000000LL
#define TEARDOWN_STATUS 134

struct work {
  int64_t stamp_ns;
  cudaEvent_t done;
  const char *what;
  int seq;
};

static struct {
  long timeout_ms;
  ncclComm_t comms[8];
  int ncomms;
  struct work ring[WORKS];
  _Atomic uint64_t head, tail; /* head: pushed (training thread), tail: retired (watchdog) */
} wd;

static void teardown(const struct work *w, int64_t now) {
  fprintf(stderr,
          "gh_workload: watchdog caught collective operation timeout: %s #%d ran for %lld ms, timeout %ld ms; "
          "aborting the communicators and taking the process down\n",
          w->what, w->seq, (long long)((now - w->stamp_ns) / 1000000), wd.timeout_ms);
  fflush(stderr);
  for (int i = 0; i < wd.ncomms; i++) ncclCommAbort(wd.comms[i]);
  _exit(TEARDOWN_STATUS);
}

static void *watch(void *arg) {
  (void)arg;
  /* Its event queries stay legal (and harmless) while another thread captures a graph. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const int64_t limit = (int64_t)wd.timeout_ms * 1000000LL;
  for (;;) {
    fk_sleep_ns(WATCH_NS);
    uint64_t t = atomic_load(&wd.tail), h = atomic_load(&wd.head);
    for (; t < h; t++) {
      struct work *w = &wd.ring[t & (WORKS - 1)];
      int64_t now = fk_now_ns();
      if (now - w->stamp_ns > limit) teardown(w, now);
      if (cudaEventQuery(w->done) == cudaErrorNotReady) break;
    }
    atomic_store(&wd.tail, t);
  }
  return NULL;
}

int gh_watchdog_start(long timeout_ms, ncclComm_t *comms, int ncomms) {
  if (timeout_ms <= 0) return 0;
  wd.timeout_ms = timeout_ms;
  for (int i = 0; i < ncomms && wd.ncomms < 8; i++)
    if (comms[i] != NULL) wd.comms[wd.ncomms++] = comms[i];
  for (int i = 0; i < WORKS; i++)
    if (cudaEventCreateWithFlags(&wd.ring[i].done, cudaEventDisableTiming) != cudaSuccess) return -1;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &attr, watch, NULL);
  pthread_attr_destroy(&attr);
  return rc == 0 ? 0 : -1;
}

int64_t gh_watchdog_stamp(void) { return wd.timeout_ms > 0 ? fk_now_ns() : 0; }

void gh_watchdog_issued(int64_t stamp_ns, const char *what, int seq) {
  if (wd.timeout_ms <= 0) return;
  uint64_t h = atomic_load(&wd.head);
  while (h - atomic_load(&wd.tail) >= WORKS) fk_sleep_ns(1000000); /* PyTorch's list grows; ours waits */
  struct work *w = &wd.ring[h & (WORKS - 1)];
  w->stamp_ns = stamp_ns;
  w->what = what;
  w->seq = seq;
  cudaEventRecord(w->done, NULL);
  atomic_store(&wd.head, h + 1);
}
