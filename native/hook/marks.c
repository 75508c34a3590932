/*
 * GPU-side completion marks (monitor mode, always on; layout 3). NCCL calls return once their work
 * is enqueued, so the comm table's host counters say what was launched; these marks say what the
 * GPU finished. After each call (after the outermost ncclGroupEnd for calls inside a group) the
 * producer fills the next slot of its communicator's mark ring and records the slot's
 * pre-created cudaEventDisableTiming event on the call's stream (hot.h; the slow cases here).
 * The poller retires slots oldest first, stopping at the first event not yet reached, and
 * publishes into the comm entry: gpu_calls_done / gpu_seq_done, and the oldest call enqueued and
 * not done (gpu_pending_*), so a collective hung on the GPU shows even though no host thread is
 * inside NCCL.
 *
 * Calls without a mark (a stream capturing a CUDA graph, where an event record would become a
 * graph node; a full ring; events not created yet; a call that failed or is still in progress on
 * a non-blocking communicator) are published through a single-producer seqlock (lost_*): such a
 * call counts as done once every earlier mark of its communicator is done, and the enqueued ones
 * are counted in gpu_marks_lost. The ring's events are created by the poller (never on the hot
 * path), in its thread-local capture mode, on the communicator's device.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>

#include "hot.h"

#define NO_STREAM ((cudaStream_t)(uintptr_t)~(uintptr_t)0)
#define MAX_STREAMS 64

struct gh_marks gh_marks[GH_MAX_COMMS];

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
static cudaStream_t streams[MAX_STREAMS];
static int nstreams;

/* A call's mark, before it has a slot: inside a group, one per communicator, published at the
 * outermost ncclGroupEnd (NCCL launches nothing before). */
struct pending {
  struct gh_marks *m;
  cudaStream_t stream;
  uint64_t first, last, upto, count, enter_ns;
  uint32_t op, dtype, first_coll, ncoll;
  int32_t peer;
};
static GH_TLS struct pending group[GH_MAX_COMMS];
static GH_TLS int ngroup;

void gh_marks_lock(void) { pthread_mutex_lock(&lock); }
void gh_marks_unlock(void) { pthread_mutex_unlock(&lock); }

/* Lost calls: single producer, so a seqlock lets the poller read the three fields consistently.
 * Release stores of the fields (after the odd version) and acquire loads of them (before the
 * version is read again) order it without fences: a reader that sees a new field sees the odd
 * version after it. */
static void lost(struct gh_marks *m, const struct pending *p, int enqueued) {
  uint32_t v = __atomic_load_n(&m->lost_ver, __ATOMIC_RELAXED);
  __atomic_store_n(&m->lost_ver, v + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&m->lost_call, p->last, __ATOMIC_RELEASE);
  __atomic_store_n(&m->lost_seq, p->upto, __ATOMIC_RELEASE);
  if (enqueued) __atomic_store_n(&m->lost_n, m->lost_n + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&m->lost_ver, v + 2, __ATOMIC_RELEASE);
}

static int read_lost(struct gh_marks *m, uint64_t out[3]) {
  uint32_t v = __atomic_load_n(&m->lost_ver, __ATOMIC_ACQUIRE);
  if (v & 1) return 0;
  out[0] = __atomic_load_n(&m->lost_call, __ATOMIC_ACQUIRE);
  out[1] = __atomic_load_n(&m->lost_seq, __ATOMIC_ACQUIRE);
  out[2] = __atomic_load_n(&m->lost_n, __ATOMIC_ACQUIRE);
  return __atomic_load_n(&m->lost_ver, __ATOMIC_RELAXED) == v;
}

static void note_stream(cudaStream_t s) {
  pthread_mutex_lock(&streams_lock);
  int known = 0;
  for (int i = 0; i < nstreams && !known; i++) known = streams[i] == s;
  if (!known && nstreams < MAX_STREAMS) streams[nstreams++] = s;
  pthread_mutex_unlock(&streams_lock);
}

int gh_streams_seen(cudaStream_t *out, int max) {
  pthread_mutex_lock(&streams_lock);
  int n = nstreams < max ? nstreams : max;
  memcpy(out, streams, (size_t)n * sizeof *out);
  pthread_mutex_unlock(&streams_lock);
  return n;
}

/* A slot for the mark, or lost. `hint` says what the caller already knows about capture. */
static void publish(const struct pending *p, int hint) {
  struct gh_marks *m = p->m;
  if (!__atomic_load_n(&m->ready, __ATOMIC_ACQUIRE)) {
    if (gh_poller_want(p->stream)) lost(m, p, 1); /* events come soon; until then, lost */
    return;                                        /* no CUDA runtime: host-only, nothing counted */
  }
  uint64_t h = m->head;
  int capturing = hint == GH_MARK_CAPTURED || (hint == GH_MARK_CHECK && gh_cuda_capturing(p->stream));
  if (capturing || hint == GH_MARK_LOST || h - __atomic_load_n(&m->tail, __ATOMIC_ACQUIRE) >= GH_MARKS) {
    lost(m, p, 1);
    return;
  }
  struct gh_mark_slot *s = &m->slot[h & (GH_MARKS - 1)];
  s->first = p->first;
  s->upto = p->upto;
  s->count = p->count;
  s->enter_ns = p->enter_ns;
  s->shape = GH_MARK_SHAPE(p->last - p->first, p->ncoll);
  s->meta = GH_MARK_META(p->op, p->dtype, p->first_coll);
  s->peer = p->peer;
  if (gh_cu.ev_record(s->ev, p->stream) != 0) {
    lost(m, p, 1);
    return;
  }
  __atomic_store_n(&m->head, h + 1, __ATOMIC_RELEASE);
}

void gh_mark_slow(const struct gh_call *c, uint16_t op, ncclResult_t res, cudaStream_t stream,
                  uint64_t count, uint32_t dtype, int peer, int hint) {
  struct gh_marks *m = c->m;
  int saved = errno;
  if (stream != m->noted) {
    note_stream(stream);
    m->noted = stream;
  }
  /* The fast path's key: only a ring with events gets one (attach resets it). */
  if (__atomic_load_n(&m->ready, __ATOMIC_ACQUIRE)) m->stream = stream;
  uint32_t coll = !GH_IS_P2P(op);
  struct pending p = {.m = m, .stream = stream, .first = c->call_no, .last = c->call_no,
                      .upto = coll ? c->seq : __atomic_load_n(&c->e->last_seq_entered, __ATOMIC_RELAXED),
                      .count = count, .enter_ns = c->enter_ns, .op = op, .dtype = dtype,
                      .first_coll = coll, .ncoll = coll, .peer = peer};
  if (c->profiled < 0) hint = GH_MARK_CAPTURED; /* profile mode already asked */
  else if (c->profiled > 0 && hint == GH_MARK_CHECK) hint = GH_MARK_CLEAR;
  if (res != ncclSuccess) {
    /* A failed call enqueued nothing; an in-progress one (non-blocking communicator) is not on its
     * stream yet, so an event recorded now could complete before it. */
    lost(m, &p, res == ncclInProgress);
  } else if (gh_thr.group_depth > 0) {
    int i = 0;
    while (i < ngroup && group[i].m != m) i++;
    if (i == ngroup) group[ngroup++] = p; /* one entry per communicator: never more than the table */
    else {
      group[i].last = p.last;
      group[i].upto = p.upto;
      group[i].ncoll += p.ncoll;
    }
  } else {
    publish(&p, hint);
  }
  errno = saved;
}

/* A group that failed enqueued nothing, and one in progress (non-blocking communicators) is not
 * on its streams yet, so an event recorded now could complete before it: lost, as a single call
 * in that state is (gh_mark_slow). */
void gh_marks_group_end(ncclResult_t res) {
  if (ngroup == 0) return;
  int saved = errno;
  for (int i = 0; i < ngroup; i++) {
    if (res == ncclSuccess) publish(&group[i], GH_MARK_CHECK);
    else lost(group[i].m, &group[i], res == ncclInProgress);
  }
  ngroup = 0;
  errno = saved;
}

int gh_marks_group_reached(uint64_t comm_id, uint64_t seq) {
  for (int i = 0; i < ngroup; i++) {
    const struct pending *p = &group[i];
    if (p->ncoll > 0 && p->upto >= seq && gh_comms[p->m - gh_marks].comm_id == comm_id) return 1;
  }
  return 0;
}

void gh_marks_attach(int idx, int device) {
  struct gh_marks *m = &gh_marks[idx];
  /* A previous communicator's marks were dropped at its destroy; its events are reused unless
   * they belong to another device (the poller then makes new ones; no producer exists yet). */
  if (m->ev_device != device) __atomic_store_n(&m->ready, 0u, __ATOMIC_RELEASE);
  m->head = 0;
  m->tail = 0;
  m->stream = NO_STREAM;
  m->noted = NO_STREAM;
  m->lost_ver = 0;
  m->lost_call = m->lost_seq = m->lost_n = 0;
  m->done_call = m->done_seq = m->calls_done = m->seq_done = 0;
  memset(m->lost_seen, 0, sizeof m->lost_seen);
  memset(&m->shown, 0, sizeof m->shown);
  m->shown.peer = -1; /* the entry's gpu_pending_peer starts at -1 (reset) */
  m->device = device;
  m->active = 1;
}

void gh_marks_detach(int idx) {
  struct gh_marks *m = &gh_marks[idx];
  struct gh_comm_entry *e = &gh_comms[idx];
  m->active = 0;
  __atomic_store_n(&m->tail, __atomic_load_n(&m->head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  uint32_t v = gh_ver_begin(&e->gpu_ver);
  __atomic_store_n(&e->gpu_pending_ns, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_seq, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_op, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_dtype, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_count, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_peer, -1, __ATOMIC_RELAXED);
  gh_ver_end(&e->gpu_ver, v);
}

/* Poller, lock held. Events on the communicator's device (a ring reused by a communicator on
 * another device gets new ones). */
static int make_events(struct gh_marks *m) {
  if (m->failed) return 0;
  if (m->ev_device != m->device) {
    for (unsigned i = 0; i < GH_MARKS; i++) {
      if (m->slot[i].ev != NULL) gh_cu.ev_destroy(m->slot[i].ev);
      m->slot[i].ev = NULL;
    }
  }
  if (m->device >= 0 && gh_cu.set_device != NULL) gh_cu.set_device(m->device);
  for (unsigned i = 0; i < GH_MARKS; i++)
    if (m->slot[i].ev == NULL && gh_cu.ev_create(&m->slot[i].ev, GH_EVENT_DISABLE_TIMING) != 0) {
      m->slot[i].ev = NULL;
      m->failed = 1; /* no marks for this ring: its calls count as lost */
      return 0;
    }
  m->ev_device = m->device;
  return 1;
}

static void poll_ring(int idx) {
  struct gh_marks *m = &gh_marks[idx];
  struct gh_comm_entry *e = &gh_comms[idx];
  if (!__atomic_load_n(&m->ready, __ATOMIC_RELAXED)) {
    if (!make_events(m)) return;
    __atomic_store_n(&m->ready, 1u, __ATOMIC_RELEASE);
    uint32_t v = gh_ver_begin(&e->gpu_ver);
    __atomic_store_n(&e->gpu_marks, 1u, __ATOMIC_RELAXED);
    gh_ver_end(&e->gpu_ver, v);
  }
  uint64_t l[3];
  if (read_lost(m, l)) memcpy(m->lost_seen, l, sizeof l); /* else: mid-update, last pass's values */
  uint64_t head = __atomic_load_n(&m->head, __ATOMIC_ACQUIRE), t = m->tail;
  for (; t < head; t++) {
    struct gh_mark_slot *s = &m->slot[t & (GH_MARKS - 1)];
    if (gh_cu.ev_query(s->ev) == GH_CUDA_NOT_READY) break; /* an error cannot complete later */
    m->done_call = s->first + (uint32_t)s->shape;
    m->done_seq = s->upto;
  }
  __atomic_store_n(&m->tail, t, __ATOMIC_RELEASE);
  const struct gh_mark_slot *p = t < head ? &m->slot[t & (GH_MARKS - 1)] : NULL;
  uint64_t calls = m->done_call, seq = m->done_seq, pend_seq = 0;
  if (p != NULL) { /* calls before the oldest pending mark are done, lost ones included */
    calls = p->first - 1;
    seq = p->upto - (p->shape >> 32);
    pend_seq = (p->meta >> 16) & 1u ? seq + 1 : 0;
  } else if (m->lost_seen[0] > calls) {
    calls = m->lost_seen[0];
    seq = m->lost_seen[1];
  }
  if (calls > m->calls_done) m->calls_done = calls;
  if (seq > m->seq_done) m->seq_done = seq;
  struct gpu_fields now = {
      .calls = m->calls_done, .seq = m->seq_done, .lost = m->lost_seen[2], .pend_seq = pend_seq,
      .op = p != NULL ? p->meta & 0xffu : 0u, .dtype = p != NULL ? (p->meta >> 8) & 0xffu : 0u,
      .count = p != NULL ? p->count : 0, .pend_ns = p != NULL ? p->enter_ns : 0,
      .peer = p != NULL ? p->peer : -1};
  /* Published only when something changed: a seqlock bumped every pass would have a reader that
   * straddles a millisecond find the row changing under it every time. */
  if (memcmp(&now, &m->shown, sizeof now) == 0) return;
  m->shown = now;
  uint32_t v = gh_ver_begin(&e->gpu_ver);
  __atomic_store_n(&e->gpu_calls_done, now.calls, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_seq_done, now.seq, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_marks_lost, now.lost, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_seq, now.pend_seq, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_op, now.op, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_dtype, now.dtype, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_count, now.count, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_peer, now.peer, __ATOMIC_RELAXED);
  __atomic_store_n(&e->gpu_pending_ns, now.pend_ns, __ATOMIC_RELEASE);
  gh_ver_end(&e->gpu_ver, v);
}

void gh_marks_poll(void) {
  if (gh_comms == NULL) return;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < GH_MAX_COMMS; i++)
    if (gh_marks[i].active) poll_ring(i);
  pthread_mutex_unlock(&lock);
}
