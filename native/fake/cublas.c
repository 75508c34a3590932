/*
 * A fake cuBLAS with a real (naive, column-major) CPU SGEMM. `slow_rank R factor` stretches each
 * GEMM of rank R to factor x its measured time by sleeping the difference, so a validator's GEMM
 * benchmark finds the slow "GPU" without burning extra CPU.
 */
#include <stdlib.h>

#include "cuda_fake.h"
#include "fk_faults.h"
#include "fk_time.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define FK_CUBLAS_MAGIC 0x63626c73u

struct cublasContext {
  unsigned magic;
  cudaStream_t stream;
};

GH_EXPORT cublasStatus_t cublasCreate_v2(cublasHandle_t *handle) {
  if (handle == NULL) return CUBLAS_STATUS_INVALID_VALUE;
  cublasHandle_t h = calloc(1, sizeof *h);
  if (h == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
  h->magic = FK_CUBLAS_MAGIC;
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

GH_EXPORT cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == NULL || handle->magic != FK_CUBLAS_MAGIC) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->magic = 0;
  free(handle);
  return CUBLAS_STATUS_SUCCESS;
}

GH_EXPORT cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == NULL || handle->magic != FK_CUBLAS_MAGIC) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

/* FAKE_GPU_GFLOPS, read once (a benign race: every thread reads the same value). */
static double gpu_gflops(void) {
  static double rate = -1.0;
  if (rate < 0.0) {
    const char *v = getenv("FAKE_GPU_GFLOPS");
    double r = v != NULL ? strtod(v, NULL) : 0.0;
    rate = r > 0.0 ? r : 0.0;
  }
  return rate;
}

static float at(const float *M, int ld, cublasOperation_t op, int i, int j) {
  return op == CUBLAS_OP_N ? M[i + (size_t)j * (size_t)ld] : M[j + (size_t)i * (size_t)ld];
}

GH_EXPORT cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                        int m, int n, int k, const float *alpha, const float *A, int lda,
                                        const float *B, int ldb, const float *beta, float *C, int ldc) {
  if (handle == NULL || handle->magic != FK_CUBLAS_MAGIC) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || alpha == NULL || beta == NULL || ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  if (C == NULL || (k > 0 && (A == NULL || B == NULL))) return CUBLAS_STATUS_INVALID_VALUE;
  int64_t t0 = fk_now_ns();
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      float acc = 0.0f;
      for (int p = 0; p < k; p++) acc += at(A, lda, transa, i, p) * at(B, ldb, transb, p, j);
      float *c = &C[i + (size_t)j * (size_t)ldc];
      *c = *alpha * acc + (*beta == 0.0f ? 0.0f : *beta * *c);
    }
  /* A GPU runs a GEMM at its own speed whatever the host does: with FAKE_GPU_GFLOPS set, the call
   * lasts at least 2mnk / rate, so GEMM checks on 2 shared CPU cores measure the fake "GPU" and
   * not the scheduler. A slow rank's GPU stretches that time by its factor. */
  int64_t took = fk_now_ns() - t0;
  double rate = gpu_gflops();
  if (rate > 0.0) {
    int64_t nominal = (int64_t)(2.0 * (double)m * (double)n * (double)k / rate);
    if (took < nominal) took = nominal;
  }
  double factor = 1.0;
  if (fk_fault_find(FK_SLOW_RANK, fk_global_rank(0), -1, &factor) && factor > 1.0)
    took = (int64_t)((double)took * factor);
  int64_t left = t0 + took - fk_now_ns();
  if (left > 0) fk_sleep_ns(left);
  return CUBLAS_STATUS_SUCCESS;
}
