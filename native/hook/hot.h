/*
 * The monitor-mode hot path of every data-path wrapper (Darshan's shape: timestamp, real call
 * outside any lock, timestamp, counters, one ring record), inlined into each wrapper so that the
 * op is a constant, the call state stays in registers and nothing is called out of line unless
 * something unusual happens: a communicator not in this thread's cache, a pause request or
 * profile mode (one control word says both), a call inside a group, a P2P peer counter, a full
 * ring. Those leave through record.c / profile.c / control.c / marks.c. Whether one of the first
 * four applies is decided once, before the call (gh_hot_gate): each wrapper carries one copy of the
 * path specialised for the common case and one general copy.
 *
 * errno: the hot path makes no call that can set it (rdtsc, loads, stores, one CAS); every slow
 * path saves and restores it, so the caller sees errno exactly as NCCL left it.
 *
 * A record is written once, at return; what is inside NCCL right now is visible to the agent
 * through the comm table (inflight_enter_ns, last_seq_entered vs last_seq_completed). NCCL is
 * asynchronous, though: a call returns once its work is enqueued on the stream, so what the GPU
 * has finished comes from a completion mark recorded after each call (marks.c): the hot path fills
 * a slot of the communicator's mark ring and records its pre-created event, two CUDA calls
 * (cudaStreamIsCapturing, cudaEventRecord) and no lock or allocation.
 */
#ifndef GREYHOUND_HOOK_HOT_H
#define GREYHOUND_HOOK_HOT_H

#include "gh_hook.h"

#define GH_INLINE static inline __attribute__((always_inline))
#define GH_IS_P2P(op) ((op) == GH_OP_SEND || (op) == GH_OP_RECV)

/* record.c */
struct gh_comm_entry *gh_comm_miss(ncclComm_t comm); /* lookup or adopt; refills the cache */
uint64_t gh_p2p_count(struct gh_comm_entry *e, uint16_t op, int peer); /* per-peer count, 0 if full */
uint32_t gh_tid_slow(void);
/* profile.c: start events when the agent selected profile mode (returns the pool slot + 1; -1 the
 * stream is capturing a graph; 0 not profiled), end them (returns the record flags), hand the
 * record index to the poller. */
int gh_profile_enter(cudaStream_t stream);
uint32_t gh_profile_exit(int profiled, ncclResult_t res);
void gh_profile_attach(uint32_t slot, uint64_t record_index, struct gh_comm_entry *e);

/* NCCL forbids using one communicator from several threads at once, so its counters have a single
 * writer at a time: plain load+store (no locked instruction) keeps them exact and cheap. */
GH_INLINE uint64_t gh_bump(uint64_t *p) {
  uint64_t v = __atomic_load_n(p, __ATOMIC_RELAXED) + 1;
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
  return v;
}

struct gh_call {
  uint64_t enter_ns, seq, call_no;
  uint32_t ver; /* the entry's host_ver after the enter's update (even) */
  struct gh_stamp stamp;
  struct gh_comm_entry *e;
  struct gh_marks *m;
  int profiled;
};

/* marks.c: everything but the common case (not ready yet, in a group, capturing, a new stream,
 * a full ring, a failed or in-progress call). `hint`: GH_MARK_CHECK, or what the caller knows. */
enum { GH_MARK_CHECK = 0, GH_MARK_CAPTURED = 1, GH_MARK_LOST = 2, GH_MARK_CLEAR = 3 };
void gh_mark_slow(const struct gh_call *c, uint16_t op, ncclResult_t res, cudaStream_t stream,
                  uint64_t count, uint32_t dtype, int peer, int hint);

/* The common case, decided once before the call: monitor mode with no pause request, outside a
 * group, on the communicator this thread used last (still active, not a recycled entry). The
 * wrapper then inlines the path with all of that known (`fast` = 1): no further test of the mode,
 * the group or a missing entry. Anything else takes the general path (`fast` = 0), which tests each
 * as it goes and reaches the same records and marks. */
GH_INLINE int gh_hot_gate(ncclComm_t comm) {
  uint64_t ctl = __atomic_load_n(__atomic_load_n(&gh_ctl_word, __ATOMIC_ACQUIRE), __ATOMIC_RELAXED);
  struct gh_comm_entry *e = gh_thr.last_entry;
  return ctl == 0 && gh_thr.group_depth == 0 && comm == gh_thr.last_comm &&
         __atomic_load_n(&e->state, __ATOMIC_RELAXED) == GH_COMM_ACTIVE &&
         e->handle == (uint64_t)(uintptr_t)comm;
}

GH_INLINE void gh_hot_enter(struct gh_call *c, int fast, uint16_t op, ncclComm_t comm, cudaStream_t stream,
                            uint64_t count, uint32_t dtype, int peer) {
  uint64_t ctl = 0;
  struct gh_comm_entry *e = gh_thr.last_entry;
  if (!fast) {
    ctl = __atomic_load_n(__atomic_load_n(&gh_ctl_word, __ATOMIC_ACQUIRE), __ATOMIC_RELAXED);
    if (ctl != 0 && GH_CTL_PAUSE(ctl) != 0 && gh_thr.group_depth == 0) gh_pause_point_slow(comm);
    if (comm != gh_thr.last_comm || __atomic_load_n(&e->state, __ATOMIC_RELAXED) != GH_COMM_ACTIVE ||
        e->handle != (uint64_t)(uintptr_t)comm)
      e = gh_comm_miss(comm);
  }
  c->e = e;
  c->m = gh_thr.last_marks;
  c->enter_ns = gh_clock_enter(&c->stamp);
  c->seq = 0;
  if (fast || e != NULL) {
    uint32_t v = gh_ver_begin(&e->host_ver);
    c->call_no = gh_bump(&e->calls_entered);
    if (!GH_IS_P2P(op)) c->seq = gh_bump(&e->last_seq_entered);
    __atomic_store_n(&e->inflight_enter_ns, c->enter_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_op, (uint32_t)op, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_count, count, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_dtype, dtype, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_peer, peer, __ATOMIC_RELAXED);
    gh_ver_end(&e->host_ver, v);
    c->ver = v + 1;
  }
  c->profiled = 0;
  if (ctl != 0) c->profiled = gh_profile_enter(stream);
}

/* The completion mark of a call outside a group on a communicator whose ring is ready (its stream
 * is then the one m->stream holds): fill the next slot (not the poller's until head moves), ask
 * whether the stream captures a graph, record the slot's event behind the call, publish.
 * Everything else goes to gh_mark_slow. The CUDA calls may touch errno: it is put back. */
GH_INLINE void gh_mark(const struct gh_call *c, uint16_t op, ncclResult_t res, cudaStream_t stream,
                       uint64_t count, uint32_t dtype, int peer, int in_group) {
  struct gh_marks *m = c->m;
  uint64_t h = m->head;
  int hint = GH_MARK_CHECK;
  /* In profile mode too: the capture check below is then asked twice, which costs, not breaks. */
  if (GH_LIKELY(stream == m->stream && !in_group && res == ncclSuccess &&
                h - __atomic_load_n(&m->tail, __ATOMIC_ACQUIRE) < GH_MARKS)) {
    struct gh_mark_slot *s = &m->slot[h & (GH_MARKS - 1)];
    gh_cuda_event ev = s->ev;
    int coll = !GH_IS_P2P(op);
    s->first = c->call_no;
    s->upto = coll ? c->seq : __atomic_load_n(&c->e->last_seq_entered, __ATOMIC_RELAXED);
    s->count = count;
    s->enter_ns = c->enter_ns;
    s->shape = GH_MARK_SHAPE(0, coll);
    s->meta = GH_MARK_META(op, dtype, coll);
    s->peer = peer;
    int *err = gh_thr.errp;
    int saved = *err, cap;
    hint = GH_MARK_CAPTURED;
    if (GH_LIKELY(gh_cu.is_capturing(stream, &cap) == 0 && cap == 0)) {
      hint = GH_MARK_LOST;
      if (GH_LIKELY(gh_cu.ev_record(ev, stream) == 0)) {
        *err = saved;
        __atomic_store_n(&m->head, h + 1, __ATOMIC_RELEASE);
        return;
      }
    }
    *err = saved;
  }
  gh_mark_slow(c, op, res, stream, count, dtype, peer, hint);
}

GH_INLINE void gh_hot_exit(struct gh_call *c, int fast, uint16_t op, ncclResult_t res, cudaStream_t stream,
                           uint64_t count, int dtype, int redop, int peer) {
  uint64_t ret_ns = gh_clock_exit(&c->stamp, c->enter_ns);
  int in_group = !fast && gh_thr.group_depth > 0;
  uint32_t flags = (res == ncclInProgress ? GH_F_IN_PROGRESS : 0u) | (in_group ? GH_F_IN_GROUP : 0u);
  if (!fast && c->profiled != 0) flags |= gh_profile_exit(c->profiled, res);
  struct gh_comm_entry *e = c->e;
  uint64_t seq = c->seq, comm_id = 0;
  int32_t rank = -1, nranks = 0;
  if (fast || e != NULL) {
    /* The enter's version, carried: no thread but this one writes the host fields meanwhile. */
    __atomic_store_n(&e->host_ver, c->ver + 1, __ATOMIC_RELAXED);
    GH_VER_FENCE();
    if (!GH_IS_P2P(op)) __atomic_store_n(&e->last_seq_completed, seq, __ATOMIC_RELAXED);
    else if (res == ncclSuccess || res == ncclInProgress) seq = gh_p2p_count(e, op, peer);
    __atomic_store_n(&e->inflight_enter_ns, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&e->calls_completed, __atomic_load_n(&e->calls_completed, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELEASE);
    gh_ver_end(&e->host_ver, c->ver + 1);
    comm_id = e->comm_id;
    rank = e->rank;
    nranks = e->nranks;
  }
  uint64_t idx = UINT64_MAX;
  struct gh_record *r = gh_reserve(&idx);
  if (GH_LIKELY(r != NULL)) {
    uint32_t tid = gh_thr.tid;
    if (GH_UNLIKELY(tid == 0)) tid = gh_tid_slow();
    r->comm_id = comm_id;
    r->count = count;
    r->seq = seq;
    r->enter_ns = c->enter_ns;
    r->return_ns = ret_ns;
    r->stream = (uint64_t)(uintptr_t)stream;
    r->group_id = fast ? 0 : gh_thr.group_id; /* 0 outside groups */
    r->gpu_start_ns = 0;
    r->gpu_end_ns = 0;
    r->comm_rank = rank;
    r->nranks = nranks;
    r->peer = peer;
    r->result = (int32_t)res;
    r->op = op;
    r->datatype = (uint8_t)dtype;
    r->redop = (uint8_t)redop;
    r->flags = flags;
    r->tid = tid;
    gh_publish(r, idx);
  }
  if (!fast && c->profiled > 0) gh_profile_attach((uint32_t)c->profiled - 1, idx, e);
  if (fast || e != NULL) gh_mark(c, op, res, stream, count, (uint32_t)dtype, peer, in_group);
}

/* Body of a data-path wrapper: pass through when nested or disabled, else record around CALL, on
 * the fast path when gh_hot_gate allows (one copy of the path for each case, each specialised). */
#define GH_DATA_CALL(OP, COMM, STREAM, CALL, COUNT, DTYPE, REDOP, PEER)                          \
  do {                                                                                           \
    if (GH_UNLIKELY(gh_thr.depth > 0 || gh_disabled)) return CALL;                              \
    gh_thr.depth = 1;                                                                            \
    struct gh_call c_;                                                                           \
    ncclResult_t res_;                                                                           \
    if (GH_LIKELY(gh_hot_gate(COMM))) {                                                          \
      gh_hot_enter(&c_, 1, (OP), (COMM), (STREAM), (uint64_t)(COUNT), (uint32_t)(DTYPE), (PEER)); \
      res_ = CALL;                                                                               \
      gh_hot_exit(&c_, 1, (OP), res_, (STREAM), (uint64_t)(COUNT), (int)(DTYPE), (int)(REDOP), (PEER)); \
    } else {                                                                                     \
      gh_hot_enter(&c_, 0, (OP), (COMM), (STREAM), (uint64_t)(COUNT), (uint32_t)(DTYPE), (PEER)); \
      res_ = CALL;                                                                               \
      gh_hot_exit(&c_, 0, (OP), res_, (STREAM), (uint64_t)(COUNT), (int)(DTYPE), (int)(REDOP), (PEER)); \
    }                                                                                            \
    gh_thr.depth = 0;                                                                            \
    return res_;                                                                                 \
  } while (0)

#endif
