/*
 * Collectives, P2P and groups. Every operation is posted first (the rank announces what it
 * entered) and waited for second; a group posts all its operations before waiting on any, which is
 * what lets a ring of sends and receives in one group complete, like NCCL's fused group launch.
 * All ranks of an operation return at one modelled time: the last entry plus the transfer time.
 */
#include <stdlib.h>
#include <string.h>

#include "fk_faults.h"
#include "fk_time.h"
#include "nccl_fake.h"

#define FK_GROUP_MAX 4096
#define FK_INPROGRESS_POLLS 2

static _Thread_local int t_group_depth;
static _Thread_local struct fk_call *t_queue;
static _Thread_local int t_queued, t_qcap;
static _Thread_local ncclResult_t t_group_err;

static int coll_entered(const struct ncclComm *c, const void *arg) {
  uint32_t need = *(const uint32_t *)arg + 1;
  for (int r = 0; r < c->nranks; r++)
    if (atomic_load(&c->shm->entered[r]) < need) return 0;
  return 1;
}

static int never_ready(const struct ncclComm *c, const void *arg) {
  (void)c;
  (void)arg;
  return 0;
}

static int fault_gone(const struct ncclComm *c, const void *arg) {
  return !fk_fault_find(FK_NEVER_COMPLETE, c->global_rank, (long)*(const uint32_t *)arg, NULL);
}

struct p2p_arg {
  const _Atomic uint32_t *counter;
  uint32_t need;
};

static int p2p_matched(const struct ncclComm *c, const void *arg) {
  (void)c;
  const struct p2p_arg *a = arg;
  return atomic_load(a->counter) >= a->need;
}

static void post(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  struct fk_shm *s = c->shm;
  int64_t now = fk_now_ns();
  if (k->op == FK_OP_SEND) {
    uint32_t n = ++c->sent[k->root];
    s->send_ns[n % FK_TS_RING][c->rank][k->root] = now;
    k->seq = n;
    atomic_store(&s->sent[c->rank][k->root], n);
  } else if (k->op == FK_OP_RECV) {
    uint32_t n = ++c->recvd[k->root];
    s->recv_ns[n % FK_TS_RING][k->root][c->rank] = now;
    k->seq = n;
    atomic_store(&s->recvd[k->root][c->rank], n);
  } else {
    uint32_t seq = c->coll_seq++;
    struct fk_entry *e = &s->rec[seq % FK_RING][c->rank];
    *e = (struct fk_entry){.op = k->op, .dtype = k->dtype, .count = k->count, .root = k->root,
                           .redop = k->redop, .enter_ns = now};
    k->seq = seq;
    atomic_store(&s->entered[c->rank], seq + 1);
  }
  fk_bump(s);
}

static int same_call(const struct fk_entry *a, const struct fk_entry *b) {
  int rooted = a->op == FK_OP_BROADCAST || a->op == FK_OP_REDUCE;
  return a->op == b->op && a->dtype == b->dtype && a->count == b->count &&
         a->redop == b->redop && (!rooted || a->root == b->root);
}

/* Real NCCL hangs (or corrupts data) when ranks disagree on a collective: the fake hangs. */
static ncclResult_t hang_on_mismatch(struct ncclComm *c, uint32_t seq) {
  const struct fk_entry *row = c->shm->rec[seq % FK_RING];
  for (int r = 1; r < c->nranks; r++) {
    if (same_call(&row[0], &row[r])) continue;
    fk_log("mismatch seq=%u rank=%d global=%d: rank0 op=%u count=%llu dtype=%u root=%d; rank%d op=%u "
           "count=%llu dtype=%u root=%d",
           seq, c->rank, c->global_rank, row[0].op, (unsigned long long)row[0].count, row[0].dtype,
           row[0].root, r, row[r].op, (unsigned long long)row[r].count, row[r].dtype, row[r].root);
    return fk_wait(c, never_ready, NULL);
  }
  return ncclSuccess;
}

static ncclResult_t wait_coll(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  if (fk_fault_find(FK_NEVER_COMPLETE, c->global_rank, (long)k->seq, NULL)) {
    fk_log("never_complete seq=%u rank=%d global=%d", k->seq, c->rank, c->global_rank);
    ncclResult_t r = fk_wait(c, fault_gone, &k->seq);
    if (r != ncclSuccess) return r;
  }
  ncclResult_t r = fk_wait(c, coll_entered, &k->seq);
  if (r != ncclSuccess) return r;
  r = hang_on_mismatch(c, k->seq);
  if (r != ncclSuccess) return r;
  int64_t ready = 0;
  for (int i = 0; i < c->nranks; i++) {
    int64_t t = c->shm->rec[k->seq % FK_RING][i].enter_ns;
    if (t > ready) ready = t;
  }
  uint64_t bytes = k->count * fk_dtype_size((ncclDataType_t)k->dtype);
  k->deadline_ns = ready + fk_model_ns(c, k->op, bytes, -1);
  return ncclSuccess;
}

static ncclResult_t wait_p2p(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  struct fk_shm *s = c->shm;
  int peer = k->root, me = c->rank, src = k->op == FK_OP_SEND ? me : peer;
  int dst = k->op == FK_OP_SEND ? peer : me;
  struct p2p_arg a = {.counter = k->op == FK_OP_SEND ? &s->recvd[src][dst] : &s->sent[src][dst],
                      .need = k->seq};
  ncclResult_t r = fk_wait(c, p2p_matched, &a);
  if (r != ncclSuccess) return r;
  int64_t ts = s->send_ns[k->seq % FK_TS_RING][src][dst], tr = s->recv_ns[k->seq % FK_TS_RING][src][dst];
  uint64_t bytes = k->count * fk_dtype_size((ncclDataType_t)k->dtype);
  k->deadline_ns = (ts > tr ? ts : tr) + fk_model_ns(c, k->op, bytes, peer);
  return ncclSuccess;
}

/* Ops of one batch overlap in time (one fused launch): the batch ends at the latest deadline. */
static ncclResult_t run_batch(struct fk_call *calls, int n) {
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < n; i++) {
    atomic_fetch_add(&calls[i].comm->inflight, 1);
    post(&calls[i]);
  }
  int64_t end = 0;
  for (int i = 0; i < n && res == ncclSuccess; i++) {
    int p2p = calls[i].op == FK_OP_SEND || calls[i].op == FK_OP_RECV;
    res = p2p ? wait_p2p(&calls[i]) : wait_coll(&calls[i]);
    if (calls[i].deadline_ns > end) end = calls[i].deadline_ns;
  }
  if (res == ncclSuccess) fk_sleep_until(end);
  for (int i = 0; i < n; i++) {
    struct ncclComm *c = calls[i].comm;
    if (res == ncclSuccess && c->nonblocking && fk_fault_find(FK_INPROGRESS, c->global_rank, -1, NULL)) {
      atomic_store(&c->async_polls, FK_INPROGRESS_POLLS);
      atomic_store(&c->async, ncclInProgress);
      res = ncclInProgress;
    }
    atomic_fetch_sub(&c->inflight, 1);
  }
  return res;
}

static ncclResult_t validate(const struct fk_call *k) {
  if (!fk_comm_ok(k->comm)) return ncclInvalidArgument;
  if (atomic_load(&k->comm->aborted)) return ncclInvalidUsage;
  if (fk_dtype_size((ncclDataType_t)k->dtype) == 0) return ncclInvalidArgument;
  int p2p = k->op == FK_OP_SEND || k->op == FK_OP_RECV;
  int rooted = k->op == FK_OP_BROADCAST || k->op == FK_OP_REDUCE;
  if ((p2p || rooted) && (k->root < 0 || k->root >= k->comm->nranks)) return ncclInvalidArgument;
  return ncclSuccess;
}

ncclResult_t fk_submit(struct fk_call *k) {
  if (fk_noop) return ncclSuccess;
  ncclResult_t r = validate(k);
  if (r != ncclSuccess) return r;
  if (t_group_depth == 0) return run_batch(k, 1);
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
  if (r != ncclSuccess) return r;
  return n > 0 ? run_batch(t_queue, n) : ncclSuccess;
}
GH_WEAK_ALIAS(ncclGroupEnd);

#define FK_CALL(op_, comm_, count_, dtype_, root_, redop_)                                          \
  struct fk_call k = {.comm = (comm_), .op = (op_), .dtype = (uint32_t)(dtype_), .count = (count_), \
                      .root = (root_), .redop = (int32_t)(redop_)};                                 \
  return fk_submit(&k)

GH_EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  (void)stream;
  FK_CALL(FK_OP_ALLREDUCE, comm, count, datatype, -1, op);
}
GH_WEAK_ALIAS(ncclAllReduce);

GH_EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      int root, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  (void)stream;
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
  (void)stream;
  FK_CALL(FK_OP_REDUCE, comm, count, datatype, root, op);
}
GH_WEAK_ALIAS(ncclReduce);

GH_EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                      ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  (void)stream;
  FK_CALL(FK_OP_ALLGATHER, comm, sendcount, datatype, -1, 0);
}
GH_WEAK_ALIAS(ncclAllGather);

GH_EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                          cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  (void)stream;
  FK_CALL(FK_OP_REDUCESCATTER, comm, recvcount, datatype, -1, op);
}
GH_WEAK_ALIAS(ncclReduceScatter);

GH_EXPORT ncclResult_t pncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                     ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)recvbuff;
  (void)stream;
  FK_CALL(FK_OP_ALLTOALL, comm, count, datatype, -1, 0);
}
GH_WEAK_ALIAS(ncclAlltoAll);

GH_EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                 ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff;
  (void)stream;
  FK_CALL(FK_OP_SEND, comm, count, datatype, peer, 0);
}
GH_WEAK_ALIAS(ncclSend);

GH_EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                                 cudaStream_t stream) {
  (void)recvbuff;
  (void)stream;
  FK_CALL(FK_OP_RECV, comm, count, datatype, peer, 0);
}
GH_WEAK_ALIAS(ncclRecv);
