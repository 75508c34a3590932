/*
 * Collectives, P2P and groups, host side. A call is checked, numbered (collective sequence, or
 * per-peer send/receive count) and enqueued on its stream, then returns: the device runs it
 * (nccl_device.c). Inside a group the calls wait in a per-thread queue until the outermost
 * ncclGroupEnd enqueues them as one batch. A non-blocking communicator under `inprogress R`
 * answers ncclInProgress and completes on later ncclCommGetAsyncError polls.
 *
 * `host_stall R seq`: rank R's collective with per-communicator sequence seq (from 0) blocks its
 * host thread inside the call, before anything is enqueued, while the line stays, as real NCCL's
 * host does in connection setup at run time (NCCL_RUNTIME_CONNECT, the default: a collective's
 * first use of an algorithm connects to the peers over the bootstrap network), in a bootstrap
 * exchange or behind a stalled proxy thread. Its GPU finishes what was queued before and idles.
 */
#include <stdlib.h>
#include <string.h>

#include "fk_faults.h"
#include "fk_time.h"
#include "nccl_fake.h"
#include "nccl_prof.h"

#define FK_GROUP_MAX 4096
#define FK_INPROGRESS_POLLS 2

static _Thread_local int t_group_depth;
static _Thread_local struct fk_call *t_queue;
static _Thread_local int t_queued, t_qcap;
static _Thread_local ncclResult_t t_group_err;

static ncclResult_t validate(const struct fk_call *k) {
  if (!fk_comm_ok(k->comm)) return ncclInvalidArgument;
  if (atomic_load(&k->comm->aborted)) return ncclInvalidUsage;
  if (fk_dtype_size((ncclDataType_t)k->dtype) == 0) return ncclInvalidArgument;
  int p2p = k->op == FK_OP_SEND || k->op == FK_OP_RECV;
  int rooted = k->op == FK_OP_BROADCAST || k->op == FK_OP_REDUCE;
  if ((p2p || rooted) && (k->root < 0 || k->root >= k->comm->nranks)) return ncclInvalidArgument;
  return ncclSuccess;
}

/* NCCL forbids using one communicator from two threads at once, so host numbering needs no lock;
 * every rank numbers its calls in the same order, which is how the devices pair them up. */
static void number(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  if (k->op == FK_OP_SEND) k->seq = ++c->sent[k->root];
  else if (k->op == FK_OP_RECV) k->seq = ++c->recvd[k->root];
  else k->seq = c->coll_seq++;
}

/* What a non-blocking communicator reports for an enqueue the fake finished at once. */
static ncclResult_t enqueued(const struct fk_call *calls, int n, ncclResult_t r) {
  for (int i = 0; i < n && r == ncclSuccess; i++) {
    struct ncclComm *c = calls[i].comm;
    if (c->nonblocking && fk_fault_find(FK_INPROGRESS, c->global_rank, -1, NULL)) {
      atomic_store(&c->async_polls, FK_INPROGRESS_POLLS);
      atomic_store(&c->async, ncclInProgress);
      r = ncclInProgress;
    }
  }
  return r;
}

static void host_stall(const struct fk_call *k) {
  struct ncclComm *c = k->comm;
  if (k->op == FK_OP_SEND || k->op == FK_OP_RECV) return;
  if (!fk_fault_find(FK_HOST_STALL, c->global_rank, (long)k->seq, NULL)) return;
  fk_log("host_stall seq=%u rank=%d global=%d", k->seq, c->rank, c->global_rank);
  while (fk_fault_find(FK_HOST_STALL, c->global_rank, (long)k->seq, NULL) && !atomic_load(&c->aborted))
    fk_sleep_ns(1000000);
}

/* No-op mode enqueues nothing, but a loaded profiler plugin still gets the caller's events of a
 * call (its API and launch events), which are what the plugin costs the caller. */
static ncclResult_t noop_call(struct fk_call *k) {
  if (fk_prof_version() == 0 || !fk_comm_ok(k->comm)) return ncclSuccess;
  fk_prof_api_call(k, 0);
  fk_prof_api_group_end();
  fk_prof_launch(k, 1);
  fk_prof_api_end();
  return ncclSuccess;
}

ncclResult_t fk_submit(struct fk_call *k) {
  if (fk_noop) return noop_call(k);
  ncclResult_t r = validate(k);
  if (r != ncclSuccess) return r;
  number(k);
  host_stall(k);
  fk_prof_api_call(k, t_group_depth);
  if (t_group_depth == 0) {
    fk_prof_api_group_end();
    r = enqueued(k, 1, fk_enqueue(k, 1));
    fk_prof_api_end();
    return r;
  }
  if (t_queued == t_qcap) {
    int cap = t_qcap ? 2 * t_qcap : 16;
    struct fk_call *q = cap <= FK_GROUP_MAX ? realloc(t_queue, (size_t)cap * sizeof *q) : NULL;
    if (q == NULL) {
      t_group_err = ncclInternalError;
      return ncclInternalError;
    }
    t_queue = q;
    t_qcap = cap;
  }
  t_queue[t_queued++] = *k;
  return ncclSuccess;
}

GH_EXPORT ncclResult_t pncclGroupStart(void) {
  if (fk_noop) return ncclSuccess;
  t_group_depth++;
  return ncclSuccess;
}
GH_WEAK_ALIAS(ncclGroupStart);

GH_EXPORT ncclResult_t pncclGroupEnd(void) {
  if (fk_noop) return ncclSuccess;
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;
  ncclResult_t r = t_group_err;
  int n = t_queued;
  t_queued = 0;
  t_group_err = ncclSuccess;
  fk_prof_api_group_end();
  if (r == ncclSuccess && n > 0) r = enqueued(t_queue, n, fk_enqueue(t_queue, n));
  fk_prof_api_end();
  return r;
}
GH_WEAK_ALIAS(ncclGroupEnd);

#define FK_CALL(op_, comm_, count_, dtype_, root_, redop_)                                          \
  struct fk_call k = {.comm = (comm_), .stream = stream, .op = (op_), .dtype = (uint32_t)(dtype_),  \
                      .count = (count_), .root = (root_), .redop = (int32_t)(redop_)};              \
  return fk_submit(&k)

GH_EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_ALLREDUCE, comm, count, datatype, -1, op);
}
GH_WEAK_ALIAS(ncclAllReduce);

GH_EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      int root, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_BROADCAST, comm, count, datatype, root, 0);
}
GH_WEAK_ALIAS(ncclBroadcast);

/* Like real NCCL, the legacy in-place Bcast calls the exported ncclBroadcast through the PLT, so
 * an LD_PRELOAD hook sees a nested call. */
GH_EXPORT ncclResult_t pncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}
GH_WEAK_ALIAS(ncclBcast);

GH_EXPORT ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_REDUCE, comm, count, datatype, root, op);
}
GH_WEAK_ALIAS(ncclReduce);

GH_EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                      ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_ALLGATHER, comm, sendcount, datatype, -1, 0);
}
GH_WEAK_ALIAS(ncclAllGather);

GH_EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                          cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_REDUCESCATTER, comm, recvcount, datatype, -1, op);
}
GH_WEAK_ALIAS(ncclReduceScatter);

GH_EXPORT ncclResult_t pncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                     ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  FK_CALL(FK_OP_ALLTOALL, comm, count, datatype, -1, 0);
}
GH_WEAK_ALIAS(ncclAlltoAll);

GH_EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                 ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  FK_CALL(FK_OP_SEND, comm, count, datatype, peer, 0);
}
GH_WEAK_ALIAS(ncclSend);

GH_EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                                 cudaStream_t stream) {
  (void)recvbuff;
  FK_CALL(FK_OP_RECV, comm, count, datatype, peer, 0);
}
GH_WEAK_ALIAS(ncclRecv);
