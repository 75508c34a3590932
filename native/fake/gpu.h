/*
 * The fake device inside libcudart (gpu.c), as the API surface (cudart.c) sees it. Like a real
 * GPU it runs work asynchronously: every stream is a FIFO queue served by its own executor thread
 * (created at the stream's first launch), so a launch returns at once and the work runs when the
 * stream reaches it. Compute work of one device runs one item at a time, in launch order across
 * the device's streams, except that an item queued behind a stream that is busy with non-compute
 * work (a collective waiting for its peers, an event) does not hold back later compute items of
 * other streams: a hung collective occupies its stream, not the whole GPU.
 */
#ifndef GH_FK_GPU_H
#define GH_FK_GPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_fake.h"

#define FK_DEVICES 8
#define FK_STREAM_MAGIC 0x7374726du
#define FK_EVENT_MAGIC 0x65766e74u

struct CUstream_st {
  uint32_t magic;
  int device;
  unsigned flags;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* work queued (executor), work done (synchronisers) */
  struct fakeGpuWork *head, *tail;
  _Atomic uint64_t launched, done;
  int in_other;  /* executor runs non-compute work; guarded by the device lock */
  int64_t t_end; /* device time its last item ended (executor only) */
  int executor;  /* its thread exists */
  int destroyed; /* cudaStreamDestroy: the executor frees the stream once it is drained */
  struct CUstream_st *all_next;
};

/* An event completes when its stream reaches the record; `recorded` counts records, `reached`
 * holds the newest record the device reached, `done_ns` its time (CLOCK_MONOTONIC). A query is
 * ready when the newest record was reached, as in CUDA (a never-recorded event is ready). */
struct CUevent_st {
  uint32_t magic;
  unsigned flags;
  _Atomic uint64_t recorded, reached;
  _Atomic int64_t done_ns;
  _Atomic int refs; /* the handle + records queued on a stream */
  atomic_flag lock; /* orders completions that race (the same event recorded on two streams) */
};

/* Process state: 1 in a child forked after the device started (its executors are gone). */
extern int fk_gpu_forked;

struct CUstream_st *fk_stream(cudaStream_t s, int device); /* NULL handle -> device default */
int fk_stream_ok(cudaStream_t s);
cudaError_t fk_stream_create(cudaStream_t *out, unsigned flags, int device);
void fk_stream_destroy(struct CUstream_st *s);
cudaError_t fk_launch(struct CUstream_st *s, struct fakeGpuWork *w);
void fk_stream_sync(struct CUstream_st *s);
int fk_stream_idle(struct CUstream_st *s);
void fk_device_sync(int device);

void fk_event_unref(cudaEvent_t e);
/* Record: completes at once on an idle stream, else when the stream reaches it. */
cudaError_t fk_event_record(cudaEvent_t e, struct CUstream_st *s, int64_t lag_ns);
int fk_event_ready(cudaEvent_t e);
void fk_event_wait(cudaEvent_t e);

#endif
