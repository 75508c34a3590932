/*
 * Two writers on one comm-table row: the training thread inside its data calls (host_ver) and
 * another thread's lifecycle calls on the same communicator (as PyTorch's watchdog aborts one
 * while the training thread is inside a call; a split by a rank that takes no part repeats such a
 * write many times). A reader following the seqlock protocol (all three words even and unchanged
 * around its copy) must never take a row whose host fields are half-written: the training
 * thread's calls keep calls_entered, last_seq_entered and last_count equal.
 */
#include <pthread.h>
#include <time.h>

#include "nccl_abi.h"
#include "ring_view.h"

/* Runs until the reader has watched the two writers at work together for a while, or a deadline:
 * the threads share two cores with the rest of the machine, which decides when they overlap. */
#define MIN_NS 1000000000ull
#define MAX_NS 8000000000ull
#define MIN_SEEN 2000
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define RELAXED(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)

static ncclComm_t comm;
static int done;
static uint64_t calls_made, splits_made;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *training(void *arg) {
  (void)arg;
  uint64_t i = 0;
  while (!LOAD(done)) {
    i++;
    ncclAllReduce(NULL, NULL, (size_t)i, ncclFloat32, ncclSum, comm, NULL);
  }
  __atomic_store_n(&calls_made, i, __ATOMIC_RELEASE);
  return NULL;
}

static void *lifecycle(void *arg) {
  (void)arg;
  while (!LOAD(done)) {
    ncclComm_t none = NULL;
    ncclCommSplit(comm, NCCL_SPLIT_NOCOLOR, 0, &none, NULL);
    __atomic_fetch_add(&splits_made, 1, __ATOMIC_RELEASE);
  }
  return NULL;
}

int main(void) {
  setenv("GREYHOUND_JOB_ID", "seqlock", 1);
  setenv("RANK", "0", 1);
  ncclUniqueId id = {{5, 9}};
  CHECK(ncclCommInitRank(&comm, 2, id, 0) == ncclSuccess);
  struct ring_view v;
  CHECK(ring_open(&v, "seqlock", 0));
  if (gh_failures) return 1;
  struct gh_comm_entry *e = &v.comms[0];
  pthread_t a, b;
  pthread_create(&a, NULL, training, NULL);
  pthread_create(&b, NULL, lifecycle, NULL);
  uint64_t taken = 0, torn = 0, splits_seen = 0;
  uint64_t t0 = now_ns();
  for (uint64_t k = 0;; k++) {
    if ((k & 0xffff) == 0) {
      uint64_t t = now_ns() - t0;
      if ((t >= MIN_NS && splits_seen >= MIN_SEEN) || t >= MAX_NS) break;
    }
    uint32_t h0 = LOAD(e->host_ver), g0 = LOAD(e->gpu_ver), l0 = LOAD(e->life_ver);
    uint64_t calls = RELAXED(e->calls_entered), seq = RELAXED(e->last_seq_entered);
    uint64_t count = RELAXED(e->last_count), done_calls = RELAXED(e->calls_completed);
    uint64_t done_seq = RELAXED(e->last_seq_completed);
    uint32_t life = RELAXED(e->life_op);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t h1 = RELAXED(e->host_ver), g1 = RELAXED(e->gpu_ver), l1 = RELAXED(e->life_ver);
    if ((h0 | g0 | l0) & 1u || h0 != h1 || g0 != g1 || l0 != l1) continue;
    taken++;
    splits_seen += life == GH_OP_COMM_SPLIT;
    if (calls != seq || calls != count || calls - done_calls != seq - done_seq) {
      if (torn++ < 5)
        fprintf(stderr, "torn row taken: calls %llu seq %llu count %llu completed %llu seq completed %llu\n",
                (unsigned long long)calls, (unsigned long long)seq, (unsigned long long)count,
                (unsigned long long)done_calls, (unsigned long long)done_seq);
    }
  }
  __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  CHECK(torn == 0);
  CHECK(taken > 100);
  uint64_t n = LOAD(calls_made);
  CHECK(LOAD(e->calls_entered) == n && LOAD(e->last_count) == n && LOAD(e->life_op) == 0);
  printf("test_hook_seqlock: %s (%llu rows taken, %llu torn, %llu inside a split)\n", gh_failures ? "FAIL" : "ok",
         (unsigned long long)taken, (unsigned long long)torn, (unsigned long long)splits_seen);
  return gh_failures != 0;
}
