/*
 * The NCCL profiler plugin inside the hook (prof_plugin.c: the versioned entry points NCCL looks
 * up; prof_events.c: what the events do to the ring's gh_progress region). Every version's
 * descriptor is turned into one gh_pev, so the counting exists once.
 */
#ifndef GREYHOUND_HOOK_PROF_H
#define GREYHOUND_HOOK_PROF_H

#include <sys/types.h>

#include "gh_hook.h"
#include "nccl_profiler_abi.h"

#pragma GCC visibility push(hidden)

/* One event as NCCL described it, whatever the interface version. */
struct gh_pev {
  uint64_t type;  /* one ncclProfile* bit */
  void *parent;   /* the parent event's handle (ours), or NULL */
  const char *func; /* Coll, P2p, CollApi, P2pApi: NCCL's function name ("AllReduce", "Send") */
  uint64_t seq;   /* Coll: NCCL's sequence number (per communicator and function) */
  uint64_t ptimer; /* KernelCh: the GPU timer at the channel's start (v4+) */
  pid_t pid;      /* ProxyOp: the process that made the op (PXN: another rank's) */
  int peer;       /* P2p, ProxyOp */
  int channel;    /* ProxyOp, KernelCh */
  int nsteps, chunk, is_send; /* ProxyOp */
  int step;       /* ProxyStep */
};

/* The interface versions this plugin gives NCCL (prof_plugin.c exports ncclProfiler_v3 .. v6). */
#define GH_PROF_MIN_VERSION 3
#define GH_PROF_MAX_VERSION 6

/* Event classes on by default: what CCL-D's counters need, a few events per collective on the
 * caller's thread (its task) and the rest on NCCL's proxy thread (each network op and step with
 * its states, each channel's kernel start and stop). The costly ones come on while the agent
 * profiles (control block in profile mode) or asks for them (gh_progress.mask_extra): per-call
 * API events and kernel launches on the caller's thread, the proxy thread's own activity and the
 * network plugin's per-request events. (NCCL 2.28+ raises GroupApi and CollApi/P2pApi events
 * whenever any task or network class is on: there the caller pays for them by default.) */
#define GH_PROF_DEFAULT_MASK                                                                      \
  (ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileKernelCh)
#define GH_PROF_COSTLY_MASK                                                                       \
  (ncclProfileProxyCtrl | ncclProfileNetPlugin | ncclProfileGroupApi | ncclProfileCollApi |       \
   ncclProfileP2pApi | ncclProfileKernelLaunch)

/* 0 on success; nonzero tells NCCL to go on without the plugin. `rank` -1: not given (v3). */
int gh_prof_init(void **ctx, uint64_t comm_hash, int *mask, int nranks, int rank, int version);
void gh_prof_finalize(void *ctx);
void gh_prof_start(void *ctx, void **handle, const struct gh_pev *ev);
void gh_prof_stop(void *handle);
/* A state transition: `size` the step's transfer size (0 unknown), `ptimer` KernelCh's stop. */
void gh_prof_state(void *handle, ncclProfilerEventState_t state, uint64_t size, uint64_t ptimer);
/* The poller's tick: the activation mask follows the control block and mask_extra. */
void gh_prof_poll(void);

#pragma GCC visibility pop

#endif
