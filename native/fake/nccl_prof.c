/*
 * The profiler plugin, loaded and fed the way NCCL does it (src/plugin/profiler.cc and
 * plugin_open.cc of NCCL 2.28-2.30): NCCL_PROFILER_PLUGIN names a library ("none": no plugin; a
 * path, or a name tried as libnccl-profiler-<name>.so; unset: libnccl-profiler.so), which is
 * dlopened (naming the preloaded hook gives back that instance) and searched for the newest
 * ncclProfiler_vN this NCCL knows first, then older ones. The fake reports itself as NCCL 2.28,
 * whose newest is v5; FAKE_NCCL_PROFILER_MAX sets another (6 as 2.29+, 4 as 2.27). A library with
 * none of them, or whose init fails for a communicator, leaves NCCL running without it (here: that
 * communicator gets no events). v1 and v2 (2.23 .. 2.25) are looked up but not modelled: a plugin
 * that has only those runs without events, and says so in FAKE_NCCL_LOG.
 *
 * The activation mask is one int of this library's; init gets its address and the plugin may
 * store into it at any time. It is read with a relaxed load when an API call starts, and an
 * operation keeps the mask it was enqueued with (its events follow that, not later changes).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "nccl_prof.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_version;   /* the interface taken, 0 none */
static const void *g_plugin;
static int g_mask;      /* NCCL's ncclProfilerEventMask */

static void *open_lib(const char *name) {
  char buf[512];
  if (name == NULL || name[0] == '\0') return dlopen("libnccl-profiler.so", RTLD_NOW | RTLD_LOCAL);
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  size_t n = strlen(name);
  if (lib == NULL && strchr(name, '/') == NULL && !(strncmp(name, "lib", 3) == 0 && n > 3 &&
                                                    strcmp(name + n - 3, ".so") == 0)) {
    snprintf(buf, sizeof buf, "libnccl-profiler-%s.so", name);
    lib = dlopen(buf, RTLD_NOW | RTLD_LOCAL);
  }
  return lib;
}

static void load(void) {
  const char *name = getenv("NCCL_PROFILER_PLUGIN");
  if (name != NULL && strcasecmp(name, "none") == 0) return;
  void *lib = open_lib(name);
  if (lib == NULL) return;
  const char *max = getenv("FAKE_NCCL_PROFILER_MAX");
  int newest = max != NULL && atoi(max) > 0 ? atoi(max) : 5;
  for (int v = newest > 6 ? 6 : newest; v >= 1; v--) {
    char sym[32];
    snprintf(sym, sizeof sym, "ncclProfiler_v%d", v);
    const void *p = dlsym(lib, sym);
    if (p == NULL) continue;
    if (v < 3) {
      fk_log("profiler plugin: only %s, not modelled: running without it", sym);
      break;
    }
    g_version = v;
    g_plugin = p;
    fk_log("profiler plugin: %s", sym);
    return;
  }
  fk_log("profiler plugin %s: no version this NCCL supports: running without it", name ? name : "");
  dlclose(lib);
}

int fk_prof_version(void) {
  pthread_once(&g_once, load);
  return g_version;
}

int fk_prof_mask(void) { return g_version != 0 ? __atomic_load_n(&g_mask, __ATOMIC_RELAXED) : 0; }

static uint64_t comm_hash(const struct ncclComm *c) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < 24; i++) h = (h ^ (unsigned char)c->id.internal[i]) * 0x100000001b3ull;
  return h;
}

void fk_prof_comm_init(struct ncclComm *c) {
  c->prof_ctx = NULL;
  c->prof_on = 0;
  if (fk_prof_version() == 0) return;
  int nodes = (c->nranks + fk_ranks_per_node() - 1) / fk_ranks_per_node();
  ncclResult_t r;
  switch (g_version) {
    case 3:
      r = ((const ncclProfiler_v3_t *)g_plugin)->init(&c->prof_ctx, &g_mask);
      break;
    case 4:
      r = ((const ncclProfiler_v4_t *)g_plugin)->init(&c->prof_ctx, &g_mask, NULL, comm_hash(c), nodes, c->nranks,
                                                      c->rank, NULL);
      break;
    case 5:
      r = ((const ncclProfiler_v5_t *)g_plugin)->init(&c->prof_ctx, comm_hash(c), &g_mask, NULL, nodes, c->nranks,
                                                      c->rank, NULL);
      break;
    default:
      r = ((const ncclProfiler_v6_t *)g_plugin)->init(&c->prof_ctx, comm_hash(c), &g_mask, NULL, nodes, c->nranks,
                                                      c->rank, NULL);
      break;
  }
  if (r != ncclSuccess) {
    fk_log("profiler plugin init failed (%d) rank=%d: continuing without it", (int)r, c->rank);
    return;
  }
  c->prof_on = 1;
}

void fk_prof_comm_fini(struct ncclComm *c) {
  if (!c->prof_on) return;
  c->prof_on = 0;
  switch (g_version) {
    case 3: ((const ncclProfiler_v3_t *)g_plugin)->finalize(c->prof_ctx); break;
    case 4: ((const ncclProfiler_v4_t *)g_plugin)->finalize(c->prof_ctx); break;
    case 5: ((const ncclProfiler_v5_t *)g_plugin)->finalize(c->prof_ctx); break;
    default: ((const ncclProfiler_v6_t *)g_plugin)->finalize(c->prof_ctx); break;
  }
}

/* One event into the descriptor of the version taken: what every version describes alike, ... */
#define FILL_PROXY(D, E)                                                                        \
  do {                                                                                          \
    if ((E)->type == ncclProfileProxyStep) {                                                    \
      (D).proxyStep.step = (E)->step;                                                           \
      break;                                                                                    \
    }                                                                                           \
    (D).proxyOp.pid = (E)->pid;                                                                 \
    (D).proxyOp.channelId = (uint8_t)(E)->channel;                                              \
    (D).proxyOp.peer = (E)->peer;                                                               \
    (D).proxyOp.nSteps = (E)->nsteps;                                                           \
    (D).proxyOp.chunkSize = (E)->chunk;                                                         \
    (D).proxyOp.isSend = (E)->is_send;                                                          \
  } while (0)
#define FILL_P2P(D, E)                                                                          \
  do {                                                                                          \
    (D).p2p.func = (E)->func;                                                                   \
    (D).p2p.count = (E)->count;                                                                 \
    (D).p2p.datatype = (E)->dtype;                                                              \
    (D).p2p.peer = (E)->peer;                                                                   \
  } while (0)
#define FILL_COLL(D, E)                                                                         \
  do {                                                                                          \
    (D).coll.seqNumber = (E)->seq;                                                              \
    (D).coll.func = (E)->func;                                                                  \
    (D).coll.count = (E)->count;                                                                \
    (D).coll.root = (E)->root;                                                                  \
    (D).coll.datatype = (E)->dtype;                                                             \
    (D).coll.algo = "RING";                                                                     \
    (D).coll.proto = "SIMPLE";                                                                  \
  } while (0)

/* ... and the rest, version by version. */
#define FILL_V5(D, E)                                                                           \
  do {                                                                                          \
    (D).type = (E)->type;                                                                       \
    (D).parentObj = (E)->parent;                                                                \
    (D).rank = (E)->rank;                                                                       \
    switch ((E)->type) {                                                                        \
      case ncclProfileGroupApi:                                                                 \
        (D).groupApi.groupDepth = (E)->depth;                                                   \
        break;                                                                                  \
      case ncclProfileCollApi:                                                                  \
        (D).collApi.func = (E)->func;                                                           \
        (D).collApi.count = (E)->count;                                                         \
        (D).collApi.datatype = (E)->dtype;                                                      \
        (D).collApi.root = (E)->root;                                                           \
        (D).collApi.stream = (E)->stream;                                                       \
        break;                                                                                  \
      case ncclProfileP2pApi:                                                                   \
        (D).p2pApi.func = (E)->func;                                                            \
        (D).p2pApi.count = (E)->count;                                                          \
        (D).p2pApi.datatype = (E)->dtype;                                                       \
        (D).p2pApi.stream = (E)->stream;                                                        \
        break;                                                                                  \
      case ncclProfileKernelLaunch:                                                             \
        (D).kernelLaunch.stream = (E)->stream;                                                  \
        break;                                                                                  \
      case ncclProfileColl:                                                                     \
        FILL_COLL(D, E);                                                                        \
        (D).coll.nChannels = (uint8_t)(E)->nchannels;                                           \
        (D).coll.parentGroup = (E)->group;                                                      \
        break;                                                                                  \
      case ncclProfileP2p:                                                                      \
        FILL_P2P(D, E);                                                                         \
        (D).p2p.nChannels = (uint8_t)(E)->nchannels;                                            \
        (D).p2p.parentGroup = (E)->group;                                                       \
        break;                                                                                  \
      case ncclProfileProxyOp:                                                                  \
      case ncclProfileProxyStep:                                                                \
        FILL_PROXY(D, E);                                                                       \
        break;                                                                                  \
      case ncclProfileKernelCh:                                                                 \
        (D).kernelCh.channelId = (uint8_t)(E)->channel;                                         \
        (D).kernelCh.pTimer = (E)->ptimer;                                                      \
        break;                                                                                  \
      default:                                                                                  \
        break;                                                                                  \
    }                                                                                           \
  } while (0)

/* v3 and v4 descriptors: the events both know (no API events; v4 parents a task to its group). */
#define FILL_V34(D, E, KERNEL_TIMER)                                                            \
  do {                                                                                          \
    (D).type = (uint8_t)(E)->type;                                                              \
    (D).parentObj = (E)->type == ncclProfileColl || (E)->type == ncclProfileP2p ? (E)->group   \
                                                                                : (E)->parent;  \
    (D).rank = (E)->rank;                                                                       \
    switch ((E)->type) {                                                                        \
      case ncclProfileColl:                                                                     \
        FILL_COLL(D, E);                                                                        \
        break;                                                                                  \
      case ncclProfileP2p:                                                                      \
        FILL_P2P(D, E);                                                                         \
        break;                                                                                  \
      case ncclProfileProxyOp:                                                                  \
      case ncclProfileProxyStep:                                                                \
        FILL_PROXY(D, E);                                                                       \
        break;                                                                                  \
      case ncclProfileKernelCh:                                                                 \
        (D).kernelCh.channelId = (uint8_t)(E)->channel;                                         \
        KERNEL_TIMER;                                                                           \
        break;                                                                                  \
      default:                                                                                  \
        break;                                                                                  \
    }                                                                                           \
  } while (0)

/* Classes an event type exists in, per version (an older NCCL never raises newer ones). */
static int raised(uint64_t type) {
  if (type & (ncclProfileGroupApi | ncclProfileCollApi | ncclProfileP2pApi | ncclProfileKernelLaunch))
    return g_version >= 5;
  if (type & (ncclProfileKernelCh | ncclProfileNetPlugin)) return g_version >= 3;
  return 1;
}

void fk_prof_start(const struct ncclComm *c, void **handle, const struct fk_pev *e) {
  *handle = NULL;
  if (!c->prof_on || !raised(e->type)) return;
  switch (g_version) {
    case 3: {
      ncclProfilerEventDescr_v3_t d;
      memset(&d, 0, sizeof d);
      FILL_V34(d, e, (void)0);
      ((const ncclProfiler_v3_t *)g_plugin)->startEvent(c->prof_ctx, handle, &d);
      break;
    }
    case 4: {
      ncclProfilerEventDescr_v4_t d;
      memset(&d, 0, sizeof d);
      FILL_V34(d, e, d.kernelCh.pTimer = e->ptimer);
      ((const ncclProfiler_v4_t *)g_plugin)->startEvent(c->prof_ctx, handle, &d);
      break;
    }
    case 5: {
      ncclProfilerEventDescr_v5_t d;
      memset(&d, 0, sizeof d);
      FILL_V5(d, e);
      ((const ncclProfiler_v5_t *)g_plugin)->startEvent(c->prof_ctx, handle, &d);
      break;
    }
    default: {
      ncclProfilerEventDescr_v6_t d;
      memset(&d, 0, sizeof d);
      FILL_V5(d, e);
      ((const ncclProfiler_v6_t *)g_plugin)->startEvent(c->prof_ctx, handle, &d);
      break;
    }
  }
}

void fk_prof_stop(void *handle) {
  if (handle == NULL || g_version == 0) return;
  switch (g_version) {
    case 3: ((const ncclProfiler_v3_t *)g_plugin)->stopEvent(handle); break;
    case 4: ((const ncclProfiler_v4_t *)g_plugin)->stopEvent(handle); break;
    case 5: ((const ncclProfiler_v5_t *)g_plugin)->stopEvent(handle); break;
    default: ((const ncclProfiler_v6_t *)g_plugin)->stopEvent(handle); break;
  }
}

/* v3 predates transfer sizes and kernel timers in the state arguments, and the SendPeerWait and
 * KernelChStop states, which NCCL's v3 adapter does not pass on. */
void fk_prof_state(void *handle, ncclProfilerEventState_t state, uint64_t size, uint64_t ptimer) {
  if (handle == NULL || g_version == 0) return;
  if (g_version == 3) {
    if (state == ncclProfilerProxyStepSendPeerWait_v4 || state == ncclProfilerKernelChStop) return;
    ncclProfilerEventStateArgs_v3_t a;
    memset(&a, 0, sizeof a);
    ((const ncclProfiler_v3_t *)g_plugin)->recordEventState(handle, state, &a);
    return;
  }
  ncclProfilerEventStateArgs_v4_t a;
  memset(&a, 0, sizeof a);
  if (state == ncclProfilerKernelChStop) a.kernelCh.pTimer = ptimer;
  else a.proxyStep.transSize = size;
  switch (g_version) {
    case 4: ((const ncclProfiler_v4_t *)g_plugin)->recordEventState(handle, state, &a); break;
    case 5: ((const ncclProfiler_v5_t *)g_plugin)->recordEventState(handle, state, &a); break;
    default: ((const ncclProfiler_v6_t *)g_plugin)->recordEventState(handle, state, &a); break;
  }
}
