/*
 * The profiler plugin's callbacks from several threads at once, as NCCL's proxy threads raise
 * them: network ops and their steps on slots claimed by CAS, more (channel, peer) keys than the
 * table holds (the excess dropped and counted, never blocking), op records reused. Every step
 * posted on a slot is done by the end; the counts add up exactly. The plugin is found the way
 * NCCL finds it (ncclProfiler_v5 in the preloaded hook); its context is bound the way NCCL binds
 * it, by a CollApi event raised inside an interposed call (the stub's ncclAllReduce calls back).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include "nccl_abi.h"
#include "nccl_profiler_abi.h"
#include "ring_view.h"

#define THREADS 4
#define OPS 3000
#define STEPS 8
#define KEYS_PER_THREAD 20 /* 4 x 20 = 80 (channel, peer) keys for 64 slots */

extern void (*stub_inside_allreduce)(void);
static const ncclProfiler_v5_t *plugin;
static void *ctx;

static void bind(void) {
  ncclProfilerEventDescr_v5_t d = {.type = ncclProfileCollApi, .collApi = {.func = "AllReduce"}};
  void *h = NULL;
  plugin->startEvent(ctx, &h, &d);
  plugin->stopEvent(h);
}

static void *proxy(void *arg) {
  int t = (int)(intptr_t)arg;
  for (int i = 0; i < OPS; i++) {
    int key = i % KEYS_PER_THREAD;
    ncclProfilerEventDescr_v5_t d = {.type = ncclProfileProxyOp,
                                     .proxyOp = {.pid = getpid(), .channelId = (uint8_t)(key % 8),
                                                 .peer = t * 100 + key / 8, .nSteps = STEPS,
                                                 .chunkSize = 4096, .isSend = i & 1}};
    void *op = NULL;
    plugin->startEvent(ctx, &op, &d);
    for (int s = 0; s < STEPS; s++) {
      ncclProfilerEventDescr_v5_t sd = {.type = ncclProfileProxyStep, .parentObj = op, .proxyStep = {.step = s}};
      void *step = NULL;
      plugin->startEvent(ctx, &step, &sd);
      ncclProfilerEventStateArgs_v5_t a = {.proxyStep = {.transSize = 4096}};
      plugin->recordEventState(step, i & 1 ? ncclProfilerProxyStepSendWait : ncclProfilerProxyStepRecvWait, &a);
      if (!(i & 1)) plugin->recordEventState(step, ncclProfilerProxyStepRecvGPUWait, &a);
      plugin->stopEvent(step);
    }
    plugin->stopEvent(op);
  }
  return NULL;
}

int main(void) {
  setenv("GREYHOUND_JOB_ID", "profstress", 1);
  setenv("RANK", "0", 1);
  ncclUniqueId id = {{3, 1, 4}};
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, 2, id, 0) == ncclSuccess);
  struct ring_view v;
  CHECK(ring_open(&v, "profstress", 0));
  plugin = dlsym(RTLD_DEFAULT, "ncclProfiler_v5");
  CHECK(plugin != NULL);
  if (gh_failures) return 1;
  int mask = 0;
  CHECK(plugin->init(&ctx, 0x1234, &mask, "s", 1, 2, 0, NULL) == ncclSuccess && ctx != NULL);
  CHECK(mask == (ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileKernelCh));
  stub_inside_allreduce = bind;
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess);
  stub_inside_allreduce = NULL;
  struct gh_progress *g = (struct gh_progress *)((char *)v.h + v.h->progress_offset);
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, proxy, (void *)(intptr_t)t);
  for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
  uint64_t posted = 0, done = 0, ops = 0, used = 0;
  for (int i = 0; i < GH_PROG_SLOTS; i++) {
    struct gh_prog_slot *s = &g->slots[i];
    if (__atomic_load_n(&s->key, __ATOMIC_ACQUIRE) == 0) continue;
    used++;
    CHECK((s->key & 0xffu) == 1u); /* the comm table's first row */
    CHECK(s->steps_posted == s->steps_done && s->ops_posted == s->ops_done);
    CHECK(s->bytes == s->steps_done * 4096 && s->seq == 0);
    posted += s->steps_posted;
    done += s->steps_done;
    ops += s->ops_posted;
  }
  uint64_t dropped = __atomic_load_n(&g->dropped, __ATOMIC_RELAXED);
  CHECK(used == GH_PROG_SLOTS && dropped > 0 && g->unbound == 0);
  CHECK(ops + dropped == (uint64_t)THREADS * OPS); /* each op counted, or dropped whole */
  CHECK(posted == ops * STEPS && done == posted);
  plugin->finalize(ctx);
  for (int i = 0; i < GH_PROG_SLOTS; i++) CHECK(g->slots[i].key == 0); /* back to the table */
  CHECK(g->contexts == 0);
  printf("test_prof_stress: %s (%llu ops on %llu slots, %llu dropped)\n", gh_failures ? "FAIL" : "ok",
         (unsigned long long)ops, (unsigned long long)used, (unsigned long long)dropped);
  return gh_failures != 0;
}
