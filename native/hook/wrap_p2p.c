/*
 * Point-to-point and group wrappers. Inside a group NCCL launches nothing until the outermost
 * ncclGroupEnd, so records issued inside carry the group id, and their completion marks (and in
 * profile mode their end events) are recorded after that outermost End (marks.c, profile.c), once
 * it enqueued the group: a group that failed, or is still in progress on non-blocking
 * communicators, gets no marks (its calls count as lost).
 *
 * Pauses happen at the outermost group boundaries, never inside a group (NCCL's group state is
 * per thread: a benchmark issued there would join the job's group). ncclGroupStart passes no
 * communicator, so a pause targeted at a communicator used only inside groups (Megatron's
 * coalesced DP reduce-scatter, batch_isend_irecv) is taken right after the outermost
 * ncclGroupEnd of the group that reached its target: every rank of that communicator stops after
 * the same group, which its peers' copies of that group need.
 */
#include "hot.h"

#define NO_REDOP 255

typedef ncclResult_t (*group_fn)(void);

static gh_send_fn real_send;
static gh_recv_fn real_recv;
static group_fn real_group_start, real_group_end;
static uint64_t next_group_id;

GH_EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                ncclComm_t comm, cudaStream_t stream) {
  gh_send_fn f = GH_RESOLVE(real_send, ncclSend);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_SEND, comm, stream, f(sendbuff, count, datatype, peer, comm, stream), count,
               datatype, NO_REDOP, peer);
}

GH_EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                ncclComm_t comm, cudaStream_t stream) {
  gh_recv_fn f = GH_RESOLVE(real_recv, ncclRecv);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  GH_DATA_CALL(GH_OP_RECV, comm, stream, f(recvbuff, count, datatype, peer, comm, stream), count,
               datatype, NO_REDOP, peer);
}

GH_EXPORT ncclResult_t ncclGroupStart(void) {
  group_fn f = GH_RESOLVE(real_group_start, ncclGroupStart);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f();
  int saved = errno;
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  if (gh_thr.group_depth == 0) {
    gh_pause_point(NULL);
    gh_thr.group_id = __atomic_add_fetch(&next_group_id, 1, __ATOMIC_RELAXED);
  }
  errno = saved;
  ncclResult_t res = f();
  saved = errno;
  if (res == ncclSuccess && gh_thr.group_depth++ == 0)
    gh_record_event(GH_OP_GROUP_START, NULL, (int)res, -1, t0);
  if (gh_thr.group_depth == 0) gh_thr.group_id = 0; /* records outside groups carry id 0 */
  gh_thr.depth--;
  errno = saved;
  return res;
}

GH_EXPORT ncclResult_t ncclGroupEnd(void) {
  group_fn f = GH_RESOLVE(real_group_end, ncclGroupEnd);
  if (GH_UNLIKELY(f == NULL)) return ncclSystemError;
  if (gh_thr.depth > 0 || gh_disabled) return f();
  int saved = errno;
  gh_thr.depth++;
  uint64_t t0 = gh_now_ns();
  errno = saved;
  ncclResult_t res = f();
  saved = errno;
  if (gh_thr.group_depth > 0 && --gh_thr.group_depth == 0) {
    const gh_ctl_word_t *w = __atomic_load_n(&gh_ctl_word, __ATOMIC_ACQUIRE);
    int pause = GH_CTL_PAUSE(__atomic_load_n(w, __ATOMIC_RELAXED)) != 0;
    int enqueued = res == ncclSuccess || res == ncclInProgress;
    int reached = pause && enqueued && gh_pause_group_target_reached();
    gh_profile_group_end(res);
    gh_marks_group_end(res);
    gh_record_event(GH_OP_GROUP_END, NULL, (int)res, -1, t0);
    gh_thr.group_id = 0;
    if (pause && enqueued) gh_pause_after_group(reached);
  }
  gh_thr.depth--;
  errno = saved;
  return res;
}
