/*
 * Validation support (GREYHOUND's pause path). The agent raises pause_request; the next training
 * thread that reaches an NCCL data-path call at depth 0 parks here, acknowledges, and runs the
 * agent's benchmark requests (bench.c) in that thread with the job's own communicators, until the
 * request is lowered. Other threads arriving meanwhile wait without acknowledging. Nothing
 * re-initialises.
 *
 * A pause is a lease, so that no agent or validator can park a job for good by dying (or by
 * never resuming): the request carries a CLOCK_MONOTONIC deadline (pause_lease_ns; 0 takes the
 * default lease, GREYHOUND_PAUSE_LEASE_MS, from the moment the hook first sees the request, and
 * the hook writes that deadline back), brought in to GH_PAUSE_LEASE_MAX_MS if it lies further
 * out. The agent may renew it by writing a later one. When it passes, the hook ends the pause
 * itself: it lowers pause_request, counts lease_expired and lets training go on. A targeted pause
 * whose call never comes expires the same way, so a stale request cannot keep every call on the
 * slow path either. No benchmark wait outlasts the lease, and requests still queued when a pause
 * ends (resumed or expired) end FAILED: they belonged to that pause.
 *
 * A pause never outlasts a share of the job's collective timeout either. The framework stamps a
 * collective before the call the hook parks in (PyTorch's ProcessGroupNCCL: the work object is
 * made first, and its watchdog aborts the communicator, with TORCH_NCCL_ASYNC_ERROR_HANDLING the
 * process, once the process group's timeout passes before the GPU completes it), so the pause
 * counts toward that timeout. The rank reports it (GREYHOUND_PG_TIMEOUT_S, or the framework
 * integration writes job_timeout_ms); a pause then ends at most 1/GH_PAUSE_TIMEOUT_SHARE of it
 * after the thread parked (pause_cap_ms; counted in pause_shortened), whatever lease was asked.
 *
 * Where a rank parks: at the entry of a data-path call, or at an outermost group boundary (the
 * start of a group, or right after the outermost ncclGroupEnd of a group that reached a targeted
 * pause's communicator: wrap_p2p.c), never inside a group.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gh_hook.h"

#define NAP_NS 200000L

static int pause_owner;

/* The longest this pause may hold the job, from the newest report of its collective timeout
 * (the environment, else what the integration wrote), published in pause_cap_ms; UINT64_MAX when
 * the timeout is unknown (the lease and GH_PAUSE_LEASE_MAX_MS alone bound it). */
static uint64_t cap_ns(void) {
  uint32_t reported = gh_env_timeout_ms();
  if (reported > 0) __atomic_store_n(&gh_ctl->job_timeout_ms, reported, __ATOMIC_RELAXED);
  uint32_t t = __atomic_load_n(&gh_ctl->job_timeout_ms, __ATOMIC_RELAXED);
  uint32_t cap = t / GH_PAUSE_TIMEOUT_SHARE;
  __atomic_store_n(&gh_ctl->pause_cap_ms, cap, __ATOMIC_RELAXED);
  return t > 0 ? (uint64_t)cap * 1000000ull : UINT64_MAX;
}

/* The cap ran out before the lease: end the request, as an expired lease does, counted apart. */
static void end_capped(void) {
  uint32_t one = 1;
  if (__atomic_compare_exchange_n(&gh_ctl->pause_request, &one, 0u, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
    __atomic_fetch_add(&gh_ctl->pause_shortened, 1, __ATOMIC_RELAXED);
}

static uint64_t default_lease_ns(void) {
  static uint64_t ns;
  uint64_t v = __atomic_load_n(&ns, __ATOMIC_RELAXED);
  if (v == 0) {
    const char *e = getenv("GREYHOUND_PAUSE_LEASE_MS");
    long ms = e != NULL ? strtol(e, NULL, 10) : 0;
    if (ms <= 0 || ms > GH_PAUSE_LEASE_MAX_MS) ms = GH_PAUSE_LEASE_DEFAULT_MS;
    v = (uint64_t)ms * 1000000ull;
    __atomic_store_n(&ns, v, __ATOMIC_RELAXED);
  }
  return v;
}

/* The request's deadline, fixed the first time the hook sees it: 0 becomes now + the default,
 * one beyond now + the maximum is brought in. A CAS, so that a renewal the agent writes
 * meanwhile wins. */
static uint64_t lease_deadline(uint64_t now) {
  uint64_t lease = __atomic_load_n(&gh_ctl->pause_lease_ns, __ATOMIC_ACQUIRE);
  uint64_t cap = now + (uint64_t)GH_PAUSE_LEASE_MAX_MS * 1000000ull;
  for (int tries = 0; tries < 4 && (lease == 0 || lease > cap); tries++) {
    uint64_t want = lease == 0 ? now + default_lease_ns() : cap;
    if (__atomic_compare_exchange_n(&gh_ctl->pause_lease_ns, &lease, want, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      lease = want;
  }
  return lease;
}

/* The lease ran out: end the request. The deadline is cleared first, by CAS, so that a renewal
 * written meanwhile keeps the pause (returns 0: look again). A new request stored in the few
 * instructions between the two CAS is lost; its requester sees the rank not park. */
static int end_expired(uint64_t lease) {
  if (!__atomic_compare_exchange_n(&gh_ctl->pause_lease_ns, &lease, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
    return 0;
  uint32_t one = 1;
  if (__atomic_compare_exchange_n(&gh_ctl->pause_request, &one, 0u, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
    __atomic_fetch_add(&gh_ctl->lease_expired, 1, __ATOMIC_RELAXED);
  return 1;
}

/* 1 while a pause is requested and its lease runs (its deadline in *deadline); an expired
 * request is ended here. */
static int pause_live(uint64_t *deadline) {
  for (int tries = 0; tries < 4; tries++) {
    if (__atomic_load_n(&gh_ctl->pause_request, __ATOMIC_ACQUIRE) == 0) return 0;
    uint64_t now = gh_now_ns(), lease = lease_deadline(now);
    if (now < lease) {
      *deadline = lease;
      return 1;
    }
    if (end_expired(lease)) return 0;
  }
  return 0; /* the agent rewrote the lease four times meanwhile: do not park on a moving target */
}

/* Run the submitted requests addressed to this rank, lowest request id first, while the lease
 * lasts. */
static void run_requests(uint64_t deadline) {
  while (gh_now_ns() < deadline) {
    struct gh_bench_slot *next = NULL;
    for (int i = 0; i < GH_BENCH_SLOTS; i++) {
      struct gh_bench_slot *s = &gh_ctl->slots[i];
      if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == GH_BENCH_SUBMITTED &&
          (next == NULL || s->req_id < next->req_id))
        next = s;
    }
    if (next == NULL) return;
    __atomic_store_n(&next->state, GH_BENCH_RUNNING, __ATOMIC_RELEASE);
    gh_bench_run(next, deadline);
  }
}

/* Requests left when the pause ends were meant for it; a later pause must not run them. */
static void cancel_queued(void) {
  for (int i = 0; i < GH_BENCH_SLOTS; i++) {
    struct gh_bench_slot *s = &gh_ctl->slots[i];
    if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == GH_BENCH_SUBMITTED) gh_bench_cancel(s);
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

static void park(int me, uint64_t deadline) {
  uint64_t cap = cap_ns(), t0 = gh_now_ns();
  uint64_t cap_end = cap > UINT64_MAX - t0 ? UINT64_MAX : t0 + cap;
  gh_ctl->paused_tid = me;
  __atomic_fetch_add(&gh_ctl->pause_count, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_ctl->paused, 1u, __ATOMIC_RELEASE);
  /* Thread-local capture mode: a graph another thread captures must not make our event queries
   * illegal, nor be invalidated by them. */
  int mode = gh_cuda_ready() ? gh_cuda_thread_local() : -1;
  struct timespec nap = {0, NAP_NS};
  uint64_t used = deadline;
  int live;
  do {
    used = deadline;
    run_requests(deadline < cap_end ? deadline : cap_end);
    nanosleep(&nap, NULL);
    live = pause_live(&deadline);
    if (live && gh_now_ns() >= cap_end) {
      used = deadline;
      end_capped();
      live = 0;
    }
  } while (live);
  cancel_queued();
  gh_bench_release(); /* training does not keep the benchmarks' memory or communicators */
  /* Resumed before the lease ran out: clear the deadline this pause used, unless the agent has
   * already written the next one. */
  __atomic_compare_exchange_n(&gh_ctl->pause_lease_ns, &used, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
  if (mode >= 0) gh_cuda_restore_mode(mode);
  __atomic_store_n(&gh_ctl->paused, 0u, __ATOMIC_RELEASE);
  __atomic_store_n(&pause_owner, 0, __ATOMIC_RELEASE);
}

/* Park here while a pause stands whose target this point meets (`reached`: known by the caller,
 * after a group; else the data-path call on `comm`). */
static void pause_at(ncclComm_t comm, int reached) {
  int saved = errno;
  int me = 0;
  struct timespec nap = {0, NAP_NS};
  uint64_t deadline;
  while (pause_live(&deadline) && (reached || at_target(comm))) {
    int expect = 0;
    if (me == 0) me = (int)syscall(SYS_gettid);
    if (__atomic_compare_exchange_n(&pause_owner, &expect, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
      park(me, deadline);
      break;
    }
    /* Another thread is parked: wait for it to leave (at the latest when the lease ends), then
     * look again, since a new request may stand by then. */
    while (__atomic_load_n(&pause_owner, __ATOMIC_ACQUIRE) != 0) nanosleep(&nap, NULL);
  }
  errno = saved;
}

void gh_pause_point_slow(ncclComm_t comm) { pause_at(comm, 0); }

int gh_pause_group_target_reached(void) {
  uint64_t want = __atomic_load_n(&gh_ctl->pause_comm_id, __ATOMIC_ACQUIRE);
  return want == 0 || gh_marks_group_reached(want, __atomic_load_n(&gh_ctl->pause_seq, __ATOMIC_ACQUIRE));
}

void gh_pause_after_group(int reached) {
  if (reached) pause_at(NULL, 1);
}
