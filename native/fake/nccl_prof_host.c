/*
 * Profiler events on the caller's thread, in NCCL 2.28's order (enqueue.cc, group.cc): the first
 * call of an outermost group (a call outside a group is a group of one) opens a GroupApi event and
 * takes the activation mask for the whole group; each call raises CollApi or P2pApi (start, stop);
 * GroupEnd marks GroupEndApiStart, launches, and closes the GroupApi event. A launch raises Group,
 * KernelLaunch, and one Coll or P2p task per call (the collective's seqNumber counts per
 * communicator and function, from 0, whether or not a plugin listens), stopped once launched: a
 * task's stop means enqueued, and its handle lives on as the parent of the device's events. Older
 * interfaces (v3, v4) have no API events: their tasks hang off the Group event.
 */
#include <string.h>
#include <unistd.h>

#include "nccl_prof.h"

#define TASK_CLASSES (ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep | \
                      ncclProfileKernelCh | ncclProfileNetPlugin)
#define API_CLASSES (TASK_CLASSES | ncclProfileGroupApi | ncclProfileCollApi | ncclProfileP2pApi | \
                     ncclProfileKernelLaunch | ncclProfileGroup)

static _Thread_local int t_open;   /* an outermost group's API events are open */
static _Thread_local int t_mask;   /* the mask its calls were enqueued with */
static _Thread_local void *t_api;  /* its GroupApi event */

static const char *func_name(uint32_t op) {
  static const char *const names[] = {[FK_OP_ALLREDUCE] = "AllReduce", [FK_OP_BROADCAST] = "Broadcast",
                                      [FK_OP_REDUCE] = "Reduce", [FK_OP_ALLGATHER] = "AllGather",
                                      [FK_OP_REDUCESCATTER] = "ReduceScatter", [FK_OP_ALLTOALL] = "AlltoAll",
                                      [FK_OP_SEND] = "Send", [FK_OP_RECV] = "Recv"};
  return op <= FK_OP_RECV && names[op] != NULL ? names[op] : "Unknown";
}

static const char *dtype_name(uint32_t t) {
  static const char *const names[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                      "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16",
                                      "ncclFloat8e4m3", "ncclFloat8e5m2"};
  return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

static int p2p(const struct fk_call *k) { return k->op == FK_OP_SEND || k->op == FK_OP_RECV; }

void fk_prof_api_call(struct fk_call *k, int group_depth) {
  k->prof_mask = 0;
  k->prof_api = k->prof_task = NULL;
  if (fk_prof_version() == 0 || !k->comm->prof_on) return;
  struct ncclComm *c = k->comm;
  if (!t_open) {
    t_open = 1;
    t_mask = fk_prof_mask();
    t_api = NULL;
    if (t_mask & API_CLASSES) {
      struct fk_pev e = {.type = ncclProfileGroupApi, .rank = c->rank, .depth = group_depth > 0 ? group_depth + 1 : 1};
      fk_prof_start(c, &t_api, &e);
      fk_prof_state(t_api, ncclProfilerGroupStartApiStop, 0, 0);
    }
  }
  k->prof_mask = t_mask;
  int want = p2p(k) ? (TASK_CLASSES | ncclProfileP2pApi) : (TASK_CLASSES | ncclProfileCollApi);
  if (t_mask & want) {
    struct fk_pev e = {.type = p2p(k) ? ncclProfileP2pApi : ncclProfileCollApi, .parent = t_api, .rank = c->rank,
                       .func = func_name(k->op), .dtype = dtype_name(k->dtype), .count = k->count,
                       .root = k->root, .stream = (void *)k->stream};
    fk_prof_start(c, &k->prof_api, &e);
    fk_prof_stop(k->prof_api);
  }
}

void fk_prof_api_group_end(void) {
  if (t_open && t_api != NULL) fk_prof_state(t_api, ncclProfilerEndGroupApiStart, 0, 0);
}

void fk_prof_api_end(void) {
  if (!t_open) return;
  fk_prof_stop(t_api);
  t_api = NULL;
  t_open = 0;
}

void fk_prof_launch(struct fk_call *calls, int n) {
  int mask = 0;
  struct ncclComm *first = NULL;
  for (int i = 0; i < n; i++) {
    struct ncclComm *c = calls[i].comm;
    c->prof_seq[calls[i].op]++; /* NCCL counts whether or not a plugin listens */
    calls[i].seq_fn = c->prof_seq[calls[i].op] - 1;
    if (first == NULL && calls[i].prof_mask != 0) {
      first = c;
      mask = calls[i].prof_mask;
    }
  }
  if (first == NULL) return;
  void *group = NULL, *launch = NULL;
  if (mask & (TASK_CLASSES | ncclProfileGroup)) {
    struct fk_pev e = {.type = ncclProfileGroup, .rank = first->rank};
    fk_prof_start(first, &group, &e);
  }
  if (mask & ncclProfileKernelLaunch) {
    struct fk_pev e = {.type = ncclProfileKernelLaunch, .parent = t_api, .rank = first->rank,
                       .stream = (void *)calls[0].stream};
    fk_prof_start(first, &launch, &e);
  }
  int nch = fk_channels();
  for (int i = 0; i < n; i++) {
    struct fk_call *k = &calls[i];
    if (!(k->prof_mask & TASK_CLASSES)) continue;
    struct fk_pev e = {.type = p2p(k) ? ncclProfileP2p : ncclProfileColl, .parent = k->prof_api, .group = group,
                       .rank = k->comm->rank, .func = func_name(k->op), .dtype = dtype_name(k->dtype),
                       .count = k->count, .seq = k->seq_fn, .root = k->root, .peer = k->root,
                       .nchannels = p2p(k) ? 1 : nch};
    fk_prof_start(k->comm, &k->prof_task, &e);
  }
  for (int i = 0; i < n; i++) fk_prof_stop(calls[i].prof_task);
  fk_prof_stop(launch);
  fk_prof_stop(group);
}
