/* Preloaded by a test before the hook: posix_fallocate fails as on a full filesystem (ENOSPC),
 * whatever the filesystem, so the hook's path for a ring it cannot reserve runs anywhere. */
#include <errno.h>
#include <sys/types.h>

int posix_fallocate(int fd, off_t offset, off_t len) {
  (void)fd;
  (void)offset;
  (void)len;
  return ENOSPC;
}

int posix_fallocate64(int fd, off_t offset, off_t len) { return posix_fallocate(fd, offset, len); }
