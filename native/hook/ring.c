/*
 * The per-rank shared-memory ring. Created lazily at the first NCCL call that knows the rank
 * (from the launcher's environment, else the first communicator's rank), built under a temporary
 * name and renamed into place so that a reader never sees a half-written header. Writers never
 * wait on the reader: a slot is reserved with a CAS on head (gh_hook.h), refused (and counted) when
 * the reader's published cursor is a full ring behind. The one wait is for the poller, and only
 * while it is inside its few stores into the very slot being recycled (gh_ring_gpu_complete).
 *
 * The ring must never harm the process that writes it, so it fails closed: whatever goes wrong
 * while creating it leaves recording disabled and training untouched.
 * - Space is reserved up front (posix_fallocate): a sparse file on a full tmpfs (Docker's
 *   /dev/shm is 64 MB) would deliver SIGBUS at the first record. The ring is not created when
 *   it would take more than half of the space left (NCCL keeps its own buffers there), nor when
 *   it is larger than RLIMIT_FSIZE allows (growing past it sends SIGXFSZ, which kills).
 * - Files are created safely: the job directory is this user's own (0700, opened without
 *   following a symlink, refused when someone else owns it or can write into it), the temporary
 *   has a random name and is opened O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600; nothing is ever
 *   truncated through a name. The shared root ($GREYHOUND_SHM_DIR), when the hook creates it,
 *   is 01777 like /tmp: every user's jobs get their directory there, none can touch another's.
 *   A root found there is used only if it is a directory (not a symlink), owned by root or by
 *   this user, and sticky when others may write into it: in a root another user owns, or a
 *   world-writable one without the sticky bit, that user could rename the job's directory
 *   away and put one of theirs in its place, or have squatted the name before the job came.
 *   The agent therefore runs as the training user or as root (deploy/compose.yaml: root).
 * - The ring file stays open with a POSIX write lock for the life of the process: the agent's
 *   reaper takes an unlocked ring as one no live process writes (a lock dies with its process,
 *   kill -9 included, and is not inherited by forked children).
 * - At normal exit the ring is unlinked (the agent keeps reading what it has mapped);
 *   GREYHOUND_RING_KEEP=1 keeps it for a post-mortem read.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "gh_hook.h"

struct gh_ring_header *gh_hdr;
struct gh_control *gh_ctl;
struct gh_comm_entry *gh_comms;
struct gh_progress *gh_prog;
struct gh_record *gh_records;
uint32_t gh_mask;
int gh_disabled;

uint64_t gh_gpu_busy;
static const gh_ctl_word_t zero_ctl;
const gh_ctl_word_t *gh_ctl_word = &zero_ctl;

static int ring_state; /* 0 not tried, 1 ready, 2 failed for good */
static pthread_mutex_t ring_lock = PTHREAD_MUTEX_INITIALIZER;

/* What the exit handler needs: the job directory, the ring's name there, the open ring file
 * (holding the lock) and the process that made it; the temporary while it exists. */
static int job_fd = -1, ring_fd = -1, keep_ring;
static pid_t ring_pid;
static char ring_name[32], tmp_name[64];

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

/* The temporary's random suffix (weak: a test linking ring.c in picks its own, to plant a
 * symlink where the hook will try first; the library's own is hidden and cannot be replaced). */
__attribute__((weak)) uint64_t gh_ring_nonce(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v) {
    v = gh_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&v;
    v = (v ^ (v >> 31)) * 0xBF58476D1CE4E5B9ull;
  }
  return v;
}

/* $GREYHOUND_SHM_DIR, made if missing (ancestors 0755, the root itself 01777), and refused
 * unless nobody but root and this user can swap what is in it (see above). */
static int open_root(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    char buf[4096];
    if (strlen(dir) >= sizeof buf) return -1;
    strcpy(buf, dir);
    for (char *p = buf + 1; *p != '\0'; p++) {
      if (*p != '/') continue;
      *p = '\0';
      if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
      *p = '/';
    }
    int made = mkdir(dir, 0700) == 0;
    if (!made && errno != EEXIST) return -1;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat mine;
    if (fd >= 0 && made && fstat(fd, &mine) == 0 && mine.st_uid == geteuid()) fchmod(fd, 01777);
  }
  if (fd < 0) return -1; /* a symlink (ELOOP), not a directory, not reachable */
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || (st.st_uid != 0 && st.st_uid != geteuid()) ||
      ((st.st_mode & 022) != 0 && (st.st_mode & S_ISVTX) == 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

/* The job's directory: this user's own and writable by nobody else, or no ring at all. */
static int open_job_dir(int root, const char *job) {
  if (mkdirat(root, job, 0700) != 0 && errno != EEXIST) return -1;
  int fd = openat(root, job, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0) return -1;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
      ((st.st_mode & 022) != 0 && fchmod(fd, 0700) != 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Room for the ring: within RLIMIT_FSIZE (past it, growing the file sends SIGXFSZ), and at most
 * half of what the filesystem has left. */
static int room_for(int dirfd, uint64_t bytes) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && (uint64_t)rl.rlim_cur < bytes)
    return 0;
  struct statvfs fs;
  return fstatvfs(dirfd, &fs) != 0 || (uint64_t)fs.f_bavail * fs.f_frsize / 2 >= bytes;
}

static uint64_t page_up(uint64_t n) { return (n + 4095u) & ~(uint64_t)4095u; }

/* A new file under a random name, never one that exists (O_EXCL: a symlink planted there fails
 * the open instead of being followed). */
static int open_temp(int dirfd) {
  for (int tries = 0; tries < 8; tries++) {
    snprintf(tmp_name, sizeof tmp_name, ".%s.%016llx", ring_name, (unsigned long long)gh_ring_nonce());
    int fd = openat(dirfd, tmp_name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

static void fill_header(struct gh_ring_header *h, const char *job, int rank, uint32_t cap,
                        uint64_t control_off, uint64_t comms_off, uint64_t progress_off, uint64_t records_off,
                        uint64_t bytes) {
  h->magic = GH_RING_MAGIC;
  h->version = GH_LAYOUT_VERSION;
  h->header_bytes = GH_HEADER_BYTES;
  h->capacity = cap;
  h->record_bytes = sizeof(struct gh_record);
  h->max_comms = GH_MAX_COMMS;
  h->max_peers = GH_MAX_PEERS;
  h->control_offset = control_off;
  h->comms_offset = comms_off;
  h->progress_offset = progress_off;
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
}

static int create_ring(int rank) {
  const char *dir = getenv("GREYHOUND_SHM_DIR");
  const char *job = getenv("GREYHOUND_JOB_ID");
  if (dir == NULL || *dir == '\0') dir = "/dev/shm/greyhound";
  if (job == NULL || *job == '\0') job = "default";
  if (strchr(job, '/') != NULL || strlen(job) >= 64 || strcmp(job, ".") == 0 || strcmp(job, "..") == 0)
    return 0;
  uint32_t cap = env_capacity();
  uint64_t control_off = GH_HEADER_BYTES;
  uint64_t comms_off = page_up(control_off + sizeof(struct gh_control));
  uint64_t progress_off = page_up(comms_off + GH_MAX_COMMS * sizeof(struct gh_comm_entry));
  uint64_t records_off = page_up(progress_off + sizeof(struct gh_progress));
  uint64_t bytes = records_off + (uint64_t)cap * sizeof(struct gh_record);
  snprintf(ring_name, sizeof ring_name, "rank-%d.ring", rank);

  int root = open_root(dir);
  if (root < 0) return 0;
  int dfd = open_job_dir(root, job);
  close(root);
  if (dfd < 0) return 0;
  int fd = room_for(dfd, bytes) ? open_temp(dfd) : -1;
  if (fd < 0) {
    tmp_name[0] = '\0';
    close(dfd);
    return 0;
  }
  job_fd = dfd; /* from here the exit handler removes the temporary should we not finish */
  struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
  (void)fcntl(fd, F_SETLK, &lock); /* best effort: without it the reaper judges by pid */
  void *m = MAP_FAILED;
  if (posix_fallocate(fd, 0, (off_t)bytes) == 0)
    m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m != MAP_FAILED) {
    fill_header(m, job, rank, cap, control_off, comms_off, progress_off, records_off, bytes);
    struct gh_control *ctl = (struct gh_control *)((char *)m + control_off);
    ctl->job_timeout_ms = gh_env_timeout_ms();
    ctl->pause_cap_ms = ctl->job_timeout_ms / GH_PAUSE_TIMEOUT_SHARE;
    if (renameat(dfd, tmp_name, dfd, ring_name) != 0) {
      munmap(m, bytes);
      m = MAP_FAILED;
    }
  }
  if (m == MAP_FAILED) {
    unlinkat(dfd, tmp_name, 0);
    tmp_name[0] = '\0';
    close(fd);
    job_fd = -1;
    close(dfd);
    return 0;
  }
  tmp_name[0] = '\0';
  ring_fd = fd;
  ring_pid = getpid();
  struct gh_ring_header *h = m;
  gh_ctl = (struct gh_control *)((char *)m + control_off);
  __atomic_store_n(&gh_ctl_word, (const gh_ctl_word_t *)gh_ctl, __ATOMIC_RELEASE);
  gh_comms = (struct gh_comm_entry *)((char *)m + comms_off);
  gh_records = (struct gh_record *)((char *)m + records_off);
  __atomic_store_n(&gh_prog, (struct gh_progress *)((char *)m + progress_off), __ATOMIC_RELEASE);
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
  gh_prog = NULL; /* a forked child's NCCL (if it made one) counts nowhere */
  __atomic_store_n(&gh_ctl_word, &zero_ctl, __ATOMIC_RELAXED);
  __atomic_store_n(&gh_gpu_busy, 0, __ATOMIC_RELAXED);
  ring_state = 2;
  job_fd = -1; /* the parent's: the child's exit must not remove them */
  tmp_name[0] = '\0';
  pthread_mutex_init(&ring_lock, NULL);
  gh_profile_fork_child();
}

__attribute__((constructor)) static void gh_ring_init(void) {
  const char *off = getenv("GREYHOUND_HOOK_DISABLE");
  if (off != NULL && *off == '1') gh_disabled = 1;
  const char *keep = getenv("GREYHOUND_RING_KEEP");
  keep_ring = keep != NULL && *keep == '1';
  pthread_atfork(NULL, NULL, on_fork_child);
}

/* Normal exit: the ring goes (an agent still reads what it has mapped), and so does a temporary
 * left by a creation this exit interrupted. Only the process that made it removes it, and only
 * if the name still holds its file (a restarted rank may have put its own there). Nothing is
 * unmapped: other threads may still be recording. */
__attribute__((destructor)) static void gh_ring_fini(void) {
  int saved = errno;
  if (job_fd >= 0 && tmp_name[0] != '\0') unlinkat(job_fd, tmp_name, 0);
  struct stat mine, named;
  if (__atomic_load_n(&ring_state, __ATOMIC_ACQUIRE) == 1 && !keep_ring && getpid() == ring_pid &&
      fstat(ring_fd, &mine) == 0 && fstatat(job_fd, ring_name, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
      mine.st_dev == named.st_dev && mine.st_ino == named.st_ino)
    unlinkat(job_fd, ring_name, 0);
  errno = saved;
}
