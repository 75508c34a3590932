/*
 * The fake device inside the fake driver, libcuda.so.1 (gpu.c, cuda_drv.c), as the APIs over it
 * (the driver's cu* in cuda_drv.c, the runtime's cuda* in cudart.c) see it. Like a real
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

/* Everything below is the driver's, exported for the runtime: the runtime may be a shared
 * libcudart.so.12 or compiled into the program (a static runtime), and either way it reaches the
 * one device of the process through libcuda.so.1, as CUDA's runtime reaches the driver. */
#pragma GCC visibility push(default)

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

/* cuda_drv.c. Contexts: the thread's current one is a device's primary context, or none. The
 * runtime makes device 0's current at a thread's first call (fk_cur_device); the driver API asks
 * fk_ctx_device, which says -1 when the thread has none. */
int fk_cur_device(void);
int fk_ctx_device(void);
cudaError_t fk_set_device(int ordinal);
/* The PCI bus id ("0000:18:00.0") of what ordinal is in this process, whose visible devices are
 * those its container or device cgroup exposes (FAKE_CUDA_DEVICES: physical GPU indices, default
 * all 8) narrowed by CUDA_VISIBLE_DEVICES (indices into that list, or GPU UUIDs of the fake NVML).
 * cudaErrorInvalidDevice for an ordinal past them. Work runs on any ordinal below FK_DEVICES: the
 * fake has one device per process; only its identity follows the visible devices. */
cudaError_t fk_device_pci(int ordinal, char *out, int len);
/* Graph capture (`capture R`) as both APIs see it. */
int fk_capture_query(cudaStream_t s);
cudaError_t fk_capture_exchange(enum cudaStreamCaptureMode *mode);
/* Events, shared by both APIs (the same objects). */
cudaError_t fk_ev_create(cudaEvent_t *event, unsigned flags);
cudaError_t fk_ev_record(cudaEvent_t event, cudaStream_t stream, int device);
cudaError_t fk_ev_query(cudaEvent_t event);
cudaError_t fk_ev_sync(cudaEvent_t event);
cudaError_t fk_ev_elapsed(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t fk_ev_destroy(cudaEvent_t event);

#pragma GCC visibility pop

#endif
