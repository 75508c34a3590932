/*
 * A fake CUDA runtime over the fake device (gpu.c): launches, event records, memsets and copies
 * return at once and run when their stream reaches them; synchronisations block until then and
 * queries answer cudaErrorNotReady meanwhile, as on a GPU. `gpu_lag_ms R ms` delays rank R's
 * event completions by ms more (a poller then meets not-ready events even on an idle device).
 * `capture R` makes rank R's default stream (the one the workload trains on) report capturing,
 * as if its training thread were capturing a CUDA graph in the default (global) capture mode;
 * streams made with cudaStreamCreate are not capturing. Then, as in CUDA, event queries and
 * synchronisations are illegal from any thread that has not switched itself to thread-local or
 * relaxed capture mode: they fail with cudaErrorStreamCaptureUnsupported (a real capture would be
 * invalidated), and recording an event into a capturing stream only adds a graph node, never a
 * timing. Both are counted, and the counts are readable through fakeCudaCaptureStats so tests can
 * assert a profiler stayed clear. Work launched on a capturing stream still runs (the fake does
 * not build graphs). Device memory is host memory, counted (fakeCudaMemStats).
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
static _Thread_local int t_device;
static _Thread_local enum cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;
static _Thread_local cudaError_t t_last_error = cudaSuccess;

static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
  return e;
}

static int event_ok(cudaEvent_t e) { return e != NULL && e->magic == FK_EVENT_MAGIC; }

static _Atomic long g_capture_violations, g_captured_records;

static int capturing(void) { return fk_fault_mine(FK_CAPTURE, NULL); }

/* A real capture starts and ends by the application thread's own calls, never between two CUDA
 * calls the hook makes for one NCCL call; the fault file can flip at any moment. So the state a
 * thread saw at its last cudaStreamIsCapturing holds for its event records until it asks again. */
static _Thread_local int t_seen_capture = -1;

static int capturing_for_record(void) { return t_seen_capture >= 0 ? t_seen_capture : capturing(); }

/* An event query/sync that a global-mode capture in progress forbids in this thread. */
static int unsafe_during_capture(void) {
  if (t_capture_mode != cudaStreamCaptureModeGlobal || !capturing()) return 0;
  atomic_fetch_add(&g_capture_violations, 1);
  return 1;
}

GH_EXPORT void fakeCudaCaptureStats(long *violations, long *captured_records) {
  if (violations != NULL) *violations = atomic_load(&g_capture_violations);
  if (captured_records != NULL) *captured_records = atomic_load(&g_captured_records);
}

GH_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  if (event == NULL) return ret(cudaErrorInvalidValue);
  cudaEvent_t e = calloc(1, sizeof *e);
  if (e == NULL) return ret(cudaErrorMemoryAllocation);
  e->magic = FK_EVENT_MAGIC;
  e->flags = flags;
  atomic_init(&e->refs, 1);
  *event = e;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

GH_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  struct CUstream_st *s = fk_stream(stream, t_device);
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (stream == NULL && capturing_for_record()) { /* a graph node; the event records nothing */
    atomic_fetch_add(&g_captured_records, 1);
    return cudaSuccess;
  }
  double lag_ms = 0;
  fk_fault_mine(FK_GPU_LAG_MS, &lag_ms);
  return ret(fk_event_record(event, s, (int64_t)(lag_ms * 1e6)));
}

/* An event never recorded counts as complete, as in CUDA. */
GH_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  if (unsafe_during_capture()) return ret(cudaErrorStreamCaptureUnsupported);
  return fk_event_ready(event) ? cudaSuccess : cudaErrorNotReady;
}

GH_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  if (unsafe_during_capture()) return ret(cudaErrorStreamCaptureUnsupported);
  if (fk_gpu_forked && !fk_event_ready(event)) return ret(cudaErrorInitializationError);
  fk_event_wait(event);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == NULL) return ret(cudaErrorInvalidValue);
  if (!event_ok(start) || !event_ok(end)) return ret(cudaErrorInvalidResourceHandle);
  if ((start->flags | end->flags) & cudaEventDisableTiming) return ret(cudaErrorInvalidResourceHandle);
  if (atomic_load(&start->recorded) == 0 || atomic_load(&end->recorded) == 0)
    return ret(cudaErrorInvalidResourceHandle);
  if (!fk_event_ready(start) || !fk_event_ready(end)) return cudaErrorNotReady;
  int64_t t0 = atomic_load(&start->done_ns), t1 = atomic_load(&end->done_ns);
  *ms = (float)((double)(t1 - t0) / 1e6);
  return cudaSuccess;
}

/* CUDA semantics: a record still queued keeps the event alive until the device reaches it. */
GH_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  event->magic = 0;
  fk_event_unref(event);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
  if (status == NULL) return ret(cudaErrorInvalidValue);
  int active = stream == NULL && capturing();
  if (stream == NULL) t_seen_capture = active;
  *status = active ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  if (mode == NULL) return ret(cudaErrorInvalidValue);
  enum cudaStreamCaptureMode old = t_capture_mode;
  t_capture_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaGetDevice(int *device) {
  if (device == NULL) return ret(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= 8) return ret(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaGetDeviceCount(int *count) {
  if (count == NULL) return ret(cudaErrorInvalidValue);
  *count = 8;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  if (stream == NULL) return ret(cudaErrorInvalidValue);
  return ret(fk_stream_create(stream, flags, t_device));
}

GH_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *stream) { return cudaStreamCreateWithFlags(stream, 0); }

GH_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!fk_stream_ok(stream)) return ret(cudaErrorInvalidResourceHandle);
  fk_stream_destroy(stream);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, t_device);
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (fk_gpu_forked) return ret(cudaErrorInitializationError);
  fk_stream_sync(s);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamQuery(cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, t_device);
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  return fk_stream_idle(s) ? cudaSuccess : cudaErrorNotReady;
}

GH_EXPORT cudaError_t cudaDeviceSynchronize(void) {
  if (fk_gpu_forked) return ret(cudaErrorInitializationError);
  fk_device_sync(t_device);
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
  if (fk_stream(stream, t_device) == NULL) return ret(cudaErrorInvalidResourceHandle);
  return cudaMalloc(ptr, size);
}

struct free_work {
  struct fakeGpuWork w;
  struct alloc_hdr *h;
};

static void free_run(struct fakeGpuWork *w) { dev_free(((struct free_work *)w)->h); }
static void free_release(struct fakeGpuWork *w) { free(w); }

GH_EXPORT cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
  struct CUstream_st *s = fk_stream(stream, t_device);
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
  struct CUstream_st *s = fk_stream(stream, t_device);
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

/* --- fake-only device entry points --- */

GH_EXPORT double fakeGpuSlowFactor(void) {
  double factor = 1.0;
  if (!fk_fault_mine(FK_SLOW_RANK, &factor) || factor < 1.0) factor = 1.0;
  return factor;
}

struct sleep_work {
  struct fakeGpuWork w;
  int64_t ns;
};

/* Decided when the device runs it, so a `slow_rank` line slows the kernels that start after it. */
static void sleep_run(struct fakeGpuWork *w) {
  w->end_ns = w->start_ns + (int64_t)((double)((struct sleep_work *)w)->ns * fakeGpuSlowFactor());
  fk_sleep_until(w->end_ns);
}

static void sleep_release(struct fakeGpuWork *w) { free(w); }

GH_EXPORT cudaError_t fakeGpuSleep(cudaStream_t stream, long long ns) {
  struct CUstream_st *s = fk_stream(stream, t_device);
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  if (ns < 0) return ret(cudaErrorInvalidValue);
  struct sleep_work *k = malloc(sizeof *k);
  if (k == NULL) return ret(cudaErrorMemoryAllocation);
  *k = (struct sleep_work){.w = {.run = sleep_run, .release = sleep_release, .compute = 1}, .ns = ns};
  cudaError_t rc = fk_launch(s, &k->w);
  if (rc != cudaSuccess) free(k);
  return ret(rc);
}

GH_EXPORT cudaError_t fakeGpuLaunch(cudaStream_t stream, struct fakeGpuWork *work) {
  if (work == NULL || work->run == NULL || work->release == NULL) return ret(cudaErrorInvalidValue);
  struct CUstream_st *s = fk_stream(stream, t_device);
  if (s == NULL) return ret(cudaErrorInvalidResourceHandle);
  return ret(fk_launch(s, work));
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
