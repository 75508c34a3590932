/*
 * Internal interfaces shared by the hook's translation units. Nothing here is exported: the
 * library is built with -fvisibility=hidden and only the NCCL entry points carry GH_EXPORT.
 */
#ifndef GREYHOUND_HOOK_H
#define GREYHOUND_HOOK_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

#include "greyhound_ring.h"
#include "nccl_abi.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define GH_TLS __thread __attribute__((tls_model("initial-exec")))
#define GH_LIKELY(x) __builtin_expect(!!(x), 1)
#define GH_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* Re-entrancy guard: NCCL calls its own exports (ncclBcast -> ncclBroadcast); record depth 0 only. */
extern GH_TLS int gh_depth;
/* Group nesting of this thread and the id of its open outermost group. */
extern GH_TLS int gh_group_depth;
extern GH_TLS uint64_t gh_group_id;

/* Process state; NULL/0 until the ring exists (or forever when recording is disabled). */
extern struct gh_ring_header *gh_hdr;
extern struct gh_control *gh_ctl;
extern struct gh_comm_entry *gh_comms;
extern struct gh_record *gh_records;
extern uint32_t gh_mask;
extern int gh_disabled;

static inline uint64_t gh_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* clock.c: CLOCK_MONOTONIC nanoseconds from the TSC where that is safe (x86-64, invariant TSC). */
struct gh_tsc_anchor {
  uint64_t tsc, ns, mult; /* ns = anchor.ns + (tsc - anchor.tsc) * mult / 2^32 */
};
extern struct gh_tsc_anchor gh_anchor[2];
extern uint32_t gh_anchor_idx;
extern int gh_tsc_ok;
extern uint64_t gh_reanchor_ticks;
void gh_clock_init(void);
uint64_t gh_tsc_reanchor(uint64_t tsc);
#if defined(__x86_64__)
#include <x86intrin.h>
static inline uint64_t gh_fast_ns(void) {
  if (GH_LIKELY(__atomic_load_n(&gh_tsc_ok, __ATOMIC_ACQUIRE))) {
    uint64_t t = __rdtsc();
    const struct gh_tsc_anchor *a = &gh_anchor[__atomic_load_n(&gh_anchor_idx, __ATOMIC_ACQUIRE)];
    uint64_t base = __atomic_load_n(&a->tsc, __ATOMIC_RELAXED);
    uint64_t dt = t - base;
    if (GH_UNLIKELY(dt > __atomic_load_n(&gh_reanchor_ticks, __ATOMIC_RELAXED))) return gh_tsc_reanchor(t);
    return __atomic_load_n(&a->ns, __ATOMIC_RELAXED) +
           (uint64_t)(((unsigned __int128)dt * __atomic_load_n(&a->mult, __ATOMIC_RELAXED)) >> 32);
  }
  return gh_now_ns();
}
#else
static inline uint64_t gh_fast_ns(void) { return gh_now_ns(); }
#endif

/* resolve.c: the real pncclX (or, failing that, ncclX that is not our own wrapper). */
void *gh_real(const char *name, void *self);
void *gh_find_library_symbol(const char *lib_prefix, const char *const *sonames, const char *name);

/* ring.c */
int gh_ring_ensure(int comm_rank); /* 1 when the ring is usable */
void gh_ring_set_device(int device);
struct gh_record *gh_reserve(uint64_t *index); /* NULL when full (counted) or disabled */
static inline void gh_publish(struct gh_record *r, uint64_t index) {
  __atomic_store_n(&r->stamp, index + 1, __ATOMIC_RELEASE);
}

/* comm.c: communicator registry (handle -> entry index), stable ids. */
struct gh_comm_entry *gh_comm_lookup(ncclComm_t comm);
struct gh_comm_entry *gh_comm_register(ncclComm_t comm, uint64_t id, uint64_t parent, int color,
                                       int rank, int nranks);
void gh_comm_forget(ncclComm_t comm, uint32_t state);
uint64_t gh_hash_bytes(const void *p, size_t n, uint64_t seed);
ncclComm_t gh_comm_handle(uint64_t comm_id);
/* wrap_comm.c: register a communicator the hook did not see created (ids are then per-process). */
struct gh_comm_entry *gh_comm_adopt(ncclComm_t comm);

/* Resolve the real entry point once; the pnccl alias can never be our own wrapper. */
#define GH_RESOLVE(var, name)                                                         \
  __extension__({                                                                     \
    __typeof__(var) f_ = __atomic_load_n(&(var), __ATOMIC_RELAXED);                   \
    if (GH_UNLIKELY(f_ == NULL)) {                                                    \
      f_ = (__typeof__(var))gh_real(#name, (void *)&name);                            \
      __atomic_store_n(&(var), f_, __ATOMIC_RELAXED);                                 \
    }                                                                                 \
    f_;                                                                               \
  })

/* Body of a data-path wrapper: pass through when nested or disabled, else record around CALL. */
#define GH_DATA_CALL(OP, COMM, STREAM, CALL, COUNT, DTYPE, REDOP, PEER)               \
  do {                                                                                \
    if (GH_UNLIKELY(gh_depth > 0 || gh_disabled)) return CALL;                       \
    int saved_ = errno;                                                               \
    gh_depth++;                                                                       \
    if (gh_group_depth == 0) gh_pause_point(COMM);                                    \
    struct gh_call c_;                                                                \
    gh_enter(&c_, (OP), (COMM), (STREAM), (COUNT), (int)(DTYPE));                      \
    errno = saved_;                                                                   \
    ncclResult_t res_ = CALL;                                                         \
    saved_ = errno;                                                                   \
    gh_exit(&c_, res_, (COMM), (COUNT), (int)(DTYPE), (int)(REDOP), (PEER), (STREAM)); \
    gh_depth--;                                                                       \
    errno = saved_;                                                                   \
    return res_;                                                                      \
  } while (0)

/* record.c: shared wrapper bodies. */
struct gh_call {
  uint64_t enter_ns;
  struct gh_comm_entry *entry;
  uint64_t seq;
  uint16_t op;
  int saved_errno;
  int profiled;      /* profile.c started events for this call */
  uint32_t prof_slot;
};
void gh_enter(struct gh_call *c, uint16_t op, ncclComm_t comm, cudaStream_t stream, uint64_t count,
              int dtype);
void gh_exit(struct gh_call *c, ncclResult_t res, ncclComm_t comm, uint64_t count, int dtype,
             int redop, int peer, cudaStream_t stream);
void gh_record_event(uint16_t op, struct gh_comm_entry *e, int result, int peer, uint64_t enter_ns);

/* control.c: pause point, run at depth 0 outside groups before a data-path call. */
void gh_pause_point_slow(ncclComm_t comm);
static inline void gh_pause_point(ncclComm_t comm) {
  if (GH_UNLIKELY(gh_ctl != 0 && __atomic_load_n(&gh_ctl->pause_request, __ATOMIC_RELAXED)))
    gh_pause_point_slow(comm);
}

/* profile.c: CUDA events around calls when the agent selected profile mode. */
int gh_profile_begin(cudaStream_t stream, uint32_t *slot, uint32_t *flags);
void gh_profile_end(uint32_t slot);
void gh_profile_attach(uint32_t slot, uint64_t record_index, struct gh_comm_entry *e);
void gh_profile_group_end(void);
void gh_profile_comm_gone(struct gh_comm_entry *e);
void gh_profile_fork_child(void);
void *gh_cuda_sym(const char *name);
int gh_private_stream(cudaStream_t *out); /* 0 on success; non-blocking where CUDA allows */

/* Real NCCL entry points used outside their own wrapper (benchmarks, comm registry). */
typedef ncclResult_t (*gh_send_fn)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*gh_recv_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*gh_query_fn)(const ncclComm_t, int *);

#endif
