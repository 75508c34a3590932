/*
 * Finding the real NCCL (and CUDA) entry points. PyTorch loads NCCL with RTLD_LOCAL, so
 * dlsym(RTLD_NEXT) finds nothing there; dlopen(RTLD_NOLOAD) of the soname does. Programs linked
 * at start-up are covered by RTLD_NEXT; a renamed library by scanning /proc/self/maps. The
 * pnccl alias is preferred because it can never be our own wrapper.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "gh_hook.h"

static void *lookup_in(void *handle, const char *name, void *self) {
  if (handle == NULL) return NULL;
  void *p = dlsym(handle, name);
  return p == self ? NULL : p;
}

/* Path of the first mapped object whose basename starts with prefix, for renamed sonames. */
static int mapped_path(const char *prefix, char *out, size_t outlen) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (f == NULL) return 0;
  char line[4096];
  int found = 0;
  size_t plen = strlen(prefix);
  while (!found && fgets(line, sizeof line, f) != NULL) {
    char *path = strchr(line, '/');
    if (path == NULL) continue;
    path[strcspn(path, "\n")] = '\0';
    const char *base = strrchr(path, '/') + 1;
    if (strncmp(base, prefix, plen) == 0 && strstr(base, ".so") != NULL &&
        strstr(base, "greyhound") == NULL && strlen(path) < outlen) {
      strcpy(out, path);
      found = 1;
    }
  }
  fclose(f);
  return found;
}

void *gh_find_library_symbol(const char *lib_prefix, const char *const *sonames, const char *name) {
  for (const char *const *s = sonames; *s != NULL; s++) {
    void *h = dlopen(*s, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) continue;
    void *p = dlsym(h, name);
    dlclose(h);
    if (p != NULL) return p;
  }
  char path[4096];
  if (mapped_path(lib_prefix, path, sizeof path)) {
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (h != NULL) {
      void *p = dlsym(h, name);
      dlclose(h);
      return p;
    }
  }
  return NULL;
}

void *gh_real(const char *name, void *self) {
  static const char *const sonames[] = {"libnccl.so.2", "libnccl.so", NULL};
  char pname[128];
  snprintf(pname, sizeof pname, "p%s", name);
  for (const char *const *s = sonames; *s != NULL; s++) {
    void *h = dlopen(*s, RTLD_LAZY | RTLD_NOLOAD);
    void *p = lookup_in(h, pname, self);
    if (p == NULL) p = lookup_in(h, name, self);
    if (h != NULL) dlclose(h); /* NOLOAD took a reference; the library stays loaded */
    if (p != NULL) return p;
  }
  void *p = lookup_in(RTLD_NEXT, pname, self);
  if (p == NULL) p = lookup_in(RTLD_NEXT, name, self);
  if (p != NULL) return p;
  p = gh_find_library_symbol("libnccl", (const char *const[]){NULL}, pname);
  if (p == NULL || p == self) p = gh_find_library_symbol("libnccl", (const char *const[]){NULL}, name);
  return p == self ? NULL : p;
}
