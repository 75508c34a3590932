/*
 * NCCL's profiler plugin interface (NCCL_PROFILER_PLUGIN, symbols ncclProfiler_v3 .. _v6), written
 * from its documentation (the profiler plugin README of NCCL 2.26 .. 2.30) so that the hook can be
 * a plugin and the fake NCCL can load one without NCCL's headers. Shared by both.
 *
 * NCCL dlopens the library NCCL_PROFILER_PLUGIN names (a path is opened as it is, so naming the
 * preloaded hook gives back that same instance) and looks for the newest struct it knows first:
 * 2.26 v3 (KernelCh events), 2.27 v4 (GPU timestamps on KernelCh, ProxyOp states deprecated),
 * 2.28 v5 (GroupApi/CollApi/P2pApi/KernelLaunch; commId moved in init), 2.29 v6 (copy-engine
 * collectives). A struct it does not find, or an init that fails, leaves NCCL running without the
 * plugin. v1 and v2 (2.23 .. 2.25: no kernel events, no rank in init) are not provided.
 *
 * The event mask is one int NCCL owns: init gets its address, and the plugin may store a new
 * value there at any time (NCCL reads it with a relaxed atomic load when an API call starts);
 * operations already enqueued keep the mask they were enqueued with.
 */
#ifndef GREYHOUND_NCCL_PROFILER_ABI_H
#define GREYHOUND_NCCL_PROFILER_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "nccl_abi.h"

/* Event classes: one bit each in the activation mask and in a descriptor's type. */
enum {
  ncclProfileGroup = 1 << 0,
  ncclProfileColl = 1 << 1,
  ncclProfileP2p = 1 << 2,
  ncclProfileProxyOp = 1 << 3,
  ncclProfileProxyStep = 1 << 4,
  ncclProfileProxyCtrl = 1 << 5,
  ncclProfileKernelCh = 1 << 6,    /* v3 */
  ncclProfileNetPlugin = 1 << 7,   /* v3 */
  ncclProfileGroupApi = 1 << 8,    /* v5 */
  ncclProfileCollApi = 1 << 9,     /* v5 */
  ncclProfileP2pApi = 1 << 10,     /* v5 */
  ncclProfileKernelLaunch = 1 << 11, /* v5 */
  ncclProfileCeColl = 1 << 12,     /* v6 */
  ncclProfileCeSync = 1 << 13,     /* v6 */
  ncclProfileCeBatch = 1 << 14     /* v6 */
};
#define GH_NCCL_PROFILE_CLASSES 15

/* State transitions (recordEventState); one numbering for every version. */
typedef enum {
  ncclProfilerProxyOpSendPosted = 0, /* ProxyOp states 0..7: deprecated in v4 */
  ncclProfilerProxyOpSendRemFifoWait = 1,
  ncclProfilerProxyOpSendTransmitted = 2,
  ncclProfilerProxyOpSendDone = 3,
  ncclProfilerProxyOpRecvPosted = 4,
  ncclProfilerProxyOpRecvReceived = 5,
  ncclProfilerProxyOpRecvTransmitted = 6,
  ncclProfilerProxyOpRecvDone = 7,
  ncclProfilerProxyStepSendGPUWait = 8,   /* waiting for the GPU to fill the step's buffer */
  ncclProfilerProxyStepSendWait = 9,      /* posted to the network, waiting for completion */
  ncclProfilerProxyStepRecvWait = 10,     /* waiting for the data from the network */
  ncclProfilerProxyStepRecvFlushWait = 11,/* received, flushing to the GPU */
  ncclProfilerProxyStepRecvGPUWait = 12,  /* received, waiting for the GPU to consume it */
  ncclProfilerProxyCtrlIdle = 13,
  ncclProfilerProxyCtrlActive = 14,
  ncclProfilerProxyCtrlSleep = 15,
  ncclProfilerProxyCtrlWakeup = 16,
  ncclProfilerProxyCtrlAppend = 17,
  ncclProfilerProxyCtrlAppendEnd = 18,
  ncclProfilerProxyOpInProgress_v4 = 19,
  ncclProfilerProxyStepSendPeerWait_v4 = 20, /* waiting for the receiver's clear-to-send credit */
  ncclProfilerNetPluginUpdate = 21,
  ncclProfilerKernelChStop = 22,
  ncclProfilerGroupStartApiStop = 23,
  ncclProfilerEndGroupApiStart = 24
} ncclProfilerEventState_t;

typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);

/* Events every version describes alike: a network op of the proxy thread (for a channel and a
 * peer, its number of steps), one of its steps, and a network plugin's own event. */
#define GH_PROFILER_PROXY_EVENTS                                                                 \
  struct {                                                                                       \
    pid_t pid; /* the process that made the op (PXN: the proxy may serve another rank's) */       \
    uint8_t channelId;                                                                           \
    int peer;                                                                                    \
    int nSteps;                                                                                  \
    int chunkSize;                                                                               \
    int isSend;                                                                                  \
  } proxyOp;                                                                                     \
  struct {                                                                                       \
    int step;                                                                                    \
  } proxyStep;
#define GH_PROFILER_NET_EVENT                                                                    \
  struct {                                                                                       \
    int64_t id;                                                                                  \
    void *data;                                                                                  \
  } netPlugin;

/* ---- v3 (NCCL 2.26) ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      const char *name;
      uint64_t commHash;
      uint64_t seqNumber;
      const char *func;
      void const *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      uint8_t nMaxChannels;
      uint8_t nWarps;
      const char *algo;
      const char *proto;
    } coll;
    struct {
      const char *name;
      uint64_t commHash;
      const char *func;
      void *buff;
      const char *datatype;
      size_t count;
      int peer;
    } p2p;
    GH_PROFILER_PROXY_EVENTS
    struct {
      uint8_t channelId;
    } kernelCh;
    GH_PROFILER_NET_EVENT
  };
} ncclProfilerEventDescr_v3_t;

typedef union {
  struct {
    size_t transSize;
    int steps;
  } proxyOp;
  struct {
    int appendedProxyOps;
  } proxyCtrl;
} ncclProfilerEventStateArgs_v3_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask);
  ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v3_t *eDescr);
  ncclResult_t (*stopEvent)(void *eHandle);
  ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v3_t *eStateArgs);
  ncclResult_t (*finalize)(void *context);
} ncclProfiler_v3_t;

/* ---- v4 (NCCL 2.27) ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      uint64_t seqNumber;
      const char *func;
      void const *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      uint8_t nChannels;
      uint8_t nWarps;
      const char *algo;
      const char *proto;
    } coll;
    struct {
      const char *func;
      void *buff;
      const char *datatype;
      size_t count;
      int peer;
      uint8_t nChannels;
    } p2p;
    GH_PROFILER_PROXY_EVENTS
    struct {
      uint8_t channelId;
      uint64_t pTimer; /* the GPU's globaltimer at the channel's start */
    } kernelCh;
    GH_PROFILER_NET_EVENT
  };
} ncclProfilerEventDescr_v4_t;

/* v4, v5 and v6 share the state arguments. */
typedef union {
  struct {
    size_t transSize;
  } proxyStep;
  struct {
    int appendedProxyOps;
  } proxyCtrl;
  struct {
    void *data;
  } netPlugin;
  struct {
    uint64_t pTimer; /* the GPU's globaltimer at the channel's stop */
  } kernelCh;
} ncclProfilerEventStateArgs_v4_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask, const char *commName, uint64_t commHash,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v4_t *eDescr);
  ncclResult_t (*stopEvent)(void *eHandle);
  ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v4_t *eStateArgs);
  ncclResult_t (*finalize)(void *context);
} ncclProfiler_v4_t;

/* ---- v5 (NCCL 2.28) and v6 (2.29: the same events, plus copy-engine ones at the union's end) ---- */
#define GH_PROFILER_V5_EVENTS                                                                    \
  struct {                                                                                       \
    bool graphCaptured;                                                                          \
    int groupDepth;                                                                              \
  } groupApi;                                                                                    \
  struct {                                                                                       \
    const char *func;                                                                            \
    size_t count;                                                                                \
    const char *datatype;                                                                        \
    int root;                                                                                    \
    void *stream;                                                                                \
    bool graphCaptured;                                                                          \
  } collApi;                                                                                     \
  struct {                                                                                       \
    const char *func;                                                                            \
    size_t count;                                                                                \
    const char *datatype;                                                                        \
    void *stream;                                                                                \
    bool graphCaptured;                                                                          \
  } p2pApi;                                                                                      \
  struct {                                                                                       \
    void *stream;                                                                                \
  } kernelLaunch;                                                                                \
  struct {                                                                                       \
    uint64_t seqNumber; /* per communicator and collective function, from 0 */                   \
    const char *func;                                                                            \
    void const *sendBuff;                                                                        \
    void *recvBuff;                                                                              \
    size_t count;                                                                                \
    int root;                                                                                    \
    const char *datatype;                                                                        \
    uint8_t nChannels;                                                                           \
    uint8_t nWarps;                                                                              \
    const char *algo;                                                                            \
    const char *proto;                                                                           \
    void *parentGroup;                                                                           \
  } coll;                                                                                        \
  struct {                                                                                       \
    const char *func;                                                                            \
    void *buff;                                                                                  \
    const char *datatype;                                                                        \
    size_t count;                                                                                \
    int peer;                                                                                    \
    uint8_t nChannels;                                                                           \
    void *parentGroup;                                                                           \
  } p2p;                                                                                         \
  GH_PROFILER_PROXY_EVENTS                                                                       \
  struct {                                                                                       \
    uint8_t channelId;                                                                           \
    uint64_t pTimer;                                                                             \
  } kernelCh;                                                                                    \
  GH_PROFILER_NET_EVENT

typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    GH_PROFILER_V5_EVENTS
  };
} ncclProfilerEventDescr_v5_t;

typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    GH_PROFILER_V5_EVENTS
    struct {
      uint64_t seqNumber;
      const char *func;
      void const *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      const char *syncStrategy;
      bool intraBatchSync;
      uint32_t batchSize;
      uint32_t numBatches;
      uint32_t ceSeqNum;
      void *stream;
    } ceColl;
    struct {
      bool isComplete;
      int nRanks;
    } ceCollSync;
    struct {
      int numOps;
      size_t totalBytes;
      bool useIntraSync;
    } ceCollBatch;
  };
} ncclProfilerEventDescr_v6_t;

typedef ncclProfilerEventStateArgs_v4_t ncclProfilerEventStateArgs_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v5_t *eDescr);
  ncclResult_t (*stopEvent)(void *eHandle);
  ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v5_t *eStateArgs);
  ncclResult_t (*finalize)(void *context);
} ncclProfiler_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v6_t *eDescr);
  ncclResult_t (*stopEvent)(void *eHandle);
  ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v5_t *eStateArgs);
  ncclResult_t (*finalize)(void *context);
} ncclProfiler_v6_t;

#endif
