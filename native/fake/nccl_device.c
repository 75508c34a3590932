/*
 * The device side of collectives, P2P and groups. A batch (one call, or the calls of one group)
 * runs on the fake device when its stream reaches it; a group spanning several streams runs once
 * every one of them has reached it (NCCL joins the streams of a group launch). It posts every call
 * (the rank's GPU arrival, on the device's timeline) before waiting on any, which is what lets a
 * ring of sends and receives in one group complete, like NCCL's fused group launch; all ranks of an
 * operation finish at one modelled time: the last arrival plus the transfer time (or, held by a
 * fault, the moment it let go plus the transfer). Faults act here: `never_complete R seq` holds
 * rank R's collective on its device, a mismatch hangs the collective on every device; an abort
 * (or a destroy with work queued) releases them.
 *
 * A batch also waits for the previous batch of each of its communicators (its device queue, as
 * NCCL's shared device stream orders a communicator's launches): it starts at the latest of its
 * streams' arrivals and those batches' ends.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fk_faults.h"
#include "fk_time.h"
#include "nccl_fake.h"
#include "nccl_prof.h"

struct fk_part {
  struct fakeGpuWork w; /* first: the device hands it back */
  struct fk_batch *b;
};

/* Memory: `mem` counts the parts (as one) and every holder of a pointer to the batch (a
 * communicator whose newest batch it is, a later batch of one that waits for it). The comms
 * are let go once the parts are done, so a communicator and its newest batch never keep each
 * other alive. */
struct fk_batch {
  _Atomic int arrived, parts_left, mem;
  int nparts, n, failed, done, nprev;
  int64_t end; /* device time the batch ended */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct fk_part *parts;
  struct fk_batch **prev; /* the previous batch of each of its communicators, NULL once waited */
  struct fk_call calls[];
};

static int coll_entered(const struct ncclComm *c, const void *arg) {
  uint32_t need = *(const uint32_t *)arg + 1;
  for (int r = 0; r < c->nranks; r++)
    if (atomic_load(&c->shm->entered[r]) < need) return 0;
  return 1;
}

static int never_ready(const struct ncclComm *c, const void *arg) {
  (void)c;
  (void)arg;
  return 0;
}

static int fault_gone(const struct ncclComm *c, const void *arg) {
  return !fk_fault_find(FK_NEVER_COMPLETE, c->global_rank, (long)*(const uint32_t *)arg, NULL);
}

struct p2p_arg {
  const _Atomic uint32_t *counter;
  uint32_t need;
};

static int p2p_matched(const struct ncclComm *c, const void *arg) {
  (void)c;
  const struct p2p_arg *a = arg;
  return atomic_load(a->counter) >= a->need;
}

static void raise_to(_Atomic uint32_t *p, uint32_t v) {
  uint32_t old = atomic_load(p);
  while (old < v && !atomic_compare_exchange_weak(p, &old, v)) {
  }
}

/* The rank's device reached the call at `now` (device time): announce it to the peers. */
static void post(const struct fk_call *k, int64_t now) {
  struct ncclComm *c = k->comm;
  struct fk_shm *s = c->shm;
  if (k->op == FK_OP_SEND) {
    s->send_ns[k->seq % FK_TS_RING][c->rank][k->root] = now;
    raise_to(&s->sent[c->rank][k->root], k->seq);
  } else if (k->op == FK_OP_RECV) {
    s->recv_ns[k->seq % FK_TS_RING][k->root][c->rank] = now;
    raise_to(&s->recvd[k->root][c->rank], k->seq);
  } else {
    s->rec[k->seq % FK_RING][c->rank] = (struct fk_entry){.op = k->op, .dtype = k->dtype, .count = k->count,
                                                          .root = k->root, .redop = k->redop, .enter_ns = now};
    raise_to(&s->entered[c->rank], k->seq + 1);
  }
  fk_bump(s);
}

static int same_call(const struct fk_entry *a, const struct fk_entry *b) {
  int rooted = a->op == FK_OP_BROADCAST || a->op == FK_OP_REDUCE;
  return a->op == b->op && a->dtype == b->dtype && a->count == b->count &&
         a->redop == b->redop && (!rooted || a->root == b->root);
}

/* Real NCCL hangs (or corrupts data) when ranks disagree on a collective: the fake hangs. */
static ncclResult_t hang_on_mismatch(struct ncclComm *c, uint32_t seq) {
  const struct fk_entry *row = c->shm->rec[seq % FK_RING];
  for (int r = 1; r < c->nranks; r++) {
    if (same_call(&row[0], &row[r])) continue;
    fk_log("mismatch seq=%u rank=%d global=%d: rank0 op=%u count=%llu dtype=%u root=%d; rank%d op=%u "
           "count=%llu dtype=%u root=%d",
           seq, c->rank, c->global_rank, row[0].op, (unsigned long long)row[0].count, row[0].dtype,
           row[0].root, r, row[r].op, (unsigned long long)row[r].count, row[r].dtype, row[r].root);
    return fk_wait(c, never_ready, NULL);
  }
  return ncclSuccess;
}

static ncclResult_t wait_coll(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  int64_t held_until = 0;
  if (fk_fault_find(FK_NEVER_COMPLETE, c->global_rank, (long)k->seq, NULL)) {
    fk_log("never_complete seq=%u rank=%d global=%d", k->seq, c->rank, c->global_rank);
    ncclResult_t r = fk_wait(c, fault_gone, &k->seq);
    if (r != ncclSuccess) return r;
    held_until = fk_now_ns();
  }
  ncclResult_t r = fk_wait(c, coll_entered, &k->seq);
  if (r != ncclSuccess) return r;
  r = hang_on_mismatch(c, k->seq);
  if (r != ncclSuccess) return r;
  int64_t ready = held_until;
  for (int i = 0; i < c->nranks; i++) {
    int64_t t = c->shm->rec[k->seq % FK_RING][i].enter_ns;
    if (t > ready) ready = t;
  }
  uint64_t bytes = k->count * fk_dtype_size((ncclDataType_t)k->dtype);
  k->ready_ns = ready;
  k->deadline_ns = ready + fk_model_ns(c, k->op, bytes, -1);
  k->stall_rank = fk_stall_rank(c, k->seq, &k->stall_channel);
  return ncclSuccess;
}

static int stall_gone(const struct ncclComm *c, const void *arg) {
  const struct fk_call *k = arg;
  int channel;
  return fk_stall_rank(c, k->seq, &channel) < 0;
}

/* `stop_channel`: the call runs up to its stall (the profiler's steps too), hangs on every rank
 * while the line stays, then its second half runs. */
static ncclResult_t wait_stalls(struct fk_batch *b, struct fk_prof_batch *pb, int64_t *end) {
  for (int i = 0; i < b->n; i++) {
    struct fk_call *k = &b->calls[i];
    if (k->stall_rank < 0) continue;
    fk_log("stop_channel seq=%u rank=%d stopping=%d channel=%d", k->seq, k->comm->rank, k->stall_rank,
           k->stall_channel);
    fk_prof_dev_run(pb);
    ncclResult_t r = fk_wait(k->comm, stall_gone, k);
    if (r != ncclSuccess) return r;
    int64_t now = fk_now_ns();
    uint64_t bytes = k->count * fk_dtype_size((ncclDataType_t)k->dtype);
    k->ready_ns = now;
    k->deadline_ns = now + fk_model_ns(k->comm, k->op, bytes, -1) / 2;
    k->stall_rank = -1;
    if (k->deadline_ns > *end) *end = k->deadline_ns;
  }
  return ncclSuccess;
}

static ncclResult_t wait_p2p(struct fk_call *k) {
  struct ncclComm *c = k->comm;
  struct fk_shm *s = c->shm;
  int peer = k->root, me = c->rank, src = k->op == FK_OP_SEND ? me : peer;
  int dst = k->op == FK_OP_SEND ? peer : me;
  struct p2p_arg a = {.counter = k->op == FK_OP_SEND ? &s->recvd[src][dst] : &s->sent[src][dst],
                      .need = k->seq};
  ncclResult_t r = fk_wait(c, p2p_matched, &a);
  if (r != ncclSuccess) return r;
  int64_t ts = s->send_ns[k->seq % FK_TS_RING][src][dst], tr = s->recv_ns[k->seq % FK_TS_RING][src][dst];
  uint64_t bytes = k->count * fk_dtype_size((ncclDataType_t)k->dtype);
  k->ready_ns = ts > tr ? ts : tr;
  k->deadline_ns = k->ready_ns + fk_model_ns(c, k->op, bytes, peer);
  k->stall_rank = -1;
  return ncclSuccess;
}

static void report(struct ncclComm *c, ncclResult_t r) {
  int ok = ncclSuccess;
  atomic_compare_exchange_strong(&c->dev_err, &ok, (int)r);
}

/* Calls of one batch overlap in time (one fused launch): the batch ends at the latest deadline. */
static void execute(struct fk_batch *b, int64_t arrival) {
  ncclResult_t res = b->failed ? ncclUnhandledCudaError : ncclSuccess;
  for (int i = 0; i < b->n && res == ncclSuccess; i++) post(&b->calls[i], arrival);
  struct fk_prof_batch *pb = res == ncclSuccess ? fk_prof_dev_begin(b->calls, b->n, arrival) : NULL;
  int64_t end = arrival;
  for (int i = 0; i < b->n && res == ncclSuccess; i++) {
    struct fk_call *k = &b->calls[i];
    res = k->op == FK_OP_SEND || k->op == FK_OP_RECV ? wait_p2p(k) : wait_coll(k);
    if (k->deadline_ns > end) end = k->deadline_ns;
  }
  if (res == ncclSuccess) res = wait_stalls(b, pb, &end);
  if (res == ncclSuccess) {
    fk_prof_dev_run(pb);
    fk_sleep_until(end);
  } else {
    for (int i = 0; i < b->n; i++) report(b->calls[i].comm, res);
    end = fk_now_ns(); /* ended now, in error */
  }
  fk_prof_dev_end(pb, res == ncclSuccess);
  b->end = end;
}

static void finish(struct fk_batch *b) {
  pthread_mutex_lock(&b->mu);
  b->done = 1;
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

void fk_batch_put(struct fk_batch *b) {
  if (atomic_fetch_sub(&b->mem, 1) != 1) return;
  for (int i = 0; i < b->nprev; i++)
    if (b->prev[i] != NULL) fk_batch_put(b->prev[i]);
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  free(b);
}

/* The device time the communicators' previous batches ended (each waited for; an aborted one
 * ends too, in error). */
static int64_t after_previous(struct fk_batch *b) {
  int64_t t = 0;
  for (int i = 0; i < b->nprev; i++) {
    struct fk_batch *p = b->prev[i];
    if (p == NULL) continue;
    pthread_mutex_lock(&p->mu);
    while (!p->done) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    if (p->end > t) t = p->end;
    b->prev[i] = NULL;
    fk_batch_put(p);
  }
  return t;
}

/* Each of the batch's streams reaches its part; the last one to arrive runs the batch, from the
 * latest of their device times (each part's start is written before its arrival is counted) and
 * of the ends of its communicators' previous batches. */
static void part_run(struct fakeGpuWork *w) {
  struct fk_batch *b = ((struct fk_part *)w)->b;
  if (atomic_fetch_add(&b->arrived, 1) + 1 == b->nparts) {
    int64_t arrival = after_previous(b);
    for (int p = 0; p < b->nparts; p++)
      if (b->parts[p].w.start_ns > arrival) arrival = b->parts[p].w.start_ns;
    execute(b, arrival);
    finish(b);
  } else {
    pthread_mutex_lock(&b->mu);
    while (!b->done) pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
  }
  w->end_ns = b->end;
}

static void part_release(struct fakeGpuWork *w) {
  struct fk_batch *b = ((struct fk_part *)w)->b;
  if (atomic_fetch_sub(&b->parts_left, 1) != 1) return;
  for (int i = 0; i < b->n; i++) fk_comm_unref(b->calls[i].comm);
  fk_batch_put(b);
}

/* The batch becomes the newest of each of its communicators, after the one it replaces. */
static void chain(struct fk_batch *b) {
  for (int i = 0; i < b->n; i++) {
    struct ncclComm *c = b->calls[i].comm;
    int seen = 0;
    for (int j = 0; j < i && !seen; j++) seen = b->calls[j].comm == c;
    if (seen) continue;
    b->prev[b->nprev++] = c->last; /* the comm's reference on it passes to this batch */
    c->last = b;
    atomic_fetch_add(&b->mem, 1);
  }
}

ncclResult_t fk_enqueue(const struct fk_call *calls, int n) {
  size_t bytes = sizeof(struct fk_batch) +
                 (size_t)n * (sizeof(struct fk_call) + sizeof(struct fk_part) + sizeof(struct fk_batch *));
  struct fk_batch *b = calloc(1, bytes);
  if (b == NULL) return ncclSystemError;
  memcpy(b->calls, calls, (size_t)n * sizeof *calls);
  b->n = n;
  fk_prof_launch(b->calls, n); /* before the device may run it: its events parent the device's */
  b->parts = (struct fk_part *)(b->calls + n);
  b->prev = (struct fk_batch **)(b->parts + n);
  for (int i = 0; i < n; i++) {
    int seen = 0;
    for (int p = 0; p < b->nparts && !seen; p++) seen = b->parts[p].w.stream == (void *)calls[i].stream;
    if (seen) continue;
    b->parts[b->nparts] = (struct fk_part){.w = {.run = part_run, .release = part_release,
                                                 .stream = (void *)calls[i].stream},
                                           .b = b};
    b->nparts++;
  }
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->cv, NULL);
  atomic_init(&b->parts_left, b->nparts);
  atomic_init(&b->mem, 1);
  for (int i = 0; i < n; i++) atomic_fetch_add(&calls[i].comm->refs, 1);
  chain(b);
  /* Once its last part is queued the device may run the batch and let go of it: nothing of the
   * batch is read after a launch but what the launcher still owns (the parts not yet queued). */
  int nparts = b->nparts, launched = 0;
  cudaError_t err = cudaSuccess;
  for (; launched < nparts; launched++)
    if ((err = fakeGpuLaunch((cudaStream_t)b->parts[launched].w.stream, &b->parts[launched].w)) != cudaSuccess)
      break;
  if (launched == nparts) return ncclSuccess;
  fk_log("launch failed: cuda error %d, part %d of %d", (int)err, launched, nparts);
  /* The parts not queued arrive here, failed: the batch ends without running (and without
   * waiting for the communicators' earlier work: this is the host thread), in error. The batch
   * lives on: those parts still hold their references. */
  b->failed = 1;
  for (int p = launched; p < nparts; p++) {
    if (atomic_fetch_add(&b->arrived, 1) + 1 == nparts) {
      execute(b, fk_now_ns());
      finish(b);
    }
  }
  for (int p = launched; p < nparts; p++) part_release(&b->parts[p].w);
  return ncclUnhandledCudaError;
}
