/*
 * The test workload: N processes training like data-parallel ranks, optionally with
 * tensor-parallel groups (ncclCommSplit, a TP all-reduce per iteration) and pipeline stages (a
 * Send/Recv group with the neighbouring stages per iteration), and a periodic long non-NCCL phase
 * (checkpoint). Configuration comes from the environment (see usage()).
 *
 * Like a PyTorch loop on a GPU, everything an iteration does on the device is asynchronous: the
 * host launches GH_COMPUTE_MS of compute as GH_KERNELS kernels (fakeGpuSleep, the analogue of
 * torch.cuda._sleep), then the pipeline group, the TP and the DP all-reduce, each returning at
 * once, and synchronises once per iteration (the loss read). So the host runs ahead of the device
 * by up to an iteration and its iteration period follows the device's. Each launch costs the host
 * real CPU work (GH_LAUNCH_US, else GH_COMPUTE_BUSY x GH_COMPUTE_MS spread over the compute
 * launches); `slow_host R f` multiplies it, which matters once the host can no longer stay ahead.
 * `slow_rank` slows the device's kernels (fake CUDA), `skip_call R it` keeps the host from ever
 * launching iteration it (H1), `mismatch R it` launches a DP all-reduce one element longer (H2).
 *
 * GH_INIT_IDS=n makes the world communicator as PyTorch does for large worlds: with
 * ncclCommInitRankScalable and n unique ids (rank 0 makes them all here; every rank passes the
 * same list). GH_SHRINK_LAST=1 (TP = PP = 1) takes the highest rank out as a fault-tolerant job
 * takes out a dead one: the others ncclCommShrink the world without it and train on the result;
 * it calls nothing more and exits.
 *
 * The DP step is GH_DP_BUCKETS collectives per iteration (a comma list: one count per pipeline
 * stage, the last repeated, so that stages' DP communicators advance at different rates, as
 * Megatron's buckets do; bucket b holds b + 1 shares of the gradients), all-reduces by default;
 * with GH_DP_GROUPED=1 they are one coalesced reduce-scatter (ncclGroupStart, a reduce-scatter
 * per bucket, ncclGroupEnd: Megatron's _coalescing_manager), so the DP communicator is used only
 * inside groups, as the pipeline's batched send/receive is (batch_isend_irecv). GH_PG_TIMEOUT_MS
 * > 0 runs the model of PyTorch's watchdog (watchdog.c) over every collective and group.
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
#include "watchdog.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define MAT 48

#define MAX_IDS 8
#define MAX_STAGES 64

struct cfg {
  int rank, world, iters, tp, pp, ckpt_every, verbose, nonblocking, kernels, nids, shrink_last, dp_grouped;
  int dp_buckets[MAX_STAGES], n_buckets;
  long pg_timeout_ms;
  double compute_ms, busy, ckpt_ms, launch_us;
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

/* Rank 0 publishes the unique ids by an atomic rename; the others poll for the file. */
static int rendezvous(const struct cfg *c, ncclUniqueId *id, int n) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/nccl_id", c->rdzv);
  if (c->rank == 0) {
    for (int i = 0; i < n; i++)
      if (ncclGetUniqueId(&id[i]) != ncclSuccess) return -1;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (f == NULL) return -1;
    int ok = fwrite(id, sizeof *id, (size_t)n, f) == (size_t)n;
    ok = (fclose(f) == 0) && ok;
    return ok && rename(tmp, path) == 0 ? 0 : -1;
  }
  for (int tries = 0; tries < 6000; tries++) {
    FILE *f = fopen(path, "rb");
    if (f != NULL) {
      int ok = fread(id, sizeof *id, (size_t)n, f) == (size_t)n;
      fclose(f);
      if (ok) return 0;
    }
    fk_sleep_ns(10000000);
  }
  return -1;
}

static float g_a[MAT * MAT], g_b[MAT * MAT], g_c[MAT * MAT];

/* The host's launch work of the current iteration ends at host_due: each launch adds its cost (us
 * x the `slow_host` factor) and does real CPU work (small SGEMM columns) until then. Against one
 * schedule from the iteration's start rather than per launch, so a moment of preemption on a
 * shared CPU is absorbed as it would be by a host with time to spare, and the iteration's launch
 * times stay as regular as its GPU's. */
static int64_t host_due;

static void host_launch_cost(const struct cfg *c, double us) {
  if (us <= 0) return;
  double factor = 1.0;
  if (!fk_fault_find(FK_SLOW_HOST, c->rank, -1, &factor) || factor < 1.0) factor = 1.0;
  host_due += (int64_t)(us * factor * 1e3);
  int64_t end = host_due;
  for (int j = 0; fk_now_ns() < end; j = (j + 1) % MAT)
    for (int i = 0; i < MAT; i++) {
      float acc = 0.0f;
      for (int p = 0; p < MAT; p++) acc += g_a[i + p * MAT] * g_b[p + j * MAT];
      g_c[i + j * MAT] = acc;
    }
}

static double nccl_launch_us(const struct cfg *c) { return c->launch_us >= 0 ? c->launch_us : 0.0; }

static ncclResult_t compute(const struct cfg *c) {
  if (c->compute_ms <= 0) return ncclSuccess;
  double each_us = c->launch_us >= 0 ? c->launch_us : c->compute_ms * c->busy * 1e3 / c->kernels;
  long long ns = (long long)(c->compute_ms * 1e6 / c->kernels);
  for (int k = 0; k < c->kernels; k++) {
    host_launch_cost(c, each_us);
    if (fakeGpuSleep(NULL, ns) != cudaSuccess) return ncclUnhandledCudaError;
  }
  return ncclSuccess;
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

/* Forward activations one stage on, as a pipeline's steady state does: a batched send/receive
 * (batch_isend_irecv), so the pipeline communicator is used only inside groups. */
static ncclResult_t pipeline_step(const struct cfg *c, const struct comms *m, float *buf, size_t count, int it) {
  host_launch_cost(c, nccl_launch_us(c));
  int64_t stamp = gh_watchdog_stamp();
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  if (m->pp_rank + 1 < m->pp_size) ncclSend(buf, count, ncclFloat32, m->pp_rank + 1, m->pp, NULL);
  if (m->pp_rank > 0) ncclRecv(buf, count, ncclFloat32, m->pp_rank - 1, m->pp, NULL);
  r = ncclGroupEnd();
  gh_watchdog_issued(stamp, "pipeline batch_isend_irecv", it);
  return r;
}

static int dp_buckets(const struct cfg *c, int pp_rank) {
  return c->dp_buckets[pp_rank < c->n_buckets ? pp_rank : c->n_buckets - 1];
}

/* Bucket b of `buckets` holds (b + 1) shares of the gradients (sizes differ, as Megatron's
 * buckets do); at least one element. */
static size_t bucket_count(size_t count, int b, int buckets) {
  size_t shares = (size_t)buckets * (size_t)(buckets + 1) / 2;
  size_t n = count * (size_t)(b + 1) / shares;
  return n > 0 ? n : 1;
}

/* The iteration's DP gradient reduction: `buckets` all-reduces, or one coalesced reduce-scatter
 * of `buckets` calls in a group (the DP communicator then never sees a call outside a group). The
 * first call carries the H2 mismatch (`extra` elements). */
static ncclResult_t dp_step(const struct cfg *c, const struct comms *m, float *buf, size_t count, size_t extra,
                            int it) {
  int buckets = dp_buckets(c, m->pp_rank);
  int dp_size = 1;
  ncclCommCount(m->dp, &dp_size);
  int64_t stamp = gh_watchdog_stamp();
  ncclResult_t r = ncclSuccess;
  if (c->dp_grouped) {
    if ((r = ncclGroupStart()) != ncclSuccess) return r;
    for (int b = 0; b < buckets && r == ncclSuccess; b++) {
      size_t part = bucket_count(count, b, buckets) / (size_t)dp_size;
      r = ncclReduceScatter(buf, buf, (part > 0 ? part : 1) + (b == 0 ? extra : 0), ncclFloat32, ncclSum, m->dp,
                            NULL);
    }
    ncclResult_t end = ncclGroupEnd();
    r = settle(m->dp, r != ncclSuccess ? r : end);
    gh_watchdog_issued(stamp, "dp coalesced reduce_scatter", it);
    return r;
  }
  for (int b = 0; b < buckets && r == ncclSuccess; b++) {
    if (b > 0) stamp = gh_watchdog_stamp();
    size_t n = bucket_count(count, b, buckets) + (b == 0 ? extra : 0);
    r = settle(m->dp, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, m->dp, NULL));
    gh_watchdog_issued(stamp, "dp all_reduce", it);
  }
  return r;
}

/* Errors of asynchronous work surface after the fact, as with real NCCL. */
static ncclResult_t async_error(const struct comms *m) {
  ncclComm_t all[4] = {m->world, m->tp, m->dp, m->pp};
  for (int i = 0; i < 4; i++) {
    ncclResult_t e = ncclSuccess;
    if (all[i] != NULL && ncclCommGetAsyncError(all[i], &e) == ncclSuccess && e != ncclSuccess &&
        e != ncclInProgress)
      return e;
  }
  return ncclSuccess;
}

/* Device times of one iteration from events: on an idle stream (the host just synchronised) an
 * event completes when recorded, so the first one anchors the others to the host clock. Not while
 * the stream captures a graph: there an event record is a graph node, not a time. */
struct gpu_marks {
  cudaEvent_t ev[3];
  int64_t anchor_ns;
  int on;
};

static void gpu_mark(struct gpu_marks *g, int i) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (i == 0) g->on = 1;
  if (g->on) g->on = cudaStreamIsCapturing(NULL, &st) == cudaSuccess && st == cudaStreamCaptureStatusNone;
  if (!g->on) return;
  /* The anchor: the record's host time, taken again (the newest record counts) when a preemption
   * stretched the call, so the device times below err by microseconds, not by the scheduler. */
  for (int tries = 0; tries < (i == 0 ? 4 : 1); tries++) {
    int64_t before = fk_now_ns();
    cudaEventRecord(g->ev[i], NULL);
    int64_t after = fk_now_ns();
    g->anchor_ns = i == 0 ? before + (after - before) / 2 : g->anchor_ns;
    if (after - before < 100000) break;
  }
}

static int64_t gpu_at(const struct gpu_marks *g, int i) {
  float ms = 0;
  if (!g->on || cudaEventElapsedTime(&ms, g->ev[0], g->ev[i]) != cudaSuccess) return 0;
  return g->anchor_ns + (int64_t)((double)ms * 1e6);
}

static ncclResult_t init_world(const struct cfg *c, ncclComm_t *world, ncclUniqueId *ids) {
  if (c->nids > 0) return ncclCommInitRankScalable(world, c->world, c->rank, c->nids, ids, NULL);
  return c->nonblocking ? ncclCommInitRankConfig(world, c->world, ids[0], c->rank, NULL)
                        : ncclCommInitRank(world, c->world, ids[0], c->rank);
}

/* The highest rank leaves; the others shrink the world without it and train on the result. */
static ncclResult_t shrink_last(const struct cfg *c, struct comms *m, int *leaving) {
  *leaving = c->rank == c->world - 1;
  if (*leaving) return ncclSuccess;
  int excluded[1] = {c->world - 1};
  ncclComm_t shrunk = NULL;
  ncclResult_t r = ncclCommShrink(m->world, excluded, 1, &shrunk, NULL, NCCL_SHRINK_DEFAULT);
  if (r != ncclSuccess) return r;
  report(c, "shrunk", shrunk);
  m->dp = shrunk;
  return ncclSuccess;
}

static int run(const struct cfg *c) {
  ncclUniqueId ids[MAX_IDS];
  struct comms m = {0};
  if (rendezvous(c, ids, c->nids > 0 ? c->nids : 1) != 0) return fail("rendezvous failed", errno);
  ncclResult_t r = settle(m.world, init_world(c, &m.world, ids));
  if (r != ncclSuccess) return fail("ncclCommInitRank", r);
  if ((r = make_comms(c, &m)) != ncclSuccess) return fail("ncclCommSplit", r);
  int leaving = 0;
  if (c->shrink_last && (r = shrink_last(c, &m, &leaving)) != ncclSuccess) return fail("ncclCommShrink", r);
  if (leaving) {
    if (c->verbose) printf("left the job\n");
    return 0;
  }
  ncclComm_t watched[4] = {m.world, m.tp, m.dp != m.world ? m.dp : NULL, m.pp};
  if (gh_watchdog_start(c->pg_timeout_ms, watched, 4) != 0) return fail("watchdog", 0);
  for (int i = 0; i < MAT * MAT; i++) g_a[i] = g_b[i] = (float)(i % 7) * 0.25f;
  struct gpu_marks g = {0};
  for (int i = 0; c->verbose && i < 3; i++)
    if (cudaEventCreate(&g.ev[i]) != cudaSuccess) return fail("cudaEventCreate", i);
  size_t count = c->bytes / sizeof(float);
  float *buf = calloc(count ? count : 1, sizeof(float));
  if (buf == NULL) return fail("out of memory", 0);
  for (int it = 0; it < c->iters; it++) {
    int64_t t0 = fk_now_ns();
    while (fk_fault_find(FK_SKIP_CALL, c->rank, it, NULL)) fk_sleep_ns(10000000); /* H1 */
    if (c->verbose) gpu_mark(&g, 0);
    host_due = fk_now_ns();
    if ((r = compute(c)) != ncclSuccess) return fail("compute launch", r);
    if (c->verbose) gpu_mark(&g, 1); /* the device reaches the collectives */
    /* tc: the host is about to launch the iteration's first collective (just before it) */
    int64_t tc = c->pp > 1 ? fk_now_ns() : 0;
    if (c->pp > 1 && (r = pipeline_step(c, &m, buf, count, it)) != ncclSuccess) return fail("pipeline send/recv", r);
    host_launch_cost(c, nccl_launch_us(c));
    int64_t stamp = gh_watchdog_stamp();
    if (c->tp > 1 && tc == 0) tc = fk_now_ns();
    if (c->tp > 1 && (r = ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, m.tp, NULL)) != ncclSuccess)
      return fail("tp all-reduce", r);
    if (c->tp > 1) gh_watchdog_issued(stamp, "tp all_reduce", it);
    size_t extra = fk_fault_find(FK_MISMATCH, c->rank, it, NULL) ? 1 : 0; /* H2 */
    host_launch_cost(c, nccl_launch_us(c));
    if (tc == 0) tc = fk_now_ns();
    if ((r = dp_step(c, &m, buf, count, extra, it)) != ncclSuccess) return fail("dp all-reduce", r);
    if (c->verbose) gpu_mark(&g, 2);
    int64_t t1 = fk_now_ns();
    if (c->verbose) {
      printf("sync it=%d t1=%lld\n", it, (long long)t1);
      fflush(stdout);
    }
    if (cudaStreamSynchronize(NULL) != cudaSuccess) return fail("cudaStreamSynchronize", 0); /* loss.item() */
    int64_t t2 = fk_now_ns();
    if ((r = async_error(&m)) != ncclSuccess) return fail("asynchronous NCCL error", r);
    if (c->verbose) {
      long mem = 0;
      fakeCudaMemStats(NULL, &mem, NULL);
      printf("it=%d t0=%lld t1=%lld t2=%lld tc=%lld ga=%lld gd=%lld mem=%ld\n", it, (long long)t0,
             (long long)t1, (long long)t2, (long long)tc, (long long)gpu_at(&g, 1), (long long)gpu_at(&g, 2),
             mem);
      fflush(stdout);
    }
    if (c->ckpt_every > 0 && (it + 1) % c->ckpt_every == 0) fk_sleep_ns((int64_t)(c->ckpt_ms * 1e6));
  }
  if (c->verbose) {
    long violations = 0, captured = 0;
    fakeCudaCaptureStats(&violations, &captured);
    printf("fake_cuda capture_violations=%ld captured_event_records=%ld\n", violations, captured);
    long live = 0, bytes = 0, peak = 0;
    fakeCudaMemStats(&live, &bytes, &peak);
    printf("fake_cuda mem_allocs=%ld mem_bytes=%ld mem_peak_bytes=%ld\n", live, bytes, peak);
  }
  for (int i = 0; c->verbose && i < 3; i++) cudaEventDestroy(g.ev[i]);
  free(buf);
  if (m.tp != NULL) ncclCommDestroy(m.tp);
  if (m.pp != NULL) ncclCommDestroy(m.pp);
  if (m.dp != m.world) ncclCommDestroy(m.dp);
  ncclCommDestroy(m.world);
  return 0;
}

/* "2,3" -> {2, 3}: DP collectives per iteration for each pipeline stage; unset: one. Returns the
 * count parsed, 0 when one is not a positive number. */
static int parse_buckets(const char *s, int *out) {
  if (s == NULL || s[0] == '\0') {
    out[0] = 1;
    return 1;
  }
  int n = 0;
  while (*s != '\0' && n < MAX_STAGES) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || v < 1 || v > 1024 || (*end != ',' && *end != '\0')) return 0;
    out[n++] = (int)v;
    s = *end == ',' ? end + 1 : end;
  }
  return n;
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
      .kernels = (int)env_long("GH_KERNELS", 4),
      .nids = (int)env_long("GH_INIT_IDS", 0),
      .shrink_last = (int)env_long("GH_SHRINK_LAST", 0),
      .compute_ms = env_double("GH_COMPUTE_MS", 10.0),
      .busy = env_double("GH_COMPUTE_BUSY", 1.0),
      .ckpt_ms = env_double("GH_CKPT_MS", 0.0),
      .launch_us = env_double("GH_LAUNCH_US", -1.0),
      .bytes = (size_t)env_long("GH_BYTES", 1 << 20),
      .rdzv = getenv("GH_RDZV"),
      .dp_grouped = (int)env_long("GH_DP_GROUPED", 0),
      .pg_timeout_ms = env_long("GH_PG_TIMEOUT_MS", 0),
  };
  c.n_buckets = parse_buckets(getenv("GH_DP_BUCKETS"), c.dp_buckets);
  if (c.rdzv == NULL || c.world < 1 || c.rank < 0 || c.rank >= c.world || c.tp < 1 || c.pp < 1 ||
      c.world % (c.tp * c.pp) != 0 || c.kernels < 1 || c.nids < 0 || c.nids > MAX_IDS || c.nids > c.world ||
      (c.shrink_last && (c.tp != 1 || c.pp != 1 || c.world < 2)) || c.n_buckets < 1) {
    fprintf(stderr,
            "gh_workload: set RANK, WORLD_SIZE, GH_RDZV (dir); optional GH_ITERS, GH_COMPUTE_MS (device "
            "time), GH_KERNELS (>= 1), GH_COMPUTE_BUSY (0..1, host launch work as a share of it), "
            "GH_LAUNCH_US (host cost per launch instead), GH_BYTES, GH_TP, GH_PP (WORLD_SIZE %% (TP*PP) == 0), "
            "GH_CKPT_EVERY, GH_CKPT_MS, GH_NONBLOCKING (InitRankConfig, poll ncclInProgress), GH_INIT_IDS (1..8: "
            "InitRankScalable with that many ids), GH_SHRINK_LAST (TP = PP = 1: shrink the last rank out), "
            "GH_VERBOSE, GH_DP_BUCKETS (per stage, e.g. 2,3; each >= 1), GH_DP_GROUPED (coalesced "
            "reduce-scatter), GH_PG_TIMEOUT_MS (the watchdog's timeout)\n");
    return 2;
  }
  if (c.busy < 0) c.busy = 0;
  if (c.busy > 1) c.busy = 1;
  mkdir(c.rdzv, 0700);
  return run(&c);
}
