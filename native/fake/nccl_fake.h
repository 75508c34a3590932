/*
 * Internals of the fake NCCL. One shared-memory segment per communicator (named from its unique
 * id) holds what the ranks must agree on: who attached, how many collectives each rank's device
 * reached and what it reached (so a mismatch is visible), split votes, and P2P counters. Waiting
 * is a futex on one generation word, bumped at every change, with a timeout so aborts and fault
 * changes are seen.
 *
 * Like real NCCL, a collective or a group is enqueued on the caller's CUDA stream (the fake
 * device in libcudart) and the call returns at once: the host numbers the call, the device posts
 * it to the peers when the stream reaches it (the rank's GPU "arrival"), waits for them, and
 * models the transfer time there. Errors surface later, through ncclCommGetAsyncError.
 *
 * One communicator's operations run in order on the device, whatever streams they were enqueued
 * on, as real NCCL's do (enqueue.cc: every launch of a communicator waits on its shared device
 * stream and advances it): an operation starts once its stream reached it and the communicator's
 * previous operation ended. So a send whose receiver never posts holds every later operation of
 * its communicator, and the streams those were enqueued on, until the communicator is aborted.
 */
#ifndef GH_NCCL_FAKE_H
#define GH_NCCL_FAKE_H

#include <stdatomic.h>
#include <stdint.h>

#include "cuda_fake.h"
#include "nccl_abi.h"

#define GH_EXPORT __attribute__((visibility("default")))
/* Real NCCL exports ncclX weak and pncclX global at one address; so does the fake. */
#define GH_WEAK_ALIAS(name) \
  extern __typeof(p##name) name __attribute__((weak, alias("p" #name), visibility("default")))

#define FK_MAX_RANKS 64
#define FK_RING 64   /* collectives one rank may post on a comm ahead of the slowest reader */
#define FK_TS_RING 4 /* P2P operations one rank may post to one peer ahead of that peer */
#define FK_COMM_MAGIC 0x6768666bu
#define FK_ID_MAGIC "ghfake01"

enum fk_op {
  FK_OP_ALLREDUCE = 1,
  FK_OP_BROADCAST,
  FK_OP_REDUCE,
  FK_OP_ALLGATHER,
  FK_OP_REDUCESCATTER,
  FK_OP_ALLTOALL,
  FK_OP_SEND,
  FK_OP_RECV
};

struct fk_entry {
  uint32_t op, dtype;
  uint64_t count;
  int32_t root, redop;
  int64_t enter_ns;
};

struct fk_shm {
  _Atomic uint32_t gen; /* futex word */
  _Atomic uint32_t attached;
  _Atomic uint32_t aborted;
  int32_t nranks;
  int32_t global_rank[FK_MAX_RANKS];
  _Atomic uint32_t entered[FK_MAX_RANKS]; /* collectives entered by each rank (last seq + 1) */
  _Atomic uint32_t split_arrived[FK_MAX_RANKS];
  int32_t split_color[2][FK_MAX_RANKS];
  int32_t split_key[2][FK_MAX_RANKS];
  _Atomic uint32_t sent[FK_MAX_RANKS][FK_MAX_RANKS]; /* [src][dst] sends posted */
  _Atomic uint32_t recvd[FK_MAX_RANKS][FK_MAX_RANKS]; /* [src][dst] receives posted */
  int64_t send_ns[FK_TS_RING][FK_MAX_RANKS][FK_MAX_RANKS];
  int64_t recv_ns[FK_TS_RING][FK_MAX_RANKS][FK_MAX_RANKS];
  struct fk_entry rec[FK_RING][FK_MAX_RANKS];
};

struct ncclComm {
  uint32_t magic;
  struct fk_shm *shm;
  ncclUniqueId id;
  int rank, nranks, global_rank;
  int nonblocking; /* made by InitRankConfig: may report ncclInProgress */
  uint32_t coll_seq, split_seq, shrink_seq;
  uint32_t sent[FK_MAX_RANKS], recvd[FK_MAX_RANKS]; /* numbered by the host at enqueue */
  _Atomic int aborted;     /* abort (or destroy with work still queued): the device lets go */
  _Atomic int refs;        /* the handle + enqueued batches: the last one frees the comm */
  _Atomic int async;       /* ncclInProgress while a non-blocking enqueue "completes" */
  _Atomic int async_polls; /* GetAsyncError calls left before an in-progress op is done */
  _Atomic int dev_err;     /* first error a device operation met, reported by GetAsyncError */
  struct fk_batch *last;   /* its newest enqueued batch (host side: one thread uses a comm at a
                              time); the next one waits for it on the device */
  void *prof_ctx;          /* the profiler plugin's context for it (nccl_prof.c) ... */
  int prof_on;             /* ... once its init succeeded */
  uint64_t prof_seq[FK_OP_RECV + 1]; /* NCCL's per-function collective sequence (profiler Coll) */
};

/* One operation, as the host enqueued it. */
struct fk_call {
  struct ncclComm *comm;
  cudaStream_t stream;
  uint32_t op, dtype;
  uint64_t count;
  int32_t root; /* root for rooted collectives, peer for P2P */
  int32_t redop;
  uint32_t seq; /* collective sequence, or per-peer P2P count, numbered at enqueue */
  int64_t ready_ns;    /* device time every rank of it had arrived (or a fault let go) ... */
  int64_t deadline_ns; /* ... and when it ends */
  /* the profiler: the mask it was enqueued with, its CollApi/P2pApi event, its task (Coll/P2p) */
  int prof_mask;
  void *prof_api, *prof_task;
  uint64_t seq_fn; /* NCCL's sequence of it per function (the profiler's Coll seqNumber) */
  /* `stop_channel`: the comm rank that stops sending on stall_channel (-1 all) half-way, -1 none */
  int stall_rank, stall_channel;
};

/* nccl_shm.c */
extern int fk_noop;
ncclResult_t fk_attach(struct ncclComm **out, const ncclUniqueId *id, int nranks, int rank, int global_rank);
ncclResult_t fk_wait_attached(struct ncclComm *c);
void fk_comm_unref(struct ncclComm *c);
void fk_bump(struct fk_shm *s);
typedef int (*fk_ready_fn)(const struct ncclComm *c, const void *arg);
ncclResult_t fk_wait(struct ncclComm *c, fk_ready_fn ready, const void *arg);
int fk_comm_ok(const struct ncclComm *c);
void fk_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* nccl_model.c */
size_t fk_dtype_size(ncclDataType_t t);
int64_t fk_model_ns(const struct ncclComm *c, uint32_t op, uint64_t bytes, int peer);
int64_t fk_link_ns(const struct ncclComm *c, int a, int b, uint64_t bytes); /* comm ranks a -> b */
uint64_t fk_traffic_bytes(const struct ncclComm *c, uint32_t op, uint64_t bytes); /* this rank sends */

/* nccl_coll.c */
ncclResult_t fk_submit(struct fk_call *call);

/* nccl_device.c: enqueue one batch (a call, or a group's calls) on its streams; let go of a
 * communicator's reference on its newest batch (when the communicator is freed). */
struct fk_batch;
ncclResult_t fk_enqueue(const struct fk_call *calls, int n);
void fk_batch_put(struct fk_batch *b);

#endif
