/*
 * The hook's one background thread. It completes profile-mode timings and monitor-mode GPU
 * completion marks by querying CUDA events, oldest first, never waiting on one. It starts at the
 * first data-path call made on a stream that is not capturing a graph (creating a thread is no
 * business of a capture), in thread-local capture mode for good: its event queries then stay
 * legal while a training thread captures a graph in global mode, and cannot invalidate it.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "prof.h"

#define PERIOD_NS 1000000L /* marks and timings complete within ~1 ms of the GPU */

static int state; /* 0 not started, 1 running, 2 never (no CUDA runtime, fork child, failure) */
static int start_device = -1;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void *poller(void *arg) {
  (void)arg;
  if (start_device >= 0 && gh_cu.set_device != NULL) gh_cu.set_device(start_device);
  gh_cuda_thread_local();
  for (;;) {
    struct timespec ts = {0, PERIOD_NS};
    nanosleep(&ts, NULL);
    gh_profile_poll();
    gh_marks_poll();
    gh_prof_poll();
  }
  return NULL;
}

int gh_poller_want(cudaStream_t stream) {
  int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (GH_LIKELY(s != 0)) return s == 1;
  if (!gh_cuda_ready()) {
    __atomic_store_n(&state, 2, __ATOMIC_RELEASE);
    return 0;
  }
  if (gh_cuda_capturing(stream)) return 0; /* ask again at a later call */
  int saved = errno;
  pthread_mutex_lock(&lock);
  if (state == 0) {
    if (gh_cu.get_device != NULL && gh_cu.get_device(&start_device) != 0) start_device = -1;
    gh_cuda_note_context(start_device);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    __atomic_store_n(&state, pthread_create(&t, &attr, poller, NULL) == 0 ? 1 : 2, __ATOMIC_RELEASE);
    pthread_attr_destroy(&attr);
  }
  pthread_mutex_unlock(&lock);
  errno = saved;
  return state == 1;
}

void gh_poller_fork_child(void) {
  state = 2; /* the thread did not survive the fork; the child records nothing anyway */
  pthread_mutex_init(&lock, NULL);
}
