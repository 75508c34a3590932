/*
 * A fake CUDA runtime over the fake driver (libcuda.so.1, which owns the device: gpu.c,
 * cuda_drv.c): launches, event records, memsets and copies return at once and run when their
 * stream reaches them; synchronisations block until then and queries answer cudaErrorNotReady
 * meanwhile, as on a GPU. Events, streams and capture state are the driver's (the same handles
 * in both APIs); `gpu_lag_ms`, `capture` and the capture rules are described there. Device
 * memory is host memory, counted (fakeCudaMemStats). Built as libcudart.so.12, or compiled into a
 * program (the static runtime nvcc links by default: then no libcudart is loaded at all).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_fake.h"
#include "fk_faults.h"
#include "fk_time.h"
#include "gpu.h"

#define GH_EXPORT __attribute__((visibility("default")))
static _Thread_local cudaError_t t_last_error = cudaSuccess;

static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
  return e;
}

GH_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  (void)fk_cur_device();
  return ret(fk_ev_create(event, flags));
}

GH_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

GH_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return ret(fk_ev_record(event, stream, fk_cur_device()));
}

GH_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) { return ret(fk_ev_query(event)); }
GH_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) { return ret(fk_ev_sync(event)); }

GH_EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  return ret(fk_ev_elapsed(ms, start, end));
}

GH_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) { return ret(fk_ev_destroy(event)); }

GH_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
  if (status == NULL) return ret(cudaErrorInvalidValue);
  if (stream != NULL && !fk_stream_ok(stream)) return ret(cudaErrorInvalidResourceHandle);
  *status = fk_capture_query(stream) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  return ret(fk_capture_exchange(mode));
}

GH_EXPORT cudaError_t cudaGetDevice(int *device) {
  if (device == NULL) return ret(cudaErrorInvalidValue);
  *device = fk_cur_device();
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaSetDevice(int device) { return ret(fk_set_device(device)); }

GH_EXPORT cudaError_t cudaGetDeviceCount(int *count) {
  if (count == NULL) return ret(cudaErrorInvalidValue);
  *count = FK_DEVICES;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
  (void)fk_cur_device();
  return ret(fk_device_pci(device, pciBusId, len));
}

GH_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  if (stream == NULL) return ret(cudaErrorInvalidValue);
  return ret(fk_stream_create(stream, flags, fk_cur_device()));
}

GH_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *stream) { return cudaStreamCreateWithFlags(stream, 0); }

GH_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!fk_stream_ok(stream)) return ret(cudaErrorInvalidResourceHandle);
  fk_stream_destroy(stream);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (fk_gpu_forked) return ret(cudaErrorInitializationError);
  fk_stream_sync(s);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamQuery(cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  return fk_stream_idle(s) ? cudaSuccess : cudaErrorNotReady;
}

GH_EXPORT cudaError_t cudaDeviceSynchronize(void) {
  if (fk_gpu_forked) return ret(cudaErrorInitializationError);
  fk_device_sync(fk_cur_device());
  return cudaSuccess;
}

/* Device memory is host memory behind a small header that keeps its size, so the process's
 * device memory can be counted; a pointer the fake did not hand out is refused, as by CUDA. */
#define FK_ALLOC_MAGIC 0x66616b65616c6c6full
struct alloc_hdr {
  uint64_t magic;
  uint64_t bytes; /* 16 bytes: what follows stays 16-byte aligned */
};
static _Atomic long g_live_allocs, g_live_bytes, g_peak_bytes;

static void *dev_alloc(size_t size) {
  if (size > (SIZE_MAX >> 1)) return NULL;
  struct alloc_hdr *h = malloc(sizeof *h + (size ? size : 1));
  if (h == NULL) return NULL;
  *h = (struct alloc_hdr){.magic = FK_ALLOC_MAGIC, .bytes = size};
  atomic_fetch_add(&g_live_allocs, 1);
  long now = atomic_fetch_add(&g_live_bytes, (long)size) + (long)size;
  long peak = atomic_load(&g_peak_bytes);
  while (now > peak && !atomic_compare_exchange_weak(&g_peak_bytes, &peak, now)) {
  }
  return h + 1;
}

static struct alloc_hdr *dev_header(void *ptr) {
  struct alloc_hdr *h = (struct alloc_hdr *)ptr - 1;
  return h->magic == FK_ALLOC_MAGIC ? h : NULL;
}

static void dev_free(struct alloc_hdr *h) {
  atomic_fetch_sub(&g_live_allocs, 1);
  atomic_fetch_sub(&g_live_bytes, (long)h->bytes);
  h->magic = 0;
  free(h);
}

GH_EXPORT void fakeCudaMemStats(long *live_allocs, long *live_bytes, long *peak_bytes) {
  if (live_allocs != NULL) *live_allocs = atomic_load(&g_live_allocs);
  if (live_bytes != NULL) *live_bytes = atomic_load(&g_live_bytes);
  if (peak_bytes != NULL) *peak_bytes = atomic_load(&g_peak_bytes);
}

GH_EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
  if (ptr == NULL) return ret(cudaErrorInvalidValue);
  *ptr = dev_alloc(size);
  return *ptr != NULL ? cudaSuccess : ret(cudaErrorMemoryAllocation);
}

GH_EXPORT cudaError_t cudaFree(void *ptr) {
  if (ptr == NULL) return cudaSuccess;
  struct alloc_hdr *h = dev_header(ptr);
  if (h == NULL) return ret(cudaErrorInvalidValue);
  dev_free(h);
  return cudaSuccess;
}

/* Stream-ordered: the memory exists from the call (CUDA reserves it from the device's pool at
 * once) and goes back when the stream reaches the free, after the work queued before it. */
GH_EXPORT cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
  if (ptr == NULL) return ret(cudaErrorInvalidValue);
  if (fk_stream(stream, fk_cur_device()) == NULL) return ret(cudaErrorInvalidResourceHandle);
  return cudaMalloc(ptr, size);
}

struct free_work {
  struct fakeGpuWork w;
  struct alloc_hdr *h;
};

static void free_run(struct fakeGpuWork *w) { dev_free(((struct free_work *)w)->h); }
static void free_release(struct fakeGpuWork *w) { free(w); }

GH_EXPORT cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (ptr == NULL) return cudaSuccess;
  struct alloc_hdr *h = dev_header(ptr);
  if (h == NULL) return ret(cudaErrorInvalidValue);
  struct free_work *f = malloc(sizeof *f);
  if (f == NULL) return ret(cudaErrorMemoryAllocation);
  *f = (struct free_work){.w = {.run = free_run, .release = free_release}, .h = h};
  cudaError_t rc = fk_launch(s, &f->w);
  if (rc != cudaSuccess) free(f);
  return ret(rc);
}

GH_EXPORT cudaError_t cudaMemset(void *ptr, int value, size_t count) {
  if (ptr == NULL && count > 0) return ret(cudaErrorInvalidValue);
  if (count > 0) memset(ptr, value, count);
  return cudaSuccess;
}

/* Memory operations are device work that does not hold the SMs. */
struct mem_work {
  struct fakeGpuWork w;
  void *dst;
  const void *src;
  int value;
  size_t count;
};

static void mem_run(struct fakeGpuWork *w) {
  struct mem_work *m = (struct mem_work *)w;
  if (m->src != NULL) memmove(m->dst, m->src, m->count);
  else memset(m->dst, m->value, m->count);
}

static void mem_release(struct fakeGpuWork *w) { free(w); }

static cudaError_t mem_launch(void *dst, const void *src, int value, size_t count, cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  if (dst == NULL) return ret(cudaErrorInvalidValue);
  struct mem_work *m = malloc(sizeof *m);
  if (m == NULL) return ret(cudaErrorMemoryAllocation);
  *m = (struct mem_work){.w = {.run = mem_run, .release = mem_release}, .dst = dst, .src = src,
                         .value = value, .count = count};
  cudaError_t rc = fk_launch(s, &m->w);
  if (rc != cudaSuccess) free(m);
  return ret(rc);
}

GH_EXPORT cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream) {
  return mem_launch(ptr, NULL, value, count, stream);
}

GH_EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                      cudaStream_t stream) {
  (void)kind;
  if (src == NULL && count > 0) return ret(cudaErrorInvalidValue);
  return mem_launch(dst, src, 0, count, stream);
}

GH_EXPORT cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

GH_EXPORT const char *cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    default: return "unrecognized error code";
  }
}
