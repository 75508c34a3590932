/*
 * The fake CUDA driver (libcuda.so.1): the one device of the process (gpu.c) and the driver API
 * over it, the slice a profiler uses when a process has no shared CUDA runtime (nvcc links the
 * runtime statically by default, and some programs use the driver API alone): initialisation,
 * devices and their PCI bus ids, primary contexts, events, streams, capture state. The runtime
 * (cudart.c, shared or compiled into a program) reaches the device through here too, so stream and
 * event handles are the same objects in both APIs, as in CUDA.
 *
 * As in CUDA: nothing works before cuInit (CUDA_ERROR_NOT_INITIALIZED; the runtime calls it
 * itself), and a thread has no current context until it sets one (cuCtxSetCurrent of a primary
 * context, or any runtime call, which makes device 0's primary current when the thread has none);
 * creating an event or a stream, or naming the NULL stream, without one is
 * CUDA_ERROR_INVALID_CONTEXT.
 *
 * Graph capture (`capture R`): rank R's default stream reports capturing in global mode; an event
 * recorded into it becomes a graph node (no timing), and an event query or synchronisation from a
 * thread not in thread-local or relaxed capture mode is illegal (cudaErrorStreamCaptureUnsupported,
 * counted: a real capture would be invalidated). `gpu_lag_ms R ms` delays rank R's event
 * completions by ms.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_fake.h"
#include "fk_faults.h"
#include "fk_pci.h"
#include "fk_time.h"
#include "gpu.h"

#define GH_EXPORT __attribute__((visibility("default")))
/* Real drivers export old ABIs under their first names and new ones with a suffix; so does this. */
#define FK_ALIAS(name, target) \
  extern __typeof(target) name __attribute__((alias(#target), visibility("default")))

struct CUctx_st {
  int device;
};
static struct CUctx_st g_primary[FK_DEVICES] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static _Thread_local struct CUctx_st *t_ctx;
static atomic_int g_inited;

int fk_ctx_device(void) { return t_ctx != NULL ? t_ctx->device : -1; }

int fk_cur_device(void) {
  if (t_ctx == NULL) {
    atomic_store(&g_inited, 1);
    t_ctx = &g_primary[0];
  }
  return t_ctx->device;
}

cudaError_t fk_set_device(int ordinal) {
  if (ordinal < 0 || ordinal >= FK_DEVICES) return cudaErrorInvalidDevice;
  atomic_store(&g_inited, 1);
  t_ctx = &g_primary[ordinal];
  return cudaSuccess;
}

/* --- device identity: what the process's ordinals are on the node --- */

static pthread_once_t g_visible_once = PTHREAD_ONCE_INIT;
static int g_nvisible;
static unsigned g_visible[FK_DEVICES]; /* ordinal -> physical GPU */

static int parse_list(const char *s, unsigned *out, int max) {
  int n = 0;
  char buf[512];
  snprintf(buf, sizeof buf, "%s", s);
  char *save = NULL;
  for (char *w = strtok_r(buf, ",", &save); w != NULL && n < max; w = strtok_r(NULL, ",", &save)) {
    while (*w == ' ') w++;
    char *end = NULL;
    long v = strtol(w, &end, 10);
    if (end == w || v < 0) break;
    out[n++] = (unsigned)v;
  }
  return n;
}

/* CUDA_VISIBLE_DEVICES narrows what the container exposes: an index into it, or a GPU's UUID
 * (a unique prefix will do); CUDA stops at the first entry it cannot use. An empty or unusable
 * list leaves the exposed GPUs as they are: the fake keeps working where a CI machine hides its
 * GPUs this way (it has none to hide from the fake). */
static void visible_init(void) {
  unsigned exposed[FK_DEVICES];
  int nexposed = FK_DEVICES;
  for (int i = 0; i < FK_DEVICES; i++) exposed[i] = (unsigned)i;
  const char *cont = getenv("FAKE_CUDA_DEVICES");
  if (cont != NULL && cont[0] != '\0') nexposed = parse_list(cont, exposed, FK_DEVICES);
  memcpy(g_visible, exposed, sizeof exposed);
  g_nvisible = nexposed;
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (vis == NULL || vis[0] == '\0') return;
  unsigned pick[FK_DEVICES];
  int n = 0;
  char buf[512];
  snprintf(buf, sizeof buf, "%s", vis);
  char *save = NULL;
  for (char *w = strtok_r(buf, ",", &save); w != NULL && n < FK_DEVICES; w = strtok_r(NULL, ",", &save)) {
    while (*w == ' ') w++;
    int found = -1;
    if (strncmp(w, "GPU-", 4) == 0) {
      for (int i = 0; i < nexposed; i++) {
        char uuid[64];
        snprintf(uuid, sizeof uuid, FK_UUID_FMT, exposed[i]);
        if (strncmp(uuid, w, strlen(w)) == 0) found = found < 0 ? i : -2;
      }
    } else {
      char *end = NULL;
      long v = strtol(w, &end, 10);
      if (end != w && *end == '\0' && v >= 0 && v < nexposed) found = (int)v;
    }
    if (found < 0) break;
    pick[n++] = exposed[found];
  }
  if (n > 0) {
    memcpy(g_visible, pick, sizeof pick);
    g_nvisible = n;
  }
}

cudaError_t fk_device_pci(int ordinal, char *out, int len) {
  pthread_once(&g_visible_once, visible_init);
  if (out == NULL || len <= 0) return cudaErrorInvalidValue;
  if (ordinal < 0 || ordinal >= g_nvisible) return cudaErrorInvalidDevice;
  unsigned g = g_visible[ordinal];
  snprintf(out, (size_t)len, "%04X:%02X:00.0", fk_pci_domain(g), fk_pci_bus(g));
  return cudaSuccess;
}

/* --- graph capture --- */

static _Thread_local enum cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;
static _Atomic long g_capture_violations, g_captured_records;

static int capturing(void) { return fk_fault_mine(FK_CAPTURE, NULL); }

/* A real capture starts and ends by the application thread's own calls, never between two CUDA
 * calls the hook makes for one NCCL call; the fault file can flip at any moment. So the state a
 * thread saw at its last capture query holds for its event records until it asks again. */
static _Thread_local int t_seen_capture = -1;

static int capturing_for_record(void) { return t_seen_capture >= 0 ? t_seen_capture : capturing(); }

/* An event query/sync that a global-mode capture in progress forbids in this thread. */
static int unsafe_during_capture(void) {
  if (t_capture_mode != cudaStreamCaptureModeGlobal || !capturing()) return 0;
  atomic_fetch_add(&g_capture_violations, 1);
  return 1;
}

int fk_capture_query(cudaStream_t s) {
  int active = s == NULL && capturing();
  if (s == NULL) t_seen_capture = active;
  return active;
}

cudaError_t fk_capture_exchange(enum cudaStreamCaptureMode *mode) {
  if (mode == NULL) return cudaErrorInvalidValue;
  enum cudaStreamCaptureMode old = t_capture_mode;
  t_capture_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

GH_EXPORT void fakeCudaCaptureStats(long *violations, long *captured_records) {
  if (violations != NULL) *violations = atomic_load(&g_capture_violations);
  if (captured_records != NULL) *captured_records = atomic_load(&g_captured_records);
}

/* --- events --- */

static int event_ok(cudaEvent_t e) { return e != NULL && e->magic == FK_EVENT_MAGIC; }

cudaError_t fk_ev_create(cudaEvent_t *event, unsigned flags) {
  if (event == NULL) return cudaErrorInvalidValue;
  cudaEvent_t e = calloc(1, sizeof *e);
  if (e == NULL) return cudaErrorMemoryAllocation;
  e->magic = FK_EVENT_MAGIC;
  e->flags = flags;
  atomic_init(&e->refs, 1);
  *event = e;
  return cudaSuccess;
}

cudaError_t fk_ev_record(cudaEvent_t event, cudaStream_t stream, int device) {
  if (!event_ok(event)) return cudaErrorInvalidResourceHandle;
  struct CUstream_st *s = fk_stream(stream, device);
  if (s == NULL) return cudaErrorInvalidResourceHandle;
  if (stream == NULL && capturing_for_record()) { /* a graph node; the event records nothing */
    atomic_fetch_add(&g_captured_records, 1);
    return cudaSuccess;
  }
  double lag_ms = 0;
  fk_fault_mine(FK_GPU_LAG_MS, &lag_ms);
  return fk_event_record(event, s, (int64_t)(lag_ms * 1e6));
}

/* An event never recorded counts as complete, as in CUDA. */
cudaError_t fk_ev_query(cudaEvent_t event) {
  if (!event_ok(event)) return cudaErrorInvalidResourceHandle;
  if (unsafe_during_capture()) return cudaErrorStreamCaptureUnsupported;
  return fk_event_ready(event) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t fk_ev_sync(cudaEvent_t event) {
  if (!event_ok(event)) return cudaErrorInvalidResourceHandle;
  if (unsafe_during_capture()) return cudaErrorStreamCaptureUnsupported;
  if (fk_gpu_forked && !fk_event_ready(event)) return cudaErrorInitializationError;
  fk_event_wait(event);
  return cudaSuccess;
}

cudaError_t fk_ev_elapsed(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == NULL) return cudaErrorInvalidValue;
  if (!event_ok(start) || !event_ok(end)) return cudaErrorInvalidResourceHandle;
  if ((start->flags | end->flags) & cudaEventDisableTiming) return cudaErrorInvalidResourceHandle;
  if (atomic_load(&start->recorded) == 0 || atomic_load(&end->recorded) == 0)
    return cudaErrorInvalidResourceHandle;
  if (!fk_event_ready(start) || !fk_event_ready(end)) return cudaErrorNotReady;
  int64_t t0 = atomic_load(&start->done_ns), t1 = atomic_load(&end->done_ns);
  *ms = (float)((double)(t1 - t0) / 1e6);
  return cudaSuccess;
}

/* CUDA semantics: a record still queued keeps the event alive until the device reaches it. */
cudaError_t fk_ev_destroy(cudaEvent_t event) {
  if (!event_ok(event)) return cudaErrorInvalidResourceHandle;
  event->magic = 0;
  fk_event_unref(event);
  return cudaSuccess;
}

/* --- the driver API --- */

#define NEED_INIT() \
  do {              \
    if (!atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED; \
  } while (0)
#define NEED_CTX() \
  do {             \
    NEED_INIT();   \
    if (t_ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT; \
  } while (0)

GH_EXPORT CUresult cuInit(unsigned int flags) {
  if (flags != 0) return cudaErrorInvalidValue;
  atomic_store(&g_inited, 1);
  return cudaSuccess;
}

GH_EXPORT CUresult cuDriverGetVersion(int *version) {
  if (version == NULL) return cudaErrorInvalidValue;
  *version = 12080;
  return cudaSuccess;
}

GH_EXPORT CUresult cuDeviceGetCount(int *count) {
  NEED_INIT();
  if (count == NULL) return cudaErrorInvalidValue;
  *count = FK_DEVICES;
  return cudaSuccess;
}

GH_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  NEED_INIT();
  if (device == NULL) return cudaErrorInvalidValue;
  if (ordinal < 0 || ordinal >= FK_DEVICES) return cudaErrorInvalidDevice;
  *device = ordinal;
  return cudaSuccess;
}

GH_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  NEED_INIT();
  return fk_device_pci(dev, pciBusId, len);
}

GH_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  NEED_INIT();
  if (pctx == NULL) return cudaErrorInvalidValue;
  if (dev < 0 || dev >= FK_DEVICES) return cudaErrorInvalidDevice;
  *pctx = &g_primary[dev];
  return cudaSuccess;
}

GH_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  NEED_INIT();
  return dev < 0 || dev >= FK_DEVICES ? cudaErrorInvalidDevice : cudaSuccess;
}
FK_ALIAS(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2);

GH_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  NEED_INIT();
  if (ctx != NULL && (ctx < &g_primary[0] || ctx >= &g_primary[FK_DEVICES])) return CUDA_ERROR_INVALID_CONTEXT;
  t_ctx = ctx;
  return cudaSuccess;
}

GH_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
  NEED_INIT();
  if (pctx == NULL) return cudaErrorInvalidValue;
  *pctx = t_ctx;
  return cudaSuccess;
}

GH_EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
  NEED_CTX();
  if (device == NULL) return cudaErrorInvalidValue;
  *device = t_ctx->device;
  return cudaSuccess;
}

GH_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  NEED_CTX();
  return fk_ev_create(phEvent, Flags);
}

GH_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  if (hStream == NULL) NEED_CTX();
  return fk_ev_record(hEvent, hStream, hStream == NULL ? t_ctx->device : 0);
}

GH_EXPORT CUresult cuEventQuery(CUevent hEvent) { return fk_ev_query(hEvent); }
GH_EXPORT CUresult cuEventSynchronize(CUevent hEvent) { return fk_ev_sync(hEvent); }

GH_EXPORT CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
  return fk_ev_elapsed(pMilliseconds, hStart, hEnd);
}
FK_ALIAS(cuEventElapsedTime_v2, cuEventElapsedTime);

GH_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) { return fk_ev_destroy(hEvent); }
FK_ALIAS(cuEventDestroy, cuEventDestroy_v2);

GH_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  NEED_CTX();
  if (phStream == NULL) return cudaErrorInvalidValue;
  return fk_stream_create(phStream, Flags, t_ctx->device);
}

GH_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
  if (!fk_stream_ok(hStream)) return cudaErrorInvalidResourceHandle;
  fk_stream_destroy(hStream);
  return cudaSuccess;
}
FK_ALIAS(cuStreamDestroy, cuStreamDestroy_v2);

GH_EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
  if (hStream == NULL) NEED_CTX();
  struct CUstream_st *s = fk_stream(hStream, hStream == NULL ? t_ctx->device : 0);
  if (s == NULL) return cudaErrorInvalidResourceHandle;
  if (fk_gpu_forked) return cudaErrorInitializationError;
  fk_stream_sync(s);
  return cudaSuccess;
}

GH_EXPORT CUresult cuStreamQuery(CUstream hStream) {
  if (hStream == NULL) NEED_CTX();
  struct CUstream_st *s = fk_stream(hStream, hStream == NULL ? t_ctx->device : 0);
  if (s == NULL) return cudaErrorInvalidResourceHandle;
  return fk_stream_idle(s) ? cudaSuccess : cudaErrorNotReady;
}

GH_EXPORT CUresult cuStreamIsCapturing(CUstream hStream, enum cudaStreamCaptureStatus *captureStatus) {
  if (hStream == NULL) NEED_CTX();
  if (captureStatus == NULL) return cudaErrorInvalidValue;
  if (hStream != NULL && !fk_stream_ok(hStream)) return cudaErrorInvalidResourceHandle;
  *captureStatus = fk_capture_query(hStream) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

GH_EXPORT CUresult cuThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  NEED_INIT();
  return fk_capture_exchange(mode);
}

/* Device memory is host memory here (the fakes never read it). */
GH_EXPORT CUresult cuMemAlloc_v2(uint64_t *dptr, size_t bytes) {
  NEED_CTX();
  if (dptr == NULL) return cudaErrorInvalidValue;
  void *p = malloc(bytes ? bytes : 1);
  if (p == NULL) return cudaErrorMemoryAllocation;
  *dptr = (uint64_t)(uintptr_t)p;
  return cudaSuccess;
}

GH_EXPORT CUresult cuMemFree_v2(uint64_t dptr) {
  free((void *)(uintptr_t)dptr);
  return cudaSuccess;
}

/* --- fake-only device entry points (the other fakes' and the workload's "kernels") --- */

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

/* Launches go through the runtime in a real program: a thread with no context gets device 0's. */
GH_EXPORT cudaError_t fakeGpuSleep(cudaStream_t stream, long long ns) {
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return cudaErrorInvalidResourceHandle;
  if (ns < 0) return cudaErrorInvalidValue;
  struct sleep_work *k = malloc(sizeof *k);
  if (k == NULL) return cudaErrorMemoryAllocation;
  *k = (struct sleep_work){.w = {.run = sleep_run, .release = sleep_release, .compute = 1}, .ns = ns};
  cudaError_t rc = fk_launch(s, &k->w);
  if (rc != cudaSuccess) free(k);
  return rc;
}

GH_EXPORT cudaError_t fakeGpuLaunch(cudaStream_t stream, struct fakeGpuWork *work) {
  if (work == NULL || work->run == NULL || work->release == NULL) return cudaErrorInvalidValue;
  struct CUstream_st *s = fk_stream(stream, fk_cur_device());
  if (s == NULL) return cudaErrorInvalidResourceHandle;
  return fk_launch(s, work);
}
