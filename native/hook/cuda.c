/*
 * CUDA as the hook uses it: resolved from the process once, never linked, never loaded by us.
 * First the shared runtime (libcudart.so.13/.12 by RTLD_NOLOAD, else /proc/self/maps); a process
 * without one (nvcc links the runtime statically by default; some programs use the driver API
 * alone) still has the driver, libcuda.so.1, which every CUDA process loads: its event, stream
 * and capture calls take the same handles (a cudaStream_t is a CUstream, a cudaEvent_t a
 * CUevent) and answer the same codes for what the hook asks (0, 600 not ready). Without either,
 * the hook runs host-only, and says so in the ring header (gpu_api), so that the agent can tell
 * everyone this rank's GPU view is off. The entry points are plain function pointers read on the
 * hot path.
 *
 * The driver needs a current context in the thread that creates events or names the NULL
 * stream: the training threads have their runtime's (a primary context); the poller makes the
 * context current that was current in the thread that started it (the runtime's, or a driver
 * program's own), else the device's primary context, which is what every runtime uses.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>

#include "gh_hook.h"

struct gh_cuda gh_cu;

static int state; /* 0 untried, else enum gh_gpu_api */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void *gh_cuda_sym(const char *name) {
  if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == GH_GPU_API_DRIVER) return NULL;
  static const char *const sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL};
  return gh_find_library_symbol("libcudart", sonames, name);
}

static void *drv_sym(const char *name) {
  static const char *const sonames[] = {"libcuda.so.1", "libcuda.so", NULL};
  return gh_find_library_symbol("libcuda.so", sonames, name);
}

/* A driver entry under its newest ABI name first (cuda.h maps cuEventDestroy to _v2, ...). */
static void *drv_sym2(const char *v2, const char *v1) {
  void *p = drv_sym(v2);
  return p != NULL ? p : drv_sym(v1);
}

typedef int (*drv_init_fn)(unsigned);
typedef int (*drv_device_get_fn)(int *, int);
typedef int (*drv_retain_fn)(void **, int);
typedef int (*drv_ctx_set_fn)(void *);
typedef int (*drv_ctx_get_fn)(void **);
typedef int (*drv_ctx_device_fn)(int *);
typedef int (*drv_pci_fn)(char *, int, int);
typedef int (*stream_create_fn)(cudaStream_t *, unsigned);
static struct {
  drv_device_get_fn device_get;
  drv_retain_fn retain;
  drv_ctx_set_fn ctx_set;
  drv_ctx_get_fn ctx_get;
  drv_ctx_device_fn ctx_device;
  drv_pci_fn pci;
  void *start_ctx; /* current in the thread that started the poller */
  int start_dev;
} drv = {.start_dev = -1};
static drv_pci_fn rt_pci;
static stream_create_fn stream_create;

/* The driver's "current device": the context current in this thread. CUdevice handles are the
 * ordinals in every CUDA release (cuDeviceGet(&d, i) gives d == i). */
static int drv_get_device(int *dev) { return drv.ctx_device(dev); }

static int drv_set_device(int dev) {
  void *ctx = NULL;
  int h = -1;
  if (drv.start_ctx != NULL && drv.start_dev == dev) return drv.ctx_set(drv.start_ctx);
  if (drv.device_get(&h, dev) != 0 || drv.retain(&ctx, h) != 0) return -1;
  return drv.ctx_set(ctx);
}

static int resolve_runtime(void) {
#define GH_CU(field, name) ((gh_cu.field = (__typeof__(gh_cu.field))gh_cuda_sym(name)) != NULL)
  int ok = GH_CU(ev_create, "cudaEventCreateWithFlags") && GH_CU(ev_record, "cudaEventRecord") &&
           GH_CU(ev_query, "cudaEventQuery") && GH_CU(ev_sync, "cudaEventSynchronize") &&
           GH_CU(ev_elapsed, "cudaEventElapsedTime") && GH_CU(ev_destroy, "cudaEventDestroy") &&
           GH_CU(is_capturing, "cudaStreamIsCapturing");
  (void)GH_CU(capture_mode, "cudaThreadExchangeStreamCaptureMode");
  (void)GH_CU(set_device, "cudaSetDevice");
  (void)GH_CU(get_device, "cudaGetDevice");
#undef GH_CU
  rt_pci = (drv_pci_fn)gh_cuda_sym("cudaDeviceGetPCIBusId");
  stream_create = (stream_create_fn)gh_cuda_sym("cudaStreamCreateWithFlags");
  return ok;
}

static int resolve_driver(void) {
  drv_init_fn init = (drv_init_fn)drv_sym("cuInit");
#define GH_DRV(dst, v2, v1) ((dst = (__typeof__(dst))drv_sym2(v2, v1)) != NULL)
  int ok = init != NULL && GH_DRV(gh_cu.ev_create, "cuEventCreate", "cuEventCreate") &&
           GH_DRV(gh_cu.ev_record, "cuEventRecord", "cuEventRecord") &&
           GH_DRV(gh_cu.ev_query, "cuEventQuery", "cuEventQuery") &&
           GH_DRV(gh_cu.ev_sync, "cuEventSynchronize", "cuEventSynchronize") &&
           GH_DRV(gh_cu.ev_elapsed, "cuEventElapsedTime_v2", "cuEventElapsedTime") &&
           GH_DRV(gh_cu.ev_destroy, "cuEventDestroy_v2", "cuEventDestroy") &&
           GH_DRV(gh_cu.is_capturing, "cuStreamIsCapturing", "cuStreamIsCapturing") &&
           GH_DRV(drv.device_get, "cuDeviceGet", "cuDeviceGet") &&
           GH_DRV(drv.retain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain") &&
           GH_DRV(drv.ctx_set, "cuCtxSetCurrent", "cuCtxSetCurrent") &&
           GH_DRV(drv.ctx_get, "cuCtxGetCurrent", "cuCtxGetCurrent") &&
           GH_DRV(drv.ctx_device, "cuCtxGetDevice", "cuCtxGetDevice");
  (void)GH_DRV(gh_cu.capture_mode, "cuThreadExchangeStreamCaptureMode", "cuThreadExchangeStreamCaptureMode");
  (void)GH_DRV(drv.pci, "cuDeviceGetPCIBusId", "cuDeviceGetPCIBusId");
  (void)GH_DRV(stream_create, "cuStreamCreate", "cuStreamCreate");
#undef GH_DRV
  /* cuInit is idempotent and the process's CUDA code has called it (NCCL does at init). */
  if (!ok || init(0) != 0) return 0;
  gh_cu.set_device = drv_set_device;
  gh_cu.get_device = drv_get_device;
  return 1;
}

static int resolve(void) {
  if (resolve_runtime()) return GH_GPU_API_RUNTIME;
  memset(&gh_cu, 0, sizeof gh_cu);
  rt_pci = NULL;
  stream_create = NULL;
  return resolve_driver() ? GH_GPU_API_DRIVER : GH_GPU_API_NONE;
}

int gh_cuda_api(void) {
  int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (GH_LIKELY(s != 0)) return s;
  int saved = errno;
  pthread_mutex_lock(&lock);
  if (state == 0) {
    int api = resolve();
    if (api != GH_GPU_API_NONE && gh_hdr != NULL) __atomic_store_n(&gh_hdr->gpu_api, (uint32_t)api, __ATOMIC_RELAXED);
    __atomic_store_n(&state, api, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&lock);
  errno = saved;
  return state;
}

int gh_cuda_ready(void) { return gh_cuda_api() != GH_GPU_API_NONE; }

/* Capturing, or unknown: a query that fails (the legacy stream asked while another stream
 * captures answers cudaErrorStreamCaptureImplicit) must not lead to an event recorded on it,
 * which could invalidate the capture. */
int gh_cuda_capturing(cudaStream_t stream) {
  int cap = 0;
  return gh_cu.is_capturing(stream, &cap) != 0 || cap != 0;
}

int gh_cuda_thread_local(void) {
  int mode = 1; /* cudaStreamCaptureModeThreadLocal */
  if (gh_cu.capture_mode != NULL) gh_cu.capture_mode(&mode);
  return mode;
}

void gh_cuda_restore_mode(int mode) {
  if (gh_cu.capture_mode != NULL) gh_cu.capture_mode(&mode);
}

/* Called in the thread that starts the poller: the context it should work in (driver only). */
void gh_cuda_note_context(int device) {
  if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != GH_GPU_API_DRIVER) return;
  void *ctx = NULL;
  if (drv.ctx_get(&ctx) == 0 && ctx != NULL) {
    drv.start_ctx = ctx;
    drv.start_dev = device;
  }
}

int gh_private_stream(cudaStream_t *out) {
  typedef int (*plain_fn)(cudaStream_t *);
  if (stream_create != NULL) return stream_create(out, 1 /* cudaStreamNonBlocking, CU_STREAM_NON_BLOCKING */);
  plain_fn plain = (plain_fn)gh_cuda_sym("cudaStreamCreate");
  return plain != NULL ? plain(out) : -1;
}

/* The ring header's GPU identity, once: what the marks rest on, and the PCI bus id of the
 * communicator's device (-1 unknown: only the API is written). */
void gh_gpu_identity(int device) {
  struct gh_ring_header *h = __atomic_load_n(&gh_hdr, __ATOMIC_ACQUIRE);
  if (h == NULL) return;
  int saved = errno;
  int api = gh_cuda_api();
  __atomic_store_n(&h->gpu_api, (uint32_t)api, __ATOMIC_RELAXED);
  static int named;
  if (device >= 0 && !__atomic_load_n(&named, __ATOMIC_ACQUIRE)) {
    char bus[sizeof h->pci_bus_id] = {0};
    int rc = -1, dev = -1;
    if (api == GH_GPU_API_RUNTIME && rt_pci != NULL) rc = rt_pci(bus, (int)sizeof bus, device);
    else if (api == GH_GPU_API_DRIVER && drv.pci != NULL && drv.device_get(&dev, device) == 0)
      rc = drv.pci(bus, (int)sizeof bus, dev);
    bus[sizeof bus - 1] = '\0';
    if (rc == 0 && bus[0] != '\0' && !__atomic_exchange_n(&named, 1, __ATOMIC_ACQ_REL))
      memcpy(h->pci_bus_id, bus, sizeof bus);
  }
  errno = saved;
}

void gh_cuda_fork_child(void) {
  pthread_mutex_init(&lock, NULL);
}
