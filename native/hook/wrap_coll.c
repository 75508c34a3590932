/*
 * Collective wrappers. ncclBcast is recorded as a BROADCAST; real NCCL implements it by calling
 * ncclBroadcast through its PLT, which lands in our wrapper at depth 1 and passes straight through,
 * so the call is recorded once.
 */
#include "hot.h"

#define NO_REDOP 255
#define NO_PEER (-1)

typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t);
typedef ncclResult_t (*broadcast_fn)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                                     cudaStream_t);
typedef ncclResult_t (*bcast_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*reduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
                                  ncclComm_t, cudaStream_t);
typedef ncclResult_t (*gather_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                                  cudaStream_t);

static allreduce_fn real_allreduce, real_reducescatter;
static broadcast_fn real_broadcast;
static bcast_fn real_bcast;
static reduce_fn real_reduce;
static gather_fn real_allgather, real_alltoall;

GH_EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                     cudaStream_t stream) {
  allreduce_fn f = GH_RESOLVE(real_allreduce, ncclAllReduce);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_ALLREDUCE, comm, stream, f(sendbuff, recvbuff, count, datatype, op, comm, stream),
               count, datatype, op, NO_PEER);
}

GH_EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                         cudaStream_t stream) {
  allreduce_fn f = GH_RESOLVE(real_reducescatter, ncclReduceScatter);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_REDUCESCATTER, comm, stream,
               f(sendbuff, recvbuff, recvcount, datatype, op, comm, stream), recvcount, datatype, op,
               NO_PEER);
}

GH_EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  gather_fn f = GH_RESOLVE(real_allgather, ncclAllGather);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_ALLGATHER, comm, stream, f(sendbuff, recvbuff, sendcount, datatype, comm, stream),
               sendcount, datatype, NO_REDOP, NO_PEER);
}

GH_EXPORT ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                                    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  gather_fn f = GH_RESOLVE(real_alltoall, ncclAlltoAll);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_ALLTOALL, comm, stream, f(sendbuff, recvbuff, count, datatype, comm, stream),
               count, datatype, NO_REDOP, NO_PEER);
}

GH_EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                     ncclDataType_t datatype, int root, ncclComm_t comm,
                                     cudaStream_t stream) {
  broadcast_fn f = GH_RESOLVE(real_broadcast, ncclBroadcast);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_BROADCAST, comm, stream, f(sendbuff, recvbuff, count, datatype, root, comm, stream),
               count, datatype, NO_REDOP, root);
}

GH_EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                                 ncclComm_t comm, cudaStream_t stream) {
  bcast_fn f = GH_RESOLVE(real_bcast, ncclBcast);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_BROADCAST, comm, stream, f(buff, count, datatype, root, comm, stream), count,
               datatype, NO_REDOP, root);
}

GH_EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
  reduce_fn f = GH_RESOLVE(real_reduce, ncclReduce);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_REDUCE, comm, stream, f(sendbuff, recvbuff, count, datatype, op, root, comm, stream),
               count, datatype, op, root);
}
