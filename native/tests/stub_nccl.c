/*
 * A tiny in-process NCCL for the hook's C unit tests (one fake target per scenario, as GOTCHA's
 * tests do). It mirrors what matters to interposition: pncclX strong symbols with weak ncclX
 * aliases, ncclBcast calling ncclBroadcast through the PLT, ncclInProgress for non-blocking
 * communicators, and an errno side effect (ncclAllReduce sets EILSEQ) to test errno handling.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_abi.h"

struct ncclComm {
  int rank, nranks, nonblocking, polls;
  ncclResult_t async;
};

#define ALIAS(name) __typeof__(p##name) name __attribute__((weak, alias("p" #name)));

/* What the tests check of the hook's own use: benchmark splits made, benchmark comms aborted. */
int stub_splits_with_config, stub_aborts;
ncclResult_t stub_group_end_result; /* what the outermost ncclGroupEnd answers (a failure, ncclInProgress) */
/* Called inside ncclAllReduce when set: where real NCCL raises a profiler plugin's task events. */
void (*stub_inside_allreduce)(void);
static int group_depth;

static ncclComm_t make(int rank, int nranks, int nonblocking) {
  ncclComm_t c = calloc(1, sizeof *c);
  c->rank = rank;
  c->nranks = nranks;
  c->nonblocking = nonblocking;
  c->async = nonblocking ? ncclInProgress : ncclSuccess;
  return c;
}
static ncclResult_t done(ncclComm_t c) { return c->nonblocking ? ncclInProgress : ncclSuccess; }

ncclResult_t pncclGetVersion(int *v) { *v = 22800; return ncclSuccess; }
ncclResult_t pncclGetUniqueId(ncclUniqueId *id) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) id->internal[i] = (char)(rand() & 0xff);
  return ncclSuccess;
}
ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  if (rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = make(rank, nranks, 0);
  return ncclSuccess;
}
ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                     ncclConfig_t *config) {
  (void)id;
  *comm = make(rank, nranks, config != NULL);
  return config != NULL ? ncclInProgress : ncclSuccess;
}
ncclResult_t pncclCommInitRankScalable(ncclComm_t *comm, int nranks, int rank, int nId, ncclUniqueId *ids,
                                       ncclConfig_t *config) {
  if (ids == NULL || nId < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = make(rank, nranks, config != NULL);
  return config != NULL ? ncclInProgress : ncclSuccess;
}
/* The excluded ranks never call it; the others close the gaps. */
ncclResult_t pncclCommShrink(ncclComm_t comm, int *exclude, int n, ncclComm_t *newcomm, ncclConfig_t *config,
                             int flags) {
  (void)config;
  (void)flags;
  int below = 0;
  for (int i = 0; i < n; i++) {
    if (exclude[i] == comm->rank) return ncclInvalidArgument;
    below += exclude[i] < comm->rank;
  }
  *newcomm = make(comm->rank - below, comm->nranks - n, 0);
  return ncclSuccess;
}
ncclResult_t pncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  (void)devlist;
  for (int i = 0; i < ndev; i++) comms[i] = make(i, ndev, 0);
  return ncclSuccess;
}
/* Colors split the ranks in halves: color c keeps the ranks r with r % 2 == c % 2. A split with a
 * config (the hook's benchmark communicator: color 0 and the rank as key on every rank) keeps them
 * all, in their order. */
ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)key;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = NULL;
    return ncclSuccess;
  }
  if (config != NULL) {
    *newcomm = make(comm->rank, comm->nranks, 0);
    stub_splits_with_config++;
    return ncclSuccess;
  }
  *newcomm = make(comm->rank / 2, (comm->nranks + 1 - comm->rank % 2) / 2, 0);
  return ncclSuccess;
}
ncclResult_t pncclCommDestroy(ncclComm_t comm) { free(comm); return ncclSuccess; }
ncclResult_t pncclCommAbort(ncclComm_t comm) { stub_aborts++; free(comm); return ncclSuccess; }
ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *e) {
  *e = comm->async;
  if (comm->async == ncclInProgress && ++comm->polls >= 1) comm->async = ncclSuccess;
  return ncclSuccess;
}
ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) { *count = comm->nranks; return ncclSuccess; }
ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device) { *device = comm->rank % 8; return ncclSuccess; }
ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) { *rank = comm->rank; return ncclSuccess; }
const char *pncclGetErrorString(ncclResult_t r) { return r == ncclSuccess ? "no error" : "error"; }
ncclResult_t pncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                            ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)op, (void)st;
  if (stub_inside_allreduce != NULL) stub_inside_allreduce();
  errno = EILSEQ;
  return comm != NULL ? done(comm) : ncclInvalidArgument;
}
ncclResult_t pncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t t, int root,
                            ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)st;
  return root < comm->nranks ? done(comm) : ncclInvalidArgument;
}
ncclResult_t pncclBcast(void *buff, size_t n, ncclDataType_t t, int root, ncclComm_t comm, cudaStream_t st) {
  return ncclBroadcast(buff, buff, n, t, root, comm, st); /* through the PLT, like real NCCL */
}
ncclResult_t pncclReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root,
                         ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)op, (void)root, (void)st;
  return done(comm);
}
ncclResult_t pncclAllGather(const void *s, void *r, size_t n, ncclDataType_t t, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)st;
  return done(comm);
}
ncclResult_t pncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)op, (void)st;
  return done(comm);
}
ncclResult_t pncclAlltoAll(const void *s, void *r, size_t n, ncclDataType_t t, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)t, (void)st;
  return done(comm);
}
ncclResult_t pncclSend(const void *s, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)n, (void)t, (void)st;
  return peer < comm->nranks ? done(comm) : ncclInvalidArgument;
}
ncclResult_t pncclRecv(void *r, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st) {
  (void)r, (void)n, (void)t, (void)st;
  return peer < comm->nranks ? done(comm) : ncclInvalidArgument;
}
ncclResult_t pncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}
ncclResult_t pncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  return --group_depth == 0 ? stub_group_end_result : ncclSuccess;
}

ALIAS(ncclGetVersion)
ALIAS(ncclGetUniqueId)
ALIAS(ncclCommInitRank)
ALIAS(ncclCommInitRankConfig)
ALIAS(ncclCommInitAll)
ALIAS(ncclCommInitRankScalable)
ALIAS(ncclCommShrink)
ALIAS(ncclCommSplit)
ALIAS(ncclCommDestroy)
ALIAS(ncclCommAbort)
ALIAS(ncclCommGetAsyncError)
ALIAS(ncclCommCount)
ALIAS(ncclCommCuDevice)
ALIAS(ncclCommUserRank)
ALIAS(ncclGetErrorString)
ALIAS(ncclAllReduce)
ALIAS(ncclBroadcast)
ALIAS(ncclBcast)
ALIAS(ncclReduce)
ALIAS(ncclAllGather)
ALIAS(ncclReduceScatter)
ALIAS(ncclAlltoAll)
ALIAS(ncclSend)
ALIAS(ncclRecv)
ALIAS(ncclGroupStart)
ALIAS(ncclGroupEnd)
