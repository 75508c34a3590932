/*
 * Communicator registry. The shared table (gh_comms, in the ring file) carries what the agent
 * reads; this process-local open-addressed map turns an ncclComm_t into its table slot on the hot
 * path without locks. Ids are stable across ranks: every rank of a communicator hashes the same
 * unique id, or for a split the same (parent id, split index, color).
 */
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "gh_hook.h"

#define MAP_SLOTS 256 /* power of two, > 2 * GH_MAX_COMMS */

struct map_slot {
  void *handle;
  int idx;
};
static struct map_slot map[MAP_SLOTS];
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static void *const TOMBSTONE = (void *)1;

uint64_t gh_hash_bytes(const void *p, size_t n, uint64_t seed) {
  const unsigned char *b = p;
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  h ^= h >> 33; /* finalise (murmur3 fmix64) so that ids spread over all bits */
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h == 0 ? 1 : h;
}

static unsigned map_pos(const void *handle) {
  uint64_t x = (uint64_t)(uintptr_t)handle;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return (unsigned)(x >> 40) & (MAP_SLOTS - 1);
}

struct gh_comm_entry *gh_comm_lookup(ncclComm_t comm) {
  if (comm == NULL || gh_comms == NULL) return NULL;
  unsigned pos = map_pos(comm);
  for (unsigned i = 0; i < MAP_SLOTS; i++) {
    struct map_slot *s = &map[(pos + i) & (MAP_SLOTS - 1)];
    void *h = __atomic_load_n(&s->handle, __ATOMIC_ACQUIRE);
    if (h == comm) return &gh_comms[s->idx];
    if (h == NULL) return NULL;
  }
  return NULL;
}

ncclComm_t gh_comm_handle(uint64_t comm_id) {
  if (gh_comms == NULL) return NULL;
  for (int i = 0; i < GH_MAX_COMMS; i++) {
    struct gh_comm_entry *e = &gh_comms[i];
    if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == GH_COMM_ACTIVE && e->comm_id == comm_id)
      return (ncclComm_t)(uintptr_t)e->handle;
  }
  return NULL;
}

static int free_table_slot(void) {
  for (int i = 0; i < GH_MAX_COMMS; i++)
    if (gh_comms[i].state == GH_COMM_FREE) return i;
  for (int i = 0; i < GH_MAX_COMMS; i++) /* reuse the slot of a finished communicator */
    if (gh_comms[i].state == GH_COMM_DESTROYED || gh_comms[i].state == GH_COMM_ABORTED) return i;
  return -1;
}

/* Clear an entry for a new communicator without touching its seqlock words (a reader that saw
 * them before must see them move): the caller holds life_ver; gpu_ver is bumped around the GPU
 * fields. Locks held. */
static void reset_entry(struct gh_comm_entry *e) {
  __atomic_store_n(&e->state, GH_COMM_FREE, __ATOMIC_RELEASE);
  uint32_t gv = gh_ver_begin(&e->gpu_ver);
  size_t vers = offsetof(struct gh_comm_entry, host_ver), after = offsetof(struct gh_comm_entry, last_peer);
  memset((char *)e + 8, 0, vers - 8);
  e->life_op = 0;
  memset((char *)e + after, 0, sizeof *e - after);
  for (int p = 0; p < GH_MAX_PEERS; p++) e->peer_ids[p] = -1;
  e->last_peer = -1;
  e->gpu_pending_peer = -1;
  gh_ver_end(&e->gpu_ver, gv);
}

/* The caller holds life_ver. */
static void fill_identity(struct gh_comm_entry *e, uint64_t id, uint64_t parent, int color, int rank,
                          int nranks) {
  e->parent_id = parent;
  e->rank = rank;
  e->nranks = nranks;
  e->color = color;
  e->comm_id = id;
}

struct gh_comm_entry *gh_comm_begin(uint64_t id, uint64_t parent, int color, int rank, int nranks,
                                    uint16_t op, uint64_t enter_ns) {
  if (rank < 0 || nranks <= 0 || !gh_ring_ensure(rank)) return NULL;
  struct gh_comm_entry *e = NULL;
  pthread_mutex_lock(&reg_lock);
  gh_marks_lock();
  int idx = free_table_slot();
  if (idx >= 0) {
    e = &gh_comms[idx];
    gh_marks_detach(idx);
    uint32_t v = gh_life_begin(&e->life_ver);
    reset_entry(e);
    fill_identity(e, id, parent, color, rank, nranks);
    e->life_op = op;
    e->inflight_enter_ns = enter_ns;
    __atomic_store_n(&e->state, GH_COMM_INIT, __ATOMIC_RELEASE);
    gh_life_end(&e->life_ver, v);
  }
  gh_marks_unlock();
  pthread_mutex_unlock(&reg_lock);
  return e;
}

void gh_comm_abandon(struct gh_comm_entry *reserved, uint64_t id) {
  if (reserved == NULL) return;
  pthread_mutex_lock(&reg_lock);
  if (__atomic_load_n(&reserved->state, __ATOMIC_ACQUIRE) == GH_COMM_INIT && reserved->comm_id == id)
    gh_comm_set_state(reserved, GH_COMM_FREE);
  pthread_mutex_unlock(&reg_lock);
}

void gh_comm_end_flight(struct gh_comm_entry *e, uint64_t id, uint32_t state) {
  uint32_t v = gh_life_begin(&e->life_ver);
  if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == state && e->comm_id == id) {
    __atomic_store_n(&e->life_op, 0u, __ATOMIC_RELAXED);
    __atomic_store_n(&e->inflight_enter_ns, 0, __ATOMIC_RELAXED);
  }
  gh_life_end(&e->life_ver, v);
}

void gh_comm_set_state(struct gh_comm_entry *e, uint32_t state) {
  uint32_t v = gh_life_begin(&e->life_ver);
  __atomic_store_n(&e->state, state, __ATOMIC_RELEASE);
  gh_life_end(&e->life_ver, v);
}

/* The marks lock keeps the poller off the entry while it changes hands (it writes the GPU fields). */
struct gh_comm_entry *gh_comm_register(ncclComm_t comm, uint64_t id, uint64_t parent, int color,
                                       int rank, int nranks, int device, struct gh_comm_entry *reserved) {
  if (comm == NULL || !gh_ring_ensure(rank)) return NULL;
  struct gh_comm_entry *e = NULL;
  pthread_mutex_lock(&reg_lock);
  gh_marks_lock();
  e = gh_comm_lookup(comm);
  int idx = e != NULL ? (int)(e - gh_comms) : -1;
  if (idx < 0 && reserved != NULL && __atomic_load_n(&reserved->state, __ATOMIC_ACQUIRE) == GH_COMM_INIT &&
      reserved->comm_id == id)
    idx = (int)(reserved - gh_comms);
  if (idx < 0) idx = free_table_slot();
  if (idx >= 0) {
    e = &gh_comms[idx];
    uint32_t v = gh_life_begin(&e->life_ver);
    reset_entry(e);
    gh_marks_attach(idx, device);
    fill_identity(e, id, parent, color, rank, nranks);
    e->handle = (uint64_t)(uintptr_t)comm;
    __atomic_store_n(&e->state, GH_COMM_ACTIVE, __ATOMIC_RELEASE);
    gh_life_end(&e->life_ver, v);
    if (gh_comm_lookup(comm) == NULL) {
      unsigned pos = map_pos(comm);
      for (unsigned i = 0; i < MAP_SLOTS; i++) {
        struct map_slot *s = &map[(pos + i) & (MAP_SLOTS - 1)];
        if (s->handle == NULL || s->handle == TOMBSTONE) {
          s->idx = idx;
          __atomic_store_n(&s->handle, (void *)comm, __ATOMIC_RELEASE);
          break;
        }
      }
    }
  } else {
    e = NULL;
  }
  if (reserved != NULL && reserved != e && __atomic_load_n(&reserved->state, __ATOMIC_ACQUIRE) == GH_COMM_INIT &&
      reserved->comm_id == id)
    gh_comm_set_state(reserved, GH_COMM_FREE);
  gh_marks_unlock();
  pthread_mutex_unlock(&reg_lock);
  return e;
}

void gh_comm_forget_entry(ncclComm_t comm, struct gh_comm_entry *e, uint64_t id, uint32_t state) {
  if (e == NULL || gh_comm_lookup(comm) != e || e->comm_id != id) return;
  gh_comm_forget(comm, state);
}

void gh_comm_forget(ncclComm_t comm, uint32_t state) {
  if (comm == NULL || gh_comms == NULL) return;
  pthread_mutex_lock(&reg_lock);
  gh_marks_lock();
  unsigned pos = map_pos(comm);
  for (unsigned i = 0; i < MAP_SLOTS; i++) {
    struct map_slot *s = &map[(pos + i) & (MAP_SLOTS - 1)];
    if (s->handle == NULL) break;
    if (s->handle == comm) {
      gh_marks_detach(s->idx);
      gh_comm_set_state(&gh_comms[s->idx], state);
      __atomic_store_n(&s->handle, TOMBSTONE, __ATOMIC_RELEASE);
      break;
    }
  }
  gh_marks_unlock();
  pthread_mutex_unlock(&reg_lock);
}
