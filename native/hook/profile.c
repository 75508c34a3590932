/*
 * Profile mode: CUDA start/end events around each call, completed off the training thread.
 * CUDA is resolved from the process (never linked). Events come from a pool created once, in the
 * first profiled call's thread (so they belong to its device); a claim that finds its slot busy
 * drops the timing and counts it. The poller queries only the oldest pending end event of each
 * stream, converts event times to CLOCK_MONOTONIC through an anchor event recorded on a private
 * idle stream (re-anchored every ANCHOR_NS, float32 ms stays precise within that), and or-s
 * GH_F_GPU_DONE into the record.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "hot.h"

#define POOL 1024u
#define ANCHORS 4u
#define ANCHOR_NS 10000000000ull
#define MAX_GROUP 256
#define CUDA_NOT_READY 600

enum { S_FREE = 0, S_STARTED = 1, S_ENDED = 2, S_ATTACHED = 4, S_GONE = 8 };

typedef void *cuda_event;
typedef int (*ev_create_fn)(cuda_event *, unsigned);
typedef int (*ev_record_fn)(cuda_event, cudaStream_t);
typedef int (*ev_query_fn)(cuda_event);
typedef int (*ev_elapsed_fn)(float *, cuda_event, cuda_event);
typedef int (*is_capturing_fn)(cudaStream_t, int *);
typedef int (*capture_mode_fn)(int *);
typedef int (*int_fn)(int);
typedef int (*intp_fn)(int *);

static struct {
  ev_create_fn ev_create;
  ev_record_fn ev_record;
  ev_query_fn ev_query, ev_sync;
  ev_elapsed_fn ev_elapsed;
  is_capturing_fn is_capturing;
  capture_mode_fn capture_mode;
  int_fn set_device;
  intp_fn get_device;
} cu;

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
static int prof_state; /* P_* below */
static pthread_mutex_t prof_lock = PTHREAD_MUTEX_INITIALIZER;
static cuda_event anchor_ev[ANCHORS];
static uint64_t anchor_ns[ANCHORS];
static uint32_t anchor_gen;
static cudaStream_t anchor_stream;
static int device = -1;
static GH_TLS uint32_t group_slots[MAX_GROUP];
static GH_TLS int group_n;

void *gh_cuda_sym(const char *name) {
  static const char *const sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL};
  return gh_find_library_symbol("libcudart", sonames, name);
}

int gh_private_stream(cudaStream_t *out) {
  typedef int (*flags_fn)(cudaStream_t *, unsigned);
  typedef int (*plain_fn)(cudaStream_t *);
  flags_fn with_flags = (flags_fn)gh_cuda_sym("cudaStreamCreateWithFlags");
  if (with_flags != NULL) return with_flags(out, 1 /* cudaStreamNonBlocking */);
  plain_fn plain = (plain_fn)gh_cuda_sym("cudaStreamCreate");
  return plain != NULL ? plain(out) : -1;
}

static int take_anchor(void) {
  uint32_t g = (anchor_gen + 1) % ANCHORS;
  if (cu.ev_record(anchor_ev[g], anchor_stream) != 0 || cu.ev_sync(anchor_ev[g]) != 0) return 0;
  anchor_ns[g] = gh_now_ns();
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
      cu.ev_elapsed(&ms0, anchor_ev[gen % ANCHORS], s->start) == 0 &&
      cu.ev_elapsed(&ms1, anchor_ev[gen % ANCHORS], s->end) == 0) {
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
    int is_blocked = 0;
    for (int b = 0; b < nblocked; b++) is_blocked |= blocked[b] == s->stream;
    if (is_blocked) continue;
    if ((st & (S_ENDED | S_ATTACHED)) != (S_ENDED | S_ATTACHED)) {
      if (nblocked < 32) blocked[nblocked++] = s->stream;
      continue;
    }
    int q = cu.ev_query(s->end);
    if (q == 0) complete(s, 0);
    else if (st & S_GONE) complete(s, GH_F_ABORTED | GH_F_GPU_LOST);
    else if (q == CUDA_NOT_READY && nblocked < 32) blocked[nblocked++] = s->stream;
    else if (q != CUDA_NOT_READY) complete(s, GH_F_GPU_LOST);
  }
  while (poll_next < end && __atomic_load_n(&pool[poll_next % POOL].state, __ATOMIC_ACQUIRE) == S_FREE)
    poll_next++;
}

static void *poller(void *arg) {
  (void)arg;
  if (device >= 0 && cu.set_device != NULL) cu.set_device(device);
  int mode = 1; /* cudaStreamCaptureModeThreadLocal: our queries must not break others' captures */
  if (cu.capture_mode != NULL) cu.capture_mode(&mode);
  uint64_t last_anchor = gh_now_ns();
  for (;;) {
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
    if (gh_now_ns() - last_anchor > ANCHOR_NS && take_anchor()) last_anchor = gh_now_ns();
    poll_once();
  }
  return NULL;
}

static int resolve_cuda(void) {
#define GH_CU(field, name) ((cu.field = (__typeof__(cu.field))gh_cuda_sym(name)) != NULL)
  int ok = GH_CU(ev_create, "cudaEventCreateWithFlags") && GH_CU(ev_record, "cudaEventRecord") &&
           GH_CU(ev_query, "cudaEventQuery") && GH_CU(ev_sync, "cudaEventSynchronize") &&
           GH_CU(ev_elapsed, "cudaEventElapsedTime");
  (void)GH_CU(is_capturing, "cudaStreamIsCapturing");
  (void)GH_CU(capture_mode, "cudaThreadExchangeStreamCaptureMode");
  (void)GH_CU(set_device, "cudaSetDevice");
  (void)GH_CU(get_device, "cudaGetDevice");
#undef GH_CU
  return ok;
}

/* Runs in a training thread. Thread-local capture mode: a graph captured meanwhile by another
 * thread must not make our event synchronisation an illegal call (nor be invalidated by it). */
static int setup(void) {
  int mode = 1; /* cudaStreamCaptureModeThreadLocal */
  if (cu.capture_mode != NULL) cu.capture_mode(&mode);
  int ok = 0;
  if (cu.get_device != NULL) cu.get_device(&device);
  if (gh_private_stream(&anchor_stream) != 0) goto out;
  for (unsigned i = 0; i < ANCHORS; i++)
    if (cu.ev_create(&anchor_ev[i], 0) != 0) goto out;
  for (unsigned i = 0; i < POOL; i++)
    if (cu.ev_create(&pool[i].start, 0) != 0 || cu.ev_create(&pool[i].end, 0) != 0) goto out;
  anchor_gen = ANCHORS - 1;
  if (!take_anchor()) goto out;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  ok = pthread_create(&t, &attr, poller, NULL) == 0;
  pthread_attr_destroy(&attr);
out:
  if (cu.capture_mode != NULL) cu.capture_mode(&mode);
  return ok;
}

enum { P_UNTRIED = 0, P_READY = 1, P_NONE = 2, P_RESOLVED = 3 };

/* Symbols first, the pool and poller only at the first call on a stream that is not capturing:
 * creating them is no business of a graph being captured. */
static int ready(cudaStream_t stream, int *capturing) {
  int st = __atomic_load_n(&prof_state, __ATOMIC_ACQUIRE);
  if (GH_UNLIKELY(st == P_UNTRIED)) {
    pthread_mutex_lock(&prof_lock);
    if (prof_state == P_UNTRIED) __atomic_store_n(&prof_state, resolve_cuda() ? P_RESOLVED : P_NONE, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&prof_lock);
    st = __atomic_load_n(&prof_state, __ATOMIC_ACQUIRE);
  }
  if (st == P_NONE) return 0;
  int cap = 0;
  *capturing = cu.is_capturing != NULL && cu.is_capturing(stream, &cap) == 0 && cap != 0;
  if (*capturing || st == P_READY) return 1;
  pthread_mutex_lock(&prof_lock);
  if (prof_state == P_RESOLVED) __atomic_store_n(&prof_state, setup() ? P_READY : P_NONE, __ATOMIC_RELEASE);
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
  s->stream = stream;
  s->record = UINT64_MAX;
  s->entry = NULL;
  s->anchor_gen = __atomic_load_n(&anchor_gen, __ATOMIC_ACQUIRE);
  cu.ev_record(s->start, stream);
  uint32_t slot = (uint32_t)(n % POOL);
  res = (int)slot + 1;
  if (gh_group_depth > 0 && group_n < MAX_GROUP) group_slots[group_n++] = slot;
  else if (gh_group_depth > 0) gh_profile_end(slot); /* group too large: end at issue */
out:
  errno = saved;
  return res;
}

uint32_t gh_profile_exit(int profiled) {
  if (profiled < 0) return GH_F_CAPTURED;
  if (gh_group_depth == 0) {
    int saved = errno;
    gh_profile_end((uint32_t)profiled - 1);
    errno = saved;
  }
  return GH_F_PROFILED;
}

void gh_profile_end(uint32_t slot) {
  struct slot *s = &pool[slot];
  if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) & S_ENDED) return;
  cu.ev_record(s->end, s->stream);
  __atomic_fetch_or(&s->state, S_ENDED, __ATOMIC_RELEASE);
}

void gh_profile_attach(uint32_t slot, uint64_t record_index, struct gh_comm_entry *e) {
  struct slot *s = &pool[slot];
  s->record = record_index;
  s->entry = e;
  __atomic_fetch_or(&s->state, S_ATTACHED, __ATOMIC_RELEASE);
}

void gh_profile_group_end(void) {
  int saved = errno;
  for (int i = 0; i < group_n; i++) gh_profile_end(group_slots[i]);
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
}
