/*
 * The per-rank shared-memory ring. Created lazily at the first NCCL call that knows the rank
 * (from the launcher's environment, else the first communicator's rank), built under a temporary
 * name and renamed into place so that a reader never sees a half-written header. Writers never
 * wait on the reader: a slot is reserved with a CAS on head (gh_hook.h), refused (and counted) when
 * the reader's published cursor is a full ring behind. The one wait is for the poller, and only
 * while it is inside its few stores into the very slot being recycled (gh_ring_gpu_complete).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gh_hook.h"

struct gh_ring_header *gh_hdr;
struct gh_control *gh_ctl;
struct gh_comm_entry *gh_comms;
struct gh_record *gh_records;
uint32_t gh_mask;
int gh_disabled;

uint64_t gh_gpu_busy;
static const gh_ctl_word_t zero_ctl;
const gh_ctl_word_t *gh_ctl_word = &zero_ctl;

static int ring_state; /* 0 not tried, 1 ready, 2 failed for good */
static pthread_mutex_t ring_lock = PTHREAD_MUTEX_INITIALIZER;

static int env_rank(void) {
  static const char *const names[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
  for (const char *const *n = names; *n != NULL; n++) {
    const char *v = getenv(*n);
    if (v != NULL && *v != '\0') {
      char *end;
      long r = strtol(v, &end, 10);
      if (*end == '\0' && r >= 0 && r < (1L << 30)) return (int)r;
    }
  }
  return -1;
}

static uint32_t env_capacity(void) {
  const char *v = getenv("GREYHOUND_RING_RECORDS");
  if (v == NULL) return GH_DEFAULT_RECORDS;
  unsigned long c = strtoul(v, NULL, 10);
  if (c < 16 || c > (1ul << 24) || (c & (c - 1)) != 0) return GH_DEFAULT_RECORDS;
  return (uint32_t)c;
}

static int mkdirs(const char *path) {
  char buf[4096];
  if (strlen(path) >= sizeof buf) return -1;
  strcpy(buf, path);
  for (char *p = buf + 1; *p != '\0'; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -1;
    *p = '/';
  }
  return (mkdir(buf, 0777) != 0 && errno != EEXIST) ? -1 : 0;
}

static uint64_t page_up(uint64_t n) { return (n + 4095u) & ~(uint64_t)4095u; }

static int create_ring(int rank) {
  const char *dir = getenv("GREYHOUND_SHM_DIR");
  const char *job = getenv("GREYHOUND_JOB_ID");
  if (dir == NULL || *dir == '\0') dir = "/dev/shm/greyhound";
  if (job == NULL || *job == '\0') job = "default";
  if (strchr(job, '/') != NULL || strlen(job) >= 64) return 0;
  char jobdir[4096], path[4200], tmp[4300];
  if (snprintf(jobdir, sizeof jobdir, "%s/%s", dir, job) >= (int)sizeof jobdir) return 0;
  if (mkdirs(jobdir) != 0) return 0;
  snprintf(path, sizeof path, "%s/rank-%d.ring", jobdir, rank);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());

  uint32_t cap = env_capacity();
  uint64_t control_off = GH_HEADER_BYTES;
  uint64_t comms_off = page_up(control_off + sizeof(struct gh_control));
  uint64_t records_off = page_up(comms_off + GH_MAX_COMMS * sizeof(struct gh_comm_entry));
  uint64_t bytes = records_off + (uint64_t)cap * sizeof(struct gh_record);

  int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return 0;
  if (ftruncate(fd, (off_t)bytes) != 0) {
    close(fd);
    unlink(tmp);
    return 0;
  }
  void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    unlink(tmp);
    return 0;
  }
  struct gh_ring_header *h = m;
  h->magic = GH_RING_MAGIC;
  h->version = GH_LAYOUT_VERSION;
  h->header_bytes = GH_HEADER_BYTES;
  h->capacity = cap;
  h->record_bytes = sizeof(struct gh_record);
  h->max_comms = GH_MAX_COMMS;
  h->max_peers = GH_MAX_PEERS;
  h->control_offset = control_off;
  h->comms_offset = comms_off;
  h->records_offset = records_off;
  h->file_bytes = bytes;
  strncpy(h->job, job, sizeof h->job - 1);
  gethostname(h->host, sizeof h->host - 1);
  h->rank = rank;
  h->pid = (int32_t)getpid();
  h->device = -1;
  struct timespec mono, wall;
  clock_gettime(CLOCK_MONOTONIC, &mono);
  clock_gettime(CLOCK_REALTIME, &wall);
  h->mono_anchor_ns = (uint64_t)mono.tv_sec * 1000000000ull + (uint64_t)mono.tv_nsec;
  h->wall_anchor_ns = (uint64_t)wall.tv_sec * 1000000000ull + (uint64_t)wall.tv_nsec;
  __atomic_store_n(&h->ready, 1u, __ATOMIC_RELEASE);
  if (rename(tmp, path) != 0) {
    munmap(m, bytes);
    unlink(tmp);
    return 0;
  }
  gh_ctl = (struct gh_control *)((char *)m + control_off);
  __atomic_store_n(&gh_ctl_word, (const gh_ctl_word_t *)gh_ctl, __ATOMIC_RELEASE);
  gh_comms = (struct gh_comm_entry *)((char *)m + comms_off);
  gh_records = (struct gh_record *)((char *)m + records_off);
  gh_mask = cap - 1;
  __atomic_store_n(&gh_hdr, h, __ATOMIC_RELEASE);
  return 1;
}

int gh_ring_ensure(int comm_rank) {
  int s = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
  if (GH_LIKELY(s != 0)) return s == 1;
  if (gh_disabled) return 0;
  int rank = env_rank();
  if (rank < 0) rank = comm_rank;
  if (rank < 0) return 0; /* wait for a communicator to tell us */
  int saved = errno;
  pthread_mutex_lock(&ring_lock);
  if (ring_state == 0) {
    gh_clock_init();
    __atomic_store_n(&ring_state, create_ring(rank) ? 1 : 2, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&ring_lock);
  errno = saved;
  return ring_state == 1;
}

void gh_ring_set_device(int device) {
  if (gh_hdr != NULL && gh_hdr->device < 0) __atomic_store_n(&gh_hdr->device, device, __ATOMIC_RELAXED);
}

void gh_reserve_wait_poller(uint64_t busy) {
  /* The poller is inside its few-instruction write into the record this slot held (the reader had
   * given up on it and the ring lapped meanwhile): wait for it to leave rather than publish a
   * record it may still scribble on. Spin first, then yield in case it was preempted there. */
  for (unsigned spins = 0; __atomic_load_n(&gh_gpu_busy, __ATOMIC_ACQUIRE) == busy; spins++) {
#if defined(__x86_64__)
    if (spins < 1024) {
      __builtin_ia32_pause();
      continue;
    }
#endif
    sched_yield();
  }
}

int gh_ring_gpu_complete(uint64_t index, uint64_t start_ns, uint64_t end_ns, uint32_t flags) {
  if (index == UINT64_MAX || gh_records == NULL) return 0;
  struct gh_record *r = &gh_records[index & gh_mask];
  struct gh_ring_header *h = gh_hdr;
  /* Announce the write, then check that no writer has reserved this slot's next lap (seq_cst
   * pairs with gh_reserve's CAS and load); while announced, such a writer waits for us. */
  __atomic_store_n(&gh_gpu_busy, index + 1, __ATOMIC_SEQ_CST);
  int ok = __atomic_load_n(&h->head, __ATOMIC_SEQ_CST) <= index + gh_mask + 1 &&
           __atomic_load_n(&r->stamp, __ATOMIC_ACQUIRE) == index + 1;
  if (ok) {
    if (flags & GH_F_GPU_DONE) {
      __atomic_store_n(&r->gpu_start_ns, start_ns, __ATOMIC_RELAXED);
      __atomic_store_n(&r->gpu_end_ns, end_ns, __ATOMIC_RELAXED);
    }
    __atomic_fetch_or(&r->flags, flags, __ATOMIC_RELEASE);
  }
  __atomic_store_n(&gh_gpu_busy, 0, __ATOMIC_RELEASE);
  return ok;
}

/* A forked child (data-loader workers) must not write into its parent's ring. */
static void on_fork_child(void) {
  gh_disabled = 1;
  gh_hdr = NULL;
  gh_ctl = NULL;
  __atomic_store_n(&gh_ctl_word, &zero_ctl, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_gpu_busy, 0, __ATOMIC_RELAXED);
  ring_state = 2;
  pthread_mutex_init(&ring_lock, NULL);
  gh_profile_fork_child();
}

__attribute__((constructor)) static void gh_ring_init(void) {
  const char *off = getenv("GREYHOUND_HOOK_DISABLE");
  if (off != NULL && *off == '1') gh_disabled = 1;
  pthread_atfork(NULL, NULL, on_fork_child);
}
