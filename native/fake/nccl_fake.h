/*
 * Internals of the fake NCCL. One shared-memory segment per communicator (named from its unique
 * id) holds what the ranks must agree on: who attached, how many collectives each rank entered and
 * what it entered (so a mismatch is visible), split votes, and P2P counters. Waiting is a futex on
 * one generation word, bumped at every change, with a timeout so aborts and fault changes are seen.
 */
#ifndef GH_NCCL_FAKE_H
#define GH_NCCL_FAKE_H

#include <stdatomic.h>
#include <stdint.h>

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
  uint32_t coll_seq, split_seq;
  uint32_t sent[FK_MAX_RANKS], recvd[FK_MAX_RANKS];
  _Atomic int aborted;
  _Atomic int inflight;
  _Atomic int async;       /* ncclResult_t reported by GetAsyncError */
  _Atomic int async_polls; /* GetAsyncError calls left before an in-progress op is done */
};

/* One queued or immediate operation. */
struct fk_call {
  struct ncclComm *comm;
  uint32_t op, dtype;
  uint64_t count;
  int32_t root; /* root for rooted collectives, peer for P2P */
  int32_t redop;
  uint32_t seq; /* filled when posted */
  int64_t deadline_ns;
};

/* nccl_shm.c */
extern int fk_noop;
ncclResult_t fk_attach(struct ncclComm **out, const ncclUniqueId *id, int nranks, int rank, int global_rank);
ncclResult_t fk_wait_attached(struct ncclComm *c);
void fk_detach(struct ncclComm *c);
void fk_bump(struct fk_shm *s);
typedef int (*fk_ready_fn)(const struct ncclComm *c, const void *arg);
ncclResult_t fk_wait(struct ncclComm *c, fk_ready_fn ready, const void *arg);
int fk_comm_ok(const struct ncclComm *c);
void fk_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* nccl_model.c */
size_t fk_dtype_size(ncclDataType_t t);
int64_t fk_model_ns(const struct ncclComm *c, uint32_t op, uint64_t bytes, int peer);

/* nccl_coll.c */
ncclResult_t fk_submit(struct fk_call *call);

#endif
