/*
 * The workload's model of PyTorch's ProcessGroupNCCL watchdog (GH_PG_TIMEOUT_MS > 0). PyTorch
 * stamps each collective's work object when it is issued, before the NCCL call, records an end
 * event after it, and a watchdog thread polls those events; once a work has not completed on the
 * GPU within the process group's timeout, it aborts the communicators and, with
 * TORCH_NCCL_ASYNC_ERROR_HANDLING (the default), tears the process down. A validation pause
 * parks the host inside the stamped call, so it counts toward that timeout: this is what the
 * hook's pause budget must stay well below.
 */
#ifndef GH_WORKLOAD_WATCHDOG_H
#define GH_WORKLOAD_WATCHDOG_H

#include <stdint.h>

#include "nccl_abi.h"

/* Start the watchdog over these communicators (NULL entries skipped); no-op unless
 * timeout_ms > 0. */
int gh_watchdog_start(long timeout_ms, ncclComm_t *comms, int ncomms);
/* A work is issued: call before the NCCL call (or the group) with what it is, then
 * gh_watchdog_issued after it, which records its end event on the stream. */
int64_t gh_watchdog_stamp(void);
void gh_watchdog_issued(int64_t stamp_ns, const char *what, int seq);

#endif
