/*
 * Validation support (GREYHOUND's pause path). The agent raises pause_request; the next training
 * thread that reaches an NCCL data-path call at depth 0 parks here, acknowledges, and runs the
 * agent's benchmark requests in that thread with the job's own communicators, until the request
 * is lowered. Other threads arriving meanwhile wait without acknowledging. Nothing re-initialises.
 *
 * Parking the host does not park the GPU: the rank's already-enqueued work keeps running and
 * would share the SMs with a benchmark. So before measuring, each request waits for that work to
 * drain (an event recorded on every stream the rank's data-path calls used, and on the default
 * stream, polled against a deadline; the time waited goes in drain_ns), then times its GEMM or
 * send/receive with CUDA events on the GPU. No wait is unbounded: a drain or a transfer whose
 * peer never posts fails the request (FAILED, result cudaErrorNotReady) instead of parking the
 * thread for good. GREYHOUND_BENCH_TIMEOUT_MS (default 10000) bounds each wait.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gh_hook.h"

#define MAX_DRAIN 65
#define POLL_NS 100000L
#define DEFAULT_TIMEOUT_MS 10000

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*blas_create_fn)(void **);
typedef int (*blas_set_stream_fn)(void *, cudaStream_t);
typedef int (*blas_sgemm_fn)(void *, int, int, int, int, int, const float *, const float *, int,
                             const float *, int, const float *, float *, int);

static int pause_owner;

static struct {
  int tried;
  malloc_fn dmalloc;
  free_fn dfree;
  cudaStream_t stream;
  void *buf;
  size_t buf_bytes;
  void *blas;
  gh_cuda_event t0, t1;           /* timing events around each measured operation */
  gh_cuda_event drain[MAX_DRAIN]; /* one per stream being drained */
  uint64_t timeout_ns;
} bench;

/* CUDA present: device buffers, a private non-blocking stream and GPU timing. Absent: host
 * buffers and host timing, for P2P over a NCCL without a GPU (the C tests' stub). */
static void bench_cuda(void) {
  if (bench.tried) return;
  bench.tried = 1;
  const char *t = getenv("GREYHOUND_BENCH_TIMEOUT_MS");
  long ms = t != NULL ? strtol(t, NULL, 10) : 0;
  bench.timeout_ns = (uint64_t)(ms > 0 ? ms : DEFAULT_TIMEOUT_MS) * 1000000ull;
  bench.dmalloc = (malloc_fn)gh_cuda_sym("cudaMalloc");
  bench.dfree = (free_fn)gh_cuda_sym("cudaFree");
  int ok = bench.dmalloc != NULL && bench.dfree != NULL && gh_cuda_ready() &&
           gh_private_stream(&bench.stream) == 0 && gh_cu.ev_create(&bench.t0, 0) == 0 &&
           gh_cu.ev_create(&bench.t1, 0) == 0;
  for (int i = 0; ok && i < MAX_DRAIN; i++) ok = gh_cu.ev_create(&bench.drain[i], GH_EVENT_DISABLE_TIMING) == 0;
  if (!ok) {
    bench.dmalloc = NULL; /* no usable CUDA runtime in the process */
    bench.stream = NULL;
  }
}

/* Poll until the event is reached or the deadline passes; never blocks in CUDA. */
static int wait_event(gh_cuda_event ev, uint64_t deadline) {
  struct timespec nap = {0, POLL_NS};
  for (;;) {
    int q = gh_cu.ev_query(ev);
    if (q != GH_CUDA_NOT_READY) return q;
    if (gh_now_ns() > deadline) return GH_CUDA_NOT_READY;
    nanosleep(&nap, NULL);
  }
}

/* The rank's queued GPU work: everything enqueued so far on the streams its data-path calls used
 * and on the default stream. A stream capturing a graph is skipped: a record there would be a
 * graph node, and captured work runs only when the graph is launched. */
static int drain(struct gh_bench_slot *s) {
  cudaStream_t streams[MAX_DRAIN];
  int n = gh_streams_seen(streams, MAX_DRAIN - 1), has_default = 0;
  for (int i = 0; i < n; i++) has_default |= streams[i] == NULL;
  if (!has_default) streams[n++] = NULL;
  uint64_t t0 = gh_now_ns(), deadline = t0 + bench.timeout_ns;
  int rc = 0;
  for (int i = 0; i < n; i++) {
    if (gh_cuda_capturing(streams[i]) || gh_cu.ev_record(bench.drain[i], streams[i]) != 0) continue;
    int q = wait_event(bench.drain[i], deadline);
    if (q != 0 && rc == 0) rc = q;
  }
  s->drain_ns = gh_now_ns() - t0;
  return rc;
}

/* After a transfer timed out its operation stays queued on the bench stream (its peer may post
 * it later): later requests get a fresh stream instead of queueing behind it. */
static void replace_stream(void) {
  cudaStream_t fresh;
  if (gh_private_stream(&fresh) == 0) bench.stream = fresh;
}

/* GPU time of one operation enqueued by `issue` on the bench stream, bounded by the deadline. */
static int gpu_time(int (*issue)(struct gh_bench_slot *, void *), struct gh_bench_slot *s, void *arg,
                    uint64_t *dt) {
  if (gh_cu.ev_record(bench.t0, bench.stream) != 0) return -1;
  int rc = issue(s, arg);
  if (rc != 0) return rc;
  if (gh_cu.ev_record(bench.t1, bench.stream) != 0) return -1;
  rc = wait_event(bench.t1, gh_now_ns() + bench.timeout_ns);
  if (rc != 0) return rc;
  float ms = 0;
  rc = gh_cu.ev_elapsed(&ms, bench.t0, bench.t1);
  *dt = (uint64_t)((double)ms * 1e6);
  return rc;
}

/* A scratch buffer of at least n bytes: device memory when CUDA is present. */
static void *scratch(size_t n) {
  if (n <= bench.buf_bytes) return bench.buf;
  if (bench.buf != NULL) {
    if (bench.dmalloc != NULL) bench.dfree(bench.buf);
    else free(bench.buf);
  }
  bench.buf = NULL;
  bench.buf_bytes = 0;
  void *p = NULL;
  if (bench.dmalloc != NULL) {
    if (bench.dmalloc(&p, n) != 0) p = NULL;
  } else {
    p = calloc(1, n);
  }
  if (p != NULL) {
    bench.buf = p;
    bench.buf_bytes = n;
  }
  return p;
}

static void finish_slot(struct gh_bench_slot *s, uint32_t state, int result) {
  s->result = result;
  __atomic_store_n(&s->state, state, __ATOMIC_RELEASE);
}

struct p2p_arg {
  gh_send_fn send;
  gh_recv_fn recv;
  ncclComm_t comm;
  void *buf;
};

static int issue_p2p(struct gh_bench_slot *s, void *arg) {
  const struct p2p_arg *a = arg;
  return s->kind == GH_BENCH_SEND ? (int)a->send(a->buf, s->size, ncclUint8, s->peer, a->comm, bench.stream)
                                  : (int)a->recv(a->buf, s->size, ncclUint8, s->peer, a->comm, bench.stream);
}

static void record_duration(struct gh_bench_slot *s, int i, uint64_t dt) {
  s->durations_ns[i] = dt;
  s->total_ns += dt;
  s->n_done = (uint32_t)i + 1;
}

static void run_p2p(struct gh_bench_slot *s) {
  static gh_send_fn send;
  static gh_recv_fn recv;
  if (send == NULL) send = (gh_send_fn)gh_real("ncclSend", (void *)&ncclSend);
  if (recv == NULL) recv = (gh_recv_fn)gh_real("ncclRecv", (void *)&ncclRecv);
  struct p2p_arg a = {.send = send, .recv = recv, .comm = gh_comm_handle(s->comm_id),
                      .buf = scratch(s->size > 0 ? s->size : 1)};
  if (a.comm == NULL || a.buf == NULL || send == NULL || recv == NULL) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  for (int i = 0; i < s->repeat; i++) {
    uint64_t dt = 0;
    int rc;
    if (bench.dmalloc != NULL) {
      rc = gpu_time(issue_p2p, s, &a, &dt);
      if (rc == GH_CUDA_NOT_READY) replace_stream(); /* the peer never posted */
    } else {
      uint64_t t0 = gh_now_ns();
      rc = issue_p2p(s, &a);
      dt = gh_now_ns() - t0;
    }
    if (rc != 0) {
      finish_slot(s, GH_BENCH_FAILED, rc);
      return;
    }
    record_duration(s, i, dt);
  }
  finish_slot(s, GH_BENCH_DONE, ncclSuccess);
}

struct gemm_arg {
  blas_sgemm_fn sgemm;
  int n;
  char *buf;
  size_t bytes;
};

static int issue_gemm(struct gh_bench_slot *s, void *arg) {
  (void)s;
  const struct gemm_arg *g = arg;
  const float alpha = 1.0f, beta = 0.0f;
  return g->sgemm(bench.blas, 0, 0, g->n, g->n, g->n, &alpha, (float *)g->buf, g->n,
                  (float *)(g->buf + g->bytes), g->n, &beta, (float *)(g->buf + 2 * g->bytes), g->n);
}

static void run_gemm(struct gh_bench_slot *s) {
  static const char *const sonames[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so", NULL};
  blas_create_fn create = (blas_create_fn)gh_find_library_symbol("libcublas.so", sonames, "cublasCreate_v2");
  blas_set_stream_fn set_stream =
      (blas_set_stream_fn)gh_find_library_symbol("libcublas.so", sonames, "cublasSetStream_v2");
  blas_sgemm_fn sgemm = (blas_sgemm_fn)gh_find_library_symbol("libcublas.so", sonames, "cublasSgemm_v2");
  if (create == NULL || sgemm == NULL || bench.dmalloc == NULL) {
    finish_slot(s, GH_BENCH_UNSUPPORTED, 0); /* no CPU fallback: a CPU GEMM says nothing of the GPU */
    return;
  }
  struct gemm_arg g = {.sgemm = sgemm, .n = (int)s->size};
  g.bytes = (size_t)g.n * (size_t)g.n * sizeof(float);
  g.buf = scratch(3 * g.bytes);
  int rc = g.buf == NULL ? -1 : 0;
  if (rc == 0 && bench.blas == NULL) rc = create(&bench.blas);
  if (rc == 0 && set_stream != NULL) rc = set_stream(bench.blas, bench.stream);
  for (int i = 0; rc == 0 && i < s->repeat; i++) {
    uint64_t dt = 0;
    rc = gpu_time(issue_gemm, s, &g, &dt);
    if (rc == 0) record_duration(s, i, dt);
  }
  finish_slot(s, rc == 0 ? GH_BENCH_DONE : GH_BENCH_FAILED, rc);
}

/* Run the submitted requests addressed to this rank, lowest request id first. */
static void run_requests(void) {
  for (;;) {
    struct gh_bench_slot *next = NULL;
    for (int i = 0; i < GH_BENCH_SLOTS; i++) {
      struct gh_bench_slot *s = &gh_ctl->slots[i];
      if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == GH_BENCH_SUBMITTED &&
          (next == NULL || s->req_id < next->req_id))
        next = s;
    }
    if (next == NULL) return;
    __atomic_store_n(&next->state, GH_BENCH_RUNNING, __ATOMIC_RELEASE);
    next->n_done = 0;
    next->total_ns = 0;
    next->drain_ns = 0;
    if (next->repeat < 1 || next->repeat > GH_BENCH_MAX_REPEAT) {
      finish_slot(next, GH_BENCH_FAILED, ncclInvalidArgument);
      continue;
    }
    bench_cuda();
    int rc = bench.dmalloc != NULL ? drain(next) : 0;
    if (rc != 0) finish_slot(next, GH_BENCH_FAILED, rc); /* the GPU did not drain in time */
    else if (next->kind == GH_BENCH_SEND || next->kind == GH_BENCH_RECV) run_p2p(next);
    else if (next->kind == GH_BENCH_GEMM) run_gemm(next);
    else finish_slot(next, GH_BENCH_UNSUPPORTED, 0);
  }
}

/* A targeted pause (comm, seq) lets every rank stop at the same collective: a rank paused at the
 * plain "next call" would leave its peers blocked inside the collective it never entered. */
static int at_target(ncclComm_t comm) {
  uint64_t want = __atomic_load_n(&gh_ctl->pause_comm_id, __ATOMIC_ACQUIRE);
  if (want == 0) return 1;
  struct gh_comm_entry *e = gh_comm_lookup(comm);
  return e != NULL && e->comm_id == want &&
         __atomic_load_n(&e->last_seq_entered, __ATOMIC_RELAXED) + 1 >=
             __atomic_load_n(&gh_ctl->pause_seq, __ATOMIC_ACQUIRE);
}

void gh_pause_point_slow(ncclComm_t comm) {
  if (!at_target(comm)) return;
  int saved = errno;
  int me = (int)syscall(SYS_gettid);
  int expect = 0;
  struct timespec nap = {0, 200000};
  if (!__atomic_compare_exchange_n(&pause_owner, &expect, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    while (__atomic_load_n(&gh_ctl->pause_request, __ATOMIC_ACQUIRE) != 0 ||
           __atomic_load_n(&pause_owner, __ATOMIC_ACQUIRE) != 0)
      nanosleep(&nap, NULL);
    errno = saved;
    return;
  }
  gh_ctl->paused_tid = me;
  __atomic_fetch_add(&gh_ctl->pause_count, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_ctl->paused, 1u, __ATOMIC_RELEASE);
  /* Thread-local capture mode: a graph another thread captures must not make our event queries
   * illegal, nor be invalidated by them. */
  int mode = gh_cuda_ready() ? gh_cuda_thread_local() : -1;
  while (__atomic_load_n(&gh_ctl->pause_request, __ATOMIC_ACQUIRE) != 0) {
    run_requests();
    nanosleep(&nap, NULL);
  }
  if (mode >= 0) gh_cuda_restore_mode(mode);
  __atomic_store_n(&gh_ctl->paused, 0u, __ATOMIC_RELEASE);
  __atomic_store_n(&pause_owner, 0, __ATOMIC_RELEASE);
  errno = saved;
}
