/* The RTLD_LOCAL consumer: dlsym(RTLD_NEXT) cannot see NCCL here; the hook must use RTLD_NOLOAD. */
#include <dlfcn.h>

#include "ring_view.h"

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  setenv("GREYHOUND_JOB_ID", "rtld-local", 1);
  setenv("RANK", "5", 1);
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  int (*run)(int) = (int (*)(int))dlsym(h, "stub_user_run");
  CHECK(run != NULL && run(10) == 0);
  struct ring_view v;
  CHECK(ring_open(&v, "rtld-local", 5));
  if (gh_failures == 0) {
    CHECK(v.h->rank == 5);
    int allreduce = 0;
    for (uint64_t i = 0; i < v.h->head; i++) allreduce += ring_at(&v, i)->op == GH_OP_ALLREDUCE;
    CHECK(allreduce == 10);
  }
  printf("test_hook_rtld_local: %s\n", gh_failures ? "FAIL" : "ok");
  return gh_failures != 0;
}
