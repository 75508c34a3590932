/*
 * Profiler events from the device side, raised by the batch's executor thread while the batch
 * runs (real NCCL raises them from its proxy thread, which watches the kernels' counters and the
 * network; the plugin sees the same calls, from another thread).
 *
 * Each call runs on fk_channels() channels (a send/receive on one), each a ring over the
 * communicator's ranks in order: a rank sends to the next and receives from the previous one. A
 * channel's kernel starts when the rank's device reaches the call (KernelCh start, the device
 * time as its GPU timer) and stops when the call ends. Transfers to a peer on another node
 * (FAKE_NCCL_RANKS_PER_NODE consecutive global ranks make a node; unset: one node) go through the
 * network, so they raise ProxyOp events (the op's steps: its bytes per channel in chunks of
 * FAKE_NCCL_CHUNK_KB, 128 KiB, at most 64) and ProxyStep events: up to NCCL_STEPS steps posted at
 * once; a send step waits for the GPU (SendGPUWait), goes on the network (SendWait) one link time
 * before it ends, and ends; a receive step waits for the data (RecvWait), arrives (RecvGPUWait) and
 * ends. Steps end evenly over the call's modelled transfer, which the slowest link of the ring
 * paces (nccl_model.c), while each send's time on the network is its own link's: a slow link
 * shows in its sender's network time per byte. Intra-node transfers (NVLink, PCIe, shared memory
 * in real NCCL) raise no proxy events, as in NCCL: the kernel events are all there is of them.
 *
 * `stop_channel R C seq`: in collective seq, rank R stops sending on channel C (-1: all) half-way.
 * On a ring each later rank can forward one step more than the one before it, so the ranks stall
 * one step apart downstream of R (R's sends the fewest), every rank's call hangs, and the channel's
 * kernels never stop, until the line is removed; then the rest of the steps run.
 */
#include <stdlib.h>
#include <unistd.h>

#include "fk_faults.h"
#include "fk_time.h"
#include "nccl_prof.h"

#define MAX_STEPS 64

enum { E_SEND_NET, E_STEP_END, E_OP_END, E_KCH_END };

struct pop {
  struct fk_call *k;
  void *h;
  void *steps[FK_NCCL_STEPS];
  int channel, peer, is_send, nsteps, next, steps_on, ended;
  uint64_t chunk;
  int64_t link_ns;
};

struct pkch {
  struct fk_call *k;
  void *h;
  int channel, ended;
};

struct fk_prof_batch {
  int nops, nkch;
  struct pop *ops;
  struct pkch *kch;
};

struct pent {
  int64_t t;
  int kind, idx, step;
};

static int env_int(const char *name, int dflt, int lo, int hi) {
  const char *s = getenv(name);
  int v = s != NULL && *s != '\0' ? atoi(s) : dflt;
  return v < lo ? lo : v > hi ? hi : v;
}

int fk_ranks_per_node(void) { return env_int("FAKE_NCCL_RANKS_PER_NODE", 1 << 20, 1, 1 << 20); }
int fk_channels(void) { return env_int("FAKE_NCCL_CHANNELS", 2, 1, 32); }

static int remote(const struct ncclComm *c, int peer) {
  int per = fk_ranks_per_node();
  return c->shm->global_rank[c->rank] / per != c->shm->global_rank[peer] / per;
}

static int p2p(const struct fk_call *k) { return k->op == FK_OP_SEND || k->op == FK_OP_RECV; }

/* Both ends of a send/receive pick the same channel. */
static int p2p_channel(const struct fk_call *k) { return (k->comm->rank + k->root) % fk_channels(); }

static void start_step(struct pop *o, int i) {
  if (!o->steps_on || i >= o->nsteps) return;
  struct fk_pev e = {.type = ncclProfileProxyStep, .parent = o->h, .rank = o->k->comm->rank, .step = i};
  void **h = &o->steps[i % FK_NCCL_STEPS];
  fk_prof_start(o->k->comm, h, &e);
  fk_prof_state(*h, o->is_send ? ncclProfilerProxyStepSendGPUWait : ncclProfilerProxyStepRecvWait, o->chunk, 0);
}

static void add_op(struct fk_prof_batch *pb, struct fk_call *k, int channel, int peer, int is_send) {
  struct ncclComm *c = k->comm;
  int nch = p2p(k) ? 1 : fk_channels();
  uint64_t bytes = fk_traffic_bytes(c, k->op, k->count * fk_dtype_size((ncclDataType_t)k->dtype)) / (uint64_t)nch;
  uint64_t chunk = (uint64_t)env_int("FAKE_NCCL_CHUNK_KB", 128, 1, 1 << 20) * 1024u;
  int nsteps = (int)((bytes + chunk - 1) / chunk);
  nsteps = nsteps < 1 ? 1 : nsteps > MAX_STEPS ? MAX_STEPS : nsteps;
  struct pop *o = &pb->ops[pb->nops++];
  *o = (struct pop){.k = k, .channel = channel, .peer = peer, .is_send = is_send, .nsteps = nsteps,
                    .chunk = (bytes + (uint64_t)nsteps - 1) / (uint64_t)nsteps,
                    .steps_on = (k->prof_mask & ncclProfileProxyStep) != 0};
  o->link_ns = fk_link_ns(c, is_send ? c->rank : peer, is_send ? peer : c->rank, o->chunk);
  struct fk_pev e = {.type = ncclProfileProxyOp, .parent = k->prof_task, .rank = c->rank, .pid = getpid(),
                     .channel = channel, .peer = peer, .nsteps = nsteps, .chunk = (int)o->chunk,
                     .is_send = is_send};
  fk_prof_start(c, &o->h, &e);
  for (int i = 0; i < FK_NCCL_STEPS; i++) start_step(o, i);
}

struct fk_prof_batch *fk_prof_dev_begin(struct fk_call *calls, int n, int64_t arrival) {
  int want = 0;
  for (int i = 0; i < n; i++) want |= calls[i].comm->prof_on ? calls[i].prof_mask : 0;
  if (!(want & (ncclProfileKernelCh | ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileNetPlugin))) return NULL;
  int nch = fk_channels();
  struct fk_prof_batch *pb = calloc(1, sizeof *pb);
  if (pb == NULL) return NULL;
  pb->ops = calloc((size_t)n * (size_t)nch * 2, sizeof *pb->ops);
  pb->kch = calloc((size_t)n * (size_t)nch, sizeof *pb->kch);
  if (pb->ops == NULL || pb->kch == NULL) {
    fk_prof_dev_end(pb, 0);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    struct fk_call *k = &calls[i];
    struct ncclComm *c = k->comm;
    if (!c->prof_on) continue;
    int channels = p2p(k) ? 1 : nch;
    for (int ch = 0; ch < channels && (k->prof_mask & ncclProfileKernelCh); ch++) {
      struct pkch *q = &pb->kch[pb->nkch++];
      *q = (struct pkch){.k = k, .channel = p2p(k) ? p2p_channel(k) : ch};
      struct fk_pev e = {.type = ncclProfileKernelCh, .parent = k->prof_task, .rank = c->rank,
                         .channel = q->channel, .ptimer = (uint64_t)arrival};
      fk_prof_start(c, &q->h, &e);
    }
    if (!(k->prof_mask & (ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileNetPlugin)) || c->nranks < 2) continue;
    if (p2p(k)) {
      if (remote(c, k->root)) add_op(pb, k, p2p_channel(k), k->root, k->op == FK_OP_SEND);
      continue;
    }
    int next = (c->rank + 1) % c->nranks, prev = (c->rank + c->nranks - 1) % c->nranks;
    for (int ch = 0; ch < nch; ch++) {
      if (remote(c, next)) add_op(pb, k, ch, next, 1);
      if (remote(c, prev)) add_op(pb, k, ch, prev, 0);
    }
  }
  return pb;
}

/* How many of its steps an op may finish now: all of them, unless its call is stalled there. */
static int cap_of(const struct pop *o) {
  const struct fk_call *k = o->k;
  if (k->stall_rank < 0 || p2p(k) || (k->stall_channel >= 0 && k->stall_channel != o->channel)) return o->nsteps;
  int n = k->comm->nranks, d = (k->comm->rank - k->stall_rank + n) % n, half = o->nsteps / 2;
  int cap = o->is_send ? half + d : (d == 0 ? half + n - 1 : half + d - 1);
  return cap < o->nsteps ? cap : o->nsteps;
}

static int stalled_channel(const struct fk_call *k, int channel) {
  return k->stall_rank >= 0 && !p2p(k) && (k->stall_channel < 0 || k->stall_channel == channel);
}

static int by_time(const void *a, const void *b) {
  const struct pent *x = a, *y = b;
  return (x->t > y->t) - (x->t < y->t);
}

static void step_end(struct pop *o, int i) {
  void **h = &o->steps[i % FK_NCCL_STEPS];
  if (!o->is_send) fk_prof_state(*h, ncclProfilerProxyStepRecvGPUWait, o->chunk, 0);
  fk_prof_stop(*h);
  *h = NULL;
  start_step(o, i + FK_NCCL_STEPS);
}

/* Raise, at their device times, the events of every step the ops may finish now (each op's steps
 * end evenly over what is left of its call's transfer window), the ends of ops done, and the
 * kernel stops of channels not stalled. */
void fk_prof_dev_run(struct fk_prof_batch *pb) {
  if (pb == NULL) return;
  size_t cap_entries = (size_t)pb->nkch;
  for (int i = 0; i < pb->nops; i++) cap_entries += 2u * (size_t)pb->ops[i].nsteps + 1u;
  struct pent *ev = malloc(cap_entries * sizeof *ev);
  if (ev == NULL) return;
  size_t n = 0;
  for (int i = 0; i < pb->nops; i++) {
    struct pop *o = &pb->ops[i];
    if (o->ended) continue;
    int cap = cap_of(o), base = o->next;
    int64_t t0 = o->k->ready_ns, span = o->k->deadline_ns - t0, prev = t0;
    for (int s = base; s < cap; s++) {
      int64_t t = t0 + span * (s - base + 1) / (o->nsteps - base);
      if (o->steps_on && o->is_send) {
        int64_t net = t - o->link_ns;
        ev[n++] = (struct pent){.t = net > prev ? net : prev, .kind = E_SEND_NET, .idx = i, .step = s};
      }
      if (o->steps_on) ev[n++] = (struct pent){.t = t, .kind = E_STEP_END, .idx = i, .step = s};
      prev = t;
    }
    if (cap == o->nsteps) ev[n++] = (struct pent){.t = cap > base ? prev : t0 + span, .kind = E_OP_END, .idx = i};
    o->next = cap;
  }
  for (int i = 0; i < pb->nkch; i++) {
    struct pkch *q = &pb->kch[i];
    if (!q->ended && !stalled_channel(q->k, q->channel))
      ev[n++] = (struct pent){.t = q->k->deadline_ns, .kind = E_KCH_END, .idx = i};
  }
  qsort(ev, n, sizeof *ev, by_time);
  for (size_t j = 0; j < n; j++) {
    if (ev[j].t > fk_now_ns()) fk_sleep_until(ev[j].t);
    switch (ev[j].kind) {
      case E_SEND_NET:
        fk_prof_state(pb->ops[ev[j].idx].steps[ev[j].step % FK_NCCL_STEPS], ncclProfilerProxyStepSendWait,
                      pb->ops[ev[j].idx].chunk, 0);
        break;
      case E_STEP_END:
        step_end(&pb->ops[ev[j].idx], ev[j].step);
        break;
      case E_OP_END:
        fk_prof_stop(pb->ops[ev[j].idx].h);
        pb->ops[ev[j].idx].ended = 1;
        break;
      default: {
        struct pkch *q = &pb->kch[ev[j].idx];
        fk_prof_state(q->h, ncclProfilerKernelChStop, 0, (uint64_t)ev[j].t);
        fk_prof_stop(q->h);
        q->ended = 1;
        break;
      }
    }
  }
  free(ev);
}

/* What is still open ends with the batch (an error or an abort ended it early). */
void fk_prof_dev_end(struct fk_prof_batch *pb, int ok) {
  (void)ok;
  if (pb == NULL) return;
  for (int i = 0; i < pb->nops; i++) {
    struct pop *o = &pb->ops[i];
    for (int s = 0; s < FK_NCCL_STEPS; s++) fk_prof_stop(o->steps[s]);
    if (!o->ended) fk_prof_stop(o->h);
  }
  for (int i = 0; i < pb->nkch; i++)
    if (!pb->kch[i].ended) fk_prof_stop(pb->kch[i].h);
  free(pb->ops);
  free(pb->kch);
  free(pb);
}

/* The comm rank that rule stop_channel names for collective seq of c, -1 none. */
int fk_stall_rank(const struct ncclComm *c, uint32_t seq, int *channel) {
  struct fk_rule r[16];
  int n = fk_fault_collect(FK_STOP_CHANNEL, r, 16);
  for (int i = 0; i < n; i++) {
    if ((long)r[i].v != (long)seq) continue;
    for (int m = 0; m < c->nranks; m++)
      if (c->shm->global_rank[m] == r[i].a) {
        *channel = (int)r[i].b;
        return m;
      }
  }
  return -1;
}
