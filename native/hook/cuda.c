/*
 * The CUDA runtime as the hook uses it: resolved from the process once (libcudart.so.13/.12 by
 * RTLD_NOLOAD, else /proc/self/maps), never linked, so a process without CUDA (CPU tests, tools)
 * runs the hook host-only. The entry points are plain function pointers read on the hot path.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "gh_hook.h"

struct gh_cuda gh_cu;

static int state; /* 0 untried, 1 resolved, 2 no CUDA runtime in the process */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void *gh_cuda_sym(const char *name) {
  static const char *const sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL};
  return gh_find_library_symbol("libcudart", sonames, name);
}

static int resolve(void) {
#define GH_CU(field, name) ((gh_cu.field = (__typeof__(gh_cu.field))gh_cuda_sym(name)) != NULL)
  int ok = GH_CU(ev_create, "cudaEventCreateWithFlags") && GH_CU(ev_record, "cudaEventRecord") &&
           GH_CU(ev_query, "cudaEventQuery") && GH_CU(ev_sync, "cudaEventSynchronize") &&
           GH_CU(ev_elapsed, "cudaEventElapsedTime") && GH_CU(ev_destroy, "cudaEventDestroy") &&
           GH_CU(is_capturing, "cudaStreamIsCapturing");
  (void)GH_CU(capture_mode, "cudaThreadExchangeStreamCaptureMode");
  (void)GH_CU(set_device, "cudaSetDevice");
  (void)GH_CU(get_device, "cudaGetDevice");
#undef GH_CU
  return ok;
}

int gh_cuda_ready(void) {
  int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (GH_LIKELY(s != 0)) return s == 1;
  int saved = errno;
  pthread_mutex_lock(&lock);
  if (state == 0) __atomic_store_n(&state, resolve() ? 1 : 2, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&lock);
  errno = saved;
  return state == 1;
}

int gh_cuda_capturing(cudaStream_t stream) {
  int cap = 0;
  return gh_cu.is_capturing(stream, &cap) == 0 && cap != 0;
}

int gh_cuda_thread_local(void) {
  int mode = 1; /* cudaStreamCaptureModeThreadLocal */
  if (gh_cu.capture_mode != NULL) gh_cu.capture_mode(&mode);
  return mode;
}

void gh_cuda_restore_mode(int mode) {
  if (gh_cu.capture_mode != NULL) gh_cu.capture_mode(&mode);
}

int gh_private_stream(cudaStream_t *out) {
  typedef int (*flags_fn)(cudaStream_t *, unsigned);
  typedef int (*plain_fn)(cudaStream_t *);
  flags_fn with_flags = (flags_fn)gh_cuda_sym("cudaStreamCreateWithFlags");
  if (with_flags != NULL) return with_flags(out, 1 /* cudaStreamNonBlocking */);
  plain_fn plain = (plain_fn)gh_cuda_sym("cudaStreamCreate");
  return plain != NULL ? plain(out) : -1;
}

void gh_cuda_fork_child(void) {
  pthread_mutex_init(&lock, NULL);
}
