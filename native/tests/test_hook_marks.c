/*
 * GPU completion marks against the stub NCCL and a stub CUDA runtime whose "device" the test
 * advances by hand: the poller creates a communicator's events and publishes what the device
 * finished (gpu_calls_done, gpu_seq_done) and the oldest call still pending; a group gets one mark
 * after its outermost GroupEnd; a capturing stream, a full ring and the calls before the events
 * exist get none (counted, done once the earlier marks are done); errno survives the CUDA calls;
 * a destroy drops the pending marks; a forked child records nothing; and a paused rank's drain
 * waits for queued GPU work with a deadline.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>

#include "nccl_abi.h"
#include "ring_view.h"

#define GH_MARKS 1024 /* the hook's mark ring per communicator (hook/gh_hook.h) */

extern _Atomic uint64_t stub_cuda_tickets, stub_cuda_done;
extern _Atomic int stub_cuda_auto, stub_cuda_capturing;
extern _Atomic long stub_cuda_records, stub_cuda_events, stub_cuda_live_allocs;
extern ncclResult_t stub_group_end_result; /* stub_nccl.c */
void stub_cuda_advance(uint64_t upto);
void stub_cuda_finish_all(void);

static struct ring_view v;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The poller passes every millisecond: give it (generously) time on a loaded machine. */
#define WAIT_FOR(cond)                                                                \
  __extension__({                                                                     \
    uint64_t end_ = now_ns() + 10000000000ull;                                        \
    while (!(cond) && now_ns() < end_) usleep(200);                                   \
    int ok_ = (cond);                                                                 \
    if (!ok_) fprintf(stderr, "%s:%d: timed out waiting for %s\n", __FILE__, __LINE__, #cond); \
    gh_failures += !ok_;                                                              \
    ok_;                                                                              \
  })

static uint64_t enter_of(uint64_t comm_id, uint16_t op, uint64_t seq) {
  for (uint64_t i = LOAD(v.h->head); i-- > 0;) {
    struct gh_record *r = ring_at(&v, i);
    if (r->comm_id == comm_id && r->op == op && r->seq == seq) return r->enter_ns;
  }
  return 0;
}

static cudaStream_t S1 = (cudaStream_t)0x51;

static void *agent(void *arg) {
  struct gh_comm_entry *e = arg;
  struct gh_control *c = v.ctl;
  __atomic_store_n(&c->pause_request, 1, __ATOMIC_RELEASE);
  while (!LOAD(c->paused)) usleep(100);
  struct gh_bench_slot *k = &c->slots[1], *s = &c->slots[0];
  k->kind = GH_BENCH_SPLIT; /* the transfers' own communicator, split from the job's */
  k->comm_id = e->comm_id;
  k->repeat = 1;
  k->req_id = 1;
  __atomic_store_n(&k->state, GH_BENCH_SUBMITTED, __ATOMIC_RELEASE);
  while (LOAD(k->state) < GH_BENCH_DONE) usleep(100);
  CHECK(LOAD(k->state) == GH_BENCH_DONE && k->drain_ns == 0); /* a split never waits for the drain */
  s->kind = GH_BENCH_SEND;
  s->comm_id = e->comm_id;
  s->size = 256;
  s->peer = 1;
  s->repeat = 2;
  s->req_id = 2;
  __atomic_store_n(&s->state, GH_BENCH_SUBMITTED, __ATOMIC_RELEASE);
  while (LOAD(s->state) < GH_BENCH_DONE) usleep(100);
  /* The device never reached the queued mark: the drain gave up at the deadline. */
  CHECK(LOAD(s->state) == GH_BENCH_FAILED && LOAD(s->result) == 600 && s->n_done == 0);
  CHECK(s->drain_ns >= 250000000ull && s->drain_ns < 5000000000ull);
  __atomic_store_n(&s->state, GH_BENCH_EMPTY, __ATOMIC_RELEASE);
  __atomic_store_n(&stub_cuda_auto, 1, __ATOMIC_RELEASE);
  stub_cuda_finish_all(); /* the device catches up: the next request drains at once */
  s->req_id = 3;
  __atomic_store_n(&s->state, GH_BENCH_SUBMITTED, __ATOMIC_RELEASE);
  while (LOAD(s->state) < GH_BENCH_DONE) usleep(100);
  CHECK(LOAD(s->state) == GH_BENCH_DONE && s->n_done == 2 && s->drain_ns < 250000000ull);
  CHECK(s->durations_ns[0] > 0 && s->durations_ns[1] > 0); /* GPU time, from the events */
  CHECK(LOAD(stub_cuda_live_allocs) == 1); /* the transfer's device scratch, until the resume */
  __atomic_store_n(&c->pause_request, 0, __ATOMIC_RELEASE);
  return NULL;
}

int main(void) {
  setenv("GREYHOUND_JOB_ID", "marks", 1);
  setenv("RANK", "0", 1);
  setenv("GREYHOUND_BENCH_TIMEOUT_MS", "300", 1);
  ncclUniqueId id = {{7, 7}};
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, 2, id, 0) == ncclSuccess);
  CHECK(ring_open(&v, "marks", 0));
  if (gh_failures) return 1;
  struct gh_comm_entry *e = &v.comms[0];
  uint64_t cid = e->comm_id;
  CHECK(LOAD(e->gpu_marks) == 0);

  /* The first call starts the poller, which makes the events: that call has no mark. */
  __atomic_store_n(&stub_cuda_auto, 0, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* call 1 */
  WAIT_FOR(LOAD(e->gpu_marks) == 1 && LOAD(e->gpu_calls_done) == 1);
  CHECK(LOAD(stub_cuda_events) >= (long)GH_MARKS && LOAD(e->gpu_marks_lost) == 1);
  CHECK(LOAD(e->gpu_seq_done) == 1 && LOAD(e->gpu_pending_ns) == 0);

  /* Enqueued, not reached by the device: pending is the oldest, with what the host enqueued. */
  long rec0 = LOAD(stub_cuda_records);
  errno = 0;
  CHECK(ncclAllReduce(NULL, NULL, 100, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* 2, seq 2 */
  CHECK(errno == EILSEQ); /* NCCL's errno, not the event record's EIO */
  uint64_t t2 = LOAD(stub_cuda_tickets);
  CHECK(ncclAllGather(NULL, NULL, 10, ncclBfloat16, comm, S1) == ncclSuccess); /* 3, seq 3 */
  CHECK(ncclSend(NULL, 5, ncclUint8, 1, comm, S1) == ncclSuccess);             /* 4, P2P */
  CHECK(LOAD(stub_cuda_records) == rec0 + 3);
  WAIT_FOR(LOAD(e->gpu_pending_ns) != 0);
  CHECK(LOAD(e->gpu_pending_seq) == 2 && LOAD(e->gpu_pending_op) == GH_OP_ALLREDUCE);
  CHECK(LOAD(e->gpu_pending_peer) == -1 && LOAD(e->last_peer) == 1); /* a collective has no peer;
                                                                       * the newest call, the send, has */
  CHECK(LOAD(e->gpu_pending_dtype) == ncclFloat32 && LOAD(e->gpu_pending_count) == 100);
  CHECK(LOAD(e->gpu_pending_ns) == enter_of(cid, GH_OP_ALLREDUCE, 2));
  CHECK(LOAD(e->gpu_calls_done) == 1 && LOAD(e->inflight_enter_ns) == 0);
  stub_cuda_advance(t2); /* the device finished call 2 */
  WAIT_FOR(LOAD(e->gpu_calls_done) == 2 && LOAD(e->gpu_pending_seq) == 3);
  CHECK(LOAD(e->gpu_seq_done) == 2 && LOAD(e->gpu_pending_op) == GH_OP_ALLGATHER);
  stub_cuda_advance(t2 + 1);
  WAIT_FOR(LOAD(e->gpu_calls_done) == 3 && LOAD(e->gpu_pending_op) == GH_OP_SEND);
  CHECK(LOAD(e->gpu_pending_seq) == 0 && LOAD(e->gpu_seq_done) == 3); /* a send has no collective seq */
  CHECK(LOAD(e->gpu_pending_peer) == 1); /* ... but a peer: a pending send is named by its pair */
  stub_cuda_finish_all();
  WAIT_FOR(LOAD(e->gpu_calls_done) == 4 && LOAD(e->gpu_pending_ns) == 0);

  /* A group: one mark for the communicator's calls, recorded after the outermost GroupEnd. */
  rec0 = LOAD(stub_cuda_records);
  CHECK(ncclGroupStart() == ncclSuccess && ncclGroupStart() == ncclSuccess);
  CHECK(ncclSend(NULL, 8, ncclUint8, 1, comm, S1) == ncclSuccess); /* 5 */
  CHECK(ncclRecv(NULL, 8, ncclUint8, 1, comm, S1) == ncclSuccess); /* 6 */
  CHECK(ncclGroupEnd() == ncclSuccess && LOAD(stub_cuda_records) == rec0);
  CHECK(ncclGroupEnd() == ncclSuccess && LOAD(stub_cuda_records) == rec0 + 1);
  WAIT_FOR(LOAD(e->gpu_pending_op) == GH_OP_SEND && LOAD(e->gpu_calls_done) == 4);
  stub_cuda_finish_all();
  WAIT_FOR(LOAD(e->gpu_calls_done) == 6 && LOAD(e->gpu_pending_ns) == 0);

  /* A capturing stream gets no event (it would be a graph node): lost, done once earlier marks
   * are done. One between two marks is done when the earlier one is. */
  rec0 = LOAD(stub_cuda_records);
  __atomic_store_n(&stub_cuda_capturing, 1, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* 7, seq 4 */
  __atomic_store_n(&stub_cuda_capturing, 0, __ATOMIC_RELEASE);
  CHECK(LOAD(stub_cuda_records) == rec0);
  WAIT_FOR(LOAD(e->gpu_calls_done) == 7 && LOAD(e->gpu_marks_lost) == 2);
  CHECK(LOAD(e->gpu_seq_done) == 4);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* 8, seq 5 */
  uint64_t t8 = LOAD(stub_cuda_tickets);
  __atomic_store_n(&stub_cuda_capturing, 1, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* 9, seq 6 */
  __atomic_store_n(&stub_cuda_capturing, 0, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* 10, seq 7 */
  WAIT_FOR(LOAD(e->gpu_pending_seq) == 5 && LOAD(e->gpu_marks_lost) == 3);
  CHECK(LOAD(e->gpu_calls_done) == 7);
  stub_cuda_advance(t8);
  WAIT_FOR(LOAD(e->gpu_calls_done) == 9 && LOAD(e->gpu_pending_seq) == 7);
  CHECK(LOAD(e->gpu_seq_done) == 6);
  stub_cuda_finish_all();
  WAIT_FOR(LOAD(e->gpu_calls_done) == 10 && LOAD(e->gpu_pending_ns) == 0);

  /* A full ring never blocks: the calls beyond it are lost and counted, then done in order. */
  uint64_t lost0 = LOAD(e->gpu_marks_lost);
  for (int i = 0; i < (int)GH_MARKS + 100; i++) ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1);
  uint64_t entered = LOAD(e->calls_entered);
  WAIT_FOR(LOAD(e->gpu_marks_lost) >= lost0 + 100 && LOAD(e->gpu_pending_seq) == 8);
  stub_cuda_finish_all();
  WAIT_FOR(LOAD(e->gpu_calls_done) == entered && LOAD(e->gpu_seq_done) == LOAD(e->last_seq_entered));

  /* A group whose outermost GroupEnd failed enqueued nothing, and one in progress is not on its
   * stream yet: no mark is recorded for either, their calls count as lost (done in order). */
  for (int k = 0; k < 2; k++) {
    rec0 = LOAD(stub_cuda_records);
    uint64_t lost_before = LOAD(e->gpu_marks_lost), calls = LOAD(e->calls_entered);
    stub_group_end_result = k == 0 ? ncclInternalError : ncclInProgress;
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(ncclAllReduce(NULL, NULL, 4, ncclFloat32, ncclSum, comm, S1) == ncclSuccess);
    CHECK(ncclGroupEnd() == stub_group_end_result);
    stub_group_end_result = ncclSuccess;
    CHECK(LOAD(stub_cuda_records) == rec0);
    WAIT_FOR(LOAD(e->gpu_calls_done) == calls + 1 && LOAD(e->gpu_marks_lost) == lost_before + (uint64_t)k);
  }

  /* Profile mode: a call timed inside a group whose outermost GroupEnd failed gets no end event
   * (it would time nothing: NCCL enqueued nothing) and its record ends GPU_LOST, never GPU_DONE;
   * a group that succeeds gets its end event after the GroupEnd and its GPU times. */
  __atomic_store_n(&stub_cuda_auto, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&v.ctl->mode, GH_MODE_PROFILE, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 2, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* makes the pool */
  for (int k = 0; k < 2; k++) {
    ncclResult_t want = k == 0 ? ncclInternalError : ncclSuccess;
    rec0 = LOAD(stub_cuda_records);
    stub_group_end_result = want;
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(ncclAllReduce(NULL, NULL, 16 + (size_t)k, ncclFloat32, ncclSum, comm, S1) == ncclSuccess);
    long issued = LOAD(stub_cuda_records) - rec0; /* the start event (and the mark's own checks) */
    CHECK(ncclGroupEnd() == want);
    stub_group_end_result = ncclSuccess;
    CHECK(LOAD(stub_cuda_records) - rec0 == issued + (k == 0 ? 0 : 2)); /* end event and mark */
    struct gh_record *r = NULL;
    for (uint64_t i = LOAD(v.h->head); i-- > 0 && r == NULL;)
      if (ring_at(&v, i)->op == GH_OP_ALLREDUCE && ring_at(&v, i)->count == 16 + (uint64_t)k) r = ring_at(&v, i);
    CHECK(r != NULL && (LOAD(r->flags) & GH_F_PROFILED));
    if (r == NULL) continue;
    WAIT_FOR(LOAD(r->flags) & (GH_F_GPU_DONE | GH_F_GPU_LOST));
    CHECK(k == 0 ? (LOAD(r->flags) & (GH_F_GPU_DONE | GH_F_GPU_LOST)) == GH_F_GPU_LOST
                 : (LOAD(r->flags) & (GH_F_GPU_DONE | GH_F_GPU_LOST)) == GH_F_GPU_DONE);
  }
  __atomic_store_n(&v.ctl->mode, GH_MODE_MONITOR, __ATOMIC_RELEASE);
  __atomic_store_n(&stub_cuda_auto, 0, __ATOMIC_RELEASE);

  /* A forked child (a data-loader worker) records nothing: no counters move, no marks. */
  entered = LOAD(e->calls_entered);
  pid_t pid = fork();
  if (pid == 0) {
    ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1);
    _exit(0);
  }
  int status;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && LOAD(e->calls_entered) == entered);

  /* Pause with GPU work still queued: the drain waits for it, within its deadline. */
  __atomic_store_n(&stub_cuda_auto, 0, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess);
  WAIT_FOR(LOAD(e->gpu_pending_ns) != 0);
  pthread_t t;
  pthread_create(&t, NULL, agent, e);
  while (!LOAD(v.ctl->pause_request)) usleep(100);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess); /* parks here */
  pthread_join(t, NULL);
  CHECK(LOAD(v.ctl->paused) == 0 && LOAD(v.ctl->pause_count) == 1);
  CHECK(LOAD(stub_cuda_live_allocs) == 0); /* cudaMalloc'd scratch freed once its stream was idle */

  /* Destroy drops what is pending: the entry stops naming a call the GPU will never report. */
  __atomic_store_n(&stub_cuda_auto, 0, __ATOMIC_RELEASE);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, S1) == ncclSuccess);
  WAIT_FOR(LOAD(e->gpu_pending_ns) != 0);
  CHECK(ncclCommDestroy(comm) == ncclSuccess);
  CHECK(LOAD(e->state) == GH_COMM_DESTROYED && LOAD(e->gpu_pending_ns) == 0 && LOAD(e->gpu_pending_op) == 0);
  usleep(20000);
  CHECK(LOAD(e->gpu_pending_ns) == 0);
  stub_cuda_finish_all();
  printf("test_hook_marks: %s\n", gh_failures ? "FAIL" : "ok");
  return gh_failures != 0;
}
