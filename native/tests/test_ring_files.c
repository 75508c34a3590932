/*
 * How the ring file is made and unmade, against ring.c linked in (each scenario in a fresh
 * process: this binary runs itself with the scenario's name, since a ring is made once per
 * process). A symlink planted at the temporary's name or at the ring's name is never followed;
 * a job directory that is a symlink is refused, one that others could write into is closed up;
 * a shared root that is a symlink, that others may write into without the sticky bit, or that
 * another user owns (when this test runs as root and can make one) is refused;
 * modes are 0600 / 0700 / 01777; a ring larger than RLIMIT_FSIZE is not attempted (growing the
 * file would send SIGXFSZ, which kills); the ring carries a write lock while its process lives;
 * it is removed at normal exit (not with GREYHOUND_RING_KEEP=1, not by a forked child, not when
 * the name now holds another file), and left for the agent's reaper after a kill.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../hook/gh_hook.h"

extern char **environ;

void gh_profile_fork_child(void) {} /* ring.c's fork handler; no profiler in this test */

#define NONCE0 0xabc0ull
/* The hook's first tries are predictable here, so a test can plant something where it looks. */
uint64_t gh_ring_nonce(void) {
  static uint64_t n = NONCE0;
  return n++;
}

static int failures;
#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);  \
      failures++;                                                                \
    }                                                                            \
  } while (0)

static char root[512], self[512];

static void path_of(char *out, size_t n, const char *job, const char *name) {
  snprintf(out, n, "%s/%s%s%s", root, job, name[0] ? "/" : "", name);
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  fputs(text, f);
  fclose(f);
}

static int file_says(const char *path, const char *text) {
  char buf[64] = {0};
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  return n == strlen(text) && memcmp(buf, text, n) == 0;
}

static int exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

/* pid of the process holding a write lock on the file, 0 when none. */
static pid_t lock_holder(const char *path) {
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return 0;
  struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
  int rc = fcntl(fd, F_GETLK, &lk);
  close(fd);
  return rc == 0 && lk.l_type != F_UNLCK ? lk.l_pid : 0;
}

/* Runs this binary as `scenario` for rank `rank` of `job`; returns its wait status. `stop` != 0:
 * the child is killed with that signal once it holds its ring (it then waits to be killed). */
static int run(const char *scenario, int rank, const char *job, int stop) {
  char rank_s[16], *argv[] = {self, (char *)scenario, rank_s, (char *)job, NULL};
  snprintf(rank_s, sizeof rank_s, "%d", rank);
  pid_t pid;
  if (posix_spawn(&pid, self, NULL, NULL, argv, environ) != 0) return -1;
  if (stop != 0) {
    char ring[700], name[32];
    snprintf(name, sizeof name, "rank-%d.ring", rank);
    path_of(ring, sizeof ring, job, name);
    for (int i = 0; i < 20000 && lock_holder(ring) != pid; i++) usleep(500);
    CHECK(lock_holder(ring) == pid); /* a live writer holds the lock */
    kill(pid, stop);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

static int exited_with(int status, int code) { return WIFEXITED(status) && WEXITSTATUS(status) == code; }

/* Entries of a directory whose name starts with '.', besides . and .. (temporaries). */
static int hidden_entries(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
    n += e->d_name[0] == '.' && strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  if (d != NULL) closedir(d);
  return n;
}

/* ---- the scenarios, each in its own process ----------------------------------------------- */

static int child(const char *scenario, int rank, const char *job) {
  setenv("GREYHOUND_JOB_ID", job, 1);
  setenv("GREYHOUND_RING_RECORDS", "16", 1);
  char ring[700], name[32];
  snprintf(name, sizeof name, "rank-%d.ring", rank);
  path_of(ring, sizeof ring, job, name);
  if (strcmp(scenario, "fsize") == 0) {
    struct rlimit rl;
    getrlimit(RLIMIT_FSIZE, &rl);
    rl.rlim_cur = 64 * 1024; /* the ring needs ~120 KiB */
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 3;
    return gh_ring_ensure(rank) ? 1 : 0; /* refused, and alive: no SIGXFSZ */
  }
  if (!gh_ring_ensure(rank)) return 2;
  if (strcmp(scenario, "forked") == 0) {
    pid_t p = fork();
    if (p == 0) exit(0); /* a data-loader worker leaving normally: runs the destructors */
    int st;
    waitpid(p, &st, 0);
    return exists(ring) ? 0 : 4;
  }
  if (strcmp(scenario, "replaced") == 0) { /* a restarted rank put its own ring at our name */
    char other[720];
    snprintf(other, sizeof other, "%s.other", ring);
    write_file(other, "newer");
    rename(other, ring);
  }
  if (strcmp(scenario, "hold") == 0) pause(); /* until killed */
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 4) {
    snprintf(root, sizeof root, "%s", getenv("GREYHOUND_SHM_DIR"));
    return child(argv[1], atoi(argv[2]), argv[3]);
  }
  alarm(120);
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n < 0) return 1;
  self[n] = '\0';
  const char *base = getenv("GREYHOUND_SHM_DIR");
  snprintf(root, sizeof root, "%s/ring-files-%d", base != NULL ? base : "/tmp", (int)getpid());
  char jobdir[600], ring[700], victim[700], dangling[700], planted[700], fresh[600], elsewhere[600];
  path_of(jobdir, sizeof jobdir, "files", "");
  snprintf(victim, sizeof victim, "%s-victim", root);
  snprintf(dangling, sizeof dangling, "%s-nothing", root);
  snprintf(elsewhere, sizeof elsewhere, "%s-elsewhere", root);
  CHECK(mkdir(root, 0755) == 0 && mkdir(elsewhere, 0700) == 0);
  setenv("GREYHOUND_SHM_DIR", root, 1);
  write_file(victim, "precious");

  /* The first temporary name the hook tries is a symlink to a file of ours, the ring's name a
   * symlink to nothing; the job directory is open to everyone. */
  CHECK(mkdir(jobdir, 0777) == 0 && chmod(jobdir, 0777) == 0);
  snprintf(planted, sizeof planted, "%s/.rank-0.ring.%016llx", jobdir, (unsigned long long)NONCE0);
  CHECK(symlink(victim, planted) == 0);
  path_of(ring, sizeof ring, "files", "rank-0.ring");
  CHECK(symlink(dangling, ring) == 0);
  setenv("GREYHOUND_RING_KEEP", "1", 1);
  CHECK(exited_with(run("made", 0, "files", 0), 0));
  unsetenv("GREYHOUND_RING_KEEP");
  struct stat st;
  CHECK(lstat(ring, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 07777) == 0600 && st.st_size > 4096);
  CHECK(file_says(victim, "precious") && !exists(dangling)); /* neither symlink was followed */
  CHECK(lstat(planted, &st) == 0 && S_ISLNK(st.st_mode));   /* left alone: O_EXCL refused it */
  CHECK(stat(jobdir, &st) == 0 && (st.st_mode & 07777) == 0700); /* closed up */
  CHECK(lock_holder(ring) == 0);                                 /* its writer is gone */
  unlink(planted);
  unlink(ring);

  /* A root the hook makes is shared like /tmp; the job directory in it is the user's own. */
  snprintf(fresh, sizeof fresh, "%s/fresh/shm", root);
  setenv("GREYHOUND_SHM_DIR", fresh, 1);
  CHECK(exited_with(run("made", 5, "files", 0), 0));
  CHECK(stat(fresh, &st) == 0 && (st.st_mode & 07777) == 01777);
  snprintf(planted, sizeof planted, "%s/files", fresh);
  CHECK(stat(planted, &st) == 0 && (st.st_mode & 07777) == 0700);
  setenv("GREYHOUND_SHM_DIR", root, 1);

  /* Normal exit removes the ring; a kill leaves it, unlocked, for the reaper. */
  path_of(ring, sizeof ring, "files", "rank-1.ring");
  CHECK(exited_with(run("made", 1, "files", 0), 0) && !exists(ring));
  int status = run("hold", 2, "files", SIGKILL);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  path_of(ring, sizeof ring, "files", "rank-2.ring");
  CHECK(exists(ring) && lock_holder(ring) == 0);

  /* A forked child's exit leaves the parent's ring; the parent's own exit removes it. */
  path_of(ring, sizeof ring, "files", "rank-3.ring");
  CHECK(exited_with(run("forked", 3, "files", 0), 0) && !exists(ring));

  /* The name now holds another process's file: it stays. */
  path_of(ring, sizeof ring, "files", "rank-4.ring");
  CHECK(exited_with(run("replaced", 4, "files", 0), 0) && file_says(ring, "newer"));

  /* Past RLIMIT_FSIZE: no ring and no SIGXFSZ. */
  path_of(ring, sizeof ring, "files", "rank-6.ring");
  CHECK(exited_with(run("fsize", 6, "files", 0), 0) && !exists(ring));

  /* A job directory that is a symlink is refused: nothing lands where it points. */
  path_of(planted, sizeof planted, "linked", "");
  CHECK(symlink(elsewhere, planted) == 0);
  CHECK(exited_with(run("made", 7, "linked", 0), 2)); /* no ring: recording disabled */
  snprintf(planted, sizeof planted, "%s/rank-7.ring", elsewhere);
  CHECK(!exists(planted) && hidden_entries(elsewhere) == 0);

  /* Roots another local user could swap things in: no ring, and nothing lands in them. */
  char shared[600], linked_root[600];
  snprintf(shared, sizeof shared, "%s-shared", root);
  snprintf(linked_root, sizeof linked_root, "%s-linked-root", root);
  CHECK(mkdir(shared, 0700) == 0 && chmod(shared, 01777) == 0 && symlink(shared, linked_root) == 0);
  setenv("GREYHOUND_SHM_DIR", linked_root, 1); /* the root itself a symlink */
  CHECK(exited_with(run("made", 8, "files", 0), 2));
  setenv("GREYHOUND_SHM_DIR", shared, 1);
  CHECK(chmod(shared, 0777) == 0); /* world-writable, not sticky */
  CHECK(exited_with(run("made", 9, "files", 0), 2));
  if (geteuid() == 0) { /* sticky, but another user's: they may rename what is in it */
    CHECK(chmod(shared, 01777) == 0 && chown(shared, 4242, 4242) == 0);
    CHECK(exited_with(run("made", 10, "files", 0), 2));
    CHECK(chown(shared, 0, 0) == 0);
  }
  CHECK(chmod(shared, 01777) == 0); /* sticky and ours (or root's): the ring is made */
  setenv("GREYHOUND_RING_KEEP", "1", 1);
  CHECK(exited_with(run("made", 11, "files", 0), 0));
  unsetenv("GREYHOUND_RING_KEEP");
  snprintf(planted, sizeof planted, "%s/files/rank-11.ring", shared);
  CHECK(exists(planted));
  for (int r = 8; r <= 10; r++) {
    snprintf(planted, sizeof planted, "%s/files/rank-%d.ring", shared, r);
    CHECK(!exists(planted));
  }
  setenv("GREYHOUND_SHM_DIR", root, 1);

  CHECK(hidden_entries(jobdir) == 0); /* no temporary left behind anywhere */
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s' '%s' '%s' '%s'", root, victim, elsewhere, shared,
           linked_root);
  CHECK(system(cmd) == 0);
  printf("test_ring_files: %s\n", failures ? "FAIL" : "ok");
  return failures != 0;
}
