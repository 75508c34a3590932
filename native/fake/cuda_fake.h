/*
 * The slice of the CUDA runtime, driver and cuBLAS ABI that the fakes implement, with the real
 * signatures and error values (CUDA 12), so code written against the real headers calls them,
 * plus a few fake-only entry points (named fake*) for the test workload and the other fakes.
 * As in CUDA, the runtime (libcudart.so.12, or compiled into a program: a "static runtime") sits
 * on the driver (libcuda.so.1), which owns the device; stream and event handles are the same
 * objects in both APIs.
 */
#ifndef GH_CUDA_FAKE_H
#define GH_CUDA_FAKE_H

#include <stddef.h>
#include <stdint.h>

#include "nccl_abi.h" /* cudaStream_t */

typedef enum {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
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

#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u

enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };

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
GH_CUDA_API(cudaError_t, cudaDeviceGetPCIBusId, (char *pciBusId, int len, int device))
GH_CUDA_API(cudaError_t, cudaStreamCreate, (cudaStream_t *stream))
GH_CUDA_API(cudaError_t, cudaStreamCreateWithFlags, (cudaStream_t *stream, unsigned int flags))
GH_CUDA_API(cudaError_t, cudaStreamDestroy, (cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaStreamSynchronize, (cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaStreamQuery, (cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaDeviceSynchronize, (void))
GH_CUDA_API(cudaError_t, cudaMalloc, (void **ptr, size_t size))
GH_CUDA_API(cudaError_t, cudaFree, (void *ptr))
GH_CUDA_API(cudaError_t, cudaMallocAsync, (void **ptr, size_t size, cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaFreeAsync, (void *ptr, cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaMemset, (void *ptr, int value, size_t count))
GH_CUDA_API(cudaError_t, cudaMemsetAsync, (void *ptr, int value, size_t count, cudaStream_t stream))
GH_CUDA_API(cudaError_t, cudaMemcpyAsync,
            (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream))
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
/* Fake-only: device memory held now (allocations and bytes) and the most bytes ever held, so
 * tests can see who keeps memory (the hook must give a validation's scratch back). */
GH_CUDA_API(void, fakeCudaMemStats, (long *live_allocs, long *live_bytes, long *peak_bytes))
/* Fake-only: a kernel that occupies the device for ns (times the rank's `slow_rank` factor),
 * the analogue of PyTorch's torch.cuda._sleep. Returns at once, like every launch. */
GH_CUDA_API(cudaError_t, fakeGpuSleep, (cudaStream_t stream, long long ns))

/* Fake-only: how the other fakes (cuBLAS, NCCL) put work on the device. The caller allocates the
 * item (usually embedded first in its own struct) and fills run/release/compute; the stream's
 * executor calls run() when the stream reaches it, then release(). The device keeps its own
 * timeline (CLOCK_MONOTONIC ns), as a GPU has its own clock: an item starts at start_ns, when its
 * stream reached it (after the previous item's end, not before it was launched; compute items
 * also after the SMs are free), and run() sets end_ns (start_ns for instant work), sleeping until
 * then. So device timestamps are model times that scheduler delays of the executor thread do not
 * shift, as long as it keeps up. `compute` work (GEMMs, kernels) holds the device's SMs: one
 * compute item at a time per device, in launch order. Work that waits on other ranks
 * (collectives) is not compute. On error the item is not taken: the caller still owns it. */
struct fakeGpuWork {
  void (*run)(struct fakeGpuWork *self);
  void (*release)(struct fakeGpuWork *self);
  /* optional: called under the stream's lock as the stream counts the item done, so what it
   * publishes (an event reached) and the stream's idleness are seen together, as in CUDA */
  void (*done)(struct fakeGpuWork *self);
  int compute;
  int64_t start_ns, end_ns; /* set by the device / by run() */
  /* owned by the device */
  int64_t launch_ns;
  struct fakeGpuWork *next, *knext;
  void *stream;
};
GH_CUDA_API(cudaError_t, fakeGpuLaunch, (cudaStream_t stream, struct fakeGpuWork *work))
/* Fake-only: the rank's `slow_rank` factor (>= 1) as the device applies it to compute work. */
GH_CUDA_API(double, fakeGpuSlowFactor, (void))

/* The driver API slice (libcuda.so.1): CUresult values equal the runtime's for the errors used
 * here (0, 1, 2, 3, 101, 400, 600, 900); CUDA_ERROR_INVALID_CONTEXT is 201. */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_CONTEXT 201
GH_CUDA_API(CUresult, cuInit, (unsigned int flags))
GH_CUDA_API(CUresult, cuDriverGetVersion, (int *version))
GH_CUDA_API(CUresult, cuDeviceGetCount, (int *count))
GH_CUDA_API(CUresult, cuDeviceGet, (CUdevice *device, int ordinal))
GH_CUDA_API(CUresult, cuDeviceGetPCIBusId, (char *pciBusId, int len, CUdevice dev))
GH_CUDA_API(CUresult, cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev))
GH_CUDA_API(CUresult, cuDevicePrimaryCtxRelease_v2, (CUdevice dev))
GH_CUDA_API(CUresult, cuCtxSetCurrent, (CUcontext ctx))
GH_CUDA_API(CUresult, cuCtxGetCurrent, (CUcontext *pctx))
GH_CUDA_API(CUresult, cuCtxGetDevice, (CUdevice *device))
GH_CUDA_API(CUresult, cuEventCreate, (CUevent *phEvent, unsigned int Flags))
GH_CUDA_API(CUresult, cuEventRecord, (CUevent hEvent, CUstream hStream))
GH_CUDA_API(CUresult, cuEventQuery, (CUevent hEvent))
GH_CUDA_API(CUresult, cuEventSynchronize, (CUevent hEvent))
GH_CUDA_API(CUresult, cuEventElapsedTime, (float *pMilliseconds, CUevent hStart, CUevent hEnd))
GH_CUDA_API(CUresult, cuEventDestroy_v2, (CUevent hEvent))
GH_CUDA_API(CUresult, cuStreamCreate, (CUstream *phStream, unsigned int Flags))
GH_CUDA_API(CUresult, cuStreamDestroy_v2, (CUstream hStream))
GH_CUDA_API(CUresult, cuStreamSynchronize, (CUstream hStream))
GH_CUDA_API(CUresult, cuStreamQuery, (CUstream hStream))
GH_CUDA_API(CUresult, cuStreamIsCapturing, (CUstream hStream, enum cudaStreamCaptureStatus *captureStatus))
GH_CUDA_API(CUresult, cuThreadExchangeStreamCaptureMode, (enum cudaStreamCaptureMode *mode))
GH_CUDA_API(CUresult, cuMemAlloc_v2, (uint64_t *dptr, size_t bytes))
GH_CUDA_API(CUresult, cuMemFree_v2, (uint64_t dptr))
#undef GH_CUDA_API

#endif
