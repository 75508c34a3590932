/*
 * The common body of every data-path wrapper (Darshan's shape): timestamp, real call outside any
 * lock, timestamp, one ring record and the communicator's counters. A record is written once, at
 * return; what is inside NCCL right now is visible to the agent through the comm table
 * (inflight_enter_ns, last_seq_entered vs last_seq_completed), so a hung call is never invisible.
 */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>

#include "gh_hook.h"

GH_TLS int gh_depth;
GH_TLS int gh_group_depth;
GH_TLS uint64_t gh_group_id;
static GH_TLS uint32_t tls_tid;

static inline uint32_t my_tid(void) {
  if (GH_UNLIKELY(tls_tid == 0)) tls_tid = (uint32_t)syscall(SYS_gettid);
  return tls_tid;
}

/* NCCL forbids using one communicator from several threads at once, so its counters have a single
 * writer at a time: plain load+store (no locked instruction) keeps them exact and cheap. */
static inline void bump(uint64_t *p) { __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED); }
static inline uint64_t bump_get(uint64_t *p) {
  uint64_t v = __atomic_load_n(p, __ATOMIC_RELAXED) + 1;
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
  return v;
}

/* The last communicator this thread used: training loops hit the same one again and again. */
static GH_TLS ncclComm_t last_comm;
static GH_TLS struct gh_comm_entry *last_entry;

static inline int is_p2p(uint16_t op) { return op == GH_OP_SEND || op == GH_OP_RECV; }

void gh_enter(struct gh_call *c, uint16_t op, ncclComm_t comm, cudaStream_t stream, uint64_t count,
              int dtype) {
  c->op = op;
  c->seq = 0;
  c->profiled = 0;
  if (GH_LIKELY(comm == last_comm && last_entry != NULL &&
                __atomic_load_n(&last_entry->state, __ATOMIC_RELAXED) == GH_COMM_ACTIVE &&
                last_entry->handle == (uint64_t)(uintptr_t)comm)) {
    c->entry = last_entry;
  } else {
    c->entry = gh_comm_lookup(comm);
    if (GH_UNLIKELY(c->entry == NULL && comm != NULL)) c->entry = gh_comm_adopt(comm);
    last_comm = comm;
    last_entry = c->entry;
  }
  c->enter_ns = gh_fast_ns();
  struct gh_comm_entry *e = c->entry;
  if (e != NULL) {
    bump(&e->calls_entered);
    if (!is_p2p(op)) c->seq = bump_get(&e->last_seq_entered);
    __atomic_store_n(&e->inflight_enter_ns, c->enter_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_op, (uint32_t)op, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_count, count, __ATOMIC_RELAXED);
    __atomic_store_n(&e->last_dtype, (uint32_t)dtype, __ATOMIC_RELAXED);
  }
  if (GH_UNLIKELY(gh_ctl != NULL && __atomic_load_n(&gh_ctl->mode, __ATOMIC_RELAXED) == GH_MODE_PROFILE))
    c->profiled = gh_profile_begin(stream, &c->prof_slot, NULL);
}

static int peer_index(struct gh_comm_entry *e, int peer) {
  uint32_t n = __atomic_load_n(&e->npeers, __ATOMIC_ACQUIRE);
  for (uint32_t i = 0; i < n; i++)
    if (e->peer_ids[i] == peer) return (int)i;
  /* A comm's P2P calls come from one thread in practice; the CAS keeps concurrent adders apart. */
  while (n < GH_MAX_PEERS) {
    if (__atomic_compare_exchange_n(&e->npeers, &n, n + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      __atomic_store_n(&e->peer_ids[n], peer, __ATOMIC_RELEASE);
      return (int)n;
    }
    for (uint32_t i = 0; i < n; i++)
      if (e->peer_ids[i] == peer) return (int)i;
  }
  return -1;
}

void gh_exit(struct gh_call *c, ncclResult_t res, ncclComm_t comm, uint64_t count, int dtype,
             int redop, int peer, cudaStream_t stream) {
  (void)comm;
  uint64_t ret_ns = gh_fast_ns();
  if (GH_UNLIKELY(ret_ns < c->enter_ns)) ret_ns = c->enter_ns; /* across a re-anchor */
  uint32_t flags = 0;
  if (res == ncclInProgress) flags |= GH_F_IN_PROGRESS;
  if (gh_group_depth > 0) flags |= GH_F_IN_GROUP;
  if (c->profiled < 0) flags |= GH_F_CAPTURED;
  if (c->profiled > 0) {
    flags |= GH_F_PROFILED;
    if (gh_group_depth == 0) gh_profile_end(c->prof_slot);
  }
  struct gh_comm_entry *e = c->entry;
  uint64_t seq = c->seq;
  int ok = res == ncclSuccess || res == ncclInProgress;
  if (e != NULL) {
    if (is_p2p(c->op) && ok) {
      int pi = peer_index(e, peer);
      if (pi >= 0) {
        uint64_t *ctr = c->op == GH_OP_SEND ? &e->send_count[pi] : &e->recv_count[pi];
        seq = bump_get(ctr);
      }
    }
    if (!is_p2p(c->op)) __atomic_store_n(&e->last_seq_completed, seq, __ATOMIC_RELAXED);
    __atomic_store_n(&e->inflight_enter_ns, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&e->calls_completed, __atomic_load_n(&e->calls_completed, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELEASE);
  }
  uint64_t idx;
  struct gh_record *r = gh_reserve(&idx);
  if (r == NULL) {
    if (c->profiled > 0) gh_profile_attach(c->prof_slot, UINT64_MAX, e);
    return;
  }
  r->comm_id = e != NULL ? e->comm_id : 0;
  r->count = count;
  r->seq = seq;
  r->enter_ns = c->enter_ns;
  r->return_ns = ret_ns;
  r->stream = (uint64_t)(uintptr_t)stream;
  r->group_id = gh_group_depth > 0 ? gh_group_id : 0;
  r->gpu_start_ns = 0;
  r->gpu_end_ns = 0;
  r->comm_rank = e != NULL ? e->rank : -1;
  r->nranks = e != NULL ? e->nranks : 0;
  r->peer = peer;
  r->result = (int32_t)res;
  r->op = c->op;
  r->datatype = (uint8_t)dtype;
  r->redop = (uint8_t)redop;
  r->flags = flags;
  r->tid = my_tid();
  gh_publish(r, idx);
  if (c->profiled > 0) gh_profile_attach(c->prof_slot, idx, e);
}

void gh_record_event(uint16_t op, struct gh_comm_entry *e, int result, int peer, uint64_t enter_ns) {
  uint64_t idx;
  struct gh_record *r = gh_reserve(&idx);
  if (r == NULL) return;
  uint64_t now = gh_now_ns();
  r->comm_id = e != NULL ? e->comm_id : 0;
  r->count = 0;
  r->seq = e != NULL ? e->last_seq_entered : 0;
  r->enter_ns = enter_ns != 0 ? enter_ns : now;
  r->return_ns = now;
  r->stream = 0;
  r->group_id = (op == GH_OP_GROUP_START || op == GH_OP_GROUP_END) ? gh_group_id : 0;
  r->gpu_start_ns = 0;
  r->gpu_end_ns = 0;
  r->comm_rank = e != NULL ? e->rank : -1;
  r->nranks = e != NULL ? e->nranks : 0;
  r->peer = peer;
  r->result = result;
  r->op = op;
  r->datatype = 0;
  r->redop = 255;
  r->flags = 0;
  r->tid = my_tid();
  gh_publish(r, idx);
}
