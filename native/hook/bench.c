/*
 * The validation benchmarks a parked training thread runs for the agent (control.c parks it):
 * P2P send/receive and a cuBLAS SGEMM, timed on the GPU.
 *
 * P2P never runs on a job's communicator. NCCL runs all of a communicator's operations in order
 * on the GPU (each launch waits on the communicator's shared device stream, enqueue.cc), so a send
 * whose peer never posts (its agent died, its drain timed out, the validator went away) would
 * stay queued on the job's communicator and every later training collective would wait behind it
 * for ever. Transfers run on a benchmark communicator instead: a SPLIT request makes one from a
 * job communicator (ncclCommSplit, color 0, keyed by the rank, so ranks keep their numbers; every
 * rank of that communicator must ask, all of them parked: the validator sends the splits once all
 * are parked and drained, in one order), with its own resources (splitShare 0: its own device
 * stream and abort flag). A transfer that fails or times out aborts it (ncclCommAbort), which
 * also ends the peer's side; the benchmark communicators left are destroyed when the pause ends.
 * A job that forces shared split resources (NCCL_COMM_SPLIT_SHARE_RESOURCES=1) gets no benchmark
 * communicator (UNSUPPORTED): its child would share the job's queue and abort flag.
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
#include <limits.h>
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
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, void *);
typedef ncclResult_t (*comm_end_fn)(ncclComm_t);
typedef ncclResult_t (*async_fn)(ncclComm_t, ncclResult_t *);

/* The prefix of ncclConfig_t that NCCL has read since 2.17: it copies at most `size` bytes and
 * gives every later field its default, by `version` (init.cc, parseCommConfig). Built here
 * because nccl.h is not available to a CPU build (and the hook never reads a caller's config). */
struct bench_config {
  size_t size;
  unsigned int magic, version;
  int blocking, cga_cluster_size, min_ctas, max_ctas;
  const char *net_name;
  int split_share;
};
#define CONFIG_MAGIC 0xcafebeefu  /* NCCL_API_MAGIC */
#define CONFIG_VERSION 21700u     /* NCCL_VERSION(2, 17, 0) */
#define CONFIG_UNDEF INT_MIN      /* NCCL_CONFIG_UNDEF_INT: NCCL's default */
#define TIMED (GH_BENCH_MAX_REPEAT + 1)

/* One benchmark communicator: split from the job communicator parent_id during this pause. */
struct child {
  uint64_t parent_id;
  ncclComm_t comm; /* NULL once aborted */
  int aborted;
};

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
  gh_cuda_event t[TIMED];         /* timing events between back-to-back repeats */
  gh_cuda_event drain[MAX_DRAIN]; /* one per stream being drained */
  struct child child[GH_BENCH_MAX_COMMS];
  int nchild;
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
           gh_private_stream(&bench.stream) == 0;
  for (int i = 0; ok && i < TIMED; i++) ok = gh_cu.ev_create(&bench.t[i], 0) == 0;
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

/* After a transfer failed, its benchmark communicator is aborted and its operation ends once the
 * abort reaches it; later requests get a fresh stream rather than wait for that. */
static void replace_stream(void) {
  cudaStream_t fresh, old = bench.stream;
  if (gh_private_stream(&fresh) != 0) return;
  bench.stream = fresh;
  if (bench.buf.p != NULL && bench.buf.stream == old) retire(&bench.buf, old);
  else destroy_stream(old);
}

/* ---- measurements ------------------------------------------------------------------------ */

static void finish_slot(struct gh_bench_slot *s, uint32_t state, int result) {
  s->result = result;
  __atomic_store_n(&s->state, state, __ATOMIC_RELEASE);
}

static void record_duration(struct gh_bench_slot *s, int i, uint64_t dt) {
  s->durations_ns[i] = dt;
  s->total_ns += dt;
  s->n_done = (uint32_t)i + 1;
}

/* The repeats of one operation enqueued back to back on the bench stream, an event between each
 * two (a host that re-synchronised each repeat would add its polling to every transfer), then one
 * wait, bounded by the deadline; the durations of the repeats the GPU finished go in the slot.
 * Returns the first error (an issue's, or cudaErrorNotReady: not finished in time). */
static int gpu_time(int (*issue)(struct gh_bench_slot *, void *), struct gh_bench_slot *s, void *arg) {
  if (gh_cu.ev_record(bench.t[0], bench.stream) != 0) return -1;
  int n = 0, rc = 0;
  while (n < s->repeat && rc == 0) {
    rc = issue(s, arg);
    if (rc == 0 && gh_cu.ev_record(bench.t[n + 1], bench.stream) != 0) rc = -1;
    if (rc == 0) n++;
  }
  if (n == 0) return rc;
  int waited = wait_event(bench.t[n], deadline_in(bench.timeout_ns));
  if (rc == 0) rc = waited;
  for (int i = 0; i < n && gh_cu.ev_query(bench.t[i + 1]) == 0; i++) {
    float ms = 0;
    if (gh_cu.ev_elapsed(&ms, bench.t[i], bench.t[i + 1]) != 0) break;
    record_duration(s, i, (uint64_t)((double)ms * 1e6));
  }
  return rc;
}

/* ---- benchmark communicators -------------------------------------------------------------- */

static void *nccl_fn(const char *name) { return gh_real(name, NULL); }

static struct child *child_of(uint64_t parent_id) {
  for (int i = 0; i < bench.nchild; i++)
    if (bench.child[i].parent_id == parent_id) return &bench.child[i];
  return NULL;
}

/* A transfer on it failed: abort it, so that nothing of the benchmark stays queued anywhere (its
 * peer's side fails too) and no later request uses it. */
static void abort_child(struct child *c) {
  comm_end_fn abort_fn = (comm_end_fn)nccl_fn("ncclCommAbort");
  if (c->comm != NULL && abort_fn != NULL) abort_fn(c->comm);
  c->comm = NULL;
  c->aborted = 1;
  __atomic_fetch_add(&gh_ctl->bench_comms_aborted, 1, __ATOMIC_RELAXED);
}

static int shares_split_resources(void) {
  const char *e = getenv("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  return e != NULL && e[0] != '\0' && strtol(e, NULL, 10) != 0;
}

/* A non-blocking parent makes the split non-blocking (NCCL decides by the parent): poll it to
 * completion, at most until the deadline, then abort the half-made child. */
static ncclResult_t settle_split(ncclComm_t child, ncclResult_t rc) {
  async_fn async = (async_fn)nccl_fn("ncclCommGetAsyncError");
  uint64_t deadline = deadline_in(bench.timeout_ns);
  struct timespec nap = {0, POLL_NS};
  while (rc == ncclInProgress && async != NULL && child != NULL) {
    ncclResult_t st = ncclInProgress;
    if (async(child, &st) != ncclSuccess) return ncclInternalError;
    if (st != ncclInProgress) return st;
    if (gh_now_ns() > deadline) return ncclInProgress;
    nanosleep(&nap, NULL);
  }
  return rc;
}

static void run_split(struct gh_bench_slot *s) {
  if (shares_split_resources()) {
    finish_slot(s, GH_BENCH_UNSUPPORTED, ncclInvalidUsage);
    return;
  }
  split_fn split = (split_fn)nccl_fn("ncclCommSplit");
  ncclComm_t parent = gh_comm_handle(s->comm_id);
  struct gh_comm_entry *e = gh_comm_lookup(parent);
  struct child *c = child_of(s->comm_id);
  if (c != NULL) { /* asked again: the one made this pause (or its abort) stands */
    finish_slot(s, c->aborted ? GH_BENCH_FAILED : GH_BENCH_DONE, c->aborted ? ncclInvalidUsage : ncclSuccess);
    return;
  }
  if (split == NULL || parent == NULL || e == NULL || bench.nchild == GH_BENCH_MAX_COMMS) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  struct bench_config cfg = {.size = sizeof cfg, .magic = CONFIG_MAGIC, .version = CONFIG_VERSION,
                             .blocking = CONFIG_UNDEF, .cga_cluster_size = CONFIG_UNDEF,
                             .min_ctas = CONFIG_UNDEF, .max_ctas = CONFIG_UNDEF, .net_name = NULL,
                             .split_share = 0};
  ncclComm_t child = NULL;
  ncclResult_t rc = split(parent, 0, e->rank, &child, &cfg);
  rc = settle_split(child, rc);
  if (child != NULL) __atomic_fetch_add(&gh_ctl->bench_comms_made, 1, __ATOMIC_RELAXED);
  if (rc != ncclSuccess || child == NULL) {
    struct child half = {.comm = child};
    if (child != NULL) abort_child(&half);
    finish_slot(s, GH_BENCH_FAILED, rc != ncclSuccess ? (int)rc : ncclInternalError);
    return;
  }
  bench.child[bench.nchild++] = (struct child){.parent_id = s->comm_id, .comm = child};
  finish_slot(s, GH_BENCH_DONE, ncclSuccess);
}

/* End of the pause: the benchmark communicators go (every operation on a live one completed: a
 * transfer that did not aborted it), and so does the scratch. */
void gh_bench_release(void) {
  comm_end_fn destroy = (comm_end_fn)nccl_fn("ncclCommDestroy");
  for (int i = 0; i < bench.nchild; i++)
    if (bench.child[i].comm != NULL && destroy != NULL) destroy(bench.child[i].comm);
  bench.nchild = 0;
  if (bench.buf.p != NULL && !give_back(&bench.buf) && bench.nretired < MAX_RETIRED) {
    bench.retired[bench.nretired++] = bench.buf;
    bench.buf = (struct scratch){0};
  }
  sweep_retired();
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
  struct child *c = child_of(s->comm_id);
  if (c == NULL || c->comm == NULL) { /* never the job's own communicator */
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidUsage);
    return;
  }
  struct p2p_arg a = {.send = send, .recv = recv, .comm = c->comm, .buf = scratch(s->size > 0 ? s->size : 1)};
  if (a.buf == NULL || send == NULL || recv == NULL) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  int rc = 0;
  if (bench.dmalloc != NULL) {
    rc = gpu_time(issue_p2p, s, &a);
  } else {
    for (int i = 0; i < s->repeat && rc == 0; i++) {
      uint64_t t0 = gh_now_ns();
      rc = issue_p2p(s, &a);
      if (rc == 0) record_duration(s, i, gh_now_ns() - t0);
    }
  }
  if (rc != 0) {
    abort_child(c); /* the peer never posted, or NCCL failed: nothing of it stays queued */
    if (bench.dmalloc != NULL) replace_stream();
    finish_slot(s, GH_BENCH_FAILED, rc);
    return;
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
  if (rc == 0) rc = gpu_time(issue_gemm, s, &g);
  finish_slot(s, rc == 0 ? GH_BENCH_DONE : GH_BENCH_FAILED, rc);
}

/* A request the hook will not run: sizes beyond the bounds (a GEMM's 3 N^2 floats overflow
 * size_t long before N reaches 2^31 on 32-bit hosts, and no validation needs gigabytes). */
static int out_of_bounds(const struct gh_bench_slot *s) {
  if (s->repeat < 1 || s->repeat > GH_BENCH_MAX_REPEAT) return 1;
  if (s->kind == GH_BENCH_GEMM) return s->size == 0 || s->size > GH_BENCH_MAX_GEMM_N;
  if (s->kind == GH_BENCH_SEND || s->kind == GH_BENCH_RECV) return s->size > GH_BENCH_MAX_P2P_BYTES;
  if (s->kind == GH_BENCH_SPLIT) return s->comm_id == 0;
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
  if (s->kind == GH_BENCH_SPLIT) { /* no drain: a split that one rank skipped would hang the rest */
    run_split(s);
    return;
  }
  int rc = bench.dmalloc != NULL ? drain(s) : 0;
  if (rc != 0) finish_slot(s, GH_BENCH_FAILED, rc); /* the GPU did not drain in time */
  else if (s->kind == GH_BENCH_SEND || s->kind == GH_BENCH_RECV) run_p2p(s);
  else if (s->kind == GH_BENCH_GEMM) run_gemm(s);
  else if (s->kind == GH_BENCH_DRAIN) finish_slot(s, GH_BENCH_DONE, ncclSuccess);
  else finish_slot(s, GH_BENCH_UNSUPPORTED, 0);
}

void gh_bench_cancel(struct gh_bench_slot *s) {
  s->n_done = 0;
  s->total_ns = 0;
  s->drain_ns = 0;
  finish_slot(s, GH_BENCH_FAILED, GH_CUDA_NOT_READY);
}
