/*
 * Shared-memory layout between the hook (one writer process per rank) and the node agent (one
 * reader). The layout is versioned: any change to a struct below bumps GH_LAYOUT_VERSION, and
 * greyhound/hookabi/layout.py mirrors it field for field (the tests compare offsets and sizes).
 *
 * One file per rank, $GREYHOUND_SHM_DIR/$GREYHOUND_JOB_ID/rank-<global rank>.ring:
 *   [0, 4096)                      gh_ring_header
 *   [control_offset, +sizeof)      gh_control      (agent writes requests, hook writes answers)
 *   [comms_offset, +max_comms*)    gh_comm_entry[] (live per-communicator counters)
 *   [progress_offset, +sizeof)     gh_progress     (v6: the profiler plugin's counters)
 *   [records_offset, +capacity*)   gh_record[]     (slot = index & (capacity - 1))
 * Offsets are stored in the header so that readers never hard-code them.
 */
#ifndef GREYHOUND_RING_H
#define GREYHOUND_RING_H

#include <stdint.h>

#define GH_RING_MAGIC 0x31474e4952484721ULL /* "!GHRING1" little-endian */
#define GH_LAYOUT_VERSION 6u
#define GH_HEADER_BYTES 4096u
#define GH_DEFAULT_RECORDS 65536u
#define GH_MAX_COMMS 64
#define GH_MAX_PEERS 64
#define GH_BENCH_SLOTS 16
#define GH_BENCH_MAX_REPEAT 64
/* Benchmark bounds the hook enforces (a request beyond them ends FAILED, ncclInvalidArgument):
 * a GEMM of N needs 3 N^2 floats of scratch (3 GiB at the bound), a transfer its size. */
#define GH_BENCH_MAX_GEMM_N 16384
#define GH_BENCH_MAX_P2P_BYTES (1ull << 30)
/* A pause is a lease: the hook resumes by itself at pause_lease_ns, or this long after it first
 * saw a request whose lease is 0 (GREYHOUND_PAUSE_LEASE_MS overrides the default); a deadline
 * further out than the maximum is brought in to it. */
#define GH_PAUSE_LEASE_DEFAULT_MS 30000
#define GH_PAUSE_LEASE_MAX_MS 600000
/* (v5) A pause never lasts longer than this share of the job's collective timeout (the process
 * group's, as the rank reports it: GREYHOUND_PG_TIMEOUT_S, written into job_timeout_ms): the
 * parked call was stamped by the framework before the hook parked it, so the pause counts toward
 * that collective's timeout (PyTorch's watchdog aborts the communicator, and the process, once it
 * passes). */
#define GH_PAUSE_TIMEOUT_SHARE 4
/* (v5) Benchmark communicators (split from the job's for P2P checks) alive at once. */
#define GH_BENCH_MAX_COMMS 16
/* (v6) The NCCL profiler plugin's counters (gh_progress): fixed slot tables, whatever the scale. */
#define GH_PROG_SLOTS 64   /* (communicator, channel, peer, direction) of network transfers */
#define GH_KCH_SLOTS 32    /* (communicator, channel) of kernels */
#define GH_PROG_CLASSES 16 /* events counted per class, one per bit of NCCL's activation mask */

/* Operation codes; values are part of the layout. */
enum gh_op {
  GH_OP_NONE = 0,
  GH_OP_ALLREDUCE = 1,
  GH_OP_ALLGATHER = 2,
  GH_OP_REDUCESCATTER = 3,
  GH_OP_BROADCAST = 4,
  GH_OP_REDUCE = 5,
  GH_OP_ALLTOALL = 6,
  GH_OP_SEND = 7,
  GH_OP_RECV = 8,
  GH_OP_GROUP_START = 16,
  GH_OP_GROUP_END = 17,
  GH_OP_COMM_INIT = 32,
  GH_OP_COMM_INIT_ALL = 33,
  GH_OP_COMM_SPLIT = 34,
  GH_OP_COMM_DESTROY = 35,
  GH_OP_COMM_ABORT = 36,
  GH_OP_ASYNC_ERROR = 37,
  GH_OP_COMM_SHRINK = 38 /* (v5) */
};

/* Record flags. */
#define GH_F_CAPTURED 0x01u    /* stream was capturing a CUDA graph: no events recorded */
#define GH_F_ABORTED 0x02u     /* communicator aborted/destroyed before GPU completion */
#define GH_F_IN_PROGRESS 0x04u /* call returned ncclInProgress (non-blocking communicator) */
#define GH_F_PROFILED 0x08u    /* CUDA events were recorded; GPU times follow */
#define GH_F_GPU_DONE 0x10u    /* gpu_start_ns / gpu_end_ns are valid (written by the poller) */
#define GH_F_IN_GROUP 0x20u    /* issued between ncclGroupStart and the outermost ncclGroupEnd */
#define GH_F_GPU_LOST 0x40u    /* profiled, but GPU times could not be obtained */

enum gh_mode { GH_MODE_MONITOR = 0, GH_MODE_PROFILE = 1 };

/* INIT (v5): a communicator being created (ncclCommInitRank*, inside NCCL until they return; its id
 * is known from the unique id before): a wait there shows like any call in flight. */
enum gh_comm_state { GH_COMM_FREE = 0, GH_COMM_ACTIVE = 1, GH_COMM_DESTROYED = 2, GH_COMM_ABORTED = 3,
                     GH_COMM_INIT = 4 };

/* (v5) What the rank's GPU completion marks and profile times rest on, decided at its first
 * communicator: the process's shared CUDA runtime, the CUDA driver API (a program with the runtime
 * linked statically, or none), or nothing (no CUDA in the process: host times only). */
enum gh_gpu_api { GH_GPU_API_UNKNOWN = 0, GH_GPU_API_RUNTIME = 1, GH_GPU_API_DRIVER = 2, GH_GPU_API_NONE = 3 };

/* P2P checks never run on a job's communicator: NCCL runs one communicator's operations in order
 * on the GPU, so a send whose peer never posts would hold every later training collective behind
 * it. SPLIT (v5) makes a benchmark communicator from comm_id (every rank of comm_id must ask for
 * it, all parked), and SEND/RECV naming comm_id run on that child, which is aborted when one of
 * them fails. DRAIN (v5) waits for the rank's queued GPU work only (drain_ns), so that transfers
 * are issued once both ends have drained. */
/* (v6) A progress slot's direction, and the last state of its newest network step (NCCL's ProxyStep
 * states; POSTED: started, no state yet; DONE: its last step, or its op, ended). */
enum gh_prog_dir { GH_PROG_SEND = 0, GH_PROG_RECV = 1 };
enum gh_step_state {
  GH_STEP_NONE = 0,
  GH_STEP_POSTED = 1,
  GH_STEP_SEND_GPU_WAIT = 2,  /* waiting for this rank's GPU to fill the buffer */
  GH_STEP_SEND_PEER_WAIT = 3, /* waiting for the receiver's credit */
  GH_STEP_SEND_WAIT = 4,      /* on the network, waiting for completion */
  GH_STEP_RECV_WAIT = 5,      /* waiting for the peer's data on the network */
  GH_STEP_RECV_FLUSH_WAIT = 6,
  GH_STEP_RECV_GPU_WAIT = 7,  /* received, waiting for this rank's GPU to take it */
  GH_STEP_DONE = 8
};

enum gh_bench_kind { GH_BENCH_SEND = 1, GH_BENCH_RECV = 2, GH_BENCH_GEMM = 3, GH_BENCH_DRAIN = 4, GH_BENCH_SPLIT = 5 };

/* Slot states: the agent moves EMPTY->SUBMITTED and any final state->EMPTY; the hook the rest. */
enum gh_bench_state {
  GH_BENCH_EMPTY = 0,
  GH_BENCH_SUBMITTED = 1,
  GH_BENCH_RUNNING = 2,
  GH_BENCH_DONE = 3,
  GH_BENCH_UNSUPPORTED = 4,
  GH_BENCH_FAILED = 5
};

struct gh_ring_header {
  uint64_t magic;          /*   0 */
  uint32_t version;        /*   8 */
  uint32_t header_bytes;   /*  12 */
  uint32_t capacity;       /*  16 records, power of two */
  uint32_t record_bytes;   /*  20 */
  uint32_t max_comms;      /*  24 */
  uint32_t max_peers;      /*  28 */
  uint64_t control_offset; /*  32 */
  uint64_t comms_offset;   /*  40 */
  uint64_t records_offset; /*  48 */
  uint64_t file_bytes;     /*  56 */
  char job[64];            /*  64 NUL-terminated */
  char host[64];           /* 128 NUL-terminated */
  int32_t rank;            /* 192 global rank */
  int32_t pid;             /* 196 */
  int32_t device;          /* 200 CUDA device, -1 unknown */
  uint32_t ready;          /* 204 1 once every field above is written */
  uint64_t mono_anchor_ns; /* 208 CLOCK_MONOTONIC ... */
  uint64_t wall_anchor_ns; /* 216 ... and CLOCK_REALTIME read back to back */
  uint32_t gpu_api;        /* 224 (v5) enum gh_gpu_api */
  char pci_bus_id[20];     /* 228 (v5) PCI bus id of `device` as CUDA names it ("0000:18:00.0"),
                            * NUL-terminated, "" unknown: the GPU's identity on the node, which an
                            * ordinal is not inside containers or device cgroups */
  uint64_t progress_offset; /* 248 (v6) gh_progress, the profiler plugin's counters */
  uint64_t head;           /* 256 records reserved by writers (own cache line) */
  uint64_t dropped;        /* 264 records dropped because the ring was full */
  uint64_t gpu_dropped;    /* 272 profiled calls whose GPU timing was skipped (pool full) */
  uint8_t pad1[40];        /* 280 */
  uint64_t consumed;       /* 320 reader's published cursor (own cache line) */
  uint8_t pad2[56];        /* 328 */
};                         /* 384 bytes used of GH_HEADER_BYTES */

struct gh_record {
  uint64_t stamp;        /*   0 index+1, stored last with release: the slot is complete */
  uint64_t comm_id;      /*   8 */
  uint64_t count;        /*  16 elements */
  uint64_t seq;          /*  24 collectives: per-comm sequence; P2P: per-peer send/recv count */
  uint64_t enter_ns;     /*  32 CLOCK_MONOTONIC */
  uint64_t return_ns;    /*  40 CLOCK_MONOTONIC */
  uint64_t stream;       /*  48 cudaStream_t value */
  uint64_t group_id;     /*  56 0 outside groups */
  uint64_t gpu_start_ns; /*  64 CLOCK_MONOTONIC domain, valid with GH_F_GPU_DONE */
  uint64_t gpu_end_ns;   /*  72 */
  int32_t comm_rank;     /*  80 */
  int32_t nranks;        /*  84 */
  int32_t peer;          /*  88 root for rooted collectives, peer for P2P, -1 otherwise */
  int32_t result;        /*  92 ncclResult_t (ASYNC_ERROR: the async error) */
  uint16_t op;           /*  96 enum gh_op */
  uint8_t datatype;      /*  98 ncclDataType_t */
  uint8_t redop;         /*  99 ncclRedOp_t (255 when not a reduction) */
  uint32_t flags;        /* 100 GH_F_* (GPU flags or-ed in later by the poller) */
  uint32_t tid;          /* 104 Linux thread id of the caller */
  uint32_t pad;          /* 108 */
  uint64_t reserved[2];  /* 112 */
};                       /* 128 bytes */

struct gh_comm_entry {
  uint64_t comm_id;            /*    0 */
  uint64_t parent_id;          /*    8 0 unless split */
  uint32_t state;              /*   16 enum gh_comm_state */
  int32_t rank;                /*   20 */
  int32_t nranks;              /*   24 */
  int32_t color;               /*   28 split color, -1 otherwise */
  uint64_t calls_entered;      /*   32 every recorded op on this comm */
  uint64_t calls_completed;    /*   40 */
  uint64_t last_seq_entered;   /*   48 collective sequence, 0 none yet */
  uint64_t last_seq_completed; /*   56 */
  uint64_t inflight_enter_ns;  /*   64 enter time of the call now inside NCCL, 0 when none */
  uint32_t last_op;            /*   72 */
  uint32_t npeers;             /*   76 used entries of peer_ids */
  uint64_t handle;             /*   80 ncclComm_t value in the writer process */
  uint64_t splits;             /*   88 splits made from this comm so far */
  int32_t peer_ids[GH_MAX_PEERS];     /*   96 */
  uint64_t send_count[GH_MAX_PEERS];  /*  352 */
  uint64_t recv_count[GH_MAX_PEERS];  /*  864 */
  uint64_t last_count;                /* 1376 count of the newest call entered (v2) */
  uint32_t last_dtype;                /* 1384 its ncclDataType_t (v2): ranks compare at one seq */
  /* GPU-side completion marks (v3). NCCL calls are asynchronous: the host fields above say what
   * was enqueued, these say what the GPU finished. Written only by the hook's poller thread. */
  uint32_t gpu_marks;                 /* 1388 1: marks are recorded for this comm; 0: host-only */
  uint64_t gpu_calls_done;            /* 1392 data-path calls (numbered as calls_entered) done on the GPU */
  uint64_t gpu_seq_done;              /* 1400 collective seq of the newest collective done on the GPU */
  uint64_t gpu_pending_ns;            /* 1408 host enqueue time of the oldest call not done on the GPU, 0 none */
  uint64_t gpu_pending_seq;           /* 1416 that call's collective seq (0 for send/recv) */
  uint32_t gpu_pending_op;            /* 1424 that call's enum gh_op, 0 none */
  uint32_t gpu_pending_dtype;         /* 1428 its ncclDataType_t ... */
  uint64_t gpu_pending_count;         /* 1432 ... and count: ranks compare the call each one is stuck in */
  uint64_t gpu_marks_lost;            /* 1440 calls enqueued without a mark (capture, mark pool full) */
  /* (v5) Seqlocks: each is odd while its writer updates its fields (host_ver: the thread inside a
   * call on this comm, over every field above but the gpu_* ones; gpu_ver: the poller, over those).
   * A reader takes a row when both read even and unchanged before and after it. */
  uint32_t host_ver;                  /* 1448 */
  uint32_t gpu_ver;                   /* 1452 */
  uint32_t life_op;                   /* 1456 (v5) enum gh_op of the lifecycle call inside NCCL on
                                       * this comm now (init, split, shrink, destroy, abort), 0 none;
                                       * its enter time is inflight_enter_ns */
  /* (v6) The third seqlock: every writer that is not the thread inside a data call (lifecycle calls,
   * an abort from a watchdog thread, a table slot changing hands) claims it by CAS from even to
   * odd, so two of them never write at once, and none of them touches host_ver, whose writer is
   * then alone. A reader takes a row when all three words read even and unchanged around it. */
  uint32_t life_ver;                  /* 1460 */
  int32_t last_peer;                  /* 1464 (v6) peer of the newest call entered (send/recv;
                                       * root of a rooted collective; -1 otherwise), host_ver */
  int32_t gpu_pending_peer;           /* 1468 (v6) peer of the oldest call pending on the GPU, gpu_ver */
};                                    /* 1472 bytes */

struct gh_bench_slot {
  uint64_t req_id;   /*  0 agent-chosen, nonzero */
  uint32_t state;    /*  8 enum gh_bench_state */
  uint32_t kind;     /* 12 enum gh_bench_kind */
  uint64_t comm_id;  /* 16 P2P, SPLIT: the job communicator (P2P runs on its benchmark child) */
  uint64_t size;     /* 24 P2P: bytes; GEMM: matrix dimension N */
  int32_t peer;      /* 32 P2P peer rank within the comm */
  int32_t repeat;    /* 36 <= GH_BENCH_MAX_REPEAT */
  int32_t result;    /* 40 ncclResult_t or cublasStatus_t of the first failure */
  uint32_t n_done;   /* 44 durations written */
  uint64_t total_ns; /* 48 */
  uint64_t drain_ns; /* 56 (v3) time spent waiting for the rank's queued GPU work before measuring */
  uint64_t durations_ns[GH_BENCH_MAX_REPEAT]; /* 64 */
};                                            /* 576 bytes */

struct gh_control {
  uint32_t mode;          /*  0 enum gh_mode, agent writes */
  uint32_t pause_request; /*  4 agent: 1 = pause at next NCCL call, 0 = resume (hook: 0 at the lease end) */
  uint32_t paused;        /*  8 hook: 1 while a training thread is parked */
  int32_t paused_tid;     /* 12 */
  uint64_t pause_count;   /* 16 pauses honoured so far */
  uint64_t pause_comm_id; /* 24 0: pause at the next data-path call; else only on this comm ... */
  uint64_t pause_seq;     /* 32 ... at the call whose collective seq would be >= pause_seq */
  uint64_t pause_lease_ns; /* 40 (v4) CLOCK_MONOTONIC deadline of the pause, agent writes before
                            * pause_request (0: the hook's default lease, which it writes here) */
  uint64_t lease_expired;  /* 48 (v4) hook: pauses it ended itself because their lease ran out */
  uint32_t job_timeout_ms; /* 56 (v5) the job's collective timeout as the rank reported it, 0 unknown:
                            * the hook writes GREYHOUND_PG_TIMEOUT_S here at start-up, the framework
                            * integration may write it later */
  uint32_t pause_cap_ms;   /* 60 (v5) hook: the longest pause it holds now (a share of the above),
                            * 0 when only GH_PAUSE_LEASE_MAX_MS bounds it */
  struct gh_bench_slot slots[GH_BENCH_SLOTS]; /* 64 */
  uint64_t pause_shortened;     /* 9280 (v5) hook: pauses ended at pause_cap_ms before their lease */
  uint64_t bench_comms_made;    /* 9288 (v5) hook: benchmark communicators split so far */
  uint64_t bench_comms_aborted; /* 9296 (v5) hook: of which aborted (a transfer failed or timed out) */
  uint64_t reserved_v5[5];      /* 9304 */
};                              /* 9344 bytes */

/* (v6) Network transfer counters of one (communicator, channel, peer, direction), from NCCL's
 * ProxyOp events (an op's steps, at its start and stop: on by default) and ProxyStep events (each
 * step and its states: switched on while a suspicion is open). Written by NCCL's proxy threads,
 * lock-free: a slot is claimed by CAS on key and keeps it until its communicator is finalised;
 * counters only grow (relaxed atomics). Intra-node transfers (P2P/SHM/NVLink) have no proxy
 * events, hence no slot. */
struct gh_prog_slot {
  uint32_t key;          /*  0 0 free; else comm table index + 1 | channel << 8 | dir << 16 */
  int32_t peer;          /*  4 the peer's rank in the communicator */
  uint64_t steps_posted; /*  8 network steps started (an op's nSteps at its start) */
  uint64_t steps_done;   /* 16 steps completed (each step's stop, or what remained at its op's stop) */
  uint64_t bytes;        /* 24 bytes of the steps completed */
  uint64_t net_ns;       /* 32 time completed steps spent on the network (send: SendWait to stop;
                          * receive: RecvWait to arrival), ProxyStep events only */
  uint64_t last_ns;      /* 40 CLOCK_MONOTONIC of the slot's last change */
  uint64_t seq;          /* 48 collective seq (as the comm table counts) of the newest op, 0 unknown */
  uint16_t ops_posted;   /* 56 ops started, modulo 2^16 */
  uint16_t ops_done;     /* 58 ops ended, modulo 2^16 */
  uint8_t op;            /* 60 enum gh_op of the newest op */
  uint8_t state;         /* 61 enum gh_step_state of its newest step */
  uint16_t pad;          /* 62 */
};                       /* 64 bytes */

/* (v6) One (communicator, channel)'s kernel, from NCCL's KernelCh events: a start without its stop
 * is a channel whose kernel has not finished. */
struct gh_kch_slot {
  uint32_t key;          /*  0 0 free; else comm table index + 1 | channel << 8 */
  uint32_t starts;       /*  4 */
  uint32_t stops;        /*  8 */
  uint32_t pad;          /* 12 */
  uint64_t start_ptimer; /* 16 the GPU's timer at the newest start (v4+; 0 before) */
  uint64_t stop_ptimer;  /* 24 ... at the newest stop */
  uint64_t last_ns;      /* 32 CLOCK_MONOTONIC when the newest start or stop was seen */
};                       /* 40 bytes */

/* (v6) The profiler plugin's region: what NCCL gave it, and the mask it runs with. */
struct gh_progress {
  uint32_t plugin_version; /*  0 the interface NCCL took (3..6), 0 never loaded */
  uint32_t mask_applied;   /*  4 NCCL's activation mask as the plugin last set it */
  uint32_t mask_extra;     /*  8 agent: classes wanted on top of the default ones (the hook adds
                            *    the costly ones itself while the control block is in profile mode) */
  uint32_t contexts;       /* 12 plugin contexts alive (communicators NCCL initialised) */
  uint64_t dropped;        /* 16 events not counted: a pool or a slot table full, another process's
                            *    op (PXN) */
  uint64_t unbound;        /* 24 events of a communicator not yet matched to a comm table row */
  uint64_t events[GH_PROG_CLASSES];    /* 32 events started per class (bit i of the mask) */
  struct gh_prog_slot slots[GH_PROG_SLOTS]; /* 160 */
  struct gh_kch_slot kch[GH_KCH_SLOTS];     /* 4256 */
};                                          /* 5536 bytes */

#ifndef __cplusplus
_Static_assert(sizeof(struct gh_prog_slot) == 64, "progress slot layout");
_Static_assert(sizeof(struct gh_kch_slot) == 40, "kernel channel slot layout");
_Static_assert(sizeof(struct gh_progress) == 5536, "progress layout");
_Static_assert(sizeof(struct gh_ring_header) == 384, "header layout");
_Static_assert(sizeof(struct gh_record) == 128, "record layout");
_Static_assert(sizeof(struct gh_comm_entry) == 1472, "comm layout");
_Static_assert(sizeof(struct gh_bench_slot) == 576, "bench slot layout");
_Static_assert(sizeof(struct gh_control) == 9344, "control layout");
#endif

#endif
