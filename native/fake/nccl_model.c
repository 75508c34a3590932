/*
 * The transfer-time model: every link between two global ranks has a bandwidth (default
 * FAKE_NCCL_BW_GBPS, 10 GB/s, divided by a `slow_link` factor) and a latency (FAKE_NCCL_LAT_US,
 * 5 us). Collectives run as rings over communicator rank order, so the slowest ring link sets the
 * pace, as in NCCL's ring algorithm; closed forms (n ranks, S bytes per rank, B slowest link):
 *   AllReduce            2(n-1)/n * S / B + 2(n-1) * lat
 *   AllGather/ReduceSc.  (n-1)/n * (n*S) / B + (n-1) * lat     (S: per-rank chunk)
 *   Broadcast/Reduce     S / B + (n-1) * lat                   (pipelined chain)
 *   AlltoAll             (n-1) * S / B_all + (n-1) * lat       (B_all: slowest pair of all)
 *   Send/Recv            S / B(a,b) + lat
 */
#include <stdlib.h>

#include "fk_faults.h"
#include "nccl_fake.h"

static double g_bw_Bps = 10e9;
static double g_lat_ns = 5000.0;

__attribute__((constructor)) static void model_init(void) {
  const char *bw = getenv("FAKE_NCCL_BW_GBPS");
  const char *lat = getenv("FAKE_NCCL_LAT_US");
  if (bw != NULL && atof(bw) > 0) g_bw_Bps = atof(bw) * 1e9;
  if (lat != NULL && atof(lat) >= 0) g_lat_ns = atof(lat) * 1e3;
}

size_t fk_dtype_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

struct links {
  int n;
  struct fk_rule r[FK_MAX_RULES];
};

static double link_bw(const struct links *l, int a, int b) {
  double bw = g_bw_Bps;
  for (int i = 0; i < l->n; i++)
    if (((l->r[i].a == a && l->r[i].b == b) || (l->r[i].a == b && l->r[i].b == a)) && l->r[i].v > 0)
      bw /= l->r[i].v;
  return bw;
}

static double ring_min_bw(const struct links *l, const struct fk_shm *s, int n) {
  double m = g_bw_Bps * 1e9;
  for (int i = 0; i < n; i++) {
    double bw = link_bw(l, s->global_rank[i], s->global_rank[(i + 1) % n]);
    if (bw < m) m = bw;
  }
  return m;
}

static double all_pairs_min_bw(const struct links *l, const struct fk_shm *s, int n) {
  double m = g_bw_Bps * 1e9;
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++) {
      double bw = link_bw(l, s->global_rank[i], s->global_rank[j]);
      if (bw < m) m = bw;
    }
  return m;
}

int64_t fk_model_ns(const struct ncclComm *c, uint32_t op, uint64_t bytes, int peer) {
  static _Thread_local struct links l;
  l.n = fk_fault_collect(FK_SLOW_LINK, l.r, FK_MAX_RULES);
  const struct fk_shm *s = c->shm;
  int n = c->nranks;
  double S = (double)bytes, t;
  if (op == FK_OP_SEND || op == FK_OP_RECV) {
    t = S / link_bw(&l, s->global_rank[c->rank], s->global_rank[peer]) * 1e9 + g_lat_ns;
    return (int64_t)t;
  }
  if (n == 1) return 0;
  switch (op) {
    case FK_OP_ALLREDUCE:
      t = 2.0 * (n - 1) / n * S / ring_min_bw(&l, s, n) * 1e9 + 2.0 * (n - 1) * g_lat_ns;
      break;
    case FK_OP_ALLGATHER:
    case FK_OP_REDUCESCATTER:
      t = (double)(n - 1) * S / ring_min_bw(&l, s, n) * 1e9 + (n - 1) * g_lat_ns;
      break;
    case FK_OP_ALLTOALL:
      t = (double)(n - 1) * S / all_pairs_min_bw(&l, s, n) * 1e9 + (n - 1) * g_lat_ns;
      break;
    default: /* Broadcast, Reduce */
      t = S / ring_min_bw(&l, s, n) * 1e9 + (n - 1) * g_lat_ns;
      break;
  }
  return (int64_t)t;
}

int64_t fk_link_ns(const struct ncclComm *c, int a, int b, uint64_t bytes) {
  static _Thread_local struct links l;
  l.n = fk_fault_collect(FK_SLOW_LINK, l.r, FK_MAX_RULES);
  return (int64_t)((double)bytes / link_bw(&l, c->shm->global_rank[a], c->shm->global_rank[b]) * 1e9 + g_lat_ns);
}

/* What one rank sends in the ring forms above (S: the call's bytes per rank). */
uint64_t fk_traffic_bytes(const struct ncclComm *c, uint32_t op, uint64_t bytes) {
  int n = c->nranks;
  double S = (double)bytes;
  if (op == FK_OP_SEND || op == FK_OP_RECV || n == 1) return bytes;
  switch (op) {
    case FK_OP_ALLREDUCE: return (uint64_t)(2.0 * (n - 1) / n * S);
    case FK_OP_ALLGATHER:
    case FK_OP_REDUCESCATTER: return (uint64_t)((double)(n - 1) * S);
    case FK_OP_ALLTOALL: return (uint64_t)((double)(n - 1) / n * S);
    default: return bytes;
  }
}
