/*
 * Communicator lifecycle wrappers: every constructor NCCL has (InitRank, InitRankConfig,
 * InitRankScalable, InitAll, Split, Shrink) gives its communicator a stable id and a table slot,
 * and destroy/abort retire it.
 *
 * Ids come from what every rank of the communicator shares, so the agent and the validator can
 * match one communicator across ranks: the unique id (InitRankScalable: the first of its list,
 * which every rank passes in the same order, as NCCL names the communicator by it); for a split,
 * (parent id, split index, color); for a shrink, (parent id, shrink index, the excluded ranks):
 * every rank that stays calls it, the excluded ones never do. A communicator the hook did not see
 * made gets a per-process id (gh_comm_adopt), which matches nothing.
 *
 * Lifecycle calls block the host inside NCCL (bootstrap, connection set-up, a destroy's flush),
 * so each is in flight while it runs, like a data call: an init on an INIT entry made before the
 * call (its id is known from the unique id), a split or shrink on its parent, a destroy on the
 * communicator itself (`life_op`, `inflight_enter_ns`). An abort is marked before the real call
 * (it is usually issued because something hangs, and the agent must see it even if the call
 * never returns).
 */
#include <stdlib.h>
#include <unistd.h>

#include "gh_hook.h"

typedef ncclResult_t (*init_rank_fn)(ncclComm_t *, int, ncclUniqueId, int);
typedef ncclResult_t (*init_config_fn)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
typedef ncclResult_t (*init_scalable_fn)(ncclComm_t *, int, int, int, ncclUniqueId *, ncclConfig_t *);
typedef ncclResult_t (*init_all_fn)(ncclComm_t *, int, const int *);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
typedef ncclResult_t (*shrink_fn)(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int);
typedef ncclResult_t (*comm_fn)(ncclComm_t);
typedef ncclResult_t (*async_fn)(ncclComm_t, ncclResult_t *);

static init_rank_fn real_init_rank;
static init_config_fn real_init_config;
static init_scalable_fn real_init_scalable;
static init_all_fn real_init_all;
static split_fn real_split;
static shrink_fn real_shrink;
static comm_fn real_destroy, real_abort;
static async_fn real_async;
static gh_query_fn real_count, real_user_rank, real_cu_device;
static int last_async[GH_MAX_COMMS];
static uint64_t shrinks[GH_MAX_COMMS]; /* shrinks made from each entry's communicator so far */
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
    if (dev >= 0) {
      gh_ring_set_device(dev);
      gh_gpu_identity(dev);
    }
  }
}

/* A lifecycle call now inside NCCL on e (0: it returned). */
static void in_flight(struct gh_comm_entry *e, uint16_t op, uint64_t enter_ns) {
  if (e == NULL) return;
  uint32_t v = gh_life_begin(&e->life_ver);
  __atomic_store_n(&e->life_op, (uint32_t)op, __ATOMIC_RELAXED);
  __atomic_store_n(&e->inflight_enter_ns, enter_ns, __ATOMIC_RELAXED);
  gh_life_end(&e->life_ver, v);
}

/* A non-blocking communicator still initialising may not answer yet: -1, marks then go on the
 * poller's current device. */
static void after_init(ncclResult_t res, ncclComm_t comm, uint64_t id, uint64_t parent, int color,
                       int rank, int nranks, uint16_t op, uint64_t t0, struct gh_comm_entry *reserved) {
  if ((res != ncclSuccess && res != ncclInProgress) || comm == NULL) {
    gh_comm_abandon(reserved, id);
    return;
  }
  int dev = res == ncclSuccess ? query(&real_cu_device, "ncclCommCuDevice", comm) : -1;
  struct gh_comm_entry *e = gh_comm_register(comm, id, parent, color, rank, nranks, dev, reserved);
  if (e == NULL) return;
  last_async[e - gh_comms] = (int)res;
  shrinks[e - gh_comms] = 0;
  if (dev >= 0) gh_ring_set_device(dev);
  gh_gpu_identity(dev);
  gh_record_event(op, e, (int)res, -1, t0);
}

struct gh_comm_entry *gh_comm_adopt(ncclComm_t comm) {
  int rank = query(&real_user_rank, "ncclCommUserRank", comm);
  int nranks = query(&real_count, "ncclCommCount", comm);
  if (rank < 0 || nranks <= 0) return NULL;
  uint64_t key[2] = {(uint64_t)(uintptr_t)comm, (uint64_t)getpid()};
  int dev = query(&real_cu_device, "ncclCommCuDevice", comm);
  struct gh_comm_entry *e = gh_comm_register(comm, gh_hash_bytes(key, sizeof key, 0x61646f7074ull), 0, -1,
                                             rank, nranks, dev, NULL);
  if (e != NULL) {
    shrinks[e - gh_comms] = 0;
    gh_gpu_identity(dev);
  }
  return e;
}

/* The shared part of InitRank, InitRankConfig and InitRankScalable: the communicator's id is the
 * unique id's hash, known before the call, so the wait inside it is visible. */
#define GH_INIT_BODY(CALL, ID, NRANKS, RANK)                                                     \
  do {                                                                                           \
    if (gh_thr.depth > 0 || gh_disabled) return CALL;                                            \
    gh_thr.depth++;                                                                              \
    int saved_ = errno;                                                                          \
    uint64_t t0_ = gh_now_ns(), id_ = gh_hash_bytes((ID)->internal, sizeof (ID)->internal, 0);    \
    struct gh_comm_entry *pre_ = gh_comm_begin(id_, 0, -1, (RANK), (NRANKS), GH_OP_COMM_INIT, t0_); \
    errno = saved_;                                                                              \
    ncclResult_t res_ = CALL;                                                                    \
    saved_ = errno;                                                                              \
    after_init(res_, comm != NULL ? *comm : NULL, id_, 0, -1, (RANK), (NRANKS), GH_OP_COMM_INIT, t0_, pre_); \
    gh_thr.depth--;                                                                              \
    errno = saved_;                                                                              \
    return res_;                                                                                 \
  } while (0)

GH_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  init_rank_fn f = GH_RESOLVE(real_init_rank, ncclCommInitRank);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_INIT_BODY(f(comm, nranks, commId, rank), &commId, nranks, rank);
}

GH_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                              int rank, ncclConfig_t *config) {
  init_config_fn f = GH_RESOLVE(real_init_config, ncclCommInitRankConfig);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_INIT_BODY(f(comm, nranks, commId, rank, config), &commId, nranks, rank);
}

/* PyTorch's way for large worlds (several bootstrap roots, NCCL 2.23+). An invalid list is NCCL's
 * to refuse; the hook only reads the first id when there is one. */
GH_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                                ncclUniqueId *commIds, ncclConfig_t *config) {
  init_scalable_fn f = GH_RESOLVE(real_init_scalable, ncclCommInitRankScalable);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  ncclComm_t *comm = newcomm;
  if (commIds == NULL || nId < 1) return f(newcomm, nranks, myrank, nId, commIds, config);
  GH_INIT_BODY(f(newcomm, nranks, myrank, nId, commIds, config), &commIds[0], nranks, myrank);
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
    after_init(res, comms[i], id, 0, -1, i, ndev, GH_OP_COMM_INIT_ALL, t0, NULL);
  gh_thr.depth--;
  errno = saved;
  return res;
}

/* The parent as the hook knows it; one made by a constructor it never saw is adopted now, so
 * its children at least carry its (per-process) id as their parent. */
static struct gh_comm_entry *parent_of(ncclComm_t comm) {
  struct gh_comm_entry *p = gh_comm_lookup(comm);
  return p != NULL || comm == NULL ? p : gh_comm_adopt(comm);
}

static void register_child(ncclResult_t res, ncclComm_t nc, uint64_t id, struct gh_comm_entry *parent,
                           int color, uint16_t op, uint64_t t0) {
  int rank = query(&real_user_rank, "ncclCommUserRank", nc);
  int nranks = query(&real_count, "ncclCommCount", nc);
  after_init(res, nc, id, parent->comm_id, color, rank, nranks, op, t0, NULL);
}

GH_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                     ncclConfig_t *config) {
  split_fn f = GH_RESOLVE(real_split, ncclCommSplit);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm, color, key, newcomm, config);
  gh_thr.depth++;
  int saved = errno;
  uint64_t t0 = gh_now_ns();
  struct gh_comm_entry *parent = parent_of(comm);
  /* Every rank of the parent calls split collectively, so the split index agrees across ranks. */
  uint64_t split_ix = parent != NULL ? __atomic_fetch_add(&parent->splits, 1, __ATOMIC_RELAXED) : 0;
  in_flight(parent, GH_OP_COMM_SPLIT, t0);
  errno = saved;
  ncclResult_t res = f(comm, color, key, newcomm, config);
  saved = errno;
  in_flight(parent, 0, 0);
  ncclComm_t nc = newcomm != NULL ? *newcomm : NULL;
  if (parent != NULL && nc != NULL && color != NCCL_SPLIT_NOCOLOR) {
    uint64_t k[3] = {parent->comm_id, split_ix, (uint64_t)(int64_t)color};
    register_child(res, nc, gh_hash_bytes(k, sizeof k, 0x73706c6974ull), parent, color, GH_OP_COMM_SPLIT, t0);
  }
  gh_thr.depth--;
  errno = saved;
  return res;
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* The child's id: the parent's, its shrink index, and the excluded ranks in order (the list is
 * the same on every caller; NCCL sorts it too). NCCL_SHRINK_ABORT ends the parent's work in
 * flight first; its marks then complete, as an abort's would. */
GH_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                      ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  shrink_fn f = GH_RESOLVE(real_shrink, ncclCommShrink);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled || excludeRanksList == NULL || excludeRanksCount < 1 ||
      excludeRanksCount > (1 << 24))
    return f(comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags);
  gh_thr.depth++;
  int saved = errno;
  uint64_t t0 = gh_now_ns();
  struct gh_comm_entry *parent = parent_of(comm);
  uint64_t id = 0;
  if (parent != NULL) {
    int *sorted = malloc((size_t)excludeRanksCount * sizeof *sorted);
    uint64_t ix = __atomic_fetch_add(&shrinks[parent - gh_comms], 1, __ATOMIC_RELAXED);
    uint64_t h = gh_hash_bytes(&ix, sizeof ix, parent->comm_id ^ 0x736872696e6bull);
    if (sorted != NULL) {
      for (int i = 0; i < excludeRanksCount; i++) sorted[i] = excludeRanksList[i];
      qsort(sorted, (size_t)excludeRanksCount, sizeof *sorted, cmp_int);
      h = gh_hash_bytes(sorted, (size_t)excludeRanksCount * sizeof *sorted, h);
      free(sorted);
      id = h;
    }
  }
  in_flight(parent, GH_OP_COMM_SHRINK, t0);
  errno = saved;
  ncclResult_t res = f(comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags);
  saved = errno;
  in_flight(parent, 0, 0);
  ncclComm_t nc = newcomm != NULL ? *newcomm : NULL;
  if (id != 0 && nc != NULL) register_child(res, nc, id, parent, -1, GH_OP_COMM_SHRINK, t0);
  gh_thr.depth--;
  errno = saved;
  return res;
}

/* A destroy flushes the communicator's work first (and would wait for ever behind a collective
 * hung on the GPU), so it is in flight until it returns; the entry goes afterwards, unless a new
 * communicator took it meanwhile (same address, made by another thread). */
GH_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  comm_fn f = GH_RESOLVE(real_destroy, ncclCommDestroy);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm);
  int saved = errno;
  gh_thr.depth++;
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  uint64_t id = e != NULL ? e->comm_id : 0;
  if (e != NULL) {
    gh_record_event(GH_OP_COMM_DESTROY, e, 0, -1, 0);
    gh_profile_comm_gone(e);
    in_flight(e, GH_OP_COMM_DESTROY, gh_now_ns());
  }
  errno = saved;
  ncclResult_t res = f(comm);
  saved = errno;
  if (e != NULL) {
    in_flight(e, 0, 0);
    gh_comm_forget_entry(comm, e, id, GH_COMM_DESTROYED);
  }
  gh_thr.depth--;
  errno = saved;
  return res;
}

GH_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  comm_fn f = GH_RESOLVE(real_abort, ncclCommAbort);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f(comm);
  int saved = errno;
  gh_thr.depth++;
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  uint64_t id = e != NULL ? e->comm_id : 0;
  if (e != NULL) {
    gh_record_event(GH_OP_COMM_ABORT, e, 0, -1, 0);
    gh_profile_comm_gone(e);
    in_flight(e, GH_OP_COMM_ABORT, gh_now_ns()); /* under life_ver: the training thread may be
                                                  * inside a call on it, writing under host_ver */
    gh_comm_forget(comm, GH_COMM_ABORTED);
  }
  errno = saved;
  ncclResult_t res = f(comm);
  saved = errno;
  if (e != NULL) gh_comm_end_flight(e, id, GH_COMM_ABORTED);
  gh_thr.depth--;
  errno = saved;
  return res;
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
