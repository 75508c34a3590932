/*
 * Communicator lifecycle wrappers: they give each communicator its stable id and table slot, and
 * mark it destroyed/aborted before the real call (an abort is usually issued because something
 * hangs, and the agent must see it even if the real call never returns).
 */
#include <unistd.h>

#include "gh_hook.h"

typedef ncclResult_t (*init_rank_fn)(ncclComm_t *, int, ncclUniqueId, int);
typedef ncclResult_t (*init_config_fn)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
typedef ncclResult_t (*init_all_fn)(ncclComm_t *, int, const int *);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
typedef ncclResult_t (*comm_fn)(ncclComm_t);
typedef ncclResult_t (*async_fn)(ncclComm_t, ncclResult_t *);

static init_rank_fn real_init_rank;
static init_config_fn real_init_config;
static init_all_fn real_init_all;
static split_fn real_split;
static comm_fn real_destroy, real_abort;
static async_fn real_async;
static gh_query_fn real_count, real_user_rank, real_cu_device;
static int last_async[GH_MAX_COMMS];
static uint64_t init_all_calls;

static int query(gh_query_fn *slot, const char *name, ncclComm_t comm) {
  gh_query_fn f = __atomic_load_n(slot, __ATOMIC_RELAXED);
  if (f == NULL) {
    f = (gh_query_fn)gh_real(name, NULL);
    __atomic_store_n(slot, f, __ATOMIC_RELAXED);
  }
  int v = -1;
  if (f == NULL || f(comm, &v) != ncclSuccess) return -1;
  return v;
}

static void note_device(ncclComm_t comm) {
  if (gh_hdr != NULL && gh_hdr->device < 0) {
    int dev = query(&real_cu_device, "ncclCommCuDevice", comm);
    if (dev >= 0) gh_ring_set_device(dev);
  }
}

/* A non-blocking communicator still initialising may not answer yet: -1, marks then go on the
 * poller's current device. */
static void after_init(ncclResult_t res, ncclComm_t comm, uint64_t id, uint64_t parent, int color,
                       int rank, int nranks, uint16_t op, uint64_t t0) {
  if ((res != ncclSuccess && res != ncclInProgress) || comm == NULL) return;
  int dev = res == ncclSuccess ? query(&real_cu_device, "ncclCommCuDevice", comm) : -1;
  struct gh_comm_entry *e = gh_comm_register(comm, id, parent, color, rank, nranks, dev);
  if (e == NULL) return;
  last_async[e - gh_comms] = (int)res;
  if (dev >= 0) gh_ring_set_device(dev);
  gh_record_event(op, e, (int)res, -1, t0);
}

struct gh_comm_entry *gh_comm_adopt(ncclComm_t comm) {
  int rank = query(&real_user_rank, "ncclCommUserRank", comm);
  int nranks = query(&real_count, "ncclCommCount", comm);
  if (rank < 0 || nranks <= 0) return NULL;
  uint64_t key[2] = {(uint64_t)(uintptr_t)comm, (uint64_t)getpid()};
  return gh_comm_register(comm, gh_hash_bytes(key, sizeof key, 0x61646f7074ull), 0, -1, rank, nranks,
                          query(&real_cu_device, "ncclCommCuDevice", comm));
}

GH_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  init_rank_fn f = GH_RESOLVE(real_init_rank, ncclCommInitRank);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm, nranks, commId, rank);
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  ncclResult_t res = f(comm, nranks, commId, rank);
  int saved = errno;
  uint64_t id = gh_hash_bytes(commId.internal, sizeof commId.internal, 0);
  after_init(res, comm != NULL ? *comm : NULL, id, 0, -1, rank, nranks, GH_OP_COMM_INIT, t0);
  gh_thr.depth--;
  errno = saved;
  return res;
}

GH_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                              int rank, ncclConfig_t *config) {
  init_config_fn f = GH_RESOLVE(real_init_config, ncclCommInitRankConfig);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm, nranks, commId, rank, config);
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  ncclResult_t res = f(comm, nranks, commId, rank, config);
  int saved = errno;
  uint64_t id = gh_hash_bytes(commId.internal, sizeof commId.internal, 0);
  after_init(res, comm != NULL ? *comm : NULL, id, 0, -1, rank, nranks, GH_OP_COMM_INIT, t0);
  gh_thr.depth--;
  errno = saved;
  return res;
}

GH_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  init_all_fn f = GH_RESOLVE(real_init_all, ncclCommInitAll);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comms, ndev, devlist);
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  ncclResult_t res = f(comms, ndev, devlist);
  int saved = errno;
  /* Every rank lives in this process: the clique is named by pid and call number. */
  uint64_t key[2] = {(uint64_t)getpid(), __atomic_add_fetch(&init_all_calls, 1, __ATOMIC_RELAXED)};
  uint64_t id = gh_hash_bytes(key, sizeof key, 0x616c6cull);
  for (int i = 0; comms != NULL && i < ndev; i++)
    after_init(res, comms[i], id, 0, -1, i, ndev, GH_OP_COMM_INIT_ALL, t0);
  gh_thr.depth--;
  errno = saved;
  return res;
}

GH_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                     ncclConfig_t *config) {
  split_fn f = GH_RESOLVE(real_split, ncclCommSplit);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm, color, key, newcomm, config);
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  struct gh_comm_entry *parent = gh_comm_lookup(comm);
  /* Every rank of the parent calls split collectively, so the split index agrees across ranks. */
  uint64_t split_ix = parent != NULL ? __atomic_fetch_add(&parent->splits, 1, __ATOMIC_RELAXED) : 0;
  ncclResult_t res = f(comm, color, key, newcomm, config);
  int saved = errno;
  ncclComm_t nc = newcomm != NULL ? *newcomm : NULL;
  if (parent != NULL && nc != NULL && color != NCCL_SPLIT_NOCOLOR) {
    uint64_t k[3] = {parent->comm_id, split_ix, (uint64_t)(int64_t)color};
    int rank = query(&real_user_rank, "ncclCommUserRank", nc);
    int nranks = query(&real_count, "ncclCommCount", nc);
    after_init(res, nc, gh_hash_bytes(k, sizeof k, 0x73706c6974ull), parent->comm_id, color, rank,
               nranks, GH_OP_COMM_SPLIT, t0);
  }
  gh_thr.depth--;
  errno = saved;
  return res;
}

static ncclResult_t finish(comm_fn f, ncclComm_t comm, uint16_t op, uint32_t state) {
  if (gh_thr.depth > 0 || gh_disabled) return f(comm);
  int saved = errno;
  gh_thr.depth++;
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  if (e != NULL) {
    gh_record_event(op, e, 0, -1, 0);
    gh_profile_comm_gone(e);
    gh_comm_forget(comm, state);
  }
  errno = saved;
  ncclResult_t res = f(comm);
  gh_thr.depth--;
  return res;
}

GH_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  comm_fn f = GH_RESOLVE(real_destroy, ncclCommDestroy);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  return finish(f, comm, GH_OP_COMM_DESTROY, GH_COMM_DESTROYED);
}

GH_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  comm_fn f = GH_RESOLVE(real_abort, ncclCommAbort);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  return finish(f, comm, GH_OP_COMM_ABORT, GH_COMM_ABORTED);
}

/* Polled constantly by watchdogs: record only changes of the async state, never pause here. */
GH_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  async_fn f = GH_RESOLVE(real_async, ncclCommGetAsyncError);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  ncclResult_t res = f(comm, asyncError);
  if (gh_thr.depth > 0 || gh_disabled || res != ncclSuccess || asyncError == NULL) return res;
  int saved = errno;
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  if (e != NULL) {
    int *last = &last_async[e - gh_comms];
    int now = (int)*asyncError;
    if (__atomic_exchange_n(last, now, __ATOMIC_RELAXED) != now) {
      gh_thr.depth++;
      if (now == ncclSuccess) note_device(comm);
      gh_record_event(GH_OP_ASYNC_ERROR, e, now, -1, 0);
      gh_thr.depth--;
    }
  }
  errno = saved;
  return res;
}
