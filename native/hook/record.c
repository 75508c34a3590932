/*
 * The out-of-line parts of the data-path wrappers (the inline hot path is in hot.h) and the
 * records of non-data calls (groups, communicator lifecycle).
 */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>

#include "hot.h"

/* last_comm starts on a value no communicator has: a thread's first call always misses the cache. */
GH_TLS struct gh_thread gh_thr = {.last_comm = (ncclComm_t)(uintptr_t)~(uintptr_t)0};

uint32_t gh_tid_slow(void) {
  gh_thr.tid = (uint32_t)syscall(SYS_gettid);
  return gh_thr.tid;
}

/* The cache never holds a NULL entry (the next call on that communicator misses again), so the
 * hot path's hit test need not check for one. */
struct gh_comm_entry *gh_comm_miss(ncclComm_t comm) {
  int saved = errno; /* adopting asks NCCL about the communicator */
  gh_thr.errp = &errno;  /* every thread misses before its first hit: the hot path may use it */
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  if (e == NULL && comm != NULL) e = gh_comm_adopt(comm);
  gh_thr.last_comm = e != NULL ? comm : (ncclComm_t)(uintptr_t)~(uintptr_t)0;
  gh_thr.last_entry = e;
  gh_thr.last_marks = e != NULL ? &gh_marks[e - gh_comms] : NULL;
  errno = saved;
  return e;
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

uint64_t gh_p2p_count(struct gh_comm_entry *e, uint16_t op, int peer) {
  int pi = peer_index(e, peer);
  if (pi < 0) return 0;
  return gh_bump(op == GH_OP_SEND ? &e->send_count[pi] : &e->recv_count[pi]);
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
  r->group_id = (op == GH_OP_GROUP_START || op == GH_OP_GROUP_END) ? gh_thr.group_id : 0;
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
  r->tid = gh_thr.tid != 0 ? gh_thr.tid : gh_tid_slow();
  gh_publish(r, idx);
}
