/*
 * The fake NCCL's side of the profiler plugin interface: loading (nccl_prof.c), the events the
 * host raises at API calls and launches (nccl_prof_host.c), and those the device side raises while
 * an operation runs: each channel's kernel, and for transfers to a peer on another node the
 * network ops and their steps (nccl_prof_dev.c).
 */
#ifndef GH_NCCL_PROF_H
#define GH_NCCL_PROF_H

#include "nccl_fake.h"
#include "nccl_profiler_abi.h"

/* One event to raise, whatever the version the plugin speaks. */
struct fk_pev {
  uint64_t type;
  void *parent; /* the parent event's handle */
  void *group;  /* tasks: their launch's Group event (v3/v4 parent them to it) */
  int rank;
  const char *func, *dtype;
  uint64_t count, seq, ptimer;
  void *stream;
  int root, peer, nchannels, depth;
  pid_t pid;
  int channel, nsteps, chunk, is_send, step;
};

/* nccl_prof.c */
int fk_prof_version(void); /* the interface the plugin gave (3..6), 0 no plugin */
int fk_prof_mask(void);    /* the activation mask now (the plugin may change it at any time) */
void fk_prof_comm_init(struct ncclComm *c);
void fk_prof_comm_fini(struct ncclComm *c);
void fk_prof_start(const struct ncclComm *c, void **handle, const struct fk_pev *e);
void fk_prof_stop(void *handle);
void fk_prof_state(void *handle, ncclProfilerEventState_t state, uint64_t size, uint64_t ptimer);

/* nccl_prof_host.c: the caller's thread. api_call raises a call's API events (opening its
 * outermost group's GroupApi event at its first call) and stamps the call with the mask its
 * launch and device events follow; api_group_end / api_end close the group (after a call outside
 * a group, or at the outermost GroupEnd); launch raises a launch's Group, KernelLaunch and tasks. */
void fk_prof_api_call(struct fk_call *k, int group_depth);
void fk_prof_api_group_end(void);
void fk_prof_api_end(void);
void fk_prof_launch(struct fk_call *calls, int n);

/* nccl_prof_dev.c: the device side of one batch. begin, once every call was posted (the
 * kernels start, the network ops are posted); run, once the calls' transfer windows are known
 * (ready_ns .. deadline_ns): raises the events of every step that may end now, at their device
 * times, a stalled channel's up to its stall (run again once the stall is over); end: whatever
 * is still open ends with the batch. */
#define FK_NCCL_STEPS 8 /* steps of one op in flight at once (NCCL_STEPS) */
int fk_ranks_per_node(void);
int fk_channels(void);
struct fk_prof_batch;
struct fk_prof_batch *fk_prof_dev_begin(struct fk_call *calls, int n, int64_t arrival);
void fk_prof_dev_run(struct fk_prof_batch *pb);
void fk_prof_dev_end(struct fk_prof_batch *pb, int ok);
/* `stop_channel` for collective seq of c: the comm rank that stops (and its channel), -1 none. */
int fk_stall_rank(const struct ncclComm *c, uint32_t seq, int *channel);

#endif
