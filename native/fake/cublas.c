/*
 * A fake cuBLAS with a real (naive, column-major) CPU SGEMM, run on the fake device: the call
 * returns at once and the GEMM runs when the handle's stream reaches it, holding the device's SMs
 * (see gpu.h), for 2mnk / FAKE_GPU_GFLOPS of device time whatever the CPU took (unset: what the
 * CPU took). `slow_rank R factor` stretches each GEMM of rank R to factor x its time by sleeping
 * the difference, decided when the device runs it, so a validator's GEMM benchmark finds the slow
 * "GPU" without burning extra CPU.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cuda_fake.h"
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

/* Scalars are read at launch (host pointer mode); matrices when the device runs it, as on a GPU. */
struct gemm_work {
  struct fakeGpuWork w;
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *A, *B;
  float *C;
};

static void gemm_run(struct fakeGpuWork *w) {
  const struct gemm_work *g = (const struct gemm_work *)w;
  int64_t t0 = fk_now_ns();
  for (int j = 0; j < g->n; j++)
    for (int i = 0; i < g->m; i++) {
      float acc = 0.0f;
      for (int p = 0; p < g->k; p++) acc += at(g->A, g->lda, g->ta, i, p) * at(g->B, g->ldb, g->tb, p, j);
      float *c = &g->C[i + (size_t)j * (size_t)g->ldc];
      *c = g->alpha * acc + (g->beta == 0.0f ? 0.0f : g->beta * *c);
    }
  /* A GPU runs a GEMM at its own speed whatever the host does: with FAKE_GPU_GFLOPS set, the
   * GEMM lasts 2mnk / rate on the device's timeline, however long the CPU took to compute its
   * result (on 2 shared cores, other processes can stretch that several times, and a "GPU" whose
   * speed followed the scheduler would make GEMM checks compare CPU contention). A slow rank's
   * GPU stretches that time by its factor. Unset: what the CPU takes. */
  int64_t took = fk_now_ns() - t0;
  double rate = gpu_gflops();
  if (rate > 0.0) took = (int64_t)(2.0 * (double)g->m * (double)g->n * (double)g->k / rate);
  took = (int64_t)((double)took * fakeGpuSlowFactor());
  w->end_ns = w->start_ns + took; /* on the device's timeline, from when the SMs took it */
  fk_sleep_until(w->end_ns);
}

static void gemm_release(struct fakeGpuWork *w) { free(w); }

GH_EXPORT cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                        int m, int n, int k, const float *alpha, const float *A, int lda,
                                        const float *B, int ldb, const float *beta, float *C, int ldc) {
  if (handle == NULL || handle->magic != FK_CUBLAS_MAGIC) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || alpha == NULL || beta == NULL || ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  if (C == NULL || (k > 0 && (A == NULL || B == NULL))) return CUBLAS_STATUS_INVALID_VALUE;
  struct gemm_work *g = malloc(sizeof *g);
  if (g == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
  *g = (struct gemm_work){.w = {.run = gemm_run, .release = gemm_release, .compute = 1}, .ta = transa,
                          .tb = transb, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc,
                          .alpha = *alpha, .beta = *beta, .A = A, .B = B, .C = C};
  if (fakeGpuLaunch(handle->stream, &g->w) != cudaSuccess) {
    free(g);
    return CUBLAS_STATUS_NOT_INITIALIZED; /* no device (e.g. a forked child) */
  }
  return CUBLAS_STATUS_SUCCESS;
}
