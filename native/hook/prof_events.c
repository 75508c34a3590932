/*
 * What NCCL's profiler events do: CCL-D's kernel-level progress counters, per (communicator,
 * channel, peer, direction) of network transfers, and per (communicator, channel) kernel starts
 * and stops, kept in the ring's gh_progress region for the agent.
 *
 * The callbacks run on NCCL's threads (the caller's for task events, the proxy thread for
 * network and kernel events) and never block or allocate: contexts, task records, op records
 * and the ring's slot tables are fixed arrays, claimed by CAS; when one is full the event is
 * dropped and counted (gh_progress.dropped), NCCL never waits. Counters only grow, with relaxed
 * atomics: a reader's copy of a slot may be a step apart between its words, never wrong in one.
 *
 * Joining with the interposer: NCCL names a communicator by its own hash, the comm table by the
 * id every rank derives from the unique id. The two meet on the caller's thread: a task event
 * that NCCL raises inside an interposed call (CollApi/P2pApi always are; Coll/P2p are outside a
 * group) belongs to the communicator that call is on (gh_thr.last_entry), which binds the
 * context to that comm table row and gives the task the call's collective seq. Network and
 * kernel events then name the row through their context, and an op the seq of its task. A
 * context never bound (NCCL linked statically: no interposer) counts its events as unbound.
 */
#define _GNU_SOURCE
#include <string.h>
#include <unistd.h>

#include "prof.h"

#define CTXS GH_MAX_COMMS
#define TASKS 256u  /* task records, reused in turn (NCCL uses a task as a parent after its stop) */
#define OPS 256u    /* network ops in flight at once */
#define OP_STEPS 8  /* NCCL_STEPS: steps of one op in flight at once */
#define CLAIMING 0xffffffffu

enum kind { K_OTHER = 1, K_TASK, K_OP, K_STEP, K_KCH };

struct pctx {
  uint32_t used;
  int32_t entry; /* comm table index, -1 until bound */
  int rank, nranks;
};

struct task {
  uint8_t kind, op;
  struct pctx *ctx;
  uint64_t seq; /* the comm table's collective seq, 0 unknown (or a send/receive) */
};

struct op;
struct step {
  uint8_t kind, state;
  struct op *op;
  uint64_t net_t0; /* when the step went on the network, 0 not (or no longer) there */
  uint64_t size;
};

struct op {
  uint8_t kind;
  uint32_t busy;
  struct gh_prog_slot *slot;
  int nsteps, counted;
  uint64_t chunk;
  struct step steps[OP_STEPS];
};

struct kch {
  uint8_t kind;
  uint32_t idx;
};

static struct pctx ctxs[CTXS];
static struct task tasks[TASKS];
static uint64_t task_next;
static struct op ops[OPS];
static uint64_t op_next;
static struct kch kch_handles[GH_KCH_SLOTS];
static struct { uint8_t kind; } other = {K_OTHER};
static int *nccl_mask;     /* NCCL's activation mask word (one per process), from the first init */
static int version_taken;  /* the interface version NCCL took */
static pid_t my_pid;

static uint64_t bump(uint64_t *p, uint64_t n) { return __atomic_fetch_add(p, n, __ATOMIC_RELAXED); }

/* Events per class are a diagnostic: a plain increment, no locked instruction on the caller's
 * path; two threads raising one class at the same instant may lose one count. */
static void count_event(struct gh_progress *g, uint64_t type) {
  unsigned bit = (unsigned)__builtin_ctzll(type | (1ull << 63));
  if (bit < GH_PROG_CLASSES)
    __atomic_store_n(&g->events[bit], __atomic_load_n(&g->events[bit], __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
}

static void dropped(uint64_t *counter) {
  if (gh_prog != NULL) bump(counter, 1);
}

/* Classes NCCL of that version knows (a mask bit it does not know is harmless, but the applied
 * mask then says what really runs). */
static int known_classes(int version) {
  int m = ncclProfileGroup | ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep |
          ncclProfileProxyCtrl | ncclProfileKernelCh | ncclProfileNetPlugin;
  if (version >= 5) m |= ncclProfileGroupApi | ncclProfileCollApi | ncclProfileP2pApi | ncclProfileKernelLaunch;
  return m;
}

/* The mask the agent wants now: the default, the costly classes while the control block is in
 * profile mode, and what it asked for on top (GREYHOUND_PROFILER_MASK replaces the default). */
static int wanted_mask(void) {
  static int base = -1;
  if (base < 0) {
    const char *e = getenv("GREYHOUND_PROFILER_MASK");
    base = e != NULL && *e != '\0' ? (int)strtol(e, NULL, 0) : GH_PROF_DEFAULT_MASK;
  }
  struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
  int m = base;
  if (g != NULL) m |= (int)__atomic_load_n(&g->mask_extra, __ATOMIC_RELAXED);
  if (gh_ctl != NULL && __atomic_load_n(&gh_ctl->mode, __ATOMIC_RELAXED) == GH_MODE_PROFILE) m |= GH_PROF_COSTLY_MASK;
  return m & known_classes(version_taken);
}

static void apply_mask(void) {
  int *word = __atomic_load_n(&nccl_mask, __ATOMIC_ACQUIRE);
  struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
  if (word == NULL || g == NULL) return;
  int want = wanted_mask();
  if ((uint32_t)want == __atomic_load_n(&g->mask_applied, __ATOMIC_RELAXED)) return;
  __atomic_store_n(word, want, __ATOMIC_RELAXED); /* NCCL reads it as each API call starts */
  __atomic_store_n(&g->mask_applied, (uint32_t)want, __ATOMIC_RELEASE);
}

void gh_prof_poll(void) { apply_mask(); }

int gh_prof_init(void **ctx, uint64_t comm_hash, int *mask, int nranks, int rank, int version) {
  (void)comm_hash;
  *ctx = NULL;
  if (gh_disabled || !gh_ring_ensure(rank) || __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE) == NULL)
    return ncclInvalidUsage; /* nowhere to count: NCCL goes on without the plugin */
  int saved = errno;
  my_pid = getpid();
  struct pctx *c = NULL;
  for (int i = 0; i < CTXS && c == NULL; i++) {
    uint32_t free_ = 0;
    if (__atomic_compare_exchange_n(&ctxs[i].used, &free_, 1u, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) c = &ctxs[i];
  }
  if (c == NULL) {
    dropped(&gh_prog->dropped); /* this communicator goes uncounted; NCCL sees no difference */
    errno = saved;
    return 0;
  }
  c->rank = rank;
  c->nranks = nranks;
  __atomic_store_n(&c->entry, -1, __ATOMIC_RELEASE);
  *ctx = c;
  if (__atomic_load_n(&version_taken, __ATOMIC_RELAXED) == 0) __atomic_store_n(&version_taken, version, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_prog->plugin_version, (uint32_t)version, __ATOMIC_RELAXED);
  __atomic_fetch_add(&gh_prog->contexts, 1u, __ATOMIC_RELAXED);
  if (mask != NULL) {
    __atomic_store_n(&nccl_mask, mask, __ATOMIC_RELEASE);
    __atomic_store_n(&gh_prog->mask_applied, 0u, __ATOMIC_RELAXED); /* a new word: set it */
    apply_mask();
  }
  errno = saved;
  return 0;
}

/* The context's slots go back to the table: its comm table row will serve another communicator. */
void gh_prof_finalize(void *ctx) {
  struct pctx *c = ctx;
  struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
  if (c == NULL) return;
  int e = __atomic_load_n(&c->entry, __ATOMIC_ACQUIRE);
  if (g != NULL) {
    if (e >= 0) {
      for (int i = 0; i < GH_PROG_SLOTS; i++)
        if ((__atomic_load_n(&g->slots[i].key, __ATOMIC_ACQUIRE) & 0xffu) == (uint32_t)e + 1u)
          __atomic_store_n(&g->slots[i].key, 0u, __ATOMIC_RELEASE);
      for (int i = 0; i < GH_KCH_SLOTS; i++)
        if ((__atomic_load_n(&g->kch[i].key, __ATOMIC_ACQUIRE) & 0xffu) == (uint32_t)e + 1u)
          __atomic_store_n(&g->kch[i].key, 0u, __ATOMIC_RELEASE);
    }
    __atomic_fetch_sub(&g->contexts, 1u, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&c->entry, -1, __ATOMIC_RELEASE);
  __atomic_store_n(&c->used, 0u, __ATOMIC_RELEASE);
}

/* The comm table row of the communicator the caller's interposed call is on, if it is this
 * context's (`in_call`: the event was raised inside the call itself, not at a group's end). */
static int bind(struct pctx *c, int in_call) {
  int e = __atomic_load_n(&c->entry, __ATOMIC_ACQUIRE);
  if (e >= 0 || !in_call || gh_thr.depth <= 0 || gh_comms == NULL) return e;
  struct gh_comm_entry *row = gh_thr.last_entry;
  if (row == NULL || (c->rank >= 0 && (row->rank != c->rank || row->nranks != c->nranks))) return -1;
  e = (int)(row - gh_comms);
  __atomic_store_n(&c->entry, e, __ATOMIC_RELEASE);
  return e;
}

/* NCCL's function names (ncclFuncToString), told apart by a letter or two. */
static uint8_t op_code(const char *f) {
  if (f == NULL || f[0] == '\0' || f[1] == '\0' || f[2] == '\0') return GH_OP_NONE;
  switch (f[0]) {
    case 'A': /* AllReduce, AllGather, AlltoAll */
      return f[3] == 'R' ? GH_OP_ALLREDUCE : f[3] == 'G' ? GH_OP_ALLGATHER : f[3] == 't' ? GH_OP_ALLTOALL : GH_OP_NONE;
    case 'B':
      return GH_OP_BROADCAST;
    case 'R': /* Reduce, ReduceScatter, Recv */
      return f[2] == 'c' ? GH_OP_RECV : f[6] == 'S' ? GH_OP_REDUCESCATTER : GH_OP_REDUCE;
    case 'S': /* Send (SendRecv, Scatter: not ours) */
      return f[1] == 'e' && f[4] == '\0' ? GH_OP_SEND : GH_OP_NONE;
    default:
      return GH_OP_NONE;
  }
}

static void start_task(struct pctx *c, void **handle, const struct gh_pev *ev) {
  int api = ev->type == ncclProfileCollApi || ev->type == ncclProfileP2pApi;
  int in_call = api || gh_thr.group_depth == 0;
  int e = bind(c, in_call);
  struct task *t = &tasks[__atomic_fetch_add(&task_next, 1, __ATOMIC_RELAXED) % TASKS];
  t->kind = K_TASK;
  t->ctx = c;
  t->op = op_code(ev->func);
  t->seq = 0;
  const struct task *parent = ev->parent;
  if (parent != NULL && parent->kind == K_TASK && parent->ctx == c && parent->seq != 0) {
    t->seq = parent->seq; /* v5+: the CollApi event raised inside the call */
  } else if (in_call && e >= 0 && gh_thr.depth > 0 && gh_thr.last_entry == &gh_comms[e] &&
             t->op != GH_OP_SEND && t->op != GH_OP_RECV) {
    t->seq = __atomic_load_n(&gh_comms[e].last_seq_entered, __ATOMIC_RELAXED); /* this call's */
  }
  *handle = t;
}

/* A slot for `key`, claimed when new; NULL when the table is full. */
static struct gh_prog_slot *claim_slot(struct gh_progress *g, uint32_t key, int peer) {
  unsigned h = (key * 2654435761u) >> 26; /* 6 bits: GH_PROG_SLOTS is 64 */
  for (unsigned i = 0; i < GH_PROG_SLOTS; i++) {
    struct gh_prog_slot *s = &g->slots[(h + i) % GH_PROG_SLOTS];
    uint32_t k = __atomic_load_n(&s->key, __ATOMIC_ACQUIRE);
    if (k == key && s->peer == peer) return s;
    if (k != 0) continue;
    if (!__atomic_compare_exchange_n(&s->key, &k, CLAIMING, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
      if (k == key && s->peer == peer) return s;
      continue;
    }
    memset((char *)s + sizeof s->key, 0, sizeof *s - sizeof s->key);
    s->peer = peer;
    __atomic_store_n(&s->key, key, __ATOMIC_RELEASE);
    return s;
  }
  return NULL;
}

static struct gh_kch_slot *claim_kch(struct gh_progress *g, uint32_t key, uint32_t *idx) {
  unsigned h = (key * 2654435761u) >> 27; /* 5 bits: GH_KCH_SLOTS is 32 */
  for (unsigned i = 0; i < GH_KCH_SLOTS; i++) {
    *idx = (h + i) % GH_KCH_SLOTS;
    struct gh_kch_slot *s = &g->kch[*idx];
    uint32_t k = __atomic_load_n(&s->key, __ATOMIC_ACQUIRE);
    if (k == key) return s;
    if (k != 0) continue;
    if (!__atomic_compare_exchange_n(&s->key, &k, CLAIMING, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
      if (k == key) return s;
      continue;
    }
    memset((char *)s + sizeof s->key, 0, sizeof *s - sizeof s->key);
    __atomic_store_n(&s->key, key, __ATOMIC_RELEASE);
    return s;
  }
  return NULL;
}

static struct op *alloc_op(void) {
  for (unsigned tries = 0; tries < 32; tries++) {
    struct op *o = &ops[__atomic_fetch_add(&op_next, 1, __ATOMIC_RELAXED) % OPS];
    uint32_t free_ = 0;
    if (__atomic_compare_exchange_n(&o->busy, &free_, 1u, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return o;
  }
  return NULL;
}

static void touch(struct gh_prog_slot *s, uint8_t state) {
  __atomic_store_n(&s->state, state, __ATOMIC_RELAXED);
  __atomic_store_n(&s->last_ns, gh_now_ns(), __ATOMIC_RELEASE);
}

static void start_op(struct gh_progress *g, struct pctx *c, void **handle, const struct gh_pev *ev) {
  int e = __atomic_load_n(&c->entry, __ATOMIC_ACQUIRE);
  if (e < 0) {
    dropped(&g->unbound);
    return;
  }
  if (ev->pid != my_pid) { /* PXN: another process's op, whose parent we cannot read */
    dropped(&g->dropped);
    return;
  }
  uint32_t key = ((uint32_t)e + 1u) | ((uint32_t)ev->channel & 0xffu) << 8 | (ev->is_send ? 0u : 1u) << 16;
  struct gh_prog_slot *s = claim_slot(g, key, ev->peer);
  struct op *o = s != NULL ? alloc_op() : NULL;
  if (o == NULL) {
    dropped(&g->dropped);
    return;
  }
  o->kind = K_OP;
  o->slot = s;
  o->nsteps = ev->nsteps > 0 ? ev->nsteps : 0;
  o->counted = 0;
  o->chunk = ev->chunk > 0 ? (uint64_t)ev->chunk : 0;
  for (int i = 0; i < OP_STEPS; i++) o->steps[i] = (struct step){.kind = K_STEP, .op = o};
  const struct task *t = ev->parent;
  if (t != NULL && t->kind == K_TASK && t->ctx == c) {
    __atomic_store_n(&s->seq, t->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&s->op, t->op, __ATOMIC_RELAXED);
  }
  bump(&s->steps_posted, (uint64_t)o->nsteps);
  __atomic_store_n(&s->ops_posted, (uint16_t)(s->ops_posted + 1u), __ATOMIC_RELAXED);
  touch(s, GH_STEP_POSTED);
  *handle = o;
}

static void start_kch(struct gh_progress *g, struct pctx *c, void **handle, const struct gh_pev *ev) {
  int e = __atomic_load_n(&c->entry, __ATOMIC_ACQUIRE);
  if (e < 0) {
    dropped(&g->unbound);
    return;
  }
  uint32_t idx, key = ((uint32_t)e + 1u) | ((uint32_t)ev->channel & 0xffu) << 8;
  struct gh_kch_slot *s = claim_kch(g, key, &idx);
  if (s == NULL) {
    dropped(&g->dropped);
    return;
  }
  __atomic_store_n(&s->start_ptimer, ev->ptimer, __ATOMIC_RELAXED);
  __atomic_fetch_add(&s->starts, 1u, __ATOMIC_RELAXED);
  __atomic_store_n(&s->last_ns, gh_now_ns(), __ATOMIC_RELEASE);
  kch_handles[idx] = (struct kch){.kind = K_KCH, .idx = idx};
  *handle = &kch_handles[idx];
}

void gh_prof_start(void *ctx, void **handle, const struct gh_pev *ev) {
  struct pctx *c = ctx;
  struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
  *handle = NULL;
  if (g == NULL) return;
  int saved = errno;
  count_event(g, ev->type);
  if (c == NULL) {
    dropped(&g->dropped);
  } else {
    switch (ev->type) {
      case ncclProfileColl:
      case ncclProfileP2p:
      case ncclProfileCollApi:
      case ncclProfileP2pApi:
        start_task(c, handle, ev);
        break;
      case ncclProfileGroup:
        apply_mask(); /* once per launch, on the caller's thread: also without a poller */
        *handle = &other;
        break;
      case ncclProfileProxyOp:
        start_op(g, c, handle, ev);
        break;
      case ncclProfileProxyStep: {
        struct op *o = ev->parent;
        if (o != NULL && o->kind == K_OP && __atomic_load_n(&o->busy, __ATOMIC_ACQUIRE)) {
          struct step *s = &o->steps[(unsigned)ev->step % OP_STEPS];
          s->state = GH_STEP_POSTED;
          s->net_t0 = 0;
          s->size = 0;
          touch(o->slot, GH_STEP_POSTED);
          *handle = s;
        }
        break;
      }
      case ncclProfileKernelCh:
        start_kch(g, c, handle, ev);
        break;
      default: /* counted only (GroupApi, KernelLaunch, ProxyCtrl, NetPlugin, copy-engine) */
        *handle = &other;
        break;
    }
  }
  errno = saved;
}

/* Steps a ProxyStep event counted are not counted again when their op ends. */
static void step_done(struct step *s) {
  struct op *o = s->op;
  struct gh_prog_slot *slot = o->slot;
  uint64_t now = gh_now_ns();
  if (s->net_t0 != 0 && now > s->net_t0) bump(&slot->net_ns, now - s->net_t0);
  s->net_t0 = 0;
  if (o->counted < o->nsteps) {
    o->counted++;
    bump(&slot->steps_done, 1);
    bump(&slot->bytes, s->size != 0 ? s->size : o->chunk);
  }
  s->state = GH_STEP_DONE;
  touch(slot, GH_STEP_DONE);
}

static void op_done(struct op *o) {
  struct gh_prog_slot *s = o->slot;
  uint64_t left = o->nsteps > o->counted ? (uint64_t)(o->nsteps - o->counted) : 0;
  if (left != 0) {
    bump(&s->steps_done, left);
    bump(&s->bytes, left * o->chunk);
  }
  __atomic_store_n(&s->ops_done, (uint16_t)(s->ops_done + 1u), __ATOMIC_RELAXED);
  touch(s, GH_STEP_DONE);
  __atomic_store_n(&o->busy, 0u, __ATOMIC_RELEASE);
}

void gh_prof_stop(void *handle) {
  if (handle == NULL) return;
  int saved = errno;
  switch (*(const uint8_t *)handle) {
    case K_OP: {
      struct op *o = handle;
      if (__atomic_load_n(&o->busy, __ATOMIC_ACQUIRE)) op_done(o);
      break;
    }
    case K_STEP: {
      struct step *s = handle;
      if (__atomic_load_n(&s->op->busy, __ATOMIC_ACQUIRE) && s->state != GH_STEP_DONE) step_done(s);
      break;
    }
    case K_KCH: {
      struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
      if (g == NULL) break;
      struct gh_kch_slot *k = &g->kch[((struct kch *)handle)->idx];
      __atomic_fetch_add(&k->stops, 1u, __ATOMIC_RELAXED);
      __atomic_store_n(&k->last_ns, gh_now_ns(), __ATOMIC_RELEASE);
      break;
    }
    default: /* tasks live on as parents; the rest holds nothing */
      break;
  }
  errno = saved;
}

static uint8_t step_state(ncclProfilerEventState_t st) {
  switch (st) {
    case ncclProfilerProxyStepSendGPUWait: return GH_STEP_SEND_GPU_WAIT;
    case ncclProfilerProxyStepSendPeerWait_v4: return GH_STEP_SEND_PEER_WAIT;
    case ncclProfilerProxyStepSendWait: return GH_STEP_SEND_WAIT;
    case ncclProfilerProxyStepRecvWait: return GH_STEP_RECV_WAIT;
    case ncclProfilerProxyStepRecvFlushWait: return GH_STEP_RECV_FLUSH_WAIT;
    case ncclProfilerProxyStepRecvGPUWait: return GH_STEP_RECV_GPU_WAIT;
    default: return GH_STEP_NONE;
  }
}

/* The network's share of a step: a send from going on the network (SendWait) to its end; a
 * receive from waiting for the data (RecvWait) to its arrival (flush or GPU wait). */
void gh_prof_state(void *handle, ncclProfilerEventState_t state, uint64_t size, uint64_t ptimer) {
  if (handle == NULL) return;
  uint8_t kind = *(const uint8_t *)handle;
  if (kind == K_KCH && state == ncclProfilerKernelChStop) {
    struct gh_progress *g = __atomic_load_n(&gh_prog, __ATOMIC_ACQUIRE);
    if (g != NULL) __atomic_store_n(&g->kch[((struct kch *)handle)->idx].stop_ptimer, ptimer, __ATOMIC_RELAXED);
    return;
  }
  if (kind != K_STEP) return;
  struct step *s = handle;
  uint8_t st = step_state(state);
  if (st == GH_STEP_NONE || !__atomic_load_n(&s->op->busy, __ATOMIC_ACQUIRE)) return;
  int saved = errno;
  uint64_t now = gh_now_ns();
  if (st == GH_STEP_SEND_WAIT || st == GH_STEP_RECV_WAIT) {
    s->net_t0 = now;
  } else if ((st == GH_STEP_RECV_FLUSH_WAIT || st == GH_STEP_RECV_GPU_WAIT) && s->net_t0 != 0) {
    if (now > s->net_t0) bump(&s->op->slot->net_ns, now - s->net_t0);
    s->net_t0 = 0;
  }
  if (size > s->size) s->size = size;
  s->state = st;
  touch(s->op->slot, st);
  errno = saved;
}
