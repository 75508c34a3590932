/*
 * The fake device: streams as FIFO queues, one executor thread per stream, compute work sharing
 * the device's SMs one item at a time, and events that complete when their stream reaches them
 * (see gpu.h for the model). Executor threads are detached and never touch state that process
 * exit tears down, so a process that exits with work still queued (or a collective hung on its
 * device) exits cleanly; a child forked after the device started has no executors, so, as with
 * CUDA, it cannot use the device (cudaErrorInitializationError) rather than hang on it.
 */
#include "gpu.h"

#include <stdlib.h>
#include <time.h>

#include "fk_time.h"

struct fk_device {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* the SMs freed, or a stream ahead turned to non-compute work */
  int busy;          /* a compute item runs */
  int64_t t_free;    /* device time the SMs are free from (the last compute item's end) */
  struct fakeGpuWork *khead, *ktail; /* compute items launched and not started, launch order */
  struct CUstream_st *_Atomic dflt;  /* the NULL stream */
};

static struct fk_device g_dev[FK_DEVICES];
/* Lock order: a stream's mu, then a device's mu; g_dflt_mu, then g_all_mu, then a stream's mu. */
static pthread_mutex_t g_dflt_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_all_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st *g_all; /* live streams, for cudaDeviceSynchronize */
static pthread_mutex_t g_ev_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_ev_cv = PTHREAD_COND_INITIALIZER;
static atomic_int g_ev_waiters;
static atomic_int g_started;
int fk_gpu_forked;

static void init_device(struct fk_device *d) {
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
}

static void on_fork_child(void) {
  for (int i = 0; i < FK_DEVICES; i++) init_device(&g_dev[i]);
  pthread_mutex_init(&g_dflt_mu, NULL);
  pthread_mutex_init(&g_all_mu, NULL);
  pthread_mutex_init(&g_ev_mu, NULL);
  pthread_cond_init(&g_ev_cv, NULL);
  if (atomic_load(&g_started)) fk_gpu_forked = 1;
}

__attribute__((constructor)) static void gpu_init(void) {
  for (int i = 0; i < FK_DEVICES; i++) init_device(&g_dev[i]);
  pthread_atfork(NULL, NULL, on_fork_child);
}

static struct CUstream_st *new_stream(unsigned flags, int device) {
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (s == NULL) return NULL;
  s->magic = FK_STREAM_MAGIC;
  s->device = device;
  s->flags = flags;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_mutex_lock(&g_all_mu);
  s->all_next = g_all;
  g_all = s;
  pthread_mutex_unlock(&g_all_mu);
  return s;
}

static void free_stream(struct CUstream_st *s) {
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

struct CUstream_st *fk_stream(cudaStream_t h, int device) {
  if (h != NULL) return fk_stream_ok(h) ? h : NULL;
  if (device < 0 || device >= FK_DEVICES) return NULL;
  struct fk_device *d = &g_dev[device];
  struct CUstream_st *s = atomic_load(&d->dflt);
  if (s != NULL) return s;
  pthread_mutex_lock(&g_dflt_mu);
  s = atomic_load(&d->dflt);
  if (s == NULL) {
    s = new_stream(0, device);
    atomic_store(&d->dflt, s);
  }
  pthread_mutex_unlock(&g_dflt_mu);
  return s;
}

int fk_stream_ok(cudaStream_t h) { return h != NULL && h->magic == FK_STREAM_MAGIC; }

cudaError_t fk_stream_create(cudaStream_t *out, unsigned flags, int device) {
  if (fk_gpu_forked) return cudaErrorInitializationError;
  struct CUstream_st *s = new_stream(flags, device);
  if (s == NULL) return cudaErrorMemoryAllocation;
  *out = s;
  return cudaSuccess;
}

/* CUDA semantics: destroy returns at once; queued work still runs, then the stream goes. */
void fk_stream_destroy(struct CUstream_st *s) {
  pthread_mutex_lock(&g_all_mu);
  for (struct CUstream_st **p = &g_all; *p != NULL; p = &(*p)->all_next)
    if (*p == s) {
      *p = s->all_next;
      break;
    }
  pthread_mutex_unlock(&g_all_mu);
  pthread_mutex_lock(&s->mu);
  s->magic = 0;
  s->destroyed = 1;
  int has_executor = s->executor;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  if (!has_executor) free_stream(s);
}

/* A compute item waits while an earlier one is launched and not started, unless that earlier
 * item's stream is busy with non-compute work (it cannot start before that work ends anyway). */
static int held_back(const struct fk_device *d, const struct fakeGpuWork *w) {
  for (const struct fakeGpuWork *x = d->khead; x != w && x != NULL; x = x->knext)
    if (!((const struct CUstream_st *)x->stream)->in_other) return 1;
  return 0;
}

static void run_compute(struct fk_device *d, struct fakeGpuWork *w) {
  pthread_mutex_lock(&d->mu);
  while (d->busy || held_back(d, w)) pthread_cond_wait(&d->cv, &d->mu);
  d->busy = 1;
  if (d->t_free > w->start_ns) w->start_ns = d->t_free;
  struct fakeGpuWork **p = &d->khead, *prev = NULL;
  while (*p != w) {
    prev = *p;
    p = &(*p)->knext;
  }
  *p = w->knext;
  if (d->ktail == w) d->ktail = prev;
  pthread_mutex_unlock(&d->mu);
  w->run(w);
  pthread_mutex_lock(&d->mu);
  d->busy = 0;
  d->t_free = w->end_ns;
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
}

static void set_other(struct fk_device *d, struct CUstream_st *s, int on) {
  pthread_mutex_lock(&d->mu);
  s->in_other = on;
  if (on && d->khead != NULL) pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
}

static void *executor(void *arg) {
  struct CUstream_st *s = arg;
  struct fk_device *d = &g_dev[s->device];
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (s->head == NULL && !s->destroyed) pthread_cond_wait(&s->cv, &s->mu);
    struct fakeGpuWork *w = s->head;
    if (w == NULL) break; /* destroyed and drained */
    s->head = w->next;
    if (s->head == NULL) s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    w->start_ns = w->launch_ns > s->t_end ? w->launch_ns : s->t_end; /* the stream reaches it */
    w->end_ns = w->start_ns;
    if (w->compute) {
      run_compute(d, w);
    } else {
      set_other(d, s, 1);
      w->run(w);
      set_other(d, s, 0);
    }
    if (w->end_ns > s->t_end) s->t_end = w->end_ns;
    pthread_mutex_lock(&s->mu);
    if (w->done != NULL) w->done(w);
    atomic_fetch_add(&s->done, 1);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    w->release(w);
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  free_stream(s);
  return NULL;
}

cudaError_t fk_launch(struct CUstream_st *s, struct fakeGpuWork *w) {
  if (fk_gpu_forked) return cudaErrorInitializationError;
  struct fk_device *d = &g_dev[s->device];
  w->stream = s;
  w->next = NULL;
  w->knext = NULL;
  w->launch_ns = fk_now_ns();
  pthread_mutex_lock(&s->mu);
  if (!s->executor) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, executor, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      pthread_mutex_unlock(&s->mu);
      return cudaErrorMemoryAllocation;
    }
    s->executor = 1;
    atomic_store(&g_started, 1);
  }
  if (w->compute) { /* in launch order, before the executor can see it */
    pthread_mutex_lock(&d->mu);
    if (d->ktail != NULL) d->ktail->knext = w;
    else d->khead = w;
    d->ktail = w;
    pthread_mutex_unlock(&d->mu);
  }
  if (s->tail != NULL) s->tail->next = w;
  else s->head = w;
  s->tail = w;
  atomic_fetch_add(&s->launched, 1);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return cudaSuccess;
}

void fk_stream_sync(struct CUstream_st *s) {
  pthread_mutex_lock(&s->mu);
  uint64_t target = atomic_load(&s->launched);
  while (atomic_load(&s->done) < target) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

int fk_stream_idle(struct CUstream_st *s) {
  uint64_t launched = atomic_load(&s->launched);
  return atomic_load(&s->done) == launched;
}

void fk_device_sync(int device) {
  pthread_mutex_lock(&g_all_mu);
  for (struct CUstream_st *s = g_all; s != NULL; s = s->all_next)
    if (s->device == device) fk_stream_sync(s);
  pthread_mutex_unlock(&g_all_mu);
}

/* --- events --- */

static void complete(cudaEvent_t e, uint64_t gen, int64_t at_ns) {
  while (atomic_flag_test_and_set(&e->lock)) {
  }
  if (gen > atomic_load(&e->reached)) {
    atomic_store(&e->done_ns, at_ns);
    atomic_store(&e->reached, gen);
  }
  atomic_flag_clear(&e->lock);
  if (atomic_load(&g_ev_waiters) > 0) {
    pthread_mutex_lock(&g_ev_mu);
    pthread_cond_broadcast(&g_ev_cv);
    pthread_mutex_unlock(&g_ev_mu);
  }
}

void fk_event_unref(cudaEvent_t e) {
  if (atomic_fetch_sub(&e->refs, 1) == 1) free(e);
}

/* Only timing events and lags need the time a record completed at. */
static int64_t stamp(cudaEvent_t e, int64_t lag_ns) {
  return (e->flags & cudaEventDisableTiming) && lag_ns == 0 ? 0 : fk_now_ns() + lag_ns;
}

struct record_work {
  struct fakeGpuWork w;
  cudaEvent_t e;
  uint64_t gen;
  int64_t lag_ns;
};

/* The event's time is the device time its stream reached it; it is reached as the stream counts
 * the record done (a query of the stream then agrees with one of the event). */
static void record_run(struct fakeGpuWork *w) { (void)w; }

static void record_done(struct fakeGpuWork *w) {
  struct record_work *r = (struct record_work *)w;
  int timed = !(r->e->flags & cudaEventDisableTiming) || r->lag_ns != 0;
  complete(r->e, r->gen, timed ? w->start_ns + r->lag_ns : 0);
}

static void record_release(struct fakeGpuWork *w) {
  struct record_work *r = (struct record_work *)w;
  fk_event_unref(r->e);
  free(r);
}

cudaError_t fk_event_record(cudaEvent_t e, struct CUstream_st *s, int64_t lag_ns) {
  if (fk_gpu_forked) return cudaErrorInitializationError;
  uint64_t gen = atomic_fetch_add(&e->recorded, 1) + 1;
  if (fk_stream_idle(s)) {
    complete(e, gen, stamp(e, lag_ns));
    return cudaSuccess;
  }
  struct record_work *r = malloc(sizeof *r);
  if (r != NULL) {
    *r = (struct record_work){.w = {.run = record_run, .release = record_release, .done = record_done}, .e = e, .gen = gen,
                              .lag_ns = lag_ns};
    atomic_fetch_add(&e->refs, 1);
    cudaError_t rc = fk_launch(s, &r->w);
    if (rc == cudaSuccess) return cudaSuccess;
    atomic_fetch_sub(&e->refs, 1);
    free(r);
  }
  complete(e, gen, fk_now_ns()); /* not queued: do not leave the event pending for ever */
  return r == NULL ? cudaErrorMemoryAllocation : cudaErrorInitializationError;
}

int fk_event_ready(cudaEvent_t e) {
  uint64_t rec = atomic_load(&e->recorded);
  if (atomic_load(&e->reached) < rec) return 0;
  int64_t at = atomic_load(&e->done_ns);
  return at <= 0 || fk_now_ns() >= at;
}

void fk_event_wait(cudaEvent_t e) {
  while (!fk_event_ready(e)) {
    if (atomic_load(&e->reached) >= atomic_load(&e->recorded)) { /* reached; a lag still runs */
      fk_sleep_until(atomic_load(&e->done_ns));
      continue;
    }
    atomic_fetch_add(&g_ev_waiters, 1);
    pthread_mutex_lock(&g_ev_mu);
    if (atomic_load(&e->reached) < atomic_load(&e->recorded)) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 20000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&g_ev_cv, &g_ev_mu, &ts);
    }
    pthread_mutex_unlock(&g_ev_mu);
    atomic_fetch_sub(&g_ev_waiters, 1);
  }
}
