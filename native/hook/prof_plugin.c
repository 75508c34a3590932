/*
 * The hook is also an NCCL profiler plugin: NCCL_PROFILER_PLUGIN naming this library makes NCCL
 * dlopen it, which gives back the instance LD_PRELOAD already loaded, so the plugin's counters
 * and the interposer's comm table live in one process state and one ring.
 *
 * NCCL looks for the newest ncclProfiler_vN it knows and falls back to older ones: this library
 * answers v6 (NCCL 2.29+), v5 (2.28), v4 (2.27) and v3 (2.26). An NCCL that finds none of them
 * (2.23 .. 2.25 ask for v2 and v1), or whose init call fails here (recording disabled, no ring),
 * goes on without the plugin. Each version's descriptor is read into one gh_pev here; what the
 * events do is prof_events.c's.
 */
#include "prof.h"

static const char plugin_name[] = "greyhound";

static ncclResult_t stop(void *handle) {
  gh_prof_stop(handle);
  return ncclSuccess;
}

static ncclResult_t finalize(void *ctx) {
  gh_prof_finalize(ctx);
  return ncclSuccess;
}

/* Network ops and steps, alike in every version. */
#define FROM_PROXY(D, EV)                                                                        \
  do {                                                                                           \
    if ((D)->type == ncclProfileProxyStep) {                                                     \
      (EV)->step = (D)->proxyStep.step;                                                          \
      break;                                                                                     \
    }                                                                                            \
    (EV)->pid = (D)->proxyOp.pid;                                                                \
    (EV)->channel = (D)->proxyOp.channelId;                                                      \
    (EV)->peer = (D)->proxyOp.peer;                                                              \
    (EV)->nsteps = (D)->proxyOp.nSteps;                                                          \
    (EV)->chunk = (D)->proxyOp.chunkSize;                                                        \
    (EV)->is_send = (D)->proxyOp.isSend;                                                         \
  } while (0)

/* ---- v5 and v6: the same events (v6 adds copy-engine ones, counted only) ---- */
#define FROM_V5(D, EV)                                                                           \
  do {                                                                                           \
    (EV)->type = (D)->type;                                                                      \
    (EV)->parent = (D)->parentObj;                                                               \
    switch ((D)->type) {                                                                         \
      case ncclProfileColl:                                                                      \
        (EV)->func = (D)->coll.func;                                                             \
        (EV)->seq = (D)->coll.seqNumber;                                                         \
        break;                                                                                   \
      case ncclProfileP2p:                                                                       \
        (EV)->func = (D)->p2p.func;                                                              \
        (EV)->peer = (D)->p2p.peer;                                                              \
        break;                                                                                   \
      case ncclProfileCollApi:                                                                   \
        (EV)->func = (D)->collApi.func;                                                          \
        break;                                                                                   \
      case ncclProfileP2pApi:                                                                    \
        (EV)->func = (D)->p2pApi.func;                                                           \
        break;                                                                                   \
      case ncclProfileProxyOp:                                                                   \
      case ncclProfileProxyStep:                                                                 \
        FROM_PROXY(D, EV);                                                                       \
        break;                                                                                   \
      case ncclProfileKernelCh:                                                                  \
        (EV)->channel = (D)->kernelCh.channelId;                                                 \
        (EV)->ptimer = (D)->kernelCh.pTimer;                                                     \
        break;                                                                                   \
      default:                                                                                   \
        break;                                                                                   \
    }                                                                                            \
  } while (0)

static ncclResult_t init_v5(void **ctx, uint64_t comm_id, int *mask, const char *name, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log) {
  (void)name, (void)nnodes, (void)log;
  return gh_prof_init(ctx, comm_id, mask, nranks, rank, 5) == 0 ? ncclSuccess : ncclInvalidUsage;
}

static ncclResult_t init_v6(void **ctx, uint64_t comm_id, int *mask, const char *name, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log) {
  (void)name, (void)nnodes, (void)log;
  return gh_prof_init(ctx, comm_id, mask, nranks, rank, 6) == 0 ? ncclSuccess : ncclInvalidUsage;
}

static ncclResult_t start_v5(void *ctx, void **handle, ncclProfilerEventDescr_v5_t *d) {
  struct gh_pev ev = {0};
  FROM_V5(d, &ev);
  gh_prof_start(ctx, handle, &ev);
  return ncclSuccess;
}

static ncclResult_t start_v6(void *ctx, void **handle, ncclProfilerEventDescr_v6_t *d) {
  struct gh_pev ev = {0};
  FROM_V5(d, &ev);
  gh_prof_start(ctx, handle, &ev);
  return ncclSuccess;
}

static ncclResult_t state_v4(void *handle, ncclProfilerEventState_t state, ncclProfilerEventStateArgs_v4_t *a) {
  uint64_t size = 0, ptimer = 0;
  if (a != NULL && state == ncclProfilerKernelChStop) ptimer = a->kernelCh.pTimer;
  else if (a != NULL && state >= ncclProfilerProxyStepSendGPUWait && state <= ncclProfilerProxyStepRecvGPUWait)
    size = a->proxyStep.transSize;
  else if (a != NULL && state == ncclProfilerProxyStepSendPeerWait_v4)
    size = a->proxyStep.transSize;
  gh_prof_state(handle, state, size, ptimer);
  return ncclSuccess;
}

/* ---- v4 ---- */
static ncclResult_t init_v4(void **ctx, int *mask, const char *name, uint64_t comm_hash, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log) {
  (void)name, (void)nnodes, (void)log;
  return gh_prof_init(ctx, comm_hash, mask, nranks, rank, 4) == 0 ? ncclSuccess : ncclInvalidUsage;
}

/* v3 and v4 descriptors carry the same events, v4 with the kernel's GPU timer. */
#define FROM_V34(D, EV, KERNEL_TIMER)                                                            \
  do {                                                                                           \
    (EV)->type = (D)->type;                                                                      \
    (EV)->parent = (D)->parentObj;                                                               \
    switch ((D)->type) {                                                                         \
      case ncclProfileColl:                                                                      \
        (EV)->func = (D)->coll.func;                                                             \
        (EV)->seq = (D)->coll.seqNumber;                                                         \
        break;                                                                                   \
      case ncclProfileP2p:                                                                       \
        (EV)->func = (D)->p2p.func;                                                              \
        (EV)->peer = (D)->p2p.peer;                                                              \
        break;                                                                                   \
      case ncclProfileProxyOp:                                                                   \
      case ncclProfileProxyStep:                                                                 \
        FROM_PROXY(D, EV);                                                                       \
        break;                                                                                   \
      case ncclProfileKernelCh:                                                                  \
        (EV)->channel = (D)->kernelCh.channelId;                                                 \
        KERNEL_TIMER;                                                                            \
        break;                                                                                   \
      default:                                                                                   \
        break;                                                                                   \
    }                                                                                            \
  } while (0)

static ncclResult_t start_v4(void *ctx, void **handle, ncclProfilerEventDescr_v4_t *d) {
  struct gh_pev ev = {0};
  FROM_V34(d, &ev, ev.ptimer = d->kernelCh.pTimer);
  gh_prof_start(ctx, handle, &ev);
  return ncclSuccess;
}

/* ---- v3: no rank in init, no GPU timers, no transfer sizes in the step states ---- */
static ncclResult_t init_v3(void **ctx, int *mask) {
  return gh_prof_init(ctx, 0, mask, 0, -1, 3) == 0 ? ncclSuccess : ncclInvalidUsage;
}

static ncclResult_t start_v3(void *ctx, void **handle, ncclProfilerEventDescr_v3_t *d) {
  struct gh_pev ev = {0};
  FROM_V34(d, &ev, (void)0);
  gh_prof_start(ctx, handle, &ev);
  return ncclSuccess;
}

static ncclResult_t state_v3(void *handle, ncclProfilerEventState_t state, ncclProfilerEventStateArgs_v3_t *a) {
  (void)a;
  gh_prof_state(handle, state, 0, 0);
  return ncclSuccess;
}

GH_EXPORT ncclProfiler_v6_t ncclProfiler_v6 = {plugin_name, init_v6, start_v6, stop, state_v4, finalize};
GH_EXPORT ncclProfiler_v5_t ncclProfiler_v5 = {plugin_name, init_v5, start_v5, stop, state_v4, finalize};
GH_EXPORT ncclProfiler_v4_t ncclProfiler_v4 = {plugin_name, init_v4, start_v4, stop, state_v4, finalize};
GH_EXPORT ncclProfiler_v3_t ncclProfiler_v3 = {plugin_name, init_v3, start_v3, stop, state_v3, finalize};
