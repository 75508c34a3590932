/*
 * The poller/writer race on a recycled slot, driven directly against ring.c (linked in, not
 * preloaded). The agent here is impatient: it gives up on every record at once (consumed = head),
 * so a tiny ring laps constantly while a "poller" thread writes GPU times into recent records,
 * tagged with their own index. A record may carry GPU_DONE only with its own tag; before the fix
 * (check the stamp, then write) a recycled slot received its previous record's times.
 * The writer checks each record one lap later, once gh_reserve has handed it the slot back: from
 * then on the poller can no longer touch it, so the check reads a quiet slot.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "../hook/gh_hook.h"

#define RECORDS 16
#define WRITES 400000
#define TAG 1000000000ull

void gh_profile_fork_child(void) {} /* ring.c's fork handler; no profiler in this test */

static int writer_done;
static uint64_t completed, refused, bad_tag, bad_flags;

static void *poller(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  while (!__atomic_load_n(&writer_done, __ATOMIC_ACQUIRE)) {
    uint64_t head = __atomic_load_n(&gh_hdr->head, __ATOMIC_ACQUIRE);
    if (head < RECORDS) continue;
    /* Mostly the oldest records: the next ones the writer recycles. */
    uint64_t idx = head - RECORDS + (uint64_t)(rand_r(&seed) % 4);
    if (gh_ring_gpu_complete(idx, idx + TAG, idx + 2 * TAG, GH_F_GPU_DONE))
      __atomic_fetch_add(&completed, 1, __ATOMIC_RELAXED);
    else
      __atomic_fetch_add(&refused, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}

static void check_previous(const struct gh_record *r, uint64_t idx) {
  if (idx < RECORDS) return;
  uint64_t prev = idx - RECORDS;
  uint32_t flags = __atomic_load_n(&r->flags, __ATOMIC_ACQUIRE);
  uint64_t start = __atomic_load_n(&r->gpu_start_ns, __ATOMIC_RELAXED);
  uint64_t end = __atomic_load_n(&r->gpu_end_ns, __ATOMIC_RELAXED);
  if (flags & GH_F_GPU_DONE) {
    if (start != prev + TAG || end != prev + 2 * TAG) bad_tag++;
  } else if (flags != 0 || start != 0 || end != 0) {
    bad_flags++;
  }
}

int main(void) {
  setenv("GREYHOUND_RING_RECORDS", "16", 1);
  if (getenv("GREYHOUND_SHM_DIR") == NULL) setenv("GREYHOUND_SHM_DIR", "/tmp/greyhound-test-ring-race", 1);
  setenv("GREYHOUND_JOB_ID", "ring_race", 1);
  if (!gh_ring_ensure(0) || gh_mask + 1 != RECORDS) {
    fprintf(stderr, "test_ring_race: no ring\n");
    return 1;
  }
  pthread_t t;
  pthread_create(&t, NULL, poller, (void *)(uintptr_t)7);
  /* Keep writing until the poller has really raced us (it may start late on a loaded machine). */
  for (uint64_t i = 0; i < WRITES || __atomic_load_n(&completed, __ATOMIC_RELAXED) +
                                         __atomic_load_n(&refused, __ATOMIC_RELAXED) < WRITES / 4;
       i++) {
    __atomic_store_n(&gh_hdr->consumed, __atomic_load_n(&gh_hdr->head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
    uint64_t idx;
    struct gh_record *r = gh_reserve(&idx);
    if (r == NULL) continue;
    check_previous(r, idx);
    r->comm_id = idx;
    r->gpu_start_ns = 0;
    r->gpu_end_ns = 0;
    __atomic_store_n(&r->flags, 0u, __ATOMIC_RELAXED);
    gh_publish(r, idx);
  }
  __atomic_store_n(&writer_done, 1, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
  int ok = bad_tag == 0 && bad_flags == 0 && completed > 0;
  printf("test_ring_race: %s (%llu completed, %llu refused, %llu foreign GPU times, %llu stray flags)\n",
         ok ? "ok" : "FAILED", (unsigned long long)completed, (unsigned long long)refused,
         (unsigned long long)bad_tag, (unsigned long long)bad_flags);
  return ok ? 0 : 1;
}
