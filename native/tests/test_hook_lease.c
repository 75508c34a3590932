/*
 * A pause is a lease: against the stub NCCL and the stub CUDA runtime, an "agent" thread pauses
 * the rank and then vanishes, and the hook resumes by itself when the lease ends (an explicit
 * deadline, the default lease from GREYHOUND_PAUSE_LEASE_MS, a renewed one, one far out brought
 * in to the maximum); a request whose lease has passed never parks; a targeted pause whose call
 * never comes stops costing the slow path; a second training thread waits no longer than the
 * lease; benchmark waits end at the lease; requests still queued when a pause ends are
 * cancelled; sizes beyond the bounds are refused; the scratch memory goes back at resume; the
 * job's collective timeout caps a pause; a targeted pause parks after a group.
 */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "nccl_abi.h"
#include "ring_view.h"

extern _Atomic uint64_t stub_cuda_tickets, stub_cuda_done;
extern _Atomic int stub_cuda_auto;
extern _Atomic long stub_cuda_live_allocs;
void stub_cuda_finish_all(void);

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#define MS 1000000ull

static struct ring_view v;
static ncclComm_t comm, comm2; /* NCCL allows one thread at a time per communicator */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms) { usleep(ms * 1000u); }

/* One collective on a training thread; returns when it came back (CLOCK_MONOTONIC ns). */
static uint64_t returned_at(ncclComm_t c) {
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, c, NULL) == ncclSuccess);
  return now_ns();
}

static uint64_t call_returned_at(void) { return returned_at(comm); }

/* A coalesced reduce-scatter (nested groups, as Megatron's coalescing manager opens them) on one
 * communicator; returns when the outermost ncclGroupEnd came back. */
static uint64_t grouped_returned_at(ncclComm_t c) {
  ncclGroupStart();
  ncclGroupStart();
  ncclReduceScatter(NULL, NULL, 8, ncclFloat32, ncclSum, c, NULL);
  ncclReduceScatter(NULL, NULL, 8, ncclFloat32, ncclSum, c, NULL);
  ncclGroupEnd();
  ncclGroupEnd();
  return now_ns();
}

static uint64_t timed_call(void) {
  uint64_t t0 = now_ns();
  return call_returned_at() - t0;
}

static void request_pause(uint64_t lease_ns, uint64_t comm_id, uint64_t seq) {
  STORE(v.ctl->pause_comm_id, comm_id);
  STORE(v.ctl->pause_seq, seq);
  STORE(v.ctl->pause_lease_ns, lease_ns);
  STORE(v.ctl->pause_request, 1u);
}

static void submit(int slot, uint64_t req_id, uint32_t kind, uint64_t size, int repeat) {
  struct gh_bench_slot *s = &v.ctl->slots[slot];
  s->kind = kind;
  s->comm_id = v.comms[0].comm_id;
  s->size = size;
  s->peer = 1;
  s->repeat = repeat;
  s->req_id = req_id;
  STORE(s->state, (uint32_t)GH_BENCH_SUBMITTED);
}

/* Waits for a slot's final state; the caller's deadlines are generous for a loaded machine. */
static uint32_t final_state(int slot) {
  uint64_t end = now_ns() + 20000 * MS;
  while (LOAD(v.ctl->slots[slot].state) < GH_BENCH_DONE && now_ns() < end) usleep(200);
  return LOAD(v.ctl->slots[slot].state);
}

static uint64_t deadline; /* the last lease an agent wrote */

/* An agent that pauses with a short lease (0: the hook's default) and dies: nobody resumes. */
static void *dying_agent(void *arg) {
  uint64_t ms = (uint64_t)(uintptr_t)arg;
  deadline = ms ? now_ns() + ms * MS : 0;
  request_pause(deadline, 0, 0);
  return NULL;
}

static void *renewing_agent(void *arg) {
  (void)arg;
  deadline = now_ns() + 300 * MS;
  request_pause(deadline, 0, 0);
  while (!LOAD(v.ctl->paused)) usleep(100);
  for (int i = 0; i < 6; i++) { /* 600 ms of renewals, then silence */
    sleep_ms(100);
    deadline = now_ns() + 300 * MS;
    STORE(v.ctl->pause_lease_ns, deadline);
  }
  return NULL;
}

static void *second_thread(void *arg) {
  uint64_t *returned = arg;
  *returned = call_returned_at();
  return NULL;
}

static void *third_thread(void *arg) { /* another training thread, on its own communicator */
  uint64_t *returned = arg;
  *returned = returned_at(comm2);
  return NULL;
}

/* Back once the lease ended, and not long after; the pause ended by the hook, cleanly. */
static void expect_resumed_by_lease(uint64_t returned, uint64_t lease, uint64_t expired_before) {
  CHECK(returned >= lease && returned < lease + 5000 * MS);
  CHECK(LOAD(v.ctl->lease_expired) == expired_before + 1);
  CHECK(LOAD(v.ctl->pause_request) == 0 && LOAD(v.ctl->pause_lease_ns) == 0 && LOAD(v.ctl->paused) == 0);
}

int main(void) {
  alarm(120); /* a lease that is not honoured would park this test for good: fail instead */
  setenv("GREYHOUND_JOB_ID", "lease", 1);
  setenv("RANK", "0", 1);
  setenv("GREYHOUND_PAUSE_LEASE_MS", "400", 1);
  setenv("GREYHOUND_BENCH_TIMEOUT_MS", "5000", 1);
  ncclUniqueId id = {{4, 2}};
  CHECK(ncclCommInitRank(&comm, 2, id, 0) == ncclSuccess);
  ncclUniqueId id2 = {{4, 3}};
  CHECK(ncclCommInitRank(&comm2, 2, id2, 0) == ncclSuccess);
  CHECK(ring_open(&v, "lease", 0));
  if (gh_failures) return 1;
  CHECK(v.h->version == GH_LAYOUT_VERSION && v.ctl->pause_lease_ns == 0 && v.ctl->lease_expired == 0);
  pthread_t t;

  /* A dead agent's pause ends with its lease. */
  pthread_create(&t, NULL, dying_agent, (void *)(uintptr_t)300);
  pthread_join(t, NULL);
  expect_resumed_by_lease(call_returned_at(), deadline, 0);
  CHECK(LOAD(v.ctl->pause_count) == 1);

  /* Lease 0: the hook's default (GREYHOUND_PAUSE_LEASE_MS), which it writes back. */
  pthread_create(&t, NULL, dying_agent, (void *)(uintptr_t)0);
  pthread_join(t, NULL);
  uint64_t seen = 0, back[2] = {0, 0}, asked = now_ns();
  pthread_t other;
  pthread_create(&other, NULL, third_thread, &back[1]); /* parks first, or waits for the one parked */
  pthread_create(&t, NULL, second_thread, &back[0]);
  for (uint64_t end = now_ns() + 5000 * MS; seen == 0 && now_ns() < end; usleep(100))
    if (LOAD(v.ctl->paused)) seen = LOAD(v.ctl->pause_lease_ns);
  pthread_join(t, NULL);
  pthread_join(other, NULL);
  CHECK(seen >= asked + 400 * MS && seen < asked + 5000 * MS); /* 400 ms from when the hook saw it */
  expect_resumed_by_lease(back[0] < back[1] ? back[0] : back[1], seen, 1); /* both held to the end */
  CHECK(LOAD(v.ctl->pause_count) == 2);

  /* Renewed leases hold the job; the last one still ends it. */
  pthread_create(&t, NULL, renewing_agent, NULL);
  while (!LOAD(v.ctl->pause_request)) usleep(100);
  uint64_t t0 = now_ns(), renewed = call_returned_at();
  pthread_join(t, NULL);
  CHECK(renewed - t0 >= 850 * MS); /* 600 ms of renewals + the last 300 ms lease */
  expect_resumed_by_lease(renewed, deadline, 2);

  /* A request whose lease has passed: no park at all, the request cleared. */
  request_pause(now_ns() - 1, 0, 0);
  CHECK(timed_call() < 1000 * MS);
  CHECK(LOAD(v.ctl->pause_count) == 3 && LOAD(v.ctl->pause_request) == 0);
  CHECK(LOAD(v.ctl->lease_expired) == 4);

  /* A targeted pause whose call never comes: calls go on, and the stale request is gone with
   * its lease, so calls stop taking the slow path. */
  uint64_t cid = v.comms[0].comm_id;
  t0 = now_ns();
  request_pause(now_ns() + 200 * MS, cid, 1ull << 40);
  while (LOAD(v.ctl->pause_request) != 0 && now_ns() - t0 < 5000 * MS) CHECK(timed_call() < 1000 * MS);
  CHECK(LOAD(v.ctl->pause_request) == 0 && now_ns() - t0 >= 150 * MS && LOAD(v.ctl->lease_expired) == 5);
  CHECK(LOAD(v.ctl->pause_count) == 3);

  /* A deadline far out is brought in to the maximum lease (then resumed as usual). */
  request_pause(UINT64_MAX - 1, 0, 0);
  pthread_create(&t, NULL, second_thread, &back[0]);
  while (!LOAD(v.ctl->paused)) usleep(100);
  uint64_t capped = LOAD(v.ctl->pause_lease_ns);
  CHECK(capped <= now_ns() + (uint64_t)GH_PAUSE_LEASE_MAX_MS * MS && capped > now_ns() + 60000 * MS);

  /* While parked: bounds refused before anything runs, a transfer done on device scratch. */
  submit(5, 1, GH_BENCH_SPLIT, 0, 1); /* the transfers' own communicator */
  submit(0, 2, GH_BENCH_GEMM, GH_BENCH_MAX_GEMM_N + 1, 1);
  submit(1, 3, GH_BENCH_GEMM, 0, 1);
  submit(2, 4, GH_BENCH_SEND, GH_BENCH_MAX_P2P_BYTES + 1, 1);
  submit(3, 5, GH_BENCH_SEND, 4096, 0);
  v.ctl->slots[6].comm_id = 0; /* a split of no communicator */
  v.ctl->slots[6].kind = GH_BENCH_SPLIT;
  v.ctl->slots[6].repeat = 1;
  v.ctl->slots[6].req_id = 6;
  STORE(v.ctl->slots[6].state, (uint32_t)GH_BENCH_SUBMITTED);
  submit(4, 7, GH_BENCH_SEND, 4096, 2);
  for (int i = 0; i < 4; i++)
    CHECK(final_state(i) == GH_BENCH_FAILED && v.ctl->slots[i].result == ncclInvalidArgument);
  CHECK(final_state(6) == GH_BENCH_FAILED && v.ctl->slots[6].result == ncclInvalidArgument);
  CHECK(final_state(5) == GH_BENCH_DONE && LOAD(v.ctl->bench_comms_made) == 1);
  CHECK(final_state(4) == GH_BENCH_DONE && v.ctl->slots[4].n_done == 2);
  CHECK(LOAD(stub_cuda_live_allocs) == 1); /* its scratch, kept for the pause's next request */
  STORE(v.ctl->pause_request, 0u);
  pthread_join(t, NULL);
  CHECK(LOAD(stub_cuda_live_allocs) == 0); /* given back at resume */
  CHECK(LOAD(v.ctl->pause_lease_ns) == 0 && LOAD(v.ctl->lease_expired) == 5);
  for (int i = 0; i < 7; i++) STORE(v.ctl->slots[i].state, (uint32_t)GH_BENCH_EMPTY);

  /* A benchmark wait ends at the lease, not at its own 5 s timeout; a request queued behind it
   * is cancelled when the pause ends, never run by a later pause. */
  STORE(stub_cuda_auto, 0);
  ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, NULL); /* GPU work the drain waits for */
  deadline = now_ns() + 1500 * MS;
  request_pause(deadline, 0, 0);
  pthread_create(&t, NULL, second_thread, &back[0]);
  while (!LOAD(v.ctl->paused)) usleep(100);
  submit(0, 6, GH_BENCH_SEND, 4096, 1);
  while (LOAD(v.ctl->slots[0].state) == GH_BENCH_SUBMITTED) usleep(100);
  submit(1, 7, GH_BENCH_SEND, 4096, 1);
  pthread_join(t, NULL);
  CHECK(final_state(0) == GH_BENCH_FAILED && v.ctl->slots[0].result == 600);
  CHECK(v.ctl->slots[0].drain_ns < 4000 * MS); /* cut by the lease */
  CHECK(final_state(1) == GH_BENCH_FAILED && v.ctl->slots[1].result == 600 && v.ctl->slots[1].drain_ns == 0);
  expect_resumed_by_lease(back[0], deadline, 5);
  STORE(stub_cuda_auto, 1);
  stub_cuda_finish_all();
  CHECK(LOAD(stub_cuda_live_allocs) == 0);

  /* The job's collective timeout caps a pause: 1.2 s reported, so at most 300 ms parked, whatever
   * the lease asked (the parked call was stamped before it: the pause counts toward it). */
  CHECK(LOAD(v.ctl->job_timeout_ms) == 0 && LOAD(v.ctl->pause_cap_ms) == 0); /* none at start-up */
  setenv("GREYHOUND_PG_TIMEOUT_S", "1.2", 1);
  uint64_t shortened0 = LOAD(v.ctl->pause_shortened), expired0 = LOAD(v.ctl->lease_expired);
  t0 = now_ns();
  request_pause(now_ns() + 20000 * MS, 0, 0);
  uint64_t back_at = call_returned_at();
  CHECK(back_at - t0 >= 300 * MS && back_at - t0 < 5000 * MS);
  CHECK(LOAD(v.ctl->job_timeout_ms) == 1200 && LOAD(v.ctl->pause_cap_ms) == 300);
  CHECK(LOAD(v.ctl->pause_shortened) == shortened0 + 1 && LOAD(v.ctl->lease_expired) == expired0);
  CHECK(LOAD(v.ctl->pause_request) == 0 && LOAD(v.ctl->pause_lease_ns) == 0 && LOAD(v.ctl->paused) == 0);
  unsetenv("GREYHOUND_PG_TIMEOUT_S");
  STORE(v.ctl->job_timeout_ms, 0u);

  /* A targeted pause on a communicator used only inside groups: no call of it carries the
   * communicator to the pause point at ncclGroupStart, so the rank parks right after the outermost
   * ncclGroupEnd of the group that reached the target; a group on another communicator runs on. */
  uint64_t pauses0 = LOAD(v.ctl->pause_count);
  deadline = now_ns() + 300 * MS;
  request_pause(deadline, cid, LOAD(v.comms[0].last_seq_entered) + 1);
  CHECK(grouped_returned_at(comm2) < deadline && LOAD(v.ctl->pause_count) == pauses0);
  uint64_t after_group = grouped_returned_at(comm);
  CHECK(after_group >= deadline && LOAD(v.ctl->pause_count) == pauses0 + 1);
  CHECK(LOAD(v.ctl->lease_expired) == expired0 + 1 && LOAD(v.ctl->paused) == 0);

  CHECK(ncclCommDestroy(comm) == ncclSuccess && ncclCommDestroy(comm2) == ncclSuccess);
  printf("test_hook_lease: %s\n", gh_failures ? "FAIL" : "ok");
  return gh_failures != 0;
}
