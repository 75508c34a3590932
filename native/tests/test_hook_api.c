/*
 * Every interposed API against the stub NCCL, checked field by field in the ring: collectives,
 * ncclBcast recorded once, groups, splits, P2P counters, non-blocking comms, abort/destroy,
 * errno, overflow counting, fork safety, and pause -> benchmark -> resume.
 */
#include <errno.h>
#include <pthread.h>
#include <sys/wait.h>

#include "nccl_abi.h"
#include "ring_view.h"

extern int stub_splits_with_config, stub_aborts; /* stub_nccl.c */

static struct ring_view v;
static uint64_t seen; /* records checked so far */

static struct gh_record *next_rec(void) {
  if (seen >= v.h->head) return NULL;
  return ring_at(&v, seen++);
}

static struct gh_record *expect_op(uint16_t op) {
  struct gh_record *r = next_rec();
  CHECK(r != NULL);
  if (r == NULL) return NULL;
  if (r->op != op) fprintf(stderr, "record %llu: op %u, expected %u\n", (unsigned long long)seen - 1, r->op, op);
  CHECK(r->op == op);
  CHECK(r->stamp == seen);
  return r;
}

/* A thread whose first call passes no communicator: the hook's per-thread cache must not take
 * NULL for a hit. */
static void *null_comm_caller(void *arg) {
  (void)arg;
  return (void *)(intptr_t)ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL);
}

/* An agent's request: the fields, then the state (the hook scans states while it is parked). */
static struct gh_bench_slot *submit_slot(int slot, uint32_t kind, uint64_t size, int peer, uint64_t req_id) {
  struct gh_bench_slot *s = &v.ctl->slots[slot];
  s->kind = kind;
  s->comm_id = v.comms[0].comm_id;
  s->size = size;
  s->peer = peer;
  s->repeat = kind == GH_BENCH_SEND ? 3 : 1;
  s->req_id = req_id;
  __atomic_store_n(&s->state, GH_BENCH_SUBMITTED, __ATOMIC_RELEASE);
  return s;
}

static void wait_final(const struct gh_bench_slot *s) {
  while (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) < GH_BENCH_DONE) usleep(100);
}

static void *agent(void *arg) {
  (void)arg;
  struct gh_control *c = v.ctl;
  __atomic_store_n(&c->pause_request, 1, __ATOMIC_RELEASE);
  while (!__atomic_load_n(&c->paused, __ATOMIC_ACQUIRE)) usleep(100);
  /* Without a benchmark communicator a transfer is refused: never on the job's own. */
  wait_final(submit_slot(3, GH_BENCH_SEND, 64, 1, 1));
  submit_slot(2, GH_BENCH_SPLIT, 0, -1, 2);
  struct gh_bench_slot *s = submit_slot(0, GH_BENCH_SEND, 4096, 1, 3);
  struct gh_bench_slot *g = submit_slot(1, GH_BENCH_GEMM, 64, -1, 4);
  wait_final(s);
  wait_final(g);
  /* A transfer NCCL refuses aborts the benchmark communicator; later ones on it are refused. */
  submit_slot(4, GH_BENCH_SEND, 4096, 7, 5);
  wait_final(submit_slot(5, GH_BENCH_SEND, 4096, 1, 6));
  __atomic_store_n(&c->pause_request, 0, __ATOMIC_RELEASE);
  return NULL;
}

int main(void) {
  setenv("GREYHOUND_JOB_ID", "api", 1);
  setenv("GREYHOUND_RING_RECORDS", "64", 1);
  unsetenv("RANK");
  ncclUniqueId id = {{1, 2, 3}};
  ncclComm_t comm, comm2, sub, nb, all[2];
  /* No launcher rank in the environment: the first communicator names the ring. */
  CHECK(ncclCommInitRank(&comm, 4, id, 3) == ncclSuccess);
  CHECK(ring_open(&v, "api", 3));
  if (gh_failures) return 1;
  CHECK(v.h->magic == GH_RING_MAGIC && v.h->version == GH_LAYOUT_VERSION && v.h->capacity == 64);
  CHECK(v.h->rank == 3 && v.h->pid == getpid() && v.h->device == 3 && v.h->ready == 1);
  CHECK(strcmp(v.h->job, "api") == 0 && v.h->host[0] != '\0' && v.h->wall_anchor_ns > v.h->mono_anchor_ns);
  struct gh_record *r = expect_op(GH_OP_COMM_INIT);
  uint64_t cid = r->comm_id;
  CHECK(cid != 0 && r->comm_rank == 3 && r->nranks == 4);
  /* Same unique id -> same comm id (what every rank computes). */
  CHECK(ncclCommInitRank(&comm2, 4, id, 3) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_INIT)->comm_id == cid);
  CHECK(ncclCommDestroy(comm2) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_DESTROY)->comm_id == cid);
  /* No CUDA in this process: the header says the marks are off; no bus id. */
  CHECK(v.h->gpu_api == GH_GPU_API_NONE && v.h->pci_bus_id[0] == '\0');
  /* InitRankScalable is named by the first of its ids, as InitRank by its one. */
  ncclUniqueId ids[2] = {id, {{9, 9, 9}}};
  CHECK(ncclCommInitRankScalable(&comm2, 4, 3, 2, ids, NULL) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_INIT)->comm_id == cid);
  struct gh_comm_entry *se = ring_comm(&v, cid);
  CHECK(se != NULL && se->state == GH_COMM_ACTIVE && se->life_op == 0 && se->inflight_enter_ns == 0);
  /* Shrinks: one id per (parent, shrink index, excluded ranks, sorted): a new one the second time,
   * with the same ranks excluded (listed in another order). */
  ncclComm_t shr1, shr2;
  int ex1[2] = {2, 0}, ex2[2] = {0, 2};
  CHECK(ncclCommShrink(comm2, ex1, 2, &shr1, NULL, NCCL_SHRINK_DEFAULT) == ncclSuccess);
  r = expect_op(GH_OP_COMM_SHRINK);
  uint64_t sh1 = r->comm_id;
  CHECK(sh1 != 0 && sh1 != cid && r->comm_rank == 1 && r->nranks == 2);
  struct gh_comm_entry *she = ring_comm(&v, sh1);
  CHECK(she != NULL && she->parent_id == cid && se->life_op == 0 && (se->host_ver & 1) == 0);
  CHECK(ncclCommShrink(comm2, ex2, 2, &shr2, NULL, NCCL_SHRINK_DEFAULT) == ncclSuccess);
  uint64_t sh2 = expect_op(GH_OP_COMM_SHRINK)->comm_id;
  CHECK(sh2 != 0 && sh2 != sh1);
  CHECK(ncclCommDestroy(shr2) == ncclSuccess && ncclCommDestroy(shr1) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_DESTROY)->comm_id == sh2 && expect_op(GH_OP_COMM_DESTROY)->comm_id == sh1);
  CHECK(ncclCommDestroy(comm2) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_DESTROY)->comm_id == cid);

  errno = 0;
  CHECK(ncclAllReduce(NULL, NULL, 1000, ncclFloat32, ncclSum, comm, (cudaStream_t)0x55) == ncclSuccess);
  CHECK(errno == EILSEQ); /* NCCL's errno survives the hook */
  errno = 77;
  CHECK(ncclAllGather(NULL, NULL, 10, ncclBfloat16, comm, NULL) == ncclSuccess);
  CHECK(errno == 77);
  CHECK(ncclReduceScatter(NULL, NULL, 11, ncclFloat16, ncclMax, comm, NULL) == ncclSuccess);
  CHECK(ncclBroadcast(NULL, NULL, 12, ncclInt8, 2, comm, NULL) == ncclSuccess);
  CHECK(ncclBcast(NULL, 13, ncclInt32, 1, comm, NULL) == ncclSuccess);
  CHECK(ncclReduce(NULL, NULL, 14, ncclFloat64, ncclProd, 0, comm, NULL) == ncclSuccess);
  CHECK(ncclAlltoAll(NULL, NULL, 15, ncclUint8, comm, NULL) == ncclSuccess);
  r = expect_op(GH_OP_ALLREDUCE);
  CHECK(r->comm_id == cid && r->count == 1000 && r->datatype == ncclFloat32 && r->redop == ncclSum);
  CHECK(r->seq == 1 && r->stream == 0x55 && r->peer == -1 && r->result == 0 && r->group_id == 0);
  CHECK(r->enter_ns > 0 && r->return_ns >= r->enter_ns && r->tid != 0 && r->flags == 0);
  r = expect_op(GH_OP_ALLGATHER);
  CHECK(r->seq == 2 && r->count == 10 && r->datatype == ncclBfloat16 && r->redop == 255);
  r = expect_op(GH_OP_REDUCESCATTER);
  CHECK(r->seq == 3 && r->count == 11 && r->redop == ncclMax);
  r = expect_op(GH_OP_BROADCAST);
  CHECK(r->seq == 4 && r->peer == 2 && r->count == 12);
  r = expect_op(GH_OP_BROADCAST); /* ncclBcast, once: its inner ncclBroadcast is not recorded */
  CHECK(r->seq == 5 && r->peer == 1 && r->count == 13 && r->datatype == ncclInt32);
  r = expect_op(GH_OP_REDUCE);
  CHECK(r->seq == 6 && r->peer == 0 && r->redop == ncclProd);
  r = expect_op(GH_OP_ALLTOALL);
  CHECK(r->seq == 7);

  /* A group of P2P calls: one group id, IN_GROUP flags, per-peer counters. */
  CHECK(ncclGroupStart() == ncclSuccess);
  CHECK(ncclGroupStart() == ncclSuccess); /* nested: no extra records */
  CHECK(ncclSend(NULL, 100, ncclUint8, 1, comm, NULL) == ncclSuccess);
  CHECK(ncclRecv(NULL, 100, ncclUint8, 2, comm, NULL) == ncclSuccess);
  CHECK(ncclSend(NULL, 100, ncclUint8, 1, comm, NULL) == ncclSuccess);
  CHECK(ncclGroupEnd() == ncclSuccess);
  CHECK(ncclGroupEnd() == ncclSuccess);
  struct gh_record *gs = expect_op(GH_OP_GROUP_START);
  uint64_t gid = gs->group_id;
  CHECK(gid != 0);
  r = expect_op(GH_OP_SEND);
  CHECK(r->peer == 1 && r->seq == 1 && r->group_id == gid && (r->flags & GH_F_IN_GROUP));
  r = expect_op(GH_OP_RECV);
  CHECK(r->peer == 2 && r->seq == 1 && r->group_id == gid);
  r = expect_op(GH_OP_SEND);
  CHECK(r->peer == 1 && r->seq == 2);
  CHECK(expect_op(GH_OP_GROUP_END)->group_id == gid);
  struct gh_comm_entry *e = ring_comm(&v, cid);
  CHECK(e != NULL);
  if (e != NULL) {
    CHECK(e->rank == 3 && e->nranks == 4 && e->state == GH_COMM_ACTIVE);
    CHECK(e->calls_entered == 10 && e->calls_completed == 10);
    CHECK(e->last_seq_entered == 7 && e->last_seq_completed == 7 && e->inflight_enter_ns == 0);
    CHECK(e->npeers == 2 && e->peer_ids[0] == 1 && e->peer_ids[1] == 2);
    CHECK(e->send_count[0] == 2 && e->recv_count[1] == 1 && e->send_count[1] == 0);
  }
  /* A failed call is recorded with its result and does not count as a P2P transfer. */
  CHECK(ncclSend(NULL, 1, ncclUint8, 9, comm, NULL) == ncclInvalidArgument);
  r = expect_op(GH_OP_SEND);
  CHECK(r->result == ncclInvalidArgument && r->seq == 0);

  /* Splits: ids from (parent, split index, color), rank/nranks from the new comm. */
  CHECK(ncclCommSplit(comm, 1, 0, &sub, NULL) == ncclSuccess);
  r = expect_op(GH_OP_COMM_SPLIT);
  uint64_t sid = r->comm_id;
  CHECK(sid != cid && r->comm_rank == 1 && r->nranks == 2);
  e = ring_comm(&v, sid);
  CHECK(e != NULL && e->parent_id == cid && e->color == 1);
  ncclComm_t none;
  CHECK(ncclCommSplit(comm, NCCL_SPLIT_NOCOLOR, 0, &none, NULL) == ncclSuccess && none == NULL);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, sub, NULL) == ncclSuccess);
  r = expect_op(GH_OP_ALLREDUCE);
  CHECK(r->comm_id == sid && r->seq == 1 && r->comm_rank == 1 && r->nranks == 2);

  /* Non-blocking comm: InProgress flagged, completion seen through GetAsyncError. */
  ncclUniqueId id2 = {{9}};
  CHECK(ncclCommInitRankConfig(&nb, 2, id2, 0, (ncclConfig_t *)&id2) == ncclInProgress);
  r = expect_op(GH_OP_COMM_INIT);
  CHECK(r->result == ncclInProgress);
  ncclResult_t ae;
  CHECK(ncclCommGetAsyncError(nb, &ae) == ncclSuccess && ae == ncclInProgress);
  CHECK(ncclCommGetAsyncError(nb, &ae) == ncclSuccess && ae == ncclSuccess);
  CHECK(ncclCommGetAsyncError(nb, &ae) == ncclSuccess && ae == ncclSuccess);
  r = expect_op(GH_OP_ASYNC_ERROR); /* one record per change, not per poll */
  CHECK(r->result == ncclSuccess);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, nb, NULL) == ncclInProgress);
  r = expect_op(GH_OP_ALLREDUCE);
  CHECK((r->flags & GH_F_IN_PROGRESS) && r->result == ncclInProgress);
  uint64_t nbid = r->comm_id;
  CHECK(ncclCommAbort(nb) == ncclSuccess);
  CHECK(expect_op(GH_OP_COMM_ABORT)->comm_id == nbid);
  e = ring_comm(&v, nbid);
  CHECK(e != NULL && e->state == GH_COMM_ABORTED);

  CHECK(ncclCommInitAll(all, 2, NULL) == ncclSuccess);
  struct gh_record *a0 = expect_op(GH_OP_COMM_INIT_ALL), *a1 = expect_op(GH_OP_COMM_INIT_ALL);
  CHECK(a0->comm_id == a1->comm_id && a0->comm_rank == 0 && a1->comm_rank == 1 && a1->nranks == 2);

  pthread_t nt;
  void *nres = NULL;
  pthread_create(&nt, NULL, null_comm_caller, NULL);
  pthread_join(nt, &nres);
  CHECK((intptr_t)nres == ncclInvalidArgument);
  r = expect_op(GH_OP_ALLREDUCE); /* recorded, with no communicator */
  CHECK(r->comm_id == 0 && r->result == ncclInvalidArgument);

  /* Pause -> benchmark (P2P send on the job's comm; GEMM unsupported: no cuBLAS) -> resume. */
  v.comms[0].comm_id = v.comms[0].comm_id; /* slot 0 is `comm` */
  CHECK(v.comms[0].comm_id == cid);
  pthread_t t;
  pthread_create(&t, NULL, agent, NULL);
  while (!__atomic_load_n(&v.ctl->pause_request, __ATOMIC_ACQUIRE)) usleep(100);
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess);
  pthread_join(t, NULL);
  CHECK(v.ctl->pause_count == 1 && v.ctl->paused == 0);
  CHECK(v.ctl->slots[3].state == GH_BENCH_FAILED && v.ctl->slots[3].result == ncclInvalidUsage);
  CHECK(v.ctl->slots[2].state == GH_BENCH_DONE && stub_splits_with_config == 1);
  CHECK(v.ctl->slots[4].state == GH_BENCH_FAILED && v.ctl->slots[4].result == ncclInvalidArgument);
  CHECK(v.ctl->slots[5].state == GH_BENCH_FAILED && v.ctl->slots[5].result == ncclInvalidUsage);
  CHECK(v.ctl->bench_comms_made == 1 && v.ctl->bench_comms_aborted == 1);
  CHECK(stub_aborts == 2); /* the job's own (above) and the benchmark communicator */
  CHECK(v.ctl->slots[0].state == GH_BENCH_DONE && v.ctl->slots[0].n_done == 3);
  CHECK(v.ctl->slots[0].durations_ns[2] > 0 && v.ctl->slots[0].total_ns >= v.ctl->slots[0].durations_ns[2]);
  CHECK(v.ctl->slots[1].state == GH_BENCH_UNSUPPORTED);
  r = expect_op(GH_OP_ALLREDUCE); /* the paused call itself ran afterwards; benchmarks unrecorded */
  CHECK(r->seq == 8);
  CHECK(next_rec() == NULL);
  e = ring_comm(&v, cid);
  CHECK(e != NULL && e->send_count[0] == 2);

  /* Fork: the child must not write into the parent's ring. */
  uint64_t before = v.h->head;
  pid_t pid = fork();
  if (pid == 0) {
    ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, NULL);
    _exit(0);
  }
  int status;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && v.h->head == before);

  /* Overflow: with the consumer never advancing, the ring drops and counts. */
  __atomic_store_n(&v.h->consumed, v.h->head, __ATOMIC_RELEASE);
  for (int i = 0; i < 100; i++) ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, comm, NULL);
  CHECK(v.h->head - v.h->consumed == 64 && v.h->dropped == 36);
  e = ring_comm(&v, cid);
  CHECK(e != NULL && e->last_seq_completed == 108); /* counters keep counting */
  /* No CUDA runtime in this process: no completion marks, the GPU fields stay unused. */
  CHECK(e != NULL && e->gpu_marks == 0 && e->gpu_calls_done == 0 && e->gpu_pending_ns == 0 &&
        e->gpu_marks_lost == 0);
  CHECK(ncclCommDestroy(comm) == ncclSuccess && ncclCommDestroy(sub) == ncclSuccess);
  printf("test_hook_api: %s\n", gh_failures ? "FAIL" : "ok");
  return gh_failures != 0;
}
