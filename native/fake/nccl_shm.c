/*
 * Attaching to a communicator's segment and waiting on it. Every rank creates-or-opens the same
 * name, so no rank has to come first; rank 0 unlinks the name once all ranks attached, so a killed
 * job leaves nothing behind in /dev/shm after initialisation.
 */
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fk_time.h"
#include "nccl_fake.h"
#include "nccl_prof.h"

#define FK_WAIT_SLICE_NS 50000000LL /* re-check aborts and faults this often while blocked */

int fk_noop;

__attribute__((constructor)) static void fk_init_env(void) {
  const char *s = getenv("FAKE_NCCL_NOOP");
  fk_noop = s != NULL && s[0] == '1';
}

static void shm_name(const ncclUniqueId *id, char *out, size_t n) {
  static const char hex[] = "0123456789abcdef";
  size_t k = (size_t)snprintf(out, n, "/ghfk-");
  for (int i = 8; i < 24 && k + 2 < n; i++) {
    unsigned char b = (unsigned char)id->internal[i];
    out[k++] = hex[b >> 4];
    out[k++] = hex[b & 15];
  }
  out[k] = '\0';
}

void fk_bump(struct fk_shm *s) {
  atomic_fetch_add(&s->gen, 1);
  syscall(SYS_futex, (uint32_t *)&s->gen, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int fk_comm_ok(const struct ncclComm *c) { return c != NULL && c->magic == FK_COMM_MAGIC; }

void fk_log(const char *fmt, ...) {
  const char *path = getenv("FAKE_NCCL_LOG");
  if (path == NULL || path[0] == '\0') return;
  FILE *f = fopen(path, "a");
  if (f == NULL) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fclose(f);
}

ncclResult_t fk_attach(struct ncclComm **out, const ncclUniqueId *id, int nranks, int rank, int global_rank) {
  if (out == NULL || nranks < 1 || nranks > FK_MAX_RANKS || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  if (memcmp(id->internal, FK_ID_MAGIC, 8) != 0) return ncclInvalidArgument;
  char name[64];
  shm_name(id, name, sizeof name);
  int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) return ncclSystemError;
  struct stat st;
  if (fstat(fd, &st) != 0 || (st.st_size < (off_t)sizeof(struct fk_shm) &&
                              ftruncate(fd, (off_t)sizeof(struct fk_shm)) != 0)) {
    close(fd);
    return ncclSystemError;
  }
  void *p = mmap(NULL, sizeof(struct fk_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return ncclSystemError;
  struct ncclComm *c = calloc(1, sizeof *c);
  if (c == NULL) {
    munmap(p, sizeof(struct fk_shm));
    return ncclSystemError;
  }
  c->magic = FK_COMM_MAGIC;
  atomic_init(&c->refs, 1);
  c->shm = p;
  c->id = *id;
  c->rank = rank;
  c->nranks = nranks;
  c->global_rank = global_rank;
  c->shm->nranks = nranks;
  c->shm->global_rank[rank] = global_rank;
  atomic_fetch_add(&c->shm->attached, 1);
  fk_bump(c->shm);
  *out = c;
  return ncclSuccess;
}

static int all_attached(const struct ncclComm *c, const void *arg) {
  (void)arg;
  return (int)atomic_load(&c->shm->attached) >= c->nranks;
}

/* Once every rank attached the communicator exists: NCCL initialises the profiler plugin's
 * context for it then (before its proxy thread starts). */
ncclResult_t fk_wait_attached(struct ncclComm *c) {
  ncclResult_t r = fk_wait(c, all_attached, NULL);
  if (r == ncclSuccess && c->rank == 0) {
    char name[64];
    shm_name(&c->id, name, sizeof name);
    shm_unlink(name);
  }
  if (r == ncclSuccess) fk_prof_comm_init(c);
  return r;
}

/* The host's handle and every batch still on a device hold a reference; the last one unmaps,
 * after the plugin's context goes (no device event of it can come later). */
void fk_comm_unref(struct ncclComm *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1) return;
  fk_prof_comm_fini(c);
  if (c->last != NULL) fk_batch_put(c->last);
  c->magic = 0;
  munmap(c->shm, sizeof(struct fk_shm));
  free(c);
}

ncclResult_t fk_wait(struct ncclComm *c, fk_ready_fn ready, const void *arg) {
  for (;;) {
    uint32_t g = atomic_load(&c->shm->gen);
    if (atomic_load(&c->aborted)) return ncclInvalidUsage;
    if (atomic_load(&c->shm->aborted)) return ncclRemoteError;
    if (ready(c, arg)) return ncclSuccess;
    struct timespec slice = {.tv_sec = 0, .tv_nsec = FK_WAIT_SLICE_NS};
    syscall(SYS_futex, (uint32_t *)&c->shm->gen, FUTEX_WAIT, g, &slice, NULL, 0);
  }
}
