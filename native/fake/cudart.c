/*
 * A fake CUDA runtime whose "GPU" is the CPU timeline. The fake NCCL runs collectives
 * synchronously, so all work queued on a stream before an event is done when the event is
 * recorded: the event completes at its record time, plus `gpu_lag_ms R ms` for this rank so a
 * poller really meets not-ready events. `capture R` makes rank R's default stream (the one the
 * workload trains on) report capturing, as if its training thread were capturing a CUDA graph in
 * the default (global) capture mode; streams made with cudaStreamCreate are not capturing.
 * Then, as in CUDA, event queries and synchronisations are illegal from any thread that has not
 * switched itself to thread-local or relaxed capture mode: they fail with
 * cudaErrorStreamCaptureUnsupported (a real capture would be invalidated), and recording an event
 * into a capturing stream only adds a graph node, never a timing. Both are counted, and the
 * counts are readable through fakeCudaCaptureStats so tests can assert a profiler stayed clear.
 * Device memory is host memory.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_fake.h"
#include "fk_faults.h"
#include "fk_time.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define FK_EVENT_MAGIC 0x65766e74u

struct CUevent_st {
  uint32_t magic;
  unsigned int flags;
  _Atomic int64_t done_ns; /* 0: never recorded */
};

static _Thread_local int t_device;
static _Thread_local enum cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;
static _Thread_local cudaError_t t_last_error = cudaSuccess;

static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
  return e;
}

static int event_ok(cudaEvent_t e) { return e != NULL && e->magic == FK_EVENT_MAGIC; }

static _Atomic long g_capture_violations, g_captured_records;

static int capturing(void) { return fk_fault_find(FK_CAPTURE, fk_global_rank(0), -1, NULL); }

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
  *event = e;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

GH_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  if (stream == NULL && capturing_for_record()) { /* a graph node; the event records nothing */
    atomic_fetch_add(&g_captured_records, 1);
    return cudaSuccess;
  }
  double lag_ms = 0;
  fk_fault_find(FK_GPU_LAG_MS, fk_global_rank(0), -1, &lag_ms);
  atomic_store(&event->done_ns, fk_now_ns() + (int64_t)(lag_ms * 1e6));
  return cudaSuccess;
}

/* An event never recorded counts as complete, as in CUDA. */
GH_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  if (unsafe_during_capture()) return ret(cudaErrorStreamCaptureUnsupported);
  return fk_now_ns() >= atomic_load(&event->done_ns) ? cudaSuccess : cudaErrorNotReady;
}

GH_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  if (unsafe_during_capture()) return ret(cudaErrorStreamCaptureUnsupported);
  fk_sleep_until(atomic_load(&event->done_ns));
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == NULL) return ret(cudaErrorInvalidValue);
  if (!event_ok(start) || !event_ok(end)) return ret(cudaErrorInvalidResourceHandle);
  if ((start->flags | end->flags) & cudaEventDisableTiming) return ret(cudaErrorInvalidResourceHandle);
  int64_t t0 = atomic_load(&start->done_ns), t1 = atomic_load(&end->done_ns);
  if (t0 == 0 || t1 == 0) return ret(cudaErrorInvalidResourceHandle);
  int64_t now = fk_now_ns();
  if (now < t0 || now < t1) return cudaErrorNotReady;
  *ms = (float)((double)(t1 - t0) / 1e6);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event_ok(event)) return ret(cudaErrorInvalidResourceHandle);
  event->magic = 0;
  free(event);
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

/* Streams are distinct non-null handles; every stream is synchronous. */
GH_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *stream) {
  if (stream == NULL) return ret(cudaErrorInvalidValue);
  *stream = malloc(1);
  return *stream != NULL ? cudaSuccess : ret(cudaErrorMemoryAllocation);
}

GH_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  free(stream);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  (void)stream;
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

GH_EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
  if (ptr == NULL) return ret(cudaErrorInvalidValue);
  *ptr = malloc(size ? size : 1);
  return *ptr != NULL ? cudaSuccess : ret(cudaErrorMemoryAllocation);
}

GH_EXPORT cudaError_t cudaFree(void *ptr) {
  free(ptr);
  return cudaSuccess;
}

GH_EXPORT cudaError_t cudaMemset(void *ptr, int value, size_t count) {
  if (ptr == NULL && count > 0) return ret(cudaErrorInvalidValue);
  if (count > 0) memset(ptr, value, count);
  return cudaSuccess;
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
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    default: return "unrecognized error code";
  }
}
