/*
 * The slice of NCCL's public ABI that the hook and the fake NCCL need, written without
 * cuda_runtime.h so that both build on machines with no CUDA (see shared NCCL-FACTS.md).
 * Layouts and enum values match nccl.h (2.18 .. 2.32); ncclConfig_t is forwarded opaquely.
 * ncclCommInitRankScalable is NCCL 2.23+, ncclCommShrink 2.27+ (signatures of nccl.h.in 2.28).
 */
#ifndef GREYHOUND_NCCL_ABI_H
#define GREYHOUND_NCCL_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef struct ncclComm *ncclComm_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct ncclConfig_opaque ncclConfig_t; /* never dereferenced: versioned by size */

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  ncclInt8 = 0, ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2, ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6, ncclHalf = 6,
  ncclFloat32 = 7, ncclFloat = 7,
  ncclFloat64 = 8, ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

typedef enum {
  ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4,
  ncclNumOps = 5, ncclMaxRedOp = 0x7fffffff
} ncclRedOp_t;

#define NCCL_SPLIT_NOCOLOR (-1)
#define NCCL_SHRINK_DEFAULT 0x00 /* shrink the parent communicator */
#define NCCL_SHRINK_ABORT 0x01   /* first end the parent's operations in flight, then shrink */

/* Every API the hook interposes; each also exists as pnccl<Name> in real NCCL and in the fake. */
#define GH_NCCL_API(ret, name, args) ret name args; ret p##name args;
GH_NCCL_API(ncclResult_t, ncclGetVersion, (int *version))
GH_NCCL_API(ncclResult_t, ncclGetUniqueId, (ncclUniqueId *uniqueId))
GH_NCCL_API(ncclResult_t, ncclCommInitRank, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank))
GH_NCCL_API(ncclResult_t, ncclCommInitRankConfig, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config))
GH_NCCL_API(ncclResult_t, ncclCommInitAll, (ncclComm_t *comms, int ndev, const int *devlist))
GH_NCCL_API(ncclResult_t, ncclCommInitRankScalable, (ncclComm_t *newcomm, int nranks, int myrank, int nId, ncclUniqueId *commIds, ncclConfig_t *config))
GH_NCCL_API(ncclResult_t, ncclCommSplit, (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config))
GH_NCCL_API(ncclResult_t, ncclCommShrink, (ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags))
GH_NCCL_API(ncclResult_t, ncclCommDestroy, (ncclComm_t comm))
GH_NCCL_API(ncclResult_t, ncclCommAbort, (ncclComm_t comm))
GH_NCCL_API(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t *asyncError))
GH_NCCL_API(ncclResult_t, ncclCommCount, (const ncclComm_t comm, int *count))
GH_NCCL_API(ncclResult_t, ncclCommCuDevice, (const ncclComm_t comm, int *device))
GH_NCCL_API(ncclResult_t, ncclCommUserRank, (const ncclComm_t comm, int *rank))
GH_NCCL_API(const char *, ncclGetErrorString, (ncclResult_t result))
GH_NCCL_API(ncclResult_t, ncclAllReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclBroadcast, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclBcast, (void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclAllGather, (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclReduceScatter, (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclAlltoAll, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclSend, (const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclRecv, (void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream))
GH_NCCL_API(ncclResult_t, ncclGroupStart, (void))
GH_NCCL_API(ncclResult_t, ncclGroupEnd, (void))
#undef GH_NCCL_API

#ifdef __cplusplus
}
#endif
#endif
