/*
 * Profile mode: CUDA start/end events around each call, completed off the training thread by the
 * poller (poller.c). Events come from a pool created once, in the first profiled call's thread (so
 * they belong to its device); a claim that finds its slot busy drops the timing and counts it. The
 * poller queries only the oldest pending end event of each stream, converts event times to
 * CLOCK_MONOTONIC through an anchor event recorded on a private idle stream (re-anchored every
 * ANCHOR_NS, float32 ms stays precise within that), and or-s GH_F_GPU_DONE into the record. The
 * start event is reached when the stream reaches the call (the rank's GPU arrival at it), the end
 * event when the call completed on the GPU.
 *
 * The anchor maps the GPU's clock to the host's, and every GPU time the job's ranks compare across
 * nodes rests on it: its host time is bracketed, read before the record and after the
 * synchronisation returns (the event was reached in between), and taken as the middle, so a
 * late wake-up of the synchronising thread widens the bracket instead of shifting the anchor; a
 * wide one is taken again. An event record that fails (start or end) leaves that event's old
 * time in place: the record is then GPU_LOST, never given the times of an earlier call.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "hot.h"

#define POOL 1024u
#define ANCHORS 4u
#define ANCHOR_NS 10000000000ull
#define ANCHOR_TRIES 4
#define ANCHOR_GOOD_NS 200000ull /* a bracket this narrow is taken at once */
#define MAX_GROUP 256
#define CUDA_NOT_READY 600

enum { S_FREE = 0, S_STARTED = 1, S_ENDED = 2, S_ATTACHED = 4, S_GONE = 8, S_FAILED = 16 };
enum { P_UNTRIED = 0, P_READY = 1, P_NONE = 2 };

typedef gh_cuda_event cuda_event;

struct slot {
  cuda_event start, end;
  cudaStream_t stream;
  uint64_t record;
  struct gh_comm_entry *entry;
  uint32_t anchor_gen;
  uint32_t state;
};

static struct slot pool[POOL];
static uint64_t claim_next, poll_next;
static int prof_state; /* P_* */
static pthread_mutex_t prof_lock = PTHREAD_MUTEX_INITIALIZER;
static cuda_event anchor_ev[ANCHORS];
static uint64_t anchor_ns[ANCHORS];
static uint32_t anchor_gen;
static cudaStream_t anchor_stream;
static uint64_t last_anchor_ns;
static GH_TLS uint32_t group_slots[MAX_GROUP];
static GH_TLS int group_n;

static int take_anchor(void) {
  uint32_t g = (anchor_gen + 1) % ANCHORS;
  uint64_t before = 0, after = 0;
  for (int i = 0; i < ANCHOR_TRIES && (i == 0 || after - before > ANCHOR_GOOD_NS); i++) {
    before = gh_now_ns();
    if (gh_cu.ev_record(anchor_ev[g], anchor_stream) != 0 || gh_cu.ev_sync(anchor_ev[g]) != 0) return 0;
    after = gh_now_ns();
  }
  anchor_ns[g] = before + (after - before) / 2;
  __atomic_store_n(&anchor_gen, anchor_gen + 1, __ATOMIC_RELEASE);
  return 1;
}

/* GPU times are computed first (CUDA calls), then written by gh_ring_gpu_complete, which keeps
 * them out of the slot if the reader gave up on this record and a writer recycled it. */
static void complete(struct slot *s, uint32_t extra_flags) {
  uint32_t flags = extra_flags;
  uint32_t gen = s->anchor_gen;
  float ms0 = 0, ms1 = 0;
  uint64_t start = 0, end = 0;
  if (extra_flags == 0 && s->record != UINT64_MAX && anchor_gen - gen < ANCHORS - 1 &&
      gh_cu.ev_elapsed(&ms0, anchor_ev[gen % ANCHORS], s->start) == 0 &&
      gh_cu.ev_elapsed(&ms1, anchor_ev[gen % ANCHORS], s->end) == 0) {
    uint64_t base = anchor_ns[gen % ANCHORS];
    start = base + (uint64_t)((double)ms0 * 1e6);
    end = base + (uint64_t)((double)ms1 * 1e6);
    flags = GH_F_GPU_DONE;
  } else if (flags == 0) {
    flags = GH_F_GPU_LOST;
  }
  gh_ring_gpu_complete(s->record, start, end, flags);
  __atomic_store_n(&s->state, S_FREE, __ATOMIC_RELEASE);
}

/* One pass: per stream, stop at its first not-ready end event. */
static void poll_once(void) {
  cudaStream_t blocked[32];
  int nblocked = 0;
  uint64_t end = __atomic_load_n(&claim_next, __ATOMIC_ACQUIRE);
  for (uint64_t i = poll_next; i < end; i++) {
    struct slot *s = &pool[i % POOL];
    uint32_t st = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
    if (st == S_FREE) continue;
    /* A slot only just claimed may not have its stream yet: read atomically, a stale stream
     * (the slot's previous call's) blocks the wrong stream for this one pass, nothing worse. */
    cudaStream_t stream = __atomic_load_n(&s->stream, __ATOMIC_RELAXED);
    int is_blocked = 0;
    for (int b = 0; b < nblocked; b++) is_blocked |= blocked[b] == stream;
    if (is_blocked) continue;
    if ((st & (S_ENDED | S_ATTACHED)) != (S_ENDED | S_ATTACHED)) {
      if (nblocked < 32) blocked[nblocked++] = stream;
      continue;
    }
    if (st & S_FAILED) { /* an event was not recorded: its time is an earlier call's */
      complete(s, (st & S_GONE ? GH_F_ABORTED : 0) | GH_F_GPU_LOST);
      continue;
    }
    int q = gh_cu.ev_query(s->end);
    if (q == 0) complete(s, 0);
    else if (st & S_GONE) complete(s, GH_F_ABORTED | GH_F_GPU_LOST);
    else if (q == CUDA_NOT_READY && nblocked < 32) blocked[nblocked++] = stream;
    else if (q != CUDA_NOT_READY) complete(s, GH_F_GPU_LOST);
  }
  while (poll_next < end && __atomic_load_n(&pool[poll_next % POOL].state, __ATOMIC_ACQUIRE) == S_FREE)
    poll_next++;
}

/* Called by the poller thread. */
void gh_profile_poll(void) {
  if (__atomic_load_n(&prof_state, __ATOMIC_ACQUIRE) != P_READY) return;
  if (gh_now_ns() - last_anchor_ns > ANCHOR_NS && take_anchor()) last_anchor_ns = gh_now_ns();
  poll_once();
}

/* Runs in a training thread. Thread-local capture mode: a graph captured meanwhile by another
 * thread must not make our event synchronisation an illegal call (nor be invalidated by it). */
static int setup(cudaStream_t stream) {
  int mode = gh_cuda_thread_local();
  int ok = 0;
  if (gh_private_stream(&anchor_stream) != 0) goto out;
  for (unsigned i = 0; i < ANCHORS; i++)
    if (gh_cu.ev_create(&anchor_ev[i], 0) != 0) goto out;
  for (unsigned i = 0; i < POOL; i++)
    if (gh_cu.ev_create(&pool[i].start, 0) != 0 || gh_cu.ev_create(&pool[i].end, 0) != 0) goto out;
  anchor_gen = ANCHORS - 1;
  if (!take_anchor()) goto out;
  last_anchor_ns = gh_now_ns();
  ok = gh_poller_want(stream);
out:
  gh_cuda_restore_mode(mode);
  return ok;
}

/* The pool only at the first call on a stream that is not capturing: creating it is no business
 * of a graph being captured. */
static int ready(cudaStream_t stream, int *capturing) {
  int st = __atomic_load_n(&prof_state, __ATOMIC_ACQUIRE);
  if (st == P_NONE) return 0;
  if (GH_UNLIKELY(!gh_cuda_ready())) {
    __atomic_store_n(&prof_state, P_NONE, __ATOMIC_RELEASE);
    return 0;
  }
  *capturing = gh_cuda_capturing(stream);
  if (*capturing || st == P_READY) return 1;
  pthread_mutex_lock(&prof_lock);
  if (prof_state == P_UNTRIED) __atomic_store_n(&prof_state, setup(stream) ? P_READY : P_NONE, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&prof_lock);
  return __atomic_load_n(&prof_state, __ATOMIC_ACQUIRE) == P_READY;
}

int gh_profile_enter(cudaStream_t stream) {
  struct gh_control *ctl = gh_ctl;
  if (ctl == NULL || __atomic_load_n(&ctl->mode, __ATOMIC_RELAXED) != GH_MODE_PROFILE) return 0;
  int saved = errno, capturing = 0, res = 0;
  if (!ready(stream, &capturing)) goto out;
  res = -1; /* capturing: an event recorded now would become a graph node, not a timing */
  if (capturing) goto out;
  res = 0;
  uint64_t n = __atomic_fetch_add(&claim_next, 1, __ATOMIC_ACQ_REL);
  struct slot *s = &pool[n % POOL];
  uint32_t expect = S_FREE;
  if (!__atomic_compare_exchange_n(&s->state, &expect, S_STARTED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    if (gh_hdr != NULL) __atomic_fetch_add(&gh_hdr->gpu_dropped, 1, __ATOMIC_RELAXED);
    goto out;
  }
  __atomic_store_n(&s->stream, stream, __ATOMIC_RELAXED);
  s->record = UINT64_MAX;
  s->entry = NULL;
  s->anchor_gen = __atomic_load_n(&anchor_gen, __ATOMIC_ACQUIRE);
  if (gh_cu.ev_record(s->start, stream) != 0) __atomic_fetch_or(&s->state, S_FAILED, __ATOMIC_RELEASE);
  uint32_t slot = (uint32_t)(n % POOL);
  res = (int)slot + 1;
  if (gh_thr.group_depth > 0 && group_n < MAX_GROUP) group_slots[group_n++] = slot;
  else if (gh_thr.group_depth > 0) gh_profile_end(slot, ncclSuccess); /* group too large: end at issue */
out:
  errno = saved;
  return res;
}

uint32_t gh_profile_exit(int profiled, ncclResult_t res) {
  if (profiled < 0) return GH_F_CAPTURED;
  if (gh_thr.group_depth == 0) {
    int saved = errno;
    gh_profile_end((uint32_t)profiled - 1, res);
    errno = saved;
  }
  return GH_F_PROFILED;
}

/* The end event goes behind the call's work. A call (or group) that failed enqueued nothing, and
 * one in progress on a non-blocking communicator is not on its stream yet: an end event recorded
 * now would time nothing (or less than the call), so the record ends GPU_LOST instead. */
void gh_profile_end(uint32_t slot, ncclResult_t res) {
  struct slot *s = &pool[slot];
  uint32_t st = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
  if (st & S_ENDED) return;
  uint32_t failed = (st & S_FAILED) || res != ncclSuccess || gh_cu.ev_record(s->end, s->stream) != 0
                        ? S_FAILED
                        : 0u;
  __atomic_fetch_or(&s->state, S_ENDED | failed, __ATOMIC_RELEASE);
}

void gh_profile_attach(uint32_t slot, uint64_t record_index, struct gh_comm_entry *e) {
  struct slot *s = &pool[slot];
  s->record = record_index;
  s->entry = e;
  __atomic_fetch_or(&s->state, S_ATTACHED, __ATOMIC_RELEASE);
}

void gh_profile_group_end(ncclResult_t res) {
  int saved = errno;
  for (int i = 0; i < group_n; i++) gh_profile_end(group_slots[i], res);
  group_n = 0;
  errno = saved;
}

void gh_profile_comm_gone(struct gh_comm_entry *e) {
  if (__atomic_load_n(&prof_state, __ATOMIC_ACQUIRE) != P_READY) return;
  for (unsigned i = 0; i < POOL; i++)
    if (__atomic_load_n(&pool[i].state, __ATOMIC_ACQUIRE) != S_FREE && pool[i].entry == e)
      __atomic_fetch_or(&pool[i].state, S_GONE, __ATOMIC_RELEASE);
}

void gh_profile_fork_child(void) {
  prof_state = P_NONE; /* the poller thread did not survive the fork */
  pthread_mutex_init(&prof_lock, NULL);
  gh_poller_fork_child();
  gh_cuda_fork_child();
}
