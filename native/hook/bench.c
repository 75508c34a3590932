/*
 * The validation benchmarks a parked training thread runs for the agent (control.c parks it):
 * P2P send/receive over the job's own communicators and a cuBLAS SGEMM, timed on the GPU.
 *
 * Parking the host does not park the GPU: the rank's already-enqueued work keeps running and
 * would share the SMs with a benchmark. So before measuring, each request waits for that work to
 * drain (an event recorded on every stream the rank's data-path calls used, and on the default
 * stream, polled; the time waited goes in drain_ns), then times its GEMM or send/receive with
 * CUDA events on a private non-blocking stream. No wait is unbounded: each ends at
 * GREYHOUND_BENCH_TIMEOUT_MS (default 10000) or at the pause's lease, whichever comes first, and a
 * drain or a transfer whose peer never posts fails the request (FAILED, cudaErrorNotReady).
 *
 * Scratch memory is the benchmarks' own and goes back when the pause ends (gh_bench_release): a
 * training job must not keep a validation's gigabytes. It is stream-ordered
 * (cudaMallocAsync/cudaFreeAsync on the benchmark stream) where the runtime has it, so freeing
 * never synchronises with the device, and memory a timed-out transfer may still write into is
 * freed behind that transfer, never under it. A runtime without stream-ordered allocation gets
 * cudaMalloc, freed only once its stream is idle (cudaFree waits for the device). The cuBLAS
 * handle is kept: cublasDestroy synchronises the device, which a hung collective would make
 * endless.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "gh_hook.h"

#define MAX_DRAIN 65
#define POLL_NS 100000L
#define DEFAULT_TIMEOUT_MS 10000
#define MAX_RETIRED 8

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*malloc_async_fn)(void **, size_t, cudaStream_t);
typedef int (*free_async_fn)(void *, cudaStream_t);
typedef int (*stream_fn)(cudaStream_t);
typedef int (*blas_create_fn)(void **);
typedef int (*blas_set_stream_fn)(void *, cudaStream_t);
typedef int (*blas_sgemm_fn)(void *, int, int, int, int, int, const float *, const float *, int,
                             const float *, int, const float *, float *, int);

enum scratch_kind { SCRATCH_NONE, SCRATCH_HOST, SCRATCH_DEVICE, SCRATCH_ORDERED };

/* A buffer and the stream whose work uses it. */
struct scratch {
  void *p;
  size_t bytes;
  cudaStream_t stream;
  enum scratch_kind kind;
};

static struct {
  int tried;
  malloc_fn dmalloc;
  free_fn dfree;
  malloc_async_fn amalloc; /* stream-ordered allocation, NULL where the runtime lacks it */
  free_async_fn afree;
  stream_fn squery, sdestroy;
  cudaStream_t stream;
  struct scratch buf;
  struct scratch retired[MAX_RETIRED]; /* cudaMalloc'd, on a stream with a transfer that timed out */
  int nretired;
  void *blas;
  gh_cuda_event t0, t1;           /* timing events around each measured operation */
  gh_cuda_event drain[MAX_DRAIN]; /* one per stream being drained */
  uint64_t timeout_ns;
  uint64_t deadline_ns; /* the request's hard end: the pause's lease */
} bench;

/* CUDA present: device buffers, a private non-blocking stream and GPU timing. Absent: host
 * buffers and host timing, for P2P over a NCCL without a GPU (the C tests' stub). */
static void bench_cuda(void) {
  if (bench.tried) return;
  bench.tried = 1;
  const char *t = getenv("GREYHOUND_BENCH_TIMEOUT_MS");
  long ms = t != NULL ? strtol(t, NULL, 10) : 0;
  bench.timeout_ns = (uint64_t)(ms > 0 && ms <= GH_PAUSE_LEASE_MAX_MS ? ms : DEFAULT_TIMEOUT_MS) * 1000000ull;
  bench.dmalloc = (malloc_fn)gh_cuda_sym("cudaMalloc");
  bench.dfree = (free_fn)gh_cuda_sym("cudaFree");
  bench.amalloc = (malloc_async_fn)gh_cuda_sym("cudaMallocAsync");
  bench.afree = (free_async_fn)gh_cuda_sym("cudaFreeAsync");
  if (bench.amalloc == NULL || bench.afree == NULL) bench.amalloc = NULL;
  bench.squery = (stream_fn)gh_cuda_sym("cudaStreamQuery");
  bench.sdestroy = (stream_fn)gh_cuda_sym("cudaStreamDestroy");
  int ok = bench.dmalloc != NULL && bench.dfree != NULL && gh_cuda_ready() &&
           gh_private_stream(&bench.stream) == 0 && gh_cu.ev_create(&bench.t0, 0) == 0 &&
           gh_cu.ev_create(&bench.t1, 0) == 0;
  for (int i = 0; ok && i < MAX_DRAIN; i++) ok = gh_cu.ev_create(&bench.drain[i], GH_EVENT_DISABLE_TIMING) == 0;
  if (!ok) {
    bench.dmalloc = NULL; /* no usable CUDA runtime in the process */
    bench.stream = NULL;
  }
}

static uint64_t deadline_in(uint64_t ns) {
  uint64_t d = gh_now_ns() + ns;
  return d < bench.deadline_ns ? d : bench.deadline_ns;
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
  uint64_t t0 = gh_now_ns(), deadline = deadline_in(bench.timeout_ns);
  int rc = 0;
  for (int i = 0; i < n; i++) {
    if (gh_cuda_capturing(streams[i]) || gh_cu.ev_record(bench.drain[i], streams[i]) != 0) continue;
    int q = wait_event(bench.drain[i], deadline);
    if (q != 0 && rc == 0) rc = q;
  }
  s->drain_ns = gh_now_ns() - t0;
  return rc;
}

/* ---- scratch memory ---------------------------------------------------------------------- */

static int stream_idle(cudaStream_t s) { return bench.squery != NULL && bench.squery(s) == 0; }

static void destroy_stream(cudaStream_t s) {
  if (s != NULL && s != bench.stream && bench.sdestroy != NULL) bench.sdestroy(s);
}

/* Give a buffer back without ever waiting for the device. Returns 0 when it could not go yet
 * (cudaMalloc'd, its stream still busy): the caller keeps it. */
static int give_back(struct scratch *s) {
  switch (s->kind) {
    case SCRATCH_HOST: free(s->p); break;
    case SCRATCH_ORDERED: bench.afree(s->p, s->stream); break; /* after the stream's work */
    case SCRATCH_DEVICE:
      if (!stream_idle(s->stream)) return 0;
      bench.dfree(s->p);
      break;
    case SCRATCH_NONE: break;
  }
  *s = (struct scratch){0};
  return 1;
}

/* A stream left holding a transfer that timed out: its buffer goes behind that transfer (or
 * waits, cudaMalloc'd, for the stream to drain) and the stream is destroyed once nothing needs
 * it (CUDA releases it when its work completes). */
static void retire(struct scratch *s, cudaStream_t stream) {
  if (s->kind == SCRATCH_DEVICE && !stream_idle(stream)) {
    if (bench.nretired < MAX_RETIRED) bench.retired[bench.nretired++] = *s;
    *s = (struct scratch){0}; /* beyond MAX_RETIRED: leaked rather than freed under a transfer */
    return;
  }
  give_back(s);
  destroy_stream(stream);
}

static void sweep_retired(void) {
  int kept = 0;
  for (int i = 0; i < bench.nretired; i++) {
    cudaStream_t st = bench.retired[i].stream;
    if (give_back(&bench.retired[i])) destroy_stream(st);
    else bench.retired[kept++] = bench.retired[i];
  }
  bench.nretired = kept;
}

/* A scratch buffer of at least n bytes for work on the benchmark stream: device memory when
 * CUDA is present. */
static void *scratch(size_t n) {
  if (bench.buf.p != NULL && n <= bench.buf.bytes) return bench.buf.p;
  if (bench.buf.p != NULL) retire(&bench.buf, bench.stream);
  struct scratch s = {.bytes = n, .stream = bench.stream};
  if (bench.dmalloc == NULL) {
    s.p = calloc(1, n);
    s.kind = SCRATCH_HOST;
  } else if (bench.amalloc != NULL && bench.amalloc(&s.p, n, bench.stream) == 0) {
    s.kind = SCRATCH_ORDERED;
  } else if (bench.dmalloc(&s.p, n) == 0) {
    s.kind = SCRATCH_DEVICE;
  } else {
    s.p = NULL;
  }
  if (s.p != NULL) bench.buf = s;
  return s.p;
}

void gh_bench_release(void) {
  if (bench.buf.p != NULL && !give_back(&bench.buf) && bench.nretired < MAX_RETIRED) {
    bench.retired[bench.nretired++] = bench.buf;
    bench.buf = (struct scratch){0};
  }
  sweep_retired();
}

/* After a transfer timed out its operation stays queued on the bench stream (its peer may post
 * it later): later requests get a fresh stream instead of queueing behind it. */
static void replace_stream(void) {
  cudaStream_t fresh, old = bench.stream;
  if (gh_private_stream(&fresh) != 0) return;
  bench.stream = fresh;
  if (bench.buf.p != NULL && bench.buf.stream == old) retire(&bench.buf, old);
  else destroy_stream(old);
}

/* ---- measurements ------------------------------------------------------------------------ */

/* GPU time of one operation enqueued by `issue` on the bench stream, bounded by the deadline. */
static int gpu_time(int (*issue)(struct gh_bench_slot *, void *), struct gh_bench_slot *s, void *arg,
                    uint64_t *dt) {
  if (gh_cu.ev_record(bench.t0, bench.stream) != 0) return -1;
  int rc = issue(s, arg);
  if (rc != 0) return rc;
  if (gh_cu.ev_record(bench.t1, bench.stream) != 0) return -1;
  rc = wait_event(bench.t1, deadline_in(bench.timeout_ns));
  if (rc != 0) return rc;
  float ms = 0;
  rc = gh_cu.ev_elapsed(&ms, bench.t0, bench.t1);
  *dt = (uint64_t)((double)ms * 1e6);
  return rc;
}

static void finish_slot(struct gh_bench_slot *s, uint32_t state, int result) {
  s->result = result;
  __atomic_store_n(&s->state, state, __ATOMIC_RELEASE);
}

static void record_duration(struct gh_bench_slot *s, int i, uint64_t dt) {
  s->durations_ns[i] = dt;
  s->total_ns += dt;
  s->n_done = (uint32_t)i + 1;
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
  size_t total;
  if (__builtin_mul_overflow((size_t)g.n * (size_t)g.n, sizeof(float), &g.bytes) ||
      __builtin_mul_overflow(g.bytes, (size_t)3, &total)) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  g.buf = scratch(total);
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

/* A request the hook will not run: sizes beyond the bounds (a GEMM's 3 N^2 floats overflow
 * size_t long before N reaches 2^31 on 32-bit hosts, and no validation needs gigabytes). */
static int out_of_bounds(const struct gh_bench_slot *s) {
  if (s->repeat < 1 || s->repeat > GH_BENCH_MAX_REPEAT) return 1;
  if (s->kind == GH_BENCH_GEMM) return s->size == 0 || s->size > GH_BENCH_MAX_GEMM_N;
  if (s->kind == GH_BENCH_SEND || s->kind == GH_BENCH_RECV) return s->size > GH_BENCH_MAX_P2P_BYTES;
  return 0;
}

void gh_bench_run(struct gh_bench_slot *s, uint64_t deadline_ns) {
  s->n_done = 0;
  s->total_ns = 0;
  s->drain_ns = 0;
  if (out_of_bounds(s)) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  bench_cuda();
  bench.deadline_ns = deadline_ns;
  int rc = bench.dmalloc != NULL ? drain(s) : 0;
  if (rc != 0) finish_slot(s, GH_BENCH_FAILED, rc); /* the GPU did not drain in time */
  else if (s->kind == GH_BENCH_SEND || s->kind == GH_BENCH_RECV) run_p2p(s);
  else if (s->kind == GH_BENCH_GEMM) run_gemm(s);
  else finish_slot(s, GH_BENCH_UNSUPPORTED, 0);
}

void gh_bench_cancel(struct gh_bench_slot *s) {
  s->n_done = 0;
  s->total_ns = 0;
  s->drain_ns = 0;
  finish_slot(s, GH_BENCH_FAILED, GH_CUDA_NOT_READY);
}
