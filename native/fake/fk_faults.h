/*
 * Run-time fault injection shared by the fake NCCL, CUDA, cuBLAS and the workload. Each library
 * links its own hidden copy; all of them read the file named by FAKE_NCCL_FAULTS, so a test changes
 * the behaviour of a running job by rewriting one file. Format (one fault a line, '#' comments):
 *   slow_rank R factor | slow_link A B factor | skip_call R seq | mismatch R seq
 *   never_complete R seq | inprogress R | gpu_lag_ms R ms | capture R | slow_host R factor
 *   host_stall R seq | stop_channel R C seq
 *   nvml_throttle G thermal|power|hw|... | nvml_xid G code | nvml_ecc G count | nvml_nvlink G count
 * Ranks are global ranks (env RANK); G is an NVML device index (the fake NVML's; the fake job
 * gives rank r device r). Removing a line ends that fault.
 */
#ifndef GH_FK_FAULTS_H
#define GH_FK_FAULTS_H

enum fk_kind {
  FK_SLOW_RANK,
  FK_SLOW_LINK,
  FK_SKIP_CALL,
  FK_MISMATCH,
  FK_NEVER_COMPLETE,
  FK_INPROGRESS,
  FK_GPU_LAG_MS,
  FK_CAPTURE,
  FK_SLOW_HOST,
  FK_NVML_THROTTLE, /* b: bitmask of nvmlClocksEventReason* from the reason words */
  FK_NVML_XID,      /* b: the Xid code */
  FK_NVML_ECC,      /* v: volatile uncorrected ECC errors */
  FK_NVML_NVLINK,   /* v: NVLink CRC errors */
  FK_HOST_STALL,    /* b: the collective seq whose call blocks the host inside NCCL */
  FK_STOP_CHANNEL,  /* b: the channel (-1 every one), v: the collective seq, where rank a stops sending */
  FK_NKINDS
};

#define FK_MAX_RULES 256

struct fk_rule {
  int kind;
  long a, b;
  double v;
};

/* Returns 1 and the rule's value when a fault of that kind matches. slow_link matches either
 * direction; kinds keyed by rank alone ignore b. */
int fk_fault_find(enum fk_kind kind, long a, long b, double *value);

/* Copies the current rules of one kind (at most max) so hot loops need no lock per lookup. */
int fk_fault_collect(enum fk_kind kind, struct fk_rule *out, int max);

/* The global rank from env RANK, or fallback when unset. */
int fk_global_rank(int fallback);

/* fk_fault_find for a kind keyed by this process's own rank (RANK, else 0); reads the environment
 * only when some rule of that kind exists, so the fake CUDA can ask on every call. */
int fk_fault_mine(enum fk_kind kind, double *value);

#endif
