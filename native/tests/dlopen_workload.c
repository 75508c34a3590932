/* The RTLD_LOCAL consumer of the real workload: dlopen libghworkload.so (NEEDED libnccl.so.2) the
 * way Python imports torch, then run its entry point. The hook must see every call. */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  int (*entry)(int, char **) = (int (*)(int, char **))dlsym(h, "gh_workload_main");
  return entry == NULL ? 3 : entry(1, argv);
}
