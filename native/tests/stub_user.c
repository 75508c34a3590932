/* A consumer library that needs libnccl.so.2, loaded by the test with dlopen(RTLD_LOCAL) the way
 * Python loads libtorch_cuda.so: the hook must still see its calls. */
#include "nccl_abi.h"

__attribute__((visibility("default"))) int stub_user_run(int iters) {
  ncclUniqueId id = {{7}};
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) return -1;
  for (int i = 0; i < iters; i++)
    if (ncclAllReduce(NULL, NULL, 16, ncclFloat32, ncclSum, comm, NULL) != ncclSuccess) return -2;
  return ncclCommDestroy(comm) == ncclSuccess ? 0 : -3;
}
