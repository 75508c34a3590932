/*
 * Communicator lifecycle. A unique id is 8 magic bytes plus 16 random ones; the random part
 * names the shared-memory segment. A split child's id is a hash of the parent id, the color and
 * the parent's split count, so all ranks of one color derive the same child without exchanging
 * it; they still rendezvous on the parent to learn who else chose their color.
 *
 * As in NCCL 2.27+/2.28 (src/init.cc): ncclCommInitRankScalable takes nId unique ids, the same
 * list in the same order on every rank (several bootstrap roots), and the communicator is named
 * by the first; ncclCommShrink is called by the ranks that stay (never by those in
 * excludeRanksList, which may be dead), which keep their order with the gaps closed; with
 * NCCL_SHRINK_ABORT it first ends this rank's operations still queued or hung on the parent.
 * The shrunk child's id derives from the parent's and its shrink count, like a split's.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "fk_faults.h"
#include "fk_time.h"
#include "nccl_fake.h"

#define FK_INPROGRESS_POLLS 2

GH_EXPORT ncclResult_t pncclGetVersion(int *version) {
  if (version == NULL) return ncclInvalidArgument;
  *version = 22809; /* reports itself as NCCL 2.28.9 */
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclGetVersion);

GH_EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId) {
  if (uniqueId == NULL) return ncclInvalidArgument;
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, FK_ID_MAGIC, 8);
  if (getrandom(uniqueId->internal + 8, 16, 0) != 16) return ncclSystemError;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclGetUniqueId);

/* Real NCCL's (static) CUDA runtime makes a primary context current on the thread that makes a
 * communicator, as any runtime call does: a driver-API caller then finds one there. */
static void runtime_context(void) {
  CUcontext ctx = NULL;
  if (cuInit(0) == 0 && cuCtxGetCurrent(&ctx) == 0 && ctx == NULL && cuDevicePrimaryCtxRetain(&ctx, 0) == 0)
    cuCtxSetCurrent(ctx);
}

static ncclResult_t init_rank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  if (comm == NULL) return ncclInvalidArgument;
  runtime_context();
  struct ncclComm *c = NULL;
  ncclResult_t r = fk_attach(&c, &id, nranks, rank, fk_global_rank(rank));
  if (r != ncclSuccess) return r;
  r = fk_wait_attached(c);
  if (r != ncclSuccess) {
    fk_comm_unref(c);
    return r;
  }
  *comm = c;
  return ncclSuccess;
}

GH_EXPORT ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, commId, rank);
}
GH_WEAK_ALIAS(ncclCommInitRank);

/* The config is never read (it is versioned by size); every comm made here may go non-blocking.
 * Initialisation itself completes before returning; `inprogress R` only changes what is reported:
 * ncclInProgress now, then GetAsyncError says ncclInProgress a few more times before ncclSuccess. */
GH_EXPORT ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                               ncclConfig_t *config) {
  (void)config;
  ncclResult_t r = init_rank(comm, nranks, commId, rank);
  if (r != ncclSuccess) return r;
  struct ncclComm *c = *comm;
  c->nonblocking = 1;
  if (fk_fault_find(FK_INPROGRESS, c->global_rank, -1, NULL)) {
    atomic_store(&c->async_polls, FK_INPROGRESS_POLLS);
    atomic_store(&c->async, ncclInProgress);
    return ncclInProgress;
  }
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommInitRankConfig);

GH_EXPORT ncclResult_t pncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                                 ncclUniqueId *commIds, ncclConfig_t *config) {
  if (commIds == NULL || nId < 1 || nId > nranks) return ncclInvalidArgument;
  return pncclCommInitRankConfig(newcomm, nranks, commIds[0], myrank, config);
}
GH_WEAK_ALIAS(ncclCommInitRankScalable);

/* One process owns every rank: attach them all first, then wait, so no rank waits alone. */
GH_EXPORT ncclResult_t pncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  (void)devlist;
  if (comms == NULL || ndev < 1 || ndev > FK_MAX_RANKS) return ncclInvalidArgument;
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id); /* through the PLT, as real NCCL does */
  if (r != ncclSuccess) return r;
  for (int i = 0; i < ndev; i++) {
    r = fk_attach(&comms[i], &id, ndev, i, i);
    if (r != ncclSuccess) {
      while (i-- > 0) fk_comm_unref(comms[i]);
      return r;
    }
  }
  for (int i = 0; i < ndev; i++) fk_wait_attached(comms[i]);
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommInitAll);

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static ncclUniqueId child_id(const ncclUniqueId *parent, int color, uint32_t split_seq) {
  uint64_t w[2];
  memcpy(w, parent->internal + 8, 16);
  uint64_t salt = ((uint64_t)(uint32_t)color << 32) | split_seq;
  uint64_t h0 = mix64(w[0] ^ mix64(salt)), h1 = mix64(w[1] ^ mix64(h0 ^ salt));
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  memcpy(id.internal, FK_ID_MAGIC, 8);
  memcpy(id.internal + 8, &h0, 8);
  memcpy(id.internal + 16, &h1, 8);
  return id;
}

/* A child communicator (split or shrink) every one of its ranks derives the same id for. */
static ncclResult_t attach_child(const ncclUniqueId *id, int size, int rank, int global_rank,
                                 ncclComm_t *newcomm) {
  struct ncclComm *child = NULL;
  ncclResult_t r = fk_attach(&child, id, size, rank, global_rank);
  if (r != ncclSuccess) return r;
  r = fk_wait_attached(child);
  if (r != ncclSuccess) {
    fk_comm_unref(child);
    return r;
  }
  *newcomm = child;
  return ncclSuccess;
}

static int split_voted(const struct ncclComm *c, const void *arg) {
  uint32_t need = *(const uint32_t *)arg + 1;
  for (int r = 0; r < c->nranks; r++)
    if (atomic_load(&c->shm->split_arrived[r]) < need) return 0;
  return 1;
}

GH_EXPORT ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                      ncclConfig_t *config) {
  (void)config;
  if (!fk_comm_ok(comm) || newcomm == NULL) return ncclInvalidArgument;
  struct ncclComm *c = comm;
  struct fk_shm *s = c->shm;
  uint32_t n = c->split_seq++;
  s->split_color[n % 2][c->rank] = color;
  s->split_key[n % 2][c->rank] = key;
  atomic_store(&s->split_arrived[c->rank], n + 1);
  fk_bump(s);
  ncclResult_t r = fk_wait(c, split_voted, &n);
  if (r != ncclSuccess) return r;
  *newcomm = NULL;
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  /* New rank: position among same-color ranks ordered by (key, parent rank). */
  int size = 0, newrank = 0;
  for (int p = 0; p < c->nranks; p++) {
    if (s->split_color[n % 2][p] != color) continue;
    size++;
    int k = s->split_key[n % 2][p];
    if (k < key || (k == key && p < c->rank)) newrank++;
  }
  ncclUniqueId id = child_id(&c->id, color, n);
  return attach_child(&id, size, newrank, c->global_rank, newcomm);
}
GH_WEAK_ALIAS(ncclCommSplit);

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* This rank's operations on c end (as an abort's do) and c stays usable: NCCL sets the abort
 * flags, waits for its device stream, and clears them. */
static void end_in_flight(struct ncclComm *c) {
  atomic_store(&c->aborted, 1);
  fk_bump(c->shm);
  while (atomic_load(&c->refs) > 1) fk_sleep_ns(1000000);
  atomic_store(&c->aborted, 0);
}

GH_EXPORT ncclResult_t pncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                       ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  (void)config;
  if (!fk_comm_ok(comm) || newcomm == NULL || excludeRanksList == NULL || excludeRanksCount < 1 ||
      excludeRanksCount >= comm->nranks)
    return ncclInvalidArgument;
  struct ncclComm *c = comm;
  qsort(excludeRanksList, (size_t)excludeRanksCount, sizeof *excludeRanksList, cmp_int); /* as NCCL */
  int below = 0;
  for (int i = 0; i < excludeRanksCount; i++) {
    if (excludeRanksList[i] < 0 || excludeRanksList[i] >= c->nranks) return ncclInvalidArgument;
    if (excludeRanksList[i] == c->rank) return ncclInvalidArgument; /* excluded ranks do not call */
    below += excludeRanksList[i] < c->rank;
  }
  if (shrinkFlags & NCCL_SHRINK_ABORT) end_in_flight(c);
  *newcomm = NULL;
  ncclUniqueId id = child_id(&c->id, -2 - (int)c->shrink_seq, 0x80000000u);
  c->shrink_seq++;
  return attach_child(&id, c->nranks - excludeRanksCount, c->rank - below, c->global_rank, newcomm);
}
GH_WEAK_ALIAS(ncclCommShrink);

/* The handle is dead at once; this rank's queued and hung operations end (ncclInvalidUsage) when
 * their device sees the flag, and the memory goes with the last one that still holds it. */
static void release_device(struct ncclComm *c) {
  atomic_store(&c->aborted, 1);
  c->magic = 0;
  fk_bump(c->shm);
  fk_comm_unref(c);
}

/* Real NCCL's destroy flushes queued work first (and would hang on a hung collective); the fake
 * releases this rank's work still queued, so a teardown never hangs: synchronise first, as the
 * workload does, to finish it. The peers are not told (as with a destroy): they keep waiting. */
GH_EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  if (!fk_comm_ok(comm)) return ncclInvalidArgument;
  release_device(comm);
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommDestroy);

/* An abort also fails the peers' operations on this communicator with ncclRemoteError, reported
 * by their GetAsyncError, as a dead rank makes real NCCL's peers fail. */
GH_EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
  if (!fk_comm_ok(comm)) return comm == NULL ? ncclSuccess : ncclInvalidArgument;
  atomic_store(&comm->shm->aborted, 1);
  release_device(comm);
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommAbort);

/* Errors of enqueued work arrive here, as with real NCCL: the first error a device operation met,
 * else ncclRemoteError once a peer aborted. */
GH_EXPORT ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!fk_comm_ok(comm) || asyncError == NULL) return ncclInvalidArgument;
  struct ncclComm *c = comm;
  if (atomic_load(&c->async) == ncclInProgress && atomic_fetch_sub(&c->async_polls, 1) <= 0)
    atomic_store(&c->async, ncclSuccess);
  ncclResult_t r = (ncclResult_t)atomic_load(&c->async);
  if (r == ncclSuccess) r = (ncclResult_t)atomic_load(&c->dev_err);
  if (r == ncclSuccess && atomic_load(&c->shm->aborted)) r = ncclRemoteError;
  *asyncError = r;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommGetAsyncError);

GH_EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) {
  if (!fk_comm_ok(comm) || count == NULL) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommCount);

/* One fake GPU per process: device = LOCAL_RANK when set, else 0. */
GH_EXPORT ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!fk_comm_ok(comm) || device == NULL) return ncclInvalidArgument;
  const char *s = getenv("LOCAL_RANK");
  *device = s != NULL ? atoi(s) : 0;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommCuDevice);

GH_EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!fk_comm_ok(comm) || rank == NULL) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclCommUserRank);

GH_EXPORT const char *pncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
GH_WEAK_ALIAS(ncclGetErrorString);
