/*
 * A profiler plugin that does nothing (v5, as the fake NCCL plays 2.28): what NCCL's own event
 * dispatch costs the caller, which bench/hook_counters.py takes off the hook's plugin's numbers.
 */
#include <stdlib.h>

#include "nccl_profiler_abi.h"

static int dummy;

static ncclResult_t init(void **ctx, uint64_t id, int *mask, const char *name, int nnodes, int nranks, int rank,
                         ncclDebugLogger_t log) {
  (void)id, (void)name, (void)nnodes, (void)nranks, (void)rank, (void)log;
  const char *e = getenv("GREYHOUND_PROFILER_MASK");
  *mask = e != NULL ? (int)strtol(e, NULL, 0)
                    : ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileKernelCh;
  *ctx = &dummy;
  return ncclSuccess;
}
static ncclResult_t start(void *ctx, void **handle, ncclProfilerEventDescr_v5_t *d) {
  (void)ctx, (void)d;
  *handle = &dummy;
  return ncclSuccess;
}
static ncclResult_t stop(void *handle) {
  (void)handle;
  return ncclSuccess;
}
static ncclResult_t state(void *handle, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v5_t *a) {
  (void)handle, (void)s, (void)a;
  return ncclSuccess;
}
static ncclResult_t fini(void *ctx) {
  (void)ctx;
  return ncclSuccess;
}
__attribute__((visibility("default"))) ncclProfiler_v5_t ncclProfiler_v5 = {"null", init, start, stop, state, fini};
