/*
 * Multi-threaded stress: writers on their own communicators race for ring slots while a consumer
 * drains concurrently. Every record must arrive exactly once, complete, and in per-comm order.
 * The stub CUDA runtime is linked in, so every call also records a completion mark that the
 * hook's poller retires concurrently: in the end every call is done on the "GPU".
 */
#include <pthread.h>

#include "nccl_abi.h"
#include "ring_view.h"

#define THREADS 8
#define CALLS 4000

static struct ring_view v;
static int writers_done;
static uint64_t next_seq[THREADS + 1];

static void *writer(void *arg) {
  int t = (int)(intptr_t)arg;
  ncclUniqueId id = {{(char)(t + 1), 42}};
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, THREADS, id, t) != ncclSuccess) return (void *)1;
  for (int i = 0; i < CALLS; i++) {
    ncclAllReduce(NULL, NULL, (size_t)t, ncclFloat32, ncclSum, comm, NULL);
    if (i % 16 == 0) ncclSend(NULL, 1, ncclUint8, (t + 1) % THREADS, comm, NULL);
  }
  __atomic_fetch_add(&writers_done, 1, __ATOMIC_RELEASE);
  return NULL;
}

static uint64_t drain(uint64_t *cursor, uint64_t *bad) {
  uint64_t n = 0;
  while (*cursor < __atomic_load_n(&v.h->head, __ATOMIC_ACQUIRE)) {
    struct gh_record *r = ring_at(&v, *cursor);
    if (__atomic_load_n(&r->stamp, __ATOMIC_ACQUIRE) != *cursor + 1) break; /* being written */
    if (r->op == GH_OP_ALLREDUCE) {
      uint64_t t = r->count;
      if (t >= THREADS || r->seq <= next_seq[t] || (__atomic_load_n(&v.h->dropped, __ATOMIC_RELAXED) == 0 && r->seq != next_seq[t] + 1)) (*bad)++;
      else next_seq[t] = r->seq;
    }
    (*cursor)++;
    n++;
    __atomic_store_n(&v.h->consumed, *cursor, __ATOMIC_RELEASE);
  }
  return n;
}

int main(void) {
  setenv("GREYHOUND_JOB_ID", "stress", 1);
  setenv("RANK", "0", 1);
  setenv("GREYHOUND_RING_RECORDS", "4096", 1); /* small: writers wait on the consumer's cursor */
  ncclUniqueId id0 = {{99}};
  ncclComm_t c0;
  CHECK(ncclCommInitRank(&c0, 1, id0, 0) == ncclSuccess); /* creates the ring */
  CHECK(ring_open(&v, "stress", 0));
  if (gh_failures) return 1;
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, writer, (void *)(intptr_t)i);
  uint64_t cursor = 0, got = 0, bad = 0;
  while (__atomic_load_n(&writers_done, __ATOMIC_ACQUIRE) < THREADS) got += drain(&cursor, &bad);
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  got += drain(&cursor, &bad);
  uint64_t per_thread = CALLS + CALLS / 16;
  uint64_t expected = 1 + THREADS * (1 + per_thread); /* c0 init, each comm init, the calls */
  CHECK(bad == 0);
  CHECK(got + v.h->dropped == expected);
  CHECK(v.h->head == got);
  for (int i = 0; i < THREADS; i++) CHECK(v.h->dropped > 0 || next_seq[i] == CALLS);
  CHECK(v.h->dropped > 0 || got == expected);
  int active = 0;
  for (int i = 0; i < GH_MAX_COMMS; i++)
    if (v.comms[i].state == GH_COMM_ACTIVE && v.comms[i].nranks == THREADS) {
      active++;
      CHECK(v.comms[i].calls_entered == per_thread && v.comms[i].calls_completed == per_thread);
      CHECK(v.comms[i].last_seq_completed == CALLS && v.comms[i].send_count[0] == CALLS / 16);
    }
  CHECK(active == THREADS);
  /* The poller (1 ms passes) catches up with every writer's marks. */
  for (int i = 0, tries = 0; i < GH_MAX_COMMS; i++) {
    struct gh_comm_entry *e = &v.comms[i];
    if (e->state != GH_COMM_ACTIVE || e->nranks != THREADS) continue;
    while (__atomic_load_n(&e->gpu_calls_done, __ATOMIC_ACQUIRE) < per_thread && tries++ < 20000) usleep(500);
    CHECK(__atomic_load_n(&e->gpu_marks, __ATOMIC_ACQUIRE) == 1);
    CHECK(__atomic_load_n(&e->gpu_calls_done, __ATOMIC_ACQUIRE) == per_thread);
    CHECK(__atomic_load_n(&e->gpu_seq_done, __ATOMIC_ACQUIRE) == CALLS);
  }
  printf("test_hook_stress: %s (%llu records, %llu dropped)\n", gh_failures ? "FAIL" : "ok",
         (unsigned long long)got, (unsigned long long)v.h->dropped);
  return gh_failures != 0;
}
