/*
 * A stub CUDA runtime for the hook's mark tests: just what the hook calls, with a "device" the
 * test drives by hand. Every event record takes the next ticket; the device has reached the
 * tickets up to stub_cuda_done (the test advances it, or auto mode completes each record at
 * once). Capture is a flag the test sets. Event records set errno, as a runtime may, so the tests
 * see the hook restore it. Counters let the tests see how many CUDA calls the hook made.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct stub_stream *cudaStream_t;
struct stub_stream {
  int id;
};
struct stub_event {
  unsigned flags;
  _Atomic uint64_t ticket;
};

_Atomic uint64_t stub_cuda_tickets, stub_cuda_done;
_Atomic int stub_cuda_auto = 1, stub_cuda_capturing;
_Atomic long stub_cuda_records, stub_cuda_events;
static __thread int t_device, t_mode;

void stub_cuda_advance(uint64_t upto) {
  uint64_t d = __atomic_load_n(&stub_cuda_done, __ATOMIC_RELAXED);
  while (d < upto && !__atomic_compare_exchange_n(&stub_cuda_done, &d, upto, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
  }
}
void stub_cuda_finish_all(void) { stub_cuda_advance(__atomic_load_n(&stub_cuda_tickets, __ATOMIC_ACQUIRE)); }

int cudaEventCreateWithFlags(struct stub_event **ev, unsigned flags) {
  struct stub_event *e = calloc(1, sizeof *e);
  if (e == NULL) return 2;
  e->flags = flags;
  __atomic_fetch_add(&stub_cuda_events, 1, __ATOMIC_RELAXED);
  *ev = e;
  return 0;
}
int cudaEventDestroy(struct stub_event *ev) {
  free(ev);
  return 0;
}
int cudaEventRecord(struct stub_event *ev, cudaStream_t s) {
  (void)s;
  uint64_t t = __atomic_add_fetch(&stub_cuda_tickets, 1, __ATOMIC_ACQ_REL);
  __atomic_store_n(&ev->ticket, t, __ATOMIC_RELEASE);
  __atomic_fetch_add(&stub_cuda_records, 1, __ATOMIC_RELAXED);
  if (__atomic_load_n(&stub_cuda_auto, __ATOMIC_ACQUIRE)) stub_cuda_advance(t);
  errno = EIO;
  return 0;
}
int cudaEventQuery(struct stub_event *ev) {
  return __atomic_load_n(&ev->ticket, __ATOMIC_ACQUIRE) <= __atomic_load_n(&stub_cuda_done, __ATOMIC_ACQUIRE)
             ? 0
             : 600;
}
int cudaEventSynchronize(struct stub_event *ev) {
  while (cudaEventQuery(ev) != 0) {
  }
  return 0;
}
/* A tenth of a millisecond per ticket between the two records. */
int cudaEventElapsedTime(float *ms, struct stub_event *a, struct stub_event *b) {
  if (cudaEventQuery(a) != 0 || cudaEventQuery(b) != 0) return 600;
  *ms = (float)(__atomic_load_n(&b->ticket, __ATOMIC_ACQUIRE) - __atomic_load_n(&a->ticket, __ATOMIC_ACQUIRE)) * 0.1f;
  return 0;
}
int cudaStreamIsCapturing(cudaStream_t s, int *status) {
  (void)s;
  *status = __atomic_load_n(&stub_cuda_capturing, __ATOMIC_ACQUIRE);
  return 0;
}
int cudaThreadExchangeStreamCaptureMode(int *mode) {
  int old = t_mode;
  t_mode = *mode;
  *mode = old;
  return 0;
}
int cudaSetDevice(int d) {
  t_device = d;
  return 0;
}
int cudaGetDevice(int *d) {
  *d = t_device;
  return 0;
}
int cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  (void)flags;
  *s = calloc(1, sizeof **s);
  return *s != NULL ? 0 : 2;
}
/* Device memory with a live count (no stream-ordered allocation here: the hook then frees its
 * scratch with cudaFree once its stream is idle, which the tests check). */
_Atomic long stub_cuda_live_allocs;
int cudaMalloc(void **p, size_t n) {
  *p = malloc(n ? n : 1);
  if (*p != NULL) __atomic_fetch_add(&stub_cuda_live_allocs, 1, __ATOMIC_RELAXED);
  return *p != NULL ? 0 : 2;
}
int cudaFree(void *p) {
  if (p != NULL) __atomic_fetch_sub(&stub_cuda_live_allocs, 1, __ATOMIC_RELAXED);
  free(p);
  return 0;
}
/* One device for every stream: idle once it has reached every record. */
int cudaStreamQuery(cudaStream_t s) {
  (void)s;
  return __atomic_load_n(&stub_cuda_done, __ATOMIC_ACQUIRE) >= __atomic_load_n(&stub_cuda_tickets, __ATOMIC_ACQUIRE)
             ? 0
             : 600;
}
int cudaStreamDestroy(cudaStream_t s) {
  free(s);
  return 0;
}
