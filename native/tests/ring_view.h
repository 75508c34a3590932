/* Test helper: map a rank's ring read-only-ish and check conditions without aborting early. */
#ifndef GH_RING_VIEW_H
#define GH_RING_VIEW_H
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "greyhound_ring.h"

__attribute__((unused)) static int gh_failures;
#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);  \
      gh_failures++;                                                             \
    }                                                                            \
  } while (0)

struct ring_view {
  struct gh_ring_header *h;
  struct gh_control *ctl;
  struct gh_comm_entry *comms;
  struct gh_record *rec;
  size_t bytes;
};

/* The hook's own mapping when this process has one: ThreadSanitizer tracks synchronisation by
 * address, so a second mapping of the same file would show false races. */
static void *hook_mapping(const char *path) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[8192];
  void *found = NULL;
  while (f != NULL && found == NULL && fgets(line, sizeof line, f) != NULL) {
    line[strcspn(line, "\n")] = '\0';
    char *p = strchr(line, '/');
    unsigned long lo;
    if (p != NULL && strcmp(p, path) == 0 && sscanf(line, "%lx-", &lo) == 1) found = (void *)lo;
  }
  if (f != NULL) fclose(f);
  return found;
}

static int ring_open(struct ring_view *v, const char *job, int rank) {
  char path[4096], real[4096];
  const char *dir = getenv("GREYHOUND_SHM_DIR");
  snprintf(path, sizeof path, "%s/%s/rank-%d.ring", dir ? dir : "/dev/shm/greyhound", job, rank);
  int fd = open(path, O_RDWR);
  if (fd < 0) return 0;
  struct stat st;
  fstat(fd, &st);
  void *m = realpath(path, real) != NULL ? hook_mapping(real) : NULL;
  if (m == NULL) m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 0;
  v->h = m;
  v->bytes = (size_t)st.st_size;
  v->ctl = (struct gh_control *)((char *)m + v->h->control_offset);
  v->comms = (struct gh_comm_entry *)((char *)m + v->h->comms_offset);
  v->rec = (struct gh_record *)((char *)m + v->h->records_offset);
  return 1;
}

__attribute__((unused)) static struct gh_record *ring_at(struct ring_view *v, uint64_t i) { return &v->rec[i & (v->h->capacity - 1)]; }

__attribute__((unused)) static struct gh_comm_entry *ring_comm(struct ring_view *v, uint64_t id) {
  for (int i = 0; i < GH_MAX_COMMS; i++)
    if (v->comms[i].comm_id == id && v->comms[i].state != GH_COMM_FREE) return &v->comms[i];
  return NULL;
}
#endif
