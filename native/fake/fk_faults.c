/*
 * The fault file is re-read when its identity (inode, size, mtime) changes, checked at most once
 * a millisecond (of the coarse monotonic clock, a few ms at most), so a writer that replaces it
 * atomically is seen promptly and cheaply. Between checks, asking for a kind no rule has costs a
 * clock read and one load, no lock: the fake CUDA asks on every event record and capture query.
 */
#include "fk_faults.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fk_time.h"

#define FK_CHECK_EVERY_NS 1000000LL

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int64_t g_next_check_ns;
static _Atomic unsigned g_kinds; /* bit k: some rule of kind k */
static struct stat g_seen;
static int g_have_file;
static int g_nrules;
static struct fk_rule g_rules[FK_MAX_RULES];

static const char *const g_names[FK_NKINDS] = {
    [FK_SLOW_RANK] = "slow_rank",         [FK_SLOW_LINK] = "slow_link",
    [FK_SKIP_CALL] = "skip_call",         [FK_MISMATCH] = "mismatch",
    [FK_NEVER_COMPLETE] = "never_complete", [FK_INPROGRESS] = "inprogress",
    [FK_GPU_LAG_MS] = "gpu_lag_ms",       [FK_CAPTURE] = "capture",
    [FK_SLOW_HOST] = "slow_host",         [FK_NVML_THROTTLE] = "nvml_throttle",
    [FK_NVML_XID] = "nvml_xid",           [FK_NVML_ECC] = "nvml_ecc",
    [FK_NVML_NVLINK] = "nvml_nvlink",     [FK_HOST_STALL] = "host_stall",
    [FK_STOP_CHANNEL] = "stop_channel",
};

/* NVML's clock event reason bits (nvmlClocksEventReason*), by the words a fault line uses. */
static const struct {
  const char *word;
  long bits;
} g_reasons[] = {
    {"idle", 0x1},         {"app_clocks", 0x2},   {"power", 0x4},         {"hw", 0x8},
    {"sync_boost", 0x10},  {"sw_thermal", 0x20},  {"hw_thermal", 0x40},   {"power_brake", 0x80},
    {"thermal", 0x60},     {"display", 0x100},
};

/* "thermal|power" -> its bits; 0 when a word is unknown (the line is then ignored). */
static long reason_bits(const char *words) {
  long bits = 0;
  char buf[64];
  snprintf(buf, sizeof buf, "%s", words);
  char *save = NULL;
  for (char *w = strtok_r(buf, "|,", &save); w != NULL; w = strtok_r(NULL, "|,", &save)) {
    long one = 0;
    for (size_t i = 0; i < sizeof g_reasons / sizeof g_reasons[0]; i++)
      if (strcmp(w, g_reasons[i].word) == 0) one = g_reasons[i].bits;
    if (one == 0) return 0;
    bits |= one;
  }
  return bits;
}

static void parse_line(const char *line) {
  char word[32];
  double x[3] = {0, 0, 0};
  int got = sscanf(line, " %31s %lf %lf %lf", word, &x[0], &x[1], &x[2]);
  if (got < 2 || word[0] == '#' || g_nrules >= FK_MAX_RULES) return;
  if (strcmp(word, "nvml_throttle") == 0) { /* the one kind whose argument is a word */
    long dev;
    char reasons[64];
    if (sscanf(line, " %*s %ld %63s", &dev, reasons) != 2) return;
    long bits = reason_bits(reasons);
    if (bits != 0) g_rules[g_nrules++] = (struct fk_rule){.kind = FK_NVML_THROTTLE, .a = dev, .b = bits, .v = 1.0};
    return;
  }
  for (int k = 0; k < FK_NKINDS; k++) {
    if (strcmp(word, g_names[k]) != 0) continue;
    struct fk_rule r = {.kind = k, .a = (long)x[0], .b = -1, .v = 1.0};
    switch (k) {
      case FK_SLOW_RANK:
      case FK_SLOW_HOST:
      case FK_GPU_LAG_MS:
      case FK_NVML_ECC:
      case FK_NVML_NVLINK:
        if (got < 3) return;
        r.v = x[1];
        break;
      case FK_SLOW_LINK:
      case FK_STOP_CHANNEL:
        if (got < 4) return;
        r.b = (long)x[1];
        r.v = x[2];
        break;
      case FK_SKIP_CALL:
      case FK_MISMATCH:
      case FK_NEVER_COMPLETE:
      case FK_HOST_STALL:
      case FK_NVML_XID:
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

static int64_t coarse_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void publish_kinds(void) {
  unsigned kinds = 0;
  for (int i = 0; i < g_nrules; i++) kinds |= 1u << g_rules[i].kind;
  atomic_store(&g_kinds, kinds);
}

/* Caller holds g_mu. */
static void refresh_locked(void) {
  int64_t now = coarse_now_ns();
  if (now < atomic_load(&g_next_check_ns)) return;
  const char *path = getenv("FAKE_NCCL_FAULTS");
  struct stat st;
  if (path == NULL || path[0] == '\0' || stat(path, &st) != 0) {
    g_have_file = 0;
    g_nrules = 0;
  } else if (!g_have_file || st.st_ino != g_seen.st_ino || st.st_size != g_seen.st_size ||
             st.st_mtim.tv_sec != g_seen.st_mtim.tv_sec || st.st_mtim.tv_nsec != g_seen.st_mtim.tv_nsec) {
    g_seen = st;
    g_have_file = 1;
    reload(path);
  }
  publish_kinds();
  atomic_store(&g_next_check_ns, now + FK_CHECK_EVERY_NS);
}

/* 1 when no rule of this kind can match until the next check: the caller needs no lock. */
static int surely_none(enum fk_kind kind) {
  return coarse_now_ns() < atomic_load(&g_next_check_ns) && !(atomic_load(&g_kinds) & (1u << kind));
}

static int matches(const struct fk_rule *r, enum fk_kind kind, long a, long b) {
  if (r->kind != (int)kind) return 0;
  switch (kind) {
    case FK_SLOW_LINK:
      return (r->a == a && r->b == b) || (r->a == b && r->b == a);
    case FK_SKIP_CALL:
    case FK_MISMATCH:
    case FK_NEVER_COMPLETE:
    case FK_HOST_STALL:
      return r->a == a && r->b == b;
    default:
      return r->a == a;
  }
}

int fk_fault_find(enum fk_kind kind, long a, long b, double *value) {
  if (surely_none(kind)) return 0;
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
  if (surely_none(kind)) return 0;
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

int fk_fault_mine(enum fk_kind kind, double *value) {
  if (surely_none(kind)) return 0;
  return fk_fault_find(kind, fk_global_rank(0), -1, value);
}
