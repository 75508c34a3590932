/*
 * The slice of the CUDA runtime and cuBLAS ABI that the fakes implement, with the real
 * signatures and error values (CUDA 12), so code written against the real headers calls them.
 */
#ifndef GH_CUDA_FAKE_H
#define GH_CUDA_FAKE_H

#include <stddef.h>

#include "nccl_abi.h" /* cudaStream_t */

typedef enum {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorStreamCaptureUnsupported = 900
} cudaError_t;

typedef struct CUevent_st *cudaEvent_t;

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};

#define cudaEventDefault 0x0u
#define cudaEventBlockingSync 0x1u
#define cudaEventDisableTiming 0x2u

typedef struct cublasContext *cublasHandle_t;
typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

#define GH_CUDA_API(ret, name, args) ret name args;
GH_CUDA_API(cudaError_t, cudaEventCreate, (cudaEvent_t *event))
GH_CUDA_API(cudaError_t, cudaEventCreateWithFlags, (cudaEvent_t *event, unsigned int flags))
GH_CUDA_API(cudaError_t, cudaEventRecord, (cudaEvent_t event, cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaEventQuery, (cudaEvent_t event))
GH_CUDA_API(cudaError_t, cudaEventSynchronize, (cudaEvent_t event))
GH_CUDA_API(cudaError_t, cudaEventElapsedTime, (float *ms, cudaEvent_t start, cudaEvent_t end))
GH_CUDA_API(cudaError_t, cudaEventDestroy, (cudaEvent_t event))
GH_CUDA_API(cudaError_t, cudaStreamIsCapturing, (cudaStream_t stream, enum cudaStreamCaptureStatus *status))
GH_CUDA_API(cudaError_t, cudaThreadExchangeStreamCaptureMode, (enum cudaStreamCaptureMode *mode))
GH_CUDA_API(cudaError_t, cudaGetDevice, (int *device))
GH_CUDA_API(cudaError_t, cudaSetDevice, (int device))
GH_CUDA_API(cudaError_t, cudaGetDeviceCount, (int *count))
GH_CUDA_API(cudaError_t, cudaStreamCreate, (cudaStream_t *stream))
GH_CUDA_API(cudaError_t, cudaStreamDestroy, (cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaStreamSynchronize, (cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaDeviceSynchronize, (void))
GH_CUDA_API(cudaError_t, cudaMalloc, (void **ptr, size_t size))
GH_CUDA_API(cudaError_t, cudaFree, (void *ptr))
GH_CUDA_API(cudaError_t, cudaMemset, (void *ptr, int value, size_t count))
GH_CUDA_API(cudaError_t, cudaGetLastError, (void))
GH_CUDA_API(const char *, cudaGetErrorString, (cudaError_t error))
GH_CUDA_API(cublasStatus_t, cublasCreate_v2, (cublasHandle_t *handle))
GH_CUDA_API(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t handle))
GH_CUDA_API(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream))
GH_CUDA_API(cublasStatus_t, cublasSgemm_v2,
            (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
             const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta, float *C,
             int ldc))
/* Fake-only: counts of CUDA calls a graph capture in progress made illegal or turned into nodes. */
GH_CUDA_API(void, fakeCudaCaptureStats, (long *violations, long *captured_records))
#undef GH_CUDA_API

#endif
