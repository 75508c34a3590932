/*
 * The test workload: N processes doing "compute, then all-reduce" like data-parallel training,
 * optionally with tensor-parallel groups (ncclCommSplit, a TP all-reduce per iteration) and
 * pipeline stages (a Send/Recv pair with the neighbouring stages per iteration), and a periodic
 * long non-NCCL phase (checkpoint). Configuration comes from the environment (see README lines in
 * usage()). Compute is real CPU work (a small SGEMM loop) for GH_COMPUTE_MS x GH_COMPUTE_BUSY of
 * wall time, then sleeps the rest; a `slow_rank` fault adds (factor-1) x GH_COMPUTE_MS as sleep,
 * so a straggler costs time, not CPU, on small CI machines.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../fake/cuda_fake.h"
#include "../fake/fk_faults.h"
#include "../fake/fk_time.h"
#include "nccl_abi.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define MAT 48

struct cfg {
  int rank, world, iters, tp, pp, ckpt_every, verbose, nonblocking;
  double compute_ms, busy, ckpt_ms;
  size_t bytes;
  const char *rdzv;
};

static long env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  return s != NULL && s[0] != '\0' ? strtol(s, NULL, 10) : dflt;
}

static double env_double(const char *name, double dflt) {
  const char *s = getenv(name);
  return s != NULL && s[0] != '\0' ? strtod(s, NULL) : dflt;
}

static int fail(const char *what, int code) {
  fprintf(stderr, "gh_workload: %s (%d)\n", what, code);
  return 1;
}

/* Rank 0 publishes the unique id by an atomic rename; the others poll for the file. */
static int rendezvous(const struct cfg *c, ncclUniqueId *id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/nccl_id", c->rdzv);
  if (c->rank == 0) {
    if (ncclGetUniqueId(id) != ncclSuccess) return -1;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (f == NULL) return -1;
    int ok = fwrite(id, sizeof *id, 1, f) == 1;
    ok = (fclose(f) == 0) && ok;
    return ok && rename(tmp, path) == 0 ? 0 : -1;
  }
  for (int tries = 0; tries < 6000; tries++) {
    FILE *f = fopen(path, "rb");
    if (f != NULL) {
      int ok = fread(id, sizeof *id, 1, f) == 1;
      fclose(f);
      if (ok) return 0;
    }
    fk_sleep_ns(10000000);
  }
  return -1;
}

static float g_a[MAT * MAT], g_b[MAT * MAT], g_c[MAT * MAT];

static void compute(const struct cfg *c, cublasHandle_t blas) {
  int64_t t0 = fk_now_ns(), busy_end = t0 + (int64_t)(c->compute_ms * c->busy * 1e6);
  const float one = 1.0f, zero = 0.0f;
  while (fk_now_ns() < busy_end)
    cublasSgemm_v2(blas, CUBLAS_OP_N, CUBLAS_OP_N, MAT, MAT, MAT, &one, g_a, MAT, g_b, MAT, &zero, g_c, MAT);
  double factor = 1.0;
  fk_fault_find(FK_SLOW_RANK, c->rank, -1, &factor);
  if (factor < 1.0) factor = 1.0;
  fk_sleep_until(t0 + (int64_t)(c->compute_ms * factor * 1e6));
}

struct comms {
  ncclComm_t world, tp, dp, pp;
  int pp_rank, pp_size;
};

static void report(const struct cfg *c, const char *name, ncclComm_t comm) {
  int r = -1, n = -1;
  if (!c->verbose || comm == NULL) return;
  ncclCommUserRank(comm, &r);
  ncclCommCount(comm, &n);
  printf("comm %s rank=%d n=%d\n", name, r, n);
}

/* Layout rank = dp_idx*(pp*tp) + pp_idx*tp + tp_idx, as Megatron orders TP innermost. */
static ncclResult_t make_comms(const struct cfg *c, struct comms *m) {
  ncclResult_t r;
  int tp_idx = c->rank % c->tp, pp_idx = (c->rank / c->tp) % c->pp, dp_idx = c->rank / (c->tp * c->pp);
  m->dp = m->world;
  m->pp_rank = pp_idx;
  m->pp_size = c->pp;
  if (c->tp > 1 && (r = ncclCommSplit(m->world, c->rank / c->tp, c->rank, &m->tp, NULL)) != ncclSuccess) return r;
  if (c->tp > 1 || c->pp > 1) {
    if ((r = ncclCommSplit(m->world, pp_idx * c->tp + tp_idx, c->rank, &m->dp, NULL)) != ncclSuccess) return r;
  }
  if (c->pp > 1 && (r = ncclCommSplit(m->world, dp_idx * c->tp + tp_idx, c->rank, &m->pp, NULL)) != ncclSuccess)
    return r;
  report(c, "world", m->world);
  report(c, "tp", m->tp);
  report(c, "dp", m->dp);
  report(c, "pp", m->pp);
  return ncclSuccess;
}

/* A non-blocking communicator may answer ncclInProgress; poll it to completion as PyTorch does. */
static ncclResult_t settle(ncclComm_t comm, ncclResult_t r) {
  while (r == ncclInProgress) {
    fk_sleep_ns(100000);
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

/* Forward activations one stage on, as a pipeline's steady state does. */
static ncclResult_t pipeline_step(const struct comms *m, float *buf, size_t count) {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  if (m->pp_rank + 1 < m->pp_size) ncclSend(buf, count, ncclFloat32, m->pp_rank + 1, m->pp, NULL);
  if (m->pp_rank > 0) ncclRecv(buf, count, ncclFloat32, m->pp_rank - 1, m->pp, NULL);
  return ncclGroupEnd();
}

static int run(const struct cfg *c) {
  ncclUniqueId id;
  struct comms m = {0};
  if (rendezvous(c, &id) != 0) return fail("rendezvous failed", errno);
  ncclResult_t r = c->nonblocking ? ncclCommInitRankConfig(&m.world, c->world, id, c->rank, NULL)
                                  : ncclCommInitRank(&m.world, c->world, id, c->rank);
  r = settle(m.world, r);
  if (r != ncclSuccess) return fail("ncclCommInitRank", r);
  if ((r = make_comms(c, &m)) != ncclSuccess) return fail("ncclCommSplit", r);
  cublasHandle_t blas;
  if (cublasCreate_v2(&blas) != CUBLAS_STATUS_SUCCESS) return fail("cublasCreate", 0);
  for (int i = 0; i < MAT * MAT; i++) g_a[i] = g_b[i] = (float)(i % 7) * 0.25f;
  size_t count = c->bytes / sizeof(float);
  float *buf = calloc(count ? count : 1, sizeof(float));
  if (buf == NULL) return fail("out of memory", 0);
  for (int it = 0; it < c->iters; it++) {
    int64_t t0 = fk_now_ns();
    while (fk_fault_find(FK_SKIP_CALL, c->rank, it, NULL)) fk_sleep_ns(10000000); /* H1 */
    compute(c, blas);
    int64_t t1 = fk_now_ns();
    if (c->pp > 1 && (r = pipeline_step(&m, buf, count)) != ncclSuccess) return fail("pipeline send/recv", r);
    if (c->tp > 1 && (r = ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, m.tp, NULL)) != ncclSuccess)
      return fail("tp all-reduce", r);
    size_t n = count + (fk_fault_find(FK_MISMATCH, c->rank, it, NULL) ? 1 : 0); /* H2 */
    r = settle(m.dp, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, m.dp, NULL));
    if (r != ncclSuccess)
      return fail("dp all-reduce", r);
    int64_t t2 = fk_now_ns();
    if (c->verbose) {
      printf("it=%d t0=%lld t1=%lld t2=%lld\n", it, (long long)t0, (long long)t1, (long long)t2);
      fflush(stdout);
    }
    if (c->ckpt_every > 0 && (it + 1) % c->ckpt_every == 0) fk_sleep_ns((int64_t)(c->ckpt_ms * 1e6));
  }
  if (c->verbose) {
    long violations = 0, captured = 0;
    fakeCudaCaptureStats(&violations, &captured);
    printf("fake_cuda capture_violations=%ld captured_event_records=%ld\n", violations, captured);
  }
  free(buf);
  cublasDestroy_v2(blas);
  if (m.tp != NULL) ncclCommDestroy(m.tp);
  if (m.pp != NULL) ncclCommDestroy(m.pp);
  if (m.dp != m.world) ncclCommDestroy(m.dp);
  ncclCommDestroy(m.world);
  return 0;
}

GH_EXPORT int gh_workload_main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  struct cfg c = {
      .rank = (int)env_long("RANK", 0),
      .world = (int)env_long("WORLD_SIZE", 1),
      .iters = (int)env_long("GH_ITERS", 10),
      .tp = (int)env_long("GH_TP", 1),
      .pp = (int)env_long("GH_PP", 1),
      .ckpt_every = (int)env_long("GH_CKPT_EVERY", 0),
      .verbose = (int)env_long("GH_VERBOSE", 0),
      .nonblocking = (int)env_long("GH_NONBLOCKING", 0),
      .compute_ms = env_double("GH_COMPUTE_MS", 10.0),
      .busy = env_double("GH_COMPUTE_BUSY", 1.0),
      .ckpt_ms = env_double("GH_CKPT_MS", 0.0),
      .bytes = (size_t)env_long("GH_BYTES", 1 << 20),
      .rdzv = getenv("GH_RDZV"),
  };
  if (c.rdzv == NULL || c.world < 1 || c.rank < 0 || c.rank >= c.world || c.tp < 1 || c.pp < 1 ||
      c.world % (c.tp * c.pp) != 0) {
    fprintf(stderr,
            "gh_workload: set RANK, WORLD_SIZE, GH_RDZV (dir); optional GH_ITERS, GH_COMPUTE_MS, "
            "GH_COMPUTE_BUSY (0..1), GH_BYTES, GH_TP, GH_PP (WORLD_SIZE %% (TP*PP) == 0), GH_CKPT_EVERY, "
            "GH_CKPT_MS, GH_NONBLOCKING (InitRankConfig, poll ncclInProgress), GH_VERBOSE\n");
    return 2;
  }
  if (c.busy < 0) c.busy = 0;
  if (c.busy > 1) c.busy = 1;
  mkdir(c.rdzv, 0700);
  return run(&c);
}
