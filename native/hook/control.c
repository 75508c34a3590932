/*
 * Validation support (GREYHOUND's pause path). The agent raises pause_request; the next training
 * thread that reaches an NCCL data-path call at depth 0 parks here, acknowledges, and runs the
 * agent's benchmark requests in that thread with the job's own communicators, until the request
 * is lowered. Other threads arriving meanwhile wait without acknowledging. Nothing re-initialises.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gh_hook.h"

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*sync_fn)(cudaStream_t);
typedef int (*blas_create_fn)(void **);
typedef int (*blas_set_stream_fn)(void *, cudaStream_t);
typedef int (*blas_sgemm_fn)(void *, int, int, int, int, int, const float *, const float *, int,
                             const float *, int, const float *, float *, int);

static int pause_owner;

static struct {
  int tried;
  malloc_fn dmalloc;
  free_fn dfree;
  sync_fn sync;
  cudaStream_t stream;
  void *buf;
  size_t buf_bytes;
  void *blas;
} bench;

static void bench_cuda(void) {
  if (bench.tried) return;
  bench.tried = 1;
  bench.dmalloc = (malloc_fn)gh_cuda_sym("cudaMalloc");
  bench.dfree = (free_fn)gh_cuda_sym("cudaFree");
  bench.sync = (sync_fn)gh_cuda_sym("cudaStreamSynchronize");
  if (bench.dmalloc == NULL || bench.dfree == NULL || bench.sync == NULL ||
      gh_private_stream(&bench.stream) != 0) {
    bench.dmalloc = NULL; /* no CUDA runtime in the process: host buffers, no stream */
    bench.stream = NULL;
  }
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

static void run_p2p(struct gh_bench_slot *s) {
  static gh_send_fn send;
  static gh_recv_fn recv;
  if (send == NULL) send = (gh_send_fn)gh_real("ncclSend", (void *)&ncclSend);
  if (recv == NULL) recv = (gh_recv_fn)gh_real("ncclRecv", (void *)&ncclRecv);
  ncclComm_t comm = gh_comm_handle(s->comm_id);
  void *buf = scratch(s->size > 0 ? s->size : 1);
  if (comm == NULL || buf == NULL || send == NULL || recv == NULL) {
    finish_slot(s, GH_BENCH_FAILED, ncclInvalidArgument);
    return;
  }
  for (int i = 0; i < s->repeat; i++) {
    uint64_t t0 = gh_now_ns();
    ncclResult_t r = s->kind == GH_BENCH_SEND
                         ? send(buf, s->size, ncclUint8, s->peer, comm, bench.stream)
                         : recv(buf, s->size, ncclUint8, s->peer, comm, bench.stream);
    if (r == ncclSuccess && bench.dmalloc != NULL && bench.sync(bench.stream) != 0) r = ncclUnhandledCudaError;
    uint64_t dt = gh_now_ns() - t0;
    if (r != ncclSuccess) {
      finish_slot(s, GH_BENCH_FAILED, r);
      return;
    }
    s->durations_ns[i] = dt;
    s->total_ns += dt;
    s->n_done = (uint32_t)i + 1;
  }
  finish_slot(s, GH_BENCH_DONE, ncclSuccess);
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
  int n = (int)s->size;
  size_t bytes = (size_t)n * (size_t)n * sizeof(float);
  char *buf = scratch(3 * bytes);
  int rc = buf == NULL ? -1 : 0;
  if (rc == 0 && bench.blas == NULL) rc = create(&bench.blas);
  if (rc == 0 && set_stream != NULL) rc = set_stream(bench.blas, bench.stream);
  const float alpha = 1.0f, beta = 0.0f;
  for (int i = 0; rc == 0 && i < s->repeat; i++) {
    uint64_t t0 = gh_now_ns();
    rc = sgemm(bench.blas, 0, 0, n, n, n, &alpha, (float *)buf, n, (float *)(buf + bytes), n, &beta,
               (float *)(buf + 2 * bytes), n);
    if (rc == 0) rc = bench.sync(bench.stream);
    uint64_t dt = gh_now_ns() - t0;
    if (rc != 0) break;
    s->durations_ns[i] = dt;
    s->total_ns += dt;
    s->n_done = (uint32_t)i + 1;
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
    if (next->repeat < 1 || next->repeat > GH_BENCH_MAX_REPEAT) {
      finish_slot(next, GH_BENCH_FAILED, ncclInvalidArgument);
      continue;
    }
    bench_cuda();
    if (next->kind == GH_BENCH_SEND || next->kind == GH_BENCH_RECV) run_p2p(next);
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
  while (__atomic_load_n(&gh_ctl->pause_request, __ATOMIC_ACQUIRE) != 0) {
    run_requests();
    nanosleep(&nap, NULL);
  }
  __atomic_store_n(&gh_ctl->paused, 0u, __ATOMIC_RELEASE);
  __atomic_store_n(&pause_owner, 0, __ATOMIC_RELEASE);
  errno = saved;
}
