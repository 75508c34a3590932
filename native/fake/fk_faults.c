/*
 * The fault file is re-read when its identity (inode, size, mtime) changes, checked at most once
 * a millisecond, so a writer that replaces it atomically is seen promptly and cheaply.
 */
#include "fk_faults.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fk_time.h"

#define FK_CHECK_EVERY_NS 1000000LL

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_next_check_ns;
static struct stat g_seen;
static int g_have_file;
static int g_nrules;
static struct fk_rule g_rules[FK_MAX_RULES];

static const char *const g_names[FK_NKINDS] = {
    [FK_SLOW_RANK] = "slow_rank",         [FK_SLOW_LINK] = "slow_link",
    [FK_SKIP_CALL] = "skip_call",         [FK_MISMATCH] = "mismatch",
    [FK_NEVER_COMPLETE] = "never_complete", [FK_INPROGRESS] = "inprogress",
    [FK_GPU_LAG_MS] = "gpu_lag_ms",       [FK_CAPTURE] = "capture",
    [FK_SLOW_HOST] = "slow_host",
};

static void parse_line(const char *line) {
  char word[32];
  double x[3] = {0, 0, 0};
  int got = sscanf(line, " %31s %lf %lf %lf", word, &x[0], &x[1], &x[2]);
  if (got < 2 || word[0] == '#' || g_nrules >= FK_MAX_RULES) return;
  for (int k = 0; k < FK_NKINDS; k++) {
    if (strcmp(word, g_names[k]) != 0) continue;
    struct fk_rule r = {.kind = k, .a = (long)x[0], .b = -1, .v = 1.0};
    switch (k) {
      case FK_SLOW_RANK:
      case FK_SLOW_HOST:
      case FK_GPU_LAG_MS:
        if (got < 3) return;
        r.v = x[1];
        break;
      case FK_SLOW_LINK:
        if (got < 4) return;
        r.b = (long)x[1];
        r.v = x[2];
        break;
      case FK_SKIP_CALL:
      case FK_MISMATCH:
      case FK_NEVER_COMPLETE:
        if (got < 3) return;
        r.b = (long)x[1];
        break;
      default:
        break;
    }
    g_rules[g_nrules++] = r;
    return;
  }
}

static void reload(const char *path) {
  g_nrules = 0;
  FILE *f = fopen(path, "r");
  if (f == NULL) return;
  char line[256];
  while (fgets(line, sizeof line, f) != NULL) parse_line(line);
  fclose(f);
}

/* Caller holds g_mu. */
static void refresh_locked(void) {
  int64_t now = fk_now_ns();
  if (now < g_next_check_ns) return;
  g_next_check_ns = now + FK_CHECK_EVERY_NS;
  const char *path = getenv("FAKE_NCCL_FAULTS");
  struct stat st;
  if (path == NULL || path[0] == '\0' || stat(path, &st) != 0) {
    g_have_file = 0;
    g_nrules = 0;
    return;
  }
  if (g_have_file && st.st_ino == g_seen.st_ino && st.st_size == g_seen.st_size &&
      st.st_mtim.tv_sec == g_seen.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_seen.st_mtim.tv_nsec)
    return;
  g_seen = st;
  g_have_file = 1;
  reload(path);
}

static int matches(const struct fk_rule *r, enum fk_kind kind, long a, long b) {
  if (r->kind != (int)kind) return 0;
  switch (kind) {
    case FK_SLOW_LINK:
      return (r->a == a && r->b == b) || (r->a == b && r->b == a);
    case FK_SKIP_CALL:
    case FK_MISMATCH:
    case FK_NEVER_COMPLETE:
      return r->a == a && r->b == b;
    default:
      return r->a == a;
  }
}

int fk_fault_find(enum fk_kind kind, long a, long b, double *value) {
  int found = 0;
  pthread_mutex_lock(&g_mu);
  refresh_locked();
  for (int i = 0; i < g_nrules; i++) {
    if (matches(&g_rules[i], kind, a, b)) {
      if (value != NULL) *value = g_rules[i].v;
      found = 1;
      break;
    }
  }
  pthread_mutex_unlock(&g_mu);
  return found;
}

int fk_fault_collect(enum fk_kind kind, struct fk_rule *out, int max) {
  int n = 0;
  pthread_mutex_lock(&g_mu);
  refresh_locked();
  for (int i = 0; i < g_nrules && n < max; i++)
    if (g_rules[i].kind == (int)kind) out[n++] = g_rules[i];
  pthread_mutex_unlock(&g_mu);
  return n;
}

int fk_global_rank(int fallback) {
  const char *s = getenv("RANK");
  if (s == NULL || s[0] == '\0') return fallback;
  return atoi(s);
}
