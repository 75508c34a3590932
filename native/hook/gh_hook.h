/*
 * Internal interfaces shared by the hook's translation units. Nothing here is exported: the
 * library is built with -fvisibility=hidden and only the NCCL entry points carry GH_EXPORT.
 */
#ifndef GREYHOUND_HOOK_H
#define GREYHOUND_HOOK_H

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "greyhound_ring.h"
#include "nccl_abi.h"
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

/* Every declaration from here on is hidden too, not only the definitions: the compiler then reaches
 * the hook's globals directly, PC-relative, instead of loading their address from the GOT first
 * (one instruction per access on the hot path). Only GH_EXPORT names leave the library. */
#pragma GCC visibility push(hidden)

#define GH_EXPORT __attribute__((visibility("default")))
#define GH_TLS __thread __attribute__((tls_model("initial-exec")))
#define GH_LIKELY(x) __builtin_expect(!!(x), 1)
#define GH_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* What a thread keeps for the hot path, in one thread-local block: a shared library reaches its
 * thread-locals through an offset loaded from the GOT, so one block costs one such load per call
 * where separate variables cost one per access. */
struct gh_thread {
  int depth;                       /* re-entrancy guard: NCCL calls its own exports (ncclBcast ->
                                      ncclBroadcast); only depth 0 is recorded */
  int group_depth;                 /* ncclGroupStart nesting ... */
  uint64_t group_id;               /* ... and the id of the open outermost group */
  ncclComm_t last_comm;            /* the last communicator this thread used (training loops hit the
                                      same one again and again): its entry and mark ring */
  struct gh_comm_entry *last_entry;
  struct gh_marks *last_marks;
  int *errp;                       /* this thread's errno (set at its first cache miss): saved
                                      without a call */
  uint32_t tid;                    /* Linux tid, 0 until first needed */
};
extern GH_TLS struct gh_thread gh_thr;

/* Process state; NULL/0 until the ring exists (or forever when recording is disabled). */
extern struct gh_ring_header *gh_hdr;
extern struct gh_control *gh_ctl;
extern struct gh_comm_entry *gh_comms;
extern struct gh_record *gh_records;
extern struct gh_progress *gh_prog; /* (v6) the profiler plugin's counters */
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
  uint64_t ticks;         /* how long the anchor serves (REANCHOR_NS) in TSC ticks; 0 (no usable TSC,
                             or not measured yet): every stamp takes the slow path, clock_gettime */
};
/* The anchor in use, published (release) whole: one load finds the TSC origin, rate and age limit,
 * and the no-TSC case needs no test of its own (its ticks are 0). Never NULL. */
extern const struct gh_tsc_anchor *gh_anchor_now;
/* What an enter stamp keeps for the return stamp: the TSC read and the anchor's rate and life. */
struct gh_stamp {
  uint64_t tsc, mult, ticks;
};
void gh_clock_init(void);
uint64_t gh_clock_slow(struct gh_stamp *k, uint64_t tsc); /* anchor too old, or no TSC */
uint64_t gh_clock_late(uint64_t ns0);                       /* a return stamp the enter's cannot serve */
/* Hot-path timestamps: the enter stamp keeps its TSC value and rate, so the return stamp costs one
 * rdtsc and a multiply (no anchor loads, never before the enter stamp). */
#if defined(__x86_64__)
static inline uint64_t gh_tsc_to_ns(uint64_t dticks, uint64_t mult) {
  return (uint64_t)(((unsigned __int128)dticks * mult) >> 32);
}
static inline uint64_t gh_clock_enter(struct gh_stamp *k) {
  const struct gh_tsc_anchor *a = __atomic_load_n(&gh_anchor_now, __ATOMIC_ACQUIRE);
  uint64_t t = __rdtsc();
  uint64_t dt = t - __atomic_load_n(&a->tsc, __ATOMIC_RELAXED); /* a TSC gone backwards wraps huge */
  uint64_t ticks = __atomic_load_n(&a->ticks, __ATOMIC_RELAXED);
  if (GH_UNLIKELY(dt >= ticks)) return gh_clock_slow(k, t);
  uint64_t m = __atomic_load_n(&a->mult, __ATOMIC_RELAXED);
  k->tsc = t;
  k->mult = m;
  k->ticks = ticks;
  return __atomic_load_n(&a->ns, __ATOMIC_RELAXED) + gh_tsc_to_ns(dt, m);
}
static inline uint64_t gh_clock_exit(const struct gh_stamp *k, uint64_t ns0) {
  uint64_t dt = __rdtsc() - k->tsc;
  if (GH_LIKELY(dt < k->ticks)) return ns0 + gh_tsc_to_ns(dt, k->mult);
  return gh_clock_late(ns0);
}
#else
static inline uint64_t gh_clock_enter(struct gh_stamp *k) {
  k->tsc = k->mult = k->ticks = 0;
  return gh_now_ns();
}
static inline uint64_t gh_clock_exit(const struct gh_stamp *k, uint64_t ns0) {
  (void)k;
  uint64_t ns = gh_now_ns();
  return ns > ns0 ? ns : ns0;
}
#endif

/* resolve.c: the real pncclX (or, failing that, ncclX that is not our own wrapper). */
void *gh_real(const char *name, void *self);
void *gh_find_library_symbol(const char *lib_prefix, const char *const *sonames, const char *name);

/* ring.c */
int gh_ring_ensure(int comm_rank); /* 1 when the ring is usable */
void gh_ring_set_device(int device);
/* The record index (+1) the poller is writing GPU times into right now, 0 when none. */
extern uint64_t gh_gpu_busy;
void gh_reserve_wait_poller(uint64_t busy);
/* 1 when the GPU times landed in record `index` (it was not recycled meanwhile). */
int gh_ring_gpu_complete(uint64_t index, uint64_t start_ns, uint64_t end_ns, uint32_t flags);

/* A slot is reserved by CAS on head and refused (counted) when the reader's cursor is a full ring
 * behind. The CAS and the load of gh_gpu_busy are seq_cst (a locked instruction and a plain load on
 * x86) so that a writer recycling a slot and the poller completing the record it held cannot both
 * miss each other (Dekker): one of them sees the other and the poller stays out of the new record. */
static inline struct gh_record *gh_reserve(uint64_t *index) {
  struct gh_ring_header *h = __atomic_load_n(&gh_hdr, __ATOMIC_ACQUIRE);
  if (h == NULL) return NULL;
  uint64_t cap = (uint64_t)gh_mask + 1;
  uint64_t head = __atomic_load_n(&h->head, __ATOMIC_RELAXED);
  do {
    if (GH_UNLIKELY(head - __atomic_load_n(&h->consumed, __ATOMIC_ACQUIRE) >= cap)) {
      __atomic_fetch_add(&h->dropped, 1, __ATOMIC_RELAXED);
      return NULL;
    }
  } while (!__atomic_compare_exchange_n(&h->head, &head, head + 1, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  uint64_t busy = __atomic_load_n(&gh_gpu_busy, __ATOMIC_SEQ_CST);
  if (GH_UNLIKELY(busy != 0 && busy + cap == head + 1)) gh_reserve_wait_poller(busy);
  *index = head;
  return &gh_records[head & gh_mask];
}
static inline void gh_publish(struct gh_record *r, uint64_t index) {
  __atomic_store_n(&r->stamp, index + 1, __ATOMIC_RELEASE);
}

/* The comm entry's seqlocks (layout 5): host_ver around the host fields, written by the one thread
 * inside a data call on the communicator (NCCL allows no more; every other writer takes life_ver,
 * below), gpu_ver around the gpu_* fields, written by the poller under the marks lock. Odd while the fields change: a reader takes a row whose
 * versions are even and the same before and after it. On x86 the fence costs no instruction. Its
 * readers are other processes, which ThreadSanitizer does not see (nor does it model fences): its
 * builds get the compiler barrier alone. */
#if defined(__SANITIZE_THREAD__)
#define GH_VER_FENCE() __atomic_signal_fence(__ATOMIC_RELEASE)
#else
#define GH_VER_FENCE() __atomic_thread_fence(__ATOMIC_RELEASE)
#endif
static inline uint32_t gh_ver_begin(uint32_t *ver) {
  uint32_t v = __atomic_load_n(ver, __ATOMIC_RELAXED) + 1;
  __atomic_store_n(ver, v, __ATOMIC_RELAXED);
  GH_VER_FENCE();
  return v;
}
static inline void gh_ver_end(uint32_t *ver, uint32_t v) { __atomic_store_n(ver, v + 1, __ATOMIC_RELEASE); }

/* (v6) life_ver: every other writer of a row's host fields (lifecycle calls, an abort from a
 * watchdog thread while the training thread is inside a call, a slot changing hands) claims it by
 * CAS from even to odd, waiting out another claimant's few stores, so that host_ver keeps its one
 * writer. A bare load-and-store (gh_ver_begin) by two writers could make a word even while one of
 * them is still writing: a reader would take the half-written row. */
static inline uint32_t gh_life_begin(uint32_t *ver) {
  uint32_t v = __atomic_load_n(ver, __ATOMIC_RELAXED);
  for (;;) {
    if (!(v & 1u) && __atomic_compare_exchange_n(ver, &v, v + 1, 1, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) break;
    if (v & 1u) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      v = __atomic_load_n(ver, __ATOMIC_RELAXED);
    }
  }
  GH_VER_FENCE();
  return v + 1;
}
static inline void gh_life_end(uint32_t *ver, uint32_t v) { __atomic_store_n(ver, v + 1, __ATOMIC_RELEASE); }

/* comm.c: communicator registry (handle -> entry index), stable ids. */
struct gh_comm_entry *gh_comm_lookup(ncclComm_t comm);
/* A communicator being created (id known before the call): an entry in state INIT with the call
 * in flight (life_op, inflight_enter_ns), not in the handle map; NULL when the table is full. */
struct gh_comm_entry *gh_comm_begin(uint64_t id, uint64_t parent, int color, int rank, int nranks,
                                    uint16_t op, uint64_t enter_ns);
/* `reserved`: the entry gh_comm_begin gave for it (or NULL): taken over when still its own. */
struct gh_comm_entry *gh_comm_register(ncclComm_t comm, uint64_t id, uint64_t parent, int color,
                                       int rank, int nranks, int device, struct gh_comm_entry *reserved);
void gh_comm_abandon(struct gh_comm_entry *reserved, uint64_t id); /* the creation failed */
void gh_comm_set_state(struct gh_comm_entry *e, uint32_t state);   /* under life_ver */
/* A lifecycle call on e returned: its life_op and enter time cleared, unless the entry changed
 * hands meanwhile (no longer `id` in `state`). */
void gh_comm_end_flight(struct gh_comm_entry *e, uint64_t id, uint32_t state);
void gh_comm_forget(ncclComm_t comm, uint32_t state);
/* forget, only if comm's entry is still `e` with that id (not a new communicator at a reused
 * address, registered while the destroy ran) */
void gh_comm_forget_entry(ncclComm_t comm, struct gh_comm_entry *e, uint64_t id, uint32_t state);
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

void gh_record_event(uint16_t op, struct gh_comm_entry *e, int result, int peer, uint64_t enter_ns);

/* The agent's mode and pause_request as one word (mode low, pause high): monitor mode with no
 * pause request reads 0, so the hot path tests both with one load. Points at a zero word until
 * the ring exists. */
typedef uint64_t __attribute__((may_alias)) gh_ctl_word_t;
extern const gh_ctl_word_t *gh_ctl_word;
#define GH_CTL_PAUSE(word) ((word) >> 32)

/* bench.c: one benchmark request (its waits end at deadline_ns, the pause's lease, at the
 * latest); a queued one cancelled; the benchmarks' scratch memory given back (end of a pause). */
void gh_bench_run(struct gh_bench_slot *s, uint64_t deadline_ns);
void gh_bench_cancel(struct gh_bench_slot *s);
void gh_bench_release(void);

/* The job's collective (process-group) timeout as the launcher or the framework integration
 * reports it, GREYHOUND_PG_TIMEOUT_S (seconds, fractions allowed), in ms; 0 when unset or not a
 * positive number. Read when the ring is made and again at each pause. */
static inline uint32_t gh_env_timeout_ms(void) {
  const char *e = getenv("GREYHOUND_PG_TIMEOUT_S");
  double s = e != NULL ? strtod(e, NULL) : 0.0;
  return s > 0.0 && s < 4.0e6 ? (uint32_t)(s * 1000.0) : 0u;
}

/* control.c: pause point, run at depth 0 outside groups before a data-path call; and after the
 * outermost ncclGroupEnd, for a targeted pause on a communicator the group used (`reached`: the
 * group took the target communicator's collective seq to pause_seq or beyond). */
void gh_pause_point_slow(ncclComm_t comm);
int gh_pause_group_target_reached(void); /* before gh_marks_group_end forgets the group */
void gh_pause_after_group(int reached);
static inline void gh_pause_point(ncclComm_t comm) {
  const gh_ctl_word_t *w = __atomic_load_n(&gh_ctl_word, __ATOMIC_ACQUIRE);
  if (GH_UNLIKELY(GH_CTL_PAUSE(__atomic_load_n(w, __ATOMIC_RELAXED)) != 0)) gh_pause_point_slow(comm);
}

/* cuda.c: the process's CUDA runtime, resolved once (never linked). */
typedef void *gh_cuda_event;
struct gh_cuda {
  int (*ev_create)(gh_cuda_event *, unsigned);
  int (*ev_record)(gh_cuda_event, cudaStream_t);
  int (*ev_query)(gh_cuda_event);
  int (*ev_sync)(gh_cuda_event);
  int (*ev_elapsed)(float *, gh_cuda_event, gh_cuda_event);
  int (*ev_destroy)(gh_cuda_event);
  int (*is_capturing)(cudaStream_t, int *);
  int (*capture_mode)(int *);
  int (*set_device)(int);
  int (*get_device)(int *);
};
#define GH_CUDA_NOT_READY 600 /* cudaErrorNotReady */
#define GH_EVENT_DISABLE_TIMING 0x2u
extern struct gh_cuda gh_cu;
int gh_cuda_ready(void); /* 1 once the runtime or the driver resolved; 0 for good without either */
int gh_cuda_api(void);   /* enum gh_gpu_api: what resolved (decided at the first call) */
int gh_cuda_capturing(cudaStream_t stream); /* 1 capturing, or the query failed: record nothing */
void gh_cuda_note_context(int device);      /* the poller's context: this thread's (driver API) */
void gh_gpu_identity(int device);           /* header gpu_api and, once, pci_bus_id of device */
int gh_cuda_thread_local(void); /* switch this thread's capture mode; returns the old one */
void gh_cuda_restore_mode(int mode);
void gh_cuda_fork_child(void);
void *gh_cuda_sym(const char *name);
int gh_private_stream(cudaStream_t *out); /* 0 on success; non-blocking where CUDA allows */

/* poller.c: the background thread; started at the first data-path call on a stream that is not
 * capturing. Returns 1 while it runs. */
int gh_poller_want(cudaStream_t stream);
void gh_poller_fork_child(void);

/* profile.c: CUDA events around calls when the agent selected profile mode. */
void gh_profile_end(uint32_t slot, ncclResult_t res);
void gh_profile_group_end(ncclResult_t res); /* the outermost GroupEnd's result */
void gh_profile_comm_gone(struct gh_comm_entry *e);
void gh_profile_fork_child(void);
void gh_profile_poll(void);

/* marks.c: GPU-side completion marks, always on (layout 3). Per communicator a single-producer
 * ring of slots, each with a pre-created cudaEventDisableTiming event recorded on the call's
 * stream after the call: the poller retires them oldest first and publishes gpu_calls_done,
 * gpu_seq_done and the oldest pending call into the comm entry. A slot covers calls
 * [first, last] (a group's calls on one communicator share one mark). */
#define GH_MARKS 1024u
/* Packed so the hot path fills it with six stores: last = first + span; the collective seq
 * before the first call is upto - ncoll; the first call's own seq is that + 1 if it is a
 * collective (GH_MARK_COLL in meta), else 0 (send/recv). */
#define GH_MARK_META(op, dtype, first_is_coll) ((uint32_t)(op) | ((uint32_t)(dtype) << 8) | ((uint32_t)(first_is_coll) << 16))
#define GH_MARK_SHAPE(span, ncoll) ((uint64_t)(span) | ((uint64_t)(ncoll) << 32))
struct gh_mark_slot {
  gh_cuda_event ev; /* created by the poller */
  uint64_t first;   /* the first call covered (calls numbered as calls_entered) */
  uint64_t upto;    /* the communicator's collective seq after the last call covered */
  uint64_t count;   /* the first call's count ... */
  uint64_t enter_ns; /* ... and host enqueue time */
  uint64_t shape;   /* GH_MARK_SHAPE(calls covered - 1, collectives covered) */
  uint32_t meta;    /* GH_MARK_META of the first call */
  int32_t peer;     /* the first call's peer (send/recv; a rooted collective's root), -1 none */
  uint32_t pad[2];  /* 64 bytes: the hot path indexes with a shift */
};
/* What the poller last published into a comm entry's gpu_* fields. */
struct gpu_fields {
  uint64_t calls, seq, lost, pend_seq, count, pend_ns;
  uint32_t op, dtype;
  int32_t peer, pad;
};
struct gh_marks {
  /* the producer: the one thread inside this communicator's calls (NCCL allows no more) */
  uint64_t head;          /* slots published (release) */
  cudaStream_t stream;    /* its last call's stream once the events exist: the fast path's key */
  cudaStream_t noted;     /* its last call's stream, noted for the drain */
  uint32_t ready;         /* events exist (set by the poller, release) */
  uint32_t lost_ver;      /* seqlock over the three below */
  uint64_t lost_call;     /* newest call without a mark ... */
  uint64_t lost_seq;      /* ... the collective seq up to it ... */
  uint64_t lost_n;        /* ... and how many calls were enqueued without one */
  uint8_t pad0[8];
  /* the poller (under the marks lock) */
  uint64_t tail;          /* slots retired (release: the producer may reuse them) */
  uint64_t done_call, done_seq, calls_done, seq_done, lost_seen[3];
  int device, ev_device;  /* the communicator's CUDA device; the one its events belong to */
  uint32_t active, failed;
  struct gpu_fields shown;
  uint8_t pad1[48];
  struct gh_mark_slot slot[GH_MARKS];
};
extern struct gh_marks gh_marks[GH_MAX_COMMS];
void gh_marks_lock(void);
void gh_marks_unlock(void);
void gh_marks_attach(int idx, int device); /* a communicator took entry idx (marks lock held) */
void gh_marks_detach(int idx);  /* it was destroyed/aborted: pending marks dropped (lock held) */
void gh_marks_poll(void);        /* poller thread */
/* After the outermost ncclGroupEnd, with its result: marks published when it enqueued the group,
 * lost otherwise (failed: nothing enqueued; ncclInProgress: not on its stream yet). */
void gh_marks_group_end(ncclResult_t res);
/* Whether the open group has a collective on the communicator of comm_id whose seq is >= seq
 * (before gh_marks_group_end forgets the group). */
int gh_marks_group_reached(uint64_t comm_id, uint64_t seq);
int gh_streams_seen(cudaStream_t *out, int max); /* streams of this process's data-path calls */

/* Real NCCL entry points used outside their own wrapper (benchmarks, comm registry). */
typedef ncclResult_t (*gh_send_fn)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*gh_recv_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*gh_query_fn)(const ncclComm_t, int *);

#pragma GCC visibility pop

#endif
