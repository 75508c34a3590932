"""The bus contract: every subject and every message Greyhound puts on NATS.

No subject string is written anywhere else. Subjects are versioned (``gh.v1``) and carry the job id
in the third token, so consumers filter and shard by job. Every message carries ``schema_version``,
an ``event_id`` (also the ``Nats-Msg-Id`` header, for JetStream de-duplication and idempotent
handlers) and a timestamp. Telemetry is columnar (one message per agent flush, lists per field) so
that a tracker can absorb tens of thousands of rank-iterations per second.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from greyhound.core import lifecycle
from greyhound.ids import TOKEN_PATTERN, check_token

SCHEMA_VERSION = 1
PREFIX = "gh.v1"
# Outside gh.v1.* so that no stream's subjects overlap with the dead letters.
DLQ_PREFIX = "gh.dlq.v1"


def _job_subject(job: str, kind: str, agent: str | None = None) -> str:
    subject = f"{PREFIX}.{check_token(job, 'job id')}.{kind}"
    return subject if agent is None else f"{subject}.{check_token(agent, 'agent id')}"


class Subjects:
    """Builders for concrete subjects and the wildcard filters consumers subscribe with.

    Per-agent subjects (telemetry from an agent, control to an agent) end in the agent id;
    job-level events end in their kind.
    """

    @staticmethod
    def hello(job: str, agent: str) -> str:
        return _job_subject(job, "hello", agent)

    @staticmethod
    def iterations(job: str, agent: str) -> str:
        return _job_subject(job, "iter", agent)

    @staticmethod
    def counters(job: str, agent: str) -> str:
        return _job_subject(job, "counters", agent)

    @staticmethod
    def collectives(job: str, agent: str) -> str:
        return _job_subject(job, "colls", agent)

    @staticmethod
    def gpu_health(job: str, agent: str) -> str:
        """GPU health (NVML) of the GPUs this agent's ranks of ``job`` run on."""
        return _job_subject(job, "gpu", agent)

    @staticmethod
    def control(job: str, agent: str) -> str:
        return _job_subject(job, "control", agent)

    @staticmethod
    def detection(job: str) -> str:
        return _job_subject(job, "detect")

    @staticmethod
    def incident(job: str) -> str:
        return _job_subject(job, "incident")

    @staticmethod
    def suspicion(job: str) -> str:
        return _job_subject(job, "suspect")

    @staticmethod
    def dead_letter(stream: str) -> str:
        return f"{DLQ_PREFIX}.{stream}"

    @staticmethod
    def job_iterations(job: str) -> str:
        """Every agent's iteration batches of one job (the API reads a job's recent window)."""
        return f"{_job_subject(job, 'iter')}.*"

    @staticmethod
    def job_collectives(job: str) -> str:
        return f"{_job_subject(job, 'colls')}.*"

    # Wildcard filters (any job, any agent).
    ALL_HELLO = f"{PREFIX}.*.hello.*"
    ALL_ITERATIONS = f"{PREFIX}.*.iter.*"
    ALL_COUNTERS = f"{PREFIX}.*.counters.*"
    ALL_COLLECTIVES = f"{PREFIX}.*.colls.*"
    ALL_GPU_HEALTH = f"{PREFIX}.*.gpu.*"
    ALL_DETECTIONS = f"{PREFIX}.*.detect"
    ALL_INCIDENTS = f"{PREFIX}.*.incident"
    ALL_SUSPICIONS = f"{PREFIX}.*.suspect"
    ALL_CONTROL = f"{PREFIX}.*.control.*"
    ALL_DEAD_LETTERS = f"{DLQ_PREFIX}.>"

    @staticmethod
    def telemetry_partitioning(partitions: int) -> tuple[str, str]:
        """Stream transform (source, destination) that shards telemetry by job for trackers.

        The stored subject's last token (the agent id, which every message also carries in its
        body) becomes the job's partition, 0..partitions-1, a stable hash of the job token; the
        other tokens, hence every existing filter, stay as they are.
        """
        return (f"{PREFIX}.*.*.*",
                f"{PREFIX}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{partition({partitions},1)}}}}")

    @staticmethod
    def in_partition(filter_subject: str, partition: int) -> str:
        """A telemetry wildcard filter (ALL_ITERATIONS, ...) narrowed to one tracker partition."""
        head, _, last = filter_subject.rpartition(".")
        if last != "*":
            raise ValueError(f"{filter_subject!r} has no agent token to partition")
        return f"{head}.{partition}"

    @staticmethod
    def job_of(subject: str) -> str:
        """The job token of any gh.v1 subject."""
        parts = subject.split(".")
        if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != PREFIX:
            raise ValueError(f"not a {PREFIX} subject: {subject!r}")
        return parts[2]


def new_event_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    """Envelope fields every message has; unknown fields are rejected so drift is caught early."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    event_id: str = Field(default_factory=new_event_id, min_length=8, max_length=64)
    ts: float = Field(default_factory=time.time, description="Unix seconds when the event was made")
    job_id: Annotated[str, Field(pattern=TOKEN_PATTERN)]


class RankInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    host: str
    pid: int = Field(ge=0)
    device: int = Field(ge=-1)
    node: int | None = Field(default=None, ge=0)


class AgentHello(Message):
    """An agent announces the ranks it watches; the tracker and API learn the job's shape from it."""

    kind: Literal["hello"] = "hello"
    agent_id: str
    host: str
    ranks: list[RankInfo]
    world_size: int | None = Field(default=None, ge=1)


def _same_lengths(model: BaseModel, fields: tuple[str, ...]) -> None:
    lengths = {f: len(getattr(model, f)) for f in fields}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"columns must have equal lengths, got {lengths}")


class IterationBatch(Message):
    """Per-rank iteration times found since the agent's last flush (columnar).

    ``iteration`` is the agent's per-rank iteration counter; ``end_ns`` is the wall-clock end of the
    iteration (ns since the epoch, from the hook's anchor); ``duration_s`` the iteration time.
    """

    kind: Literal["iterations"] = "iterations"
    agent_id: str
    rank: list[int]
    iteration: list[int]
    end_ns: list[int]
    duration_s: list[float]

    COLUMNS: ClassVar[tuple[str, ...]] = ("rank", "iteration", "end_ns", "duration_s")

    @model_validator(mode="after")
    def _columns(self) -> IterationBatch:
        _same_lengths(self, self.COLUMNS)
        return self

    def __len__(self) -> int:
        return len(self.rank)


class CounterBatch(Message):
    """CCL-D style per-communicator counters of each rank, sampled by the agent (columnar).

    NCCL calls are asynchronous, so the columns come in two sets. Host side: ``entered`` /
    ``last_seq_entered`` and ``last_*`` say what the host enqueued (``last_*`` describe its
    newest call, which may be past the one the GPU is stuck in); ``completed`` /
    ``last_seq_completed`` move at host return, microseconds later; ``inflight_s`` is how long a
    host thread has been inside the NCCL API (normally microseconds, 0 when none). GPU side,
    from the hook's completion marks: ``gpu_marks`` is 1 when they are recorded for this
    communicator (0: a host-only process, whose readers fall back to the host columns);
    ``gpu_completed`` counts calls done on the GPU (numbered as ``entered``) and
    ``gpu_seq_completed`` is the newest collective done there; ``gpu_pending_s`` is the age of
    the oldest call enqueued and not done on the GPU (0 when none), and ``gpu_pending_seq`` /
    ``_op`` / ``_count`` / ``_dtype`` describe that call (seq 0 for a send or receive), so ranks
    stuck at one sequence compare what each one is stuck in. A hung collective shows as a large
    ``gpu_pending_s`` while every host has left NCCL.
    """

    kind: Literal["counters"] = "counters"
    agent_id: str
    sampled_ns: int = Field(description="wall-clock ns of the sample")
    rank: list[int]
    comm_id: list[int]
    comm_rank: list[int]
    nranks: list[int]
    entered: list[int]
    completed: list[int]
    last_seq_entered: list[int]
    last_seq_completed: list[int]
    inflight_s: list[float]
    last_op: list[int]
    last_count: list[int]
    last_dtype: list[int]
    gpu_marks: list[int]
    gpu_completed: list[int]
    gpu_seq_completed: list[int]
    gpu_pending_s: list[float]
    gpu_pending_seq: list[int]
    gpu_pending_op: list[int]
    gpu_pending_count: list[int]
    gpu_pending_dtype: list[int]

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "rank", "comm_id", "comm_rank", "nranks", "entered", "completed", "last_seq_entered",
        "last_seq_completed", "inflight_s", "last_op", "last_count", "last_dtype", "gpu_marks",
        "gpu_completed", "gpu_seq_completed", "gpu_pending_s", "gpu_pending_seq",
        "gpu_pending_op", "gpu_pending_count", "gpu_pending_dtype")

    @model_validator(mode="after")
    def _columns(self) -> CounterBatch:
        _same_lengths(self, self.COLUMNS)
        return self


DetectionKind = Literal["slowdown", "recovery", "hang"]


class DetectionEvent(Message):
    """The tracker's verdict that a job changed: it got slower, recovered, or a communicator hangs."""

    kind: DetectionKind
    ranks: list[int] = Field(description="ranks whose detectors fired (all ranks of a sync job usually)")
    first_iteration: int = Field(description="estimated first slow (or recovered) iteration")
    detected_iteration: int
    before_s: float = Field(ge=0)
    after_s: float = Field(ge=0)
    detected_ns: int = Field(description="wall-clock ns of detection")
    comm_id: int | None = None
    stalled_s: float | None = Field(default=None, ge=0)
    threshold_s: float | None = Field(default=None, ge=0)
    method: str = "bocd-v"
    evidence: dict[str, Any] = Field(
        default_factory=dict,
        description="what the tracker saw: for hangs, the communicator's latest counter rows")

    @property
    def slowdown(self) -> float:
        return self.after_s / self.before_s if self.before_s > 0 else float("inf")


IncidentStage = lifecycle.Status


class IncidentEvent(Message):
    """An incident was opened or moved on (published after its database commit)."""

    incident_id: str
    stage: IncidentStage
    kind: str
    severity: float
    summary: str


MAX_GPUS = 64  # per agent and message: a node has 8 or 16; the bound keeps messages small


class XidEvent(BaseModel):
    """An Xid critical error NVML reported for one GPU (the agent's wall clock when it saw it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: int = Field(ge=0)
    ts: float


class GpuSample(BaseModel):
    """One GPU's health from NVML. A field is None when NVML cannot say (no such counter on this
    GPU, no permission, a failed call): absent, never a made-up zero.

    ``index`` is the NVML device index on ``host``; ``ranks`` the job's ranks on it (from the
    rings' device field). ``throttle`` names the bits of ``throttle_mask`` (NVML's clock event
    reasons: thermal, power cap, hardware slowdown, ...). ECC counts are volatile (since the
    driver loaded); ``nvlink_errors`` sums each NVLink error counter over the active links
    (None without NVLink); ``xids`` are the Xid events of the last minutes, newest last.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    host: str = Field(max_length=255)
    uuid: str | None = Field(default=None, max_length=96)
    name: str | None = Field(default=None, max_length=96)
    ranks: list[int] = Field(default_factory=list, max_length=256)
    sm_clock_mhz: int | None = Field(default=None, ge=0)
    sm_clock_max_mhz: int | None = Field(default=None, ge=0)
    mem_clock_mhz: int | None = Field(default=None, ge=0)
    mem_clock_max_mhz: int | None = Field(default=None, ge=0)
    throttle_mask: int | None = Field(default=None, ge=0)
    throttle: list[str] = Field(default_factory=list, max_length=16)
    temperature_c: int | None = None
    power_w: float | None = Field(default=None, ge=0)
    ecc_corrected: int | None = Field(default=None, ge=0)
    ecc_uncorrected: int | None = Field(default=None, ge=0)
    pcie_replays: int | None = Field(default=None, ge=0)
    nvlink_links: int | None = Field(default=None, ge=0)
    nvlink_errors: dict[str, int] | None = Field(default=None, max_length=8)
    xids: list[XidEvent] = Field(default_factory=list, max_length=16)


class GpuHealth(Message):
    """GPU health of one agent's GPUs that run ranks of the job, sampled every few seconds.

    Per job rather than per node: every subject carries its job (consumers filter and shard by
    it), and a job's incident wants its own GPUs, not the node's others."""

    kind: Literal["gpu"] = "gpu"
    agent_id: str
    sampled_ns: int = Field(description="wall-clock ns of the sample")
    gpus: list[GpuSample] = Field(max_length=MAX_GPUS)


class DeadLetter(BaseModel):
    """What the dead-letter subject receives for a message that failed validation, failed its
    handler for good, or ran out of deliveries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str
    consumer: str
    subject: str
    reason: str
    payload: str = Field(description="the raw payload, decoded as UTF-8 with replacement")
    ts: float = Field(default_factory=time.time)
    payload_bytes: int | None = Field(default=None, ge=0, description="size of the raw payload")
    payload_cut_bytes: int = Field(
        default=0, ge=0, description="bytes left off the end of the payload so the letter fits "
        "under the server's max_payload")


class CollectiveBatch(Message):
    """Every collective a rank completed, with wall-clock enter/exit (and GPU times when profiled).

    Agents publish these only while a job is in profile mode (the analyzer asks for it when a
    job slows down): they carry one row per call, far too many to send all the time.
    """

    kind: Literal["collectives"] = "collectives"
    agent_id: str
    rank: list[int]
    comm_id: list[int]
    comm_rank: list[int]
    nranks: list[int]
    seq: list[int]
    op: list[int]
    count: list[int]
    dtype: list[int]
    peer: list[int]
    enter_ns: list[int]
    exit_ns: list[int]
    gpu_start_ns: list[int] = Field(description="0 when the call was not profiled")
    gpu_end_ns: list[int]

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "rank", "comm_id", "comm_rank", "nranks", "seq", "op", "count", "dtype", "peer",
        "enter_ns", "exit_ns", "gpu_start_ns", "gpu_end_ns")

    @model_validator(mode="after")
    def _columns(self) -> CollectiveBatch:
        _same_lengths(self, self.COLUMNS)
        return self


def split_columns(msg: Message) -> tuple[Message, Message] | None:
    """The two halves of a columnar batch, each with its own event id, or None when it cannot be
    split (not columnar, or one row). A publisher whose message is over the server's size limit
    sends the halves instead: the limit is the server's setting, not the contract's."""
    if not isinstance(msg, IterationBatch | CounterBatch | CollectiveBatch):
        return None
    n = len(getattr(msg, msg.COLUMNS[0]))
    if n < 2:
        return None
    half = n // 2
    data = msg.model_dump(exclude={"event_id"})
    lo = {**data, **{c: data[c][:half] for c in msg.COLUMNS}}
    hi = {**data, **{c: data[c][half:] for c in msg.COLUMNS}}
    return type(msg).model_validate(lo), type(msg).model_validate(hi)


SuspicionKind = Literal["compute_slow", "comm_slow", "mixed_slow"]


class Suspicion(Message):
    """The analyzer's classified slow suspicion, for the validator to confirm on the hardware."""

    incident_id: str
    kind: SuspicionKind
    ranks: list[int] = Field(description="ranks named as compute culprits")
    comm_ids: list[int] = Field(description="communicators whose collectives are slow")
    slow_groups: list[int] = Field(default_factory=list, description="comm ids > 10% above peers")
    evidence: dict[str, Any] = Field(default_factory=dict)


class BenchItem(BaseModel):
    """One benchmark for one rank: a GEMM on its GPU, or one side of a P2P transfer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    kind: Literal["gemm", "send", "recv"]
    size: int = Field(gt=0, description="GEMM: matrix dimension N; P2P: bytes")
    repeat: int = Field(default=3, ge=1, le=64)
    comm_id: int = 0
    peer: int = Field(default=-1, description="P2P peer's rank within comm_id")


class ControlRequest(BaseModel):
    """Validator/analyzer -> agent, by request/reply on ``Subjects.control(job, agent)``.

    ``status`` reports each rank's mode, pause state and communicators; ``set_mode`` switches the
    hook between monitor and profile; ``pause`` parks each rank at the entry of its call on
    ``pause_comm_id`` (per rank, as the rank's own comm id) whose sequence is >= ``pause_seq``;
    ``bench`` runs ``bench`` items on paused ranks and replies with their durations; ``resume``
    releases them; ``gpu`` samples the GPU health (NVML) of the ranks' GPUs now.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    job_id: str
    action: Literal["status", "set_mode", "pause", "resume", "bench", "gpu"]
    ranks: list[int] | None = Field(default=None, description="None: every rank of the job here")
    mode: Literal["monitor", "profile"] | None = None
    pause_comm_id: dict[int, int] = Field(default_factory=dict, description="rank -> comm id")
    pause_seq: int = 0
    bench: list[BenchItem] = Field(default_factory=list)
    timeout_s: float = Field(default=10.0, gt=0, le=300)


class CommStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    comm_id: int
    comm_rank: int
    nranks: int
    last_seq_entered: int
    last_seq_completed: int


class RankStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    host: str
    device: int
    mode: Literal["monitor", "profile"]
    paused: bool
    comms: list[CommStatus]


class BenchOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    item: BenchItem
    state: Literal["done", "unsupported", "failed", "timeout"]
    durations_ns: list[int] = Field(default_factory=list, description="GPU time of each repeat")
    drain_ns: int = Field(default=0, ge=0, description=(
        "how long the paused rank waited for its queued GPU work before measuring"))


class ControlReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    ok: bool
    error: str | None = None
    agent_id: str
    ranks: list[RankStatus] = Field(default_factory=list)
    results: list[BenchOutcome] = Field(default_factory=list)
    gpus: list[GpuSample] = Field(default_factory=list, max_length=MAX_GPUS,
                                  description="the answer to a gpu request")
