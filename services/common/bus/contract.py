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
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from greyhound.core import lifecycle
from greyhound.ids import TOKEN_PATTERN, check_token
from services.common.bus.bounds import (
    MAX_LISTED,
    MAX_ROWS,
    Age,
    Code,
    CommRank,
    CommSize,
    Counter,
    EventId,
    Evidence,
    Id64,
    Iteration,
    Name,
    Nanos,
    ObjectId,
    Peer,
    Rank,
    Rate,
    Seconds,
    Severity,
    SignedNanos,
    Size,
    Text,
    UnixSeconds,
)

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
        """Requests that only look or switch the mode (status, set_mode) to one agent."""
        return _job_subject(job, "control", agent)

    @staticmethod
    def validation(job: str, agent: str) -> str:
        """Requests that hold the job (pause, bench, resume): a subject of their own, so that
        the server lets only the validator publish them (docs/security.md)."""
        return _job_subject(job, "validate", agent)

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
    def plan(job: str) -> str:
        """The job's current plan: the planner's newest delivery (the plans stream keeps only
        that one per job, so a job that subscribes late still gets it)."""
        return _job_subject(job, "plan")

    @staticmethod
    def plan_report(job: str) -> str:
        """The job's reports that it applied (or could not apply) a delivered plan."""
        return _job_subject(job, "planreport")

    @staticmethod
    def dead_letter(stream: str) -> str:
        return f"{DLQ_PREFIX}.{stream}"

    @staticmethod
    def job_iterations(job: str) -> str:
        """Every agent's iteration batches of one job as stored (the API reads a job's recent
        window), with or without a partition token after the agent's."""
        return f"{_job_subject(job, 'iter')}.>"

    @staticmethod
    def job_collectives(job: str) -> str:
        return f"{_job_subject(job, 'colls')}.>"

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
    ALL_PLANS = f"{PREFIX}.*.plan"
    ALL_PLAN_REPORTS = f"{PREFIX}.*.planreport"
    ALL_VALIDATION = f"{PREFIX}.*.validate.*"
    ALL_DEAD_LETTERS = f"{DLQ_PREFIX}.>"

    @staticmethod
    def telemetry_partitioning(partitions: int) -> tuple[str, str]:
        """Stream transform (source, destination) that shards telemetry by job for trackers.

        The job's partition, 0..partitions-1 (a stable hash of the job token), is appended to
        the stored subject after the agent id: the agent token stays, so a consumer can still
        check that the body's agent is the one the server let publish there (it replaced the
        agent token before, which left the body's word for who sent it).
        """
        return (f"{PREFIX}.*.*.*",
                f"{PREFIX}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}"
                f".{{{{partition({partitions},1)}}}}")

    @staticmethod
    def in_partition(filter_subject: str, partition: int) -> str:
        """A telemetry wildcard filter (ALL_ITERATIONS, ...) narrowed to one tracker partition."""
        if filter_subject.rpartition(".")[2] != "*":
            raise ValueError(f"{filter_subject!r} has no agent token to partition")
        return f"{filter_subject}.{partition}"

    @staticmethod
    def stored(filter_subject: str) -> str:
        """A telemetry wildcard filter (ALL_COLLECTIVES, ...) that matches its subjects as the
        stream stores them, with the partition token or without."""
        head, _, last = filter_subject.rpartition(".")
        if last != "*":
            raise ValueError(f"{filter_subject!r} has no agent token")
        return f"{head}.>"

    @staticmethod
    def published(stored: str) -> str:
        """The subject a message was published on, from the one its stream stored it under
        (less the partition token a partitioned stream appends)."""
        parts = stored.split(".")
        if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != PREFIX:
            return stored
        return ".".join(parts[:5] if parts[3] in _PER_AGENT_KINDS else parts[:4])

    @staticmethod
    def agent_of(subject: str) -> str | None:
        """The agent token of a per-agent subject (telemetry from an agent, requests to one),
        None for a job-level one."""
        parts = subject.split(".")
        if len(parts) >= 5 and parts[3] in _PER_AGENT_KINDS:
            return parts[4]
        return None

    @staticmethod
    def job_of(subject: str) -> str:
        """The job token of any gh.v1 subject."""
        parts = subject.split(".")
        if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != PREFIX:
            raise ValueError(f"not a {PREFIX} subject: {subject!r}")
        return parts[2]


# The kinds whose subjects end in an agent id (Subjects.hello ... Subjects.validation).
_PER_AGENT_KINDS = frozenset({"hello", "iter", "counters", "colls", "gpu", "control", "validate"})


def subject_mismatch(subject: str, msg: BaseModel) -> str | None:
    """Why ``msg`` may not be taken as sent on ``subject``, None when it may.

    The server checks who publishes on which subject (an agent only on subjects ending in its
    own id), never what the body says, so a consumer believes the subject: a body whose job
    differs from the subject's job token, or whose agent differs from the subject's agent
    token, is a forgery (one node's bus password speaking for another job or agent)."""
    try:
        job = Subjects.job_of(subject)
    except ValueError as exc:
        return str(exc)
    said = getattr(msg, "job_id", None)
    if said is not None and said != job:
        return f"the body's job {said!r} is not the subject's {job!r}"
    agent, said = Subjects.agent_of(subject), getattr(msg, "agent_id", None)
    if agent is not None and said is not None and said != agent:
        return f"the body's agent {said!r} is not the subject's {agent!r}"
    return None


def new_event_id() -> str:
    return uuid.uuid4().hex


# Every model here: unknown fields rejected (drift is caught early), no NaN or infinity anywhere
# (services.common.bus.bounds says why each value has a range).
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
Token = Annotated[str, Field(pattern=TOKEN_PATTERN)]
Column = Annotated[list[Any], Field(max_length=MAX_ROWS)]


class Message(BaseModel):
    """Envelope fields every message has."""

    model_config = STRICT

    schema_version: Literal[1] = 1
    event_id: EventId = Field(default_factory=new_event_id)
    ts: UnixSeconds = Field(default_factory=time.time,
                            description="Unix seconds when the event was made")
    job_id: Token


class RankInfo(BaseModel):
    model_config = STRICT

    rank: Rank
    host: Name
    pid: int = Field(ge=0, lt=1 << 32)
    device: int = Field(ge=-1, lt=1 << 16)
    node: int | None = Field(default=None, ge=0, lt=1 << 20)


class AgentHello(Message):
    """An agent announces the ranks it watches; the tracker and API learn the job's shape from it.

    ``marks_off`` lists those of ``ranks`` whose hook found neither a CUDA runtime nor the driver
    API in their process: they have no GPU completion marks and no GPU times, so their hang watch
    and every timing rest on host time alone (an agent says it again when it learns it later)."""

    kind: Literal["hello"] = "hello"
    agent_id: Token
    host: Name
    ranks: list[RankInfo] = Field(max_length=MAX_LISTED)
    world_size: Size | None = None
    marks_off: list[Rank] = Field(default_factory=list, max_length=MAX_LISTED)


class Columnar(Message):
    """A batch of rows sent as one list per field (``COLUMNS``), all of one length; a column of
    ``OPTIONAL`` (added after the message first shipped) may be empty instead, as an older
    producer sends it."""

    COLUMNS: ClassVar[tuple[str, ...]] = ()
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _same_lengths(self) -> Self:
        lengths = {f: len(getattr(self, f)) for f in self.COLUMNS
                   if f not in self.OPTIONAL or len(getattr(self, f))}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"columns must have equal lengths, got {lengths}")
        return self

    @classmethod
    def keep_valid(cls, columns: Mapping[str, Sequence[Any]], **envelope: Any
                   ) -> tuple[Self | None, int]:
        """The message a producer means to send, less the rows outside the contract's bounds
        (a corrupt ring, a clock that jumped), and how many rows were left out; None when none
        is left. A producer uses this so that one bad row costs that row, not the batch nor the
        producer. Errors outside the rows (the envelope) are the producer's bug: raised."""
        cols = {name: list(columns[name]) for name in cls.COLUMNS if name in columns}
        dropped = 0
        for _ in range(3):
            try:
                return cls.model_validate({**envelope, **cols}), dropped
            except ValidationError as exc:
                bad: set[int] = set()
                for err in exc.errors():
                    loc = err["loc"]
                    if len(loc) >= 2 and loc[0] in cols and isinstance(loc[1], int):
                        bad.add(loc[1])
                    elif not (len(loc) == 1 and loc[0] in cols and err["type"] == "too_long"):
                        raise
                n = len(next(iter(cols.values()), []))
                if not bad and n > MAX_ROWS:
                    bad = set(range(MAX_ROWS, n))
                keep = [i for i in range(n) if i not in bad]
                dropped += n - len(keep)
                cols = {name: [col[i] for i in keep] for name, col in cols.items()}
                if not keep:
                    return None, dropped
        return cls.model_validate({**envelope, **cols}), dropped


class IterationBatch(Columnar):
    """Per-rank iteration times found since the agent's last flush (columnar).

    ``iteration`` is the agent's per-rank iteration counter; ``end_ns`` is the wall-clock end of the
    iteration (ns since the epoch, from the hook's anchor); ``duration_s`` the iteration time.
    """

    kind: Literal["iterations"] = "iterations"
    agent_id: Token
    rank: list[Rank] = Field(max_length=MAX_ROWS)
    iteration: list[Annotated[int, Field(ge=0, lt=1 << 63)]] = Field(max_length=MAX_ROWS)
    end_ns: list[Nanos] = Field(max_length=MAX_ROWS)
    duration_s: list[Seconds] = Field(max_length=MAX_ROWS)

    COLUMNS: ClassVar[tuple[str, ...]] = ("rank", "iteration", "end_ns", "duration_s")

    def __len__(self) -> int:
        return len(self.rank)


class ProgressRows(BaseModel):
    """CCL-D's kernel-level counters from NCCL's profiler plugin (the hook), one row per (rank,
    communicator, channel, peer, kind) of this agent's ranks.

    ``kind`` 0 sends, 1 receives (network transfers: NCCL raises no step events for peers on the
    same node), 2 a channel's kernel. ``peer`` is the peer's rank in the communicator (-1 for a
    kernel), ``comm_rank`` the owner's. ``posted`` / ``done`` count network steps (CCL-D's
    SendCount and RecvCount; a kernel: starts and stops), ``bytes`` and ``net_s`` the bytes done
    and their time on the network, ``stalled_s`` how long ago the row last moved (on its host's
    clock), ``seq`` the collective (the comm table's sequence) of its newest op (0 unknown).
    ``rate`` (steps/s, CCL-D's SendRate and RecvRate), ``byte_rate`` (bytes/s) and ``net_bw``
    (bytes per second of network time) are over the agent's last sampling window, 0 unknown."""

    model_config = STRICT

    rank: list[Rank] = Field(max_length=MAX_ROWS)
    comm_id: list[Id64] = Field(max_length=MAX_ROWS)
    comm_rank: list[CommRank] = Field(max_length=MAX_ROWS)
    kind: list[Literal[0, 1, 2]] = Field(max_length=MAX_ROWS)
    channel: list[Code] = Field(max_length=MAX_ROWS)
    peer: list[Peer] = Field(max_length=MAX_ROWS)
    posted: list[Counter] = Field(max_length=MAX_ROWS)
    done: list[Counter] = Field(max_length=MAX_ROWS)
    bytes: list[Counter] = Field(max_length=MAX_ROWS)
    net_s: list[Age] = Field(max_length=MAX_ROWS)
    stalled_s: list[Age] = Field(max_length=MAX_ROWS)
    seq: list[Counter] = Field(max_length=MAX_ROWS)
    rate: list[Rate] = Field(max_length=MAX_ROWS)
    byte_rate: list[Rate] = Field(max_length=MAX_ROWS)
    net_bw: list[Rate] = Field(max_length=MAX_ROWS)

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "rank", "comm_id", "comm_rank", "kind", "channel", "peer", "posted", "done", "bytes",
        "net_s", "stalled_s", "seq", "rate", "byte_rate", "net_bw")

    @model_validator(mode="after")
    def _same_lengths(self) -> Self:
        lengths = {len(getattr(self, f)) for f in self.COLUMNS}
        if len(lengths) > 1:
            raise ValueError("progress columns must have equal lengths")
        return self


class CounterBatch(Columnar):
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
    ``gpu_pending_s`` while every host has left NCCL. ``last_peer`` and ``gpu_pending_peer``
    (layout 6; empty from older agents) name the peer of those calls (a send or receive's, a
    rooted collective's root; -1 none), so a point-to-point hang is named by its pair.
    ``progress`` carries the profiler plugin's counters of the same ranks, when it runs.
    """

    kind: Literal["counters"] = "counters"
    agent_id: Token
    sampled_ns: Nanos = Field(description="wall-clock ns of the sample")
    rank: list[Rank] = Field(max_length=MAX_ROWS)
    comm_id: list[Id64] = Field(max_length=MAX_ROWS)
    comm_rank: list[CommRank] = Field(max_length=MAX_ROWS)
    nranks: list[CommSize] = Field(max_length=MAX_ROWS)
    entered: list[Counter] = Field(max_length=MAX_ROWS)
    completed: list[Counter] = Field(max_length=MAX_ROWS)
    last_seq_entered: list[Counter] = Field(max_length=MAX_ROWS)
    last_seq_completed: list[Counter] = Field(max_length=MAX_ROWS)
    inflight_s: list[Age] = Field(max_length=MAX_ROWS)
    last_op: list[Code] = Field(max_length=MAX_ROWS)
    last_count: list[Counter] = Field(max_length=MAX_ROWS)
    last_dtype: list[Code] = Field(max_length=MAX_ROWS)
    gpu_marks: list[Code] = Field(max_length=MAX_ROWS)
    gpu_completed: list[Counter] = Field(max_length=MAX_ROWS)
    gpu_seq_completed: list[Counter] = Field(max_length=MAX_ROWS)
    gpu_pending_s: list[Age] = Field(max_length=MAX_ROWS)
    gpu_pending_seq: list[Counter] = Field(max_length=MAX_ROWS)
    gpu_pending_op: list[Code] = Field(max_length=MAX_ROWS)
    gpu_pending_count: list[Counter] = Field(max_length=MAX_ROWS)
    gpu_pending_dtype: list[Code] = Field(max_length=MAX_ROWS)
    last_peer: list[Peer] = Field(default_factory=list, max_length=MAX_ROWS)
    gpu_pending_peer: list[Peer] = Field(default_factory=list, max_length=MAX_ROWS)
    progress: ProgressRows | None = None

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "rank", "comm_id", "comm_rank", "nranks", "entered", "completed", "last_seq_entered",
        "last_seq_completed", "inflight_s", "last_op", "last_count", "last_dtype", "gpu_marks",
        "gpu_completed", "gpu_seq_completed", "gpu_pending_s", "gpu_pending_seq",
        "gpu_pending_op", "gpu_pending_count", "gpu_pending_dtype", "last_peer",
        "gpu_pending_peer")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("last_peer", "gpu_pending_peer")


DetectionKind = Literal["slowdown", "recovery", "hang"]


DetectionStage = Literal["suspected", "confirmed"]


class DetectionEvent(Message):
    """The tracker's verdict that a job changed: it got slower, recovered, or a communicator hangs.

    A slowdown comes in two stages (greyhound.core.levels): ``suspected`` when a short transient
    could still explain it (consumers may profile, never pause the job), then a second event,
    ``confirmed``, once it has held, or a recovery whose evidence ``change`` is ``withdrawn``
    when the level came back first. A slowdown confirmed at once is one ``confirmed`` event.
    ``suspected_iteration`` / ``suspected_ns`` say when it was first suspected; the confirmation
    is ``detected_iteration`` / ``detected_ns`` of the confirmed event, and ``confirms`` names
    the suspected event it confirms (None when confirmed at once), as a withdrawal names the one
    it withdraws. An event without a stage
    (sent before there were two) is confirmed."""

    kind: DetectionKind
    ranks: list[Rank] = Field(max_length=MAX_LISTED, description=(
        "ranks whose detectors fired (all ranks of a sync job usually)"))
    first_iteration: Iteration = Field(description="estimated first slow (or recovered) iteration")
    detected_iteration: Iteration
    before_s: Seconds = Field(description=(
        "the level before the change; for a hang, the typical iteration; for the end of a "
        "hang, the longest wait"))
    after_s: Seconds = Field(description="the level after; for a hang, how long it stalled")
    detected_ns: Nanos = Field(description="wall-clock ns of detection")
    comm_id: Id64 | None = None
    stalled_s: Age | None = None
    threshold_s: Age | None = None
    method: Name = "bocd-v"
    evidence: Evidence = Field(
        default_factory=dict,
        description="what the tracker saw: for hangs, the communicator's latest counter rows")
    stage: DetectionStage = "confirmed"
    suspected_iteration: Iteration | None = Field(
        default=None, description="a slowdown's iteration when first suspected")
    suspected_ns: Nanos | None = Field(
        default=None, description="wall-clock ns when a slowdown was first suspected")
    confirms: EventId | None = Field(
        default=None, description=(
            "the suspected event (its event_id) this confirms, or, for a withdrawal, withdraws"))

    HANG_WATCH: ClassVar[str] = "hang-watch"

    @property
    def slowdown(self) -> float:
        return self.after_s / self.before_s

    @property
    def withdrawn(self) -> bool:
        """A suspected slowdown the job's level came back from before it was confirmed."""
        return self.kind == "recovery" and self.evidence.get("change") == "withdrawn"

    @property
    def hang_over(self) -> bool:
        """A recovery from the hang watch: the stalled communicators move again."""
        return self.kind == "recovery" and self.method == self.HANG_WATCH


IncidentStage = lifecycle.Status


class IncidentEvent(Message):
    """An incident was opened or moved on (published after its database commit)."""

    incident_id: ObjectId
    stage: IncidentStage
    kind: Name
    severity: Severity
    summary: Text


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
    agent_id: Token
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


class CollectiveBatch(Columnar):
    """Every collective a rank completed, with wall-clock enter/exit (and GPU times when profiled).

    Agents publish these only while a job is in profile mode (the analyzer asks for it when a
    job slows down): they carry one row per call, far too many to send all the time.
    """

    kind: Literal["collectives"] = "collectives"
    agent_id: Token
    rank: list[Rank] = Field(max_length=MAX_ROWS)
    comm_id: list[Id64] = Field(max_length=MAX_ROWS)
    comm_rank: list[CommRank] = Field(max_length=MAX_ROWS)
    nranks: list[CommSize] = Field(max_length=MAX_ROWS)
    seq: list[Counter] = Field(max_length=MAX_ROWS)
    op: list[Code] = Field(max_length=MAX_ROWS)
    count: list[Counter] = Field(max_length=MAX_ROWS)
    dtype: list[Code] = Field(max_length=MAX_ROWS)
    peer: list[Peer] = Field(max_length=MAX_ROWS)
    enter_ns: list[SignedNanos] = Field(max_length=MAX_ROWS)
    exit_ns: list[SignedNanos] = Field(max_length=MAX_ROWS)
    gpu_start_ns: list[SignedNanos] = Field(max_length=MAX_ROWS,
                                            description="0 when the call was not profiled")
    gpu_end_ns: list[SignedNanos] = Field(max_length=MAX_ROWS)

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "rank", "comm_id", "comm_rank", "nranks", "seq", "op", "count", "dtype", "peer",
        "enter_ns", "exit_ns", "gpu_start_ns", "gpu_end_ns")


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
    if "progress" in hi:
        hi["progress"] = None  # rows of their own, sent once
    return type(msg).model_validate(lo), type(msg).model_validate(hi)


SuspicionKind = Literal["compute_slow", "comm_slow", "mixed_slow"]


class Suspicion(Message):
    """The analyzer's classified slow suspicion, for the validator to confirm on the hardware."""

    incident_id: ObjectId
    kind: SuspicionKind
    ranks: list[Rank] = Field(max_length=MAX_LISTED, description="ranks named as compute culprits")
    comm_ids: list[Id64] = Field(max_length=MAX_LISTED,
                                 description="communicators whose collectives are slow")
    slow_groups: list[Id64] = Field(default_factory=list, max_length=MAX_LISTED,
                                    description="comm ids > 10% above peers")
    evidence: Evidence = Field(default_factory=dict)


MAX_GEMM_N = 16_384  # a 16384^2 float32 matrix is 1 GiB; three of them fit any training GPU's spare
MAX_P2P_BYTES = 1 << 30
MAX_BENCH_ITEMS = 4096
MAX_COMMS_PER_RANK = 4096


class BenchItem(BaseModel):
    """One benchmark for one rank: a GEMM on its GPU, one side of a P2P transfer, a wait for the
    rank's queued GPU work (``drain``), or the split of ``comm_id`` into the benchmark
    communicator that the transfers naming ``comm_id`` run on (``split``: every rank of
    ``comm_id`` must get one; transfers never run on a job's own communicator). Sizes are
    bounded: the hook allocates what they say on a training GPU."""

    model_config = STRICT

    rank: Rank
    kind: Literal["gemm", "send", "recv", "drain", "split"]
    size: int = Field(default=0, ge=0, le=MAX_P2P_BYTES, description=(
        f"GEMM: matrix dimension N (<= {MAX_GEMM_N}); P2P: bytes (<= {MAX_P2P_BYTES}); "
        "drain and split: 0"))
    repeat: int = Field(default=3, ge=1, le=64)
    comm_id: Id64 = 0
    peer: Peer = Field(default=-1, description="P2P peer's rank within comm_id")

    @model_validator(mode="after")
    def _sizes(self) -> Self:
        if self.kind == "gemm" and self.size > MAX_GEMM_N:
            raise ValueError(f"GEMM dimension {self.size} is over {MAX_GEMM_N}")
        if (self.kind in ("drain", "split")) != (self.size == 0):
            raise ValueError(f"a {self.kind} item takes size "
                             f"{'0' if self.kind in ('drain', 'split') else '> 0'}")
        if self.kind == "split" and self.comm_id == 0:
            raise ValueError("a split item names the communicator to split (comm_id)")
        return self


class ControlRequest(BaseModel):
    """Validator/analyzer -> agent, by request/reply: ``status`` and ``set_mode`` on
    ``Subjects.control(job, agent)``, ``pause``, ``bench`` and ``resume`` (which hold the job,
    the validator's alone) on ``Subjects.validation(job, agent)``; bus.control picks the subject.

    ``status`` reports each rank's mode, pause state and communicators; ``set_mode`` switches the
    hook between monitor and profile; ``pause`` parks each rank at the entry of its call on
    ``pause_comm_id`` (per rank, as the rank's own comm id) whose sequence is >= ``pause_seq``;
    ``bench`` runs ``bench`` items on paused ranks and replies with their durations; ``resume``
    releases them; ``gpu`` samples the GPU health (NVML) of the ranks' GPUs now.
    """

    model_config = STRICT

    schema_version: Literal[1] = 1
    job_id: Token
    action: Literal["status", "set_mode", "pause", "resume", "bench", "gpu"]
    ranks: list[Rank] | None = Field(default=None, max_length=MAX_LISTED,
                                     description="None: every rank of the job here")
    mode: Literal["monitor", "profile"] | None = None
    pause_comm_id: dict[Rank, Id64] = Field(default_factory=dict, max_length=MAX_LISTED,
                                            description="rank -> comm id")
    pause_seq: Counter = 0
    bench: list[BenchItem] = Field(default_factory=list, max_length=MAX_BENCH_ITEMS)
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    lease_s: float | None = Field(default=None, gt=0, le=600, description=(
        "pause: the hook resumes by itself this long after the request, whatever becomes of "
        "the requester (None: the hook's default lease)"))


class CommStatus(BaseModel):
    model_config = STRICT

    comm_id: Id64
    comm_rank: CommRank
    nranks: CommSize
    last_seq_entered: Counter
    last_seq_completed: Counter


class RankStatus(BaseModel):
    model_config = STRICT

    rank: Rank
    host: Name
    device: int = Field(ge=-1, lt=1 << 16)
    mode: Literal["monitor", "profile"]
    paused: bool
    comms: list[CommStatus] = Field(max_length=MAX_COMMS_PER_RANK)
    job_timeout_s: float | None = Field(default=None, gt=0, le=4e6, description=(
        "the job's collective (process-group) timeout as the rank reported it; a pause of the "
        "rank ends at a quarter of it whatever its lease"))


class BenchOutcome(BaseModel):
    model_config = STRICT

    item: BenchItem
    state: Literal["done", "unsupported", "failed", "timeout"]
    durations_ns: list[Nanos] = Field(default_factory=list, max_length=64,
                                      description="GPU time of each repeat")
    drain_ns: Nanos = Field(default=0, description=(
        "how long the paused rank waited for its queued GPU work before measuring"))


class ControlReply(BaseModel):
    model_config = STRICT

    schema_version: Literal[1] = 1
    ok: bool
    error: Text | None = None
    agent_id: Token
    ranks: list[RankStatus] = Field(default_factory=list, max_length=MAX_LISTED)
    results: list[BenchOutcome] = Field(default_factory=list, max_length=MAX_BENCH_ITEMS)
    gpus: list[GpuSample] = Field(default_factory=list, max_length=MAX_GPUS,
                                  description="the answer to a gpu request")


class JobLayout(BaseModel):
    """A training job's parallel layout as it declares it (``PUT /v1/jobs/{id}/layout``): what
    the planner needs to build plans and nothing the telemetry already says.

    Ranks follow Megatron's order ``rank = tp + TP * (dp + DP * pp)``; GPU ``g`` is the
    ``g % gpus_per_node``-th GPU of the job's ``g // gpus_per_node``-th node, rank ``r`` starting on
    GPU ``r``. ``microbatches`` is M, the global batch's micro-batches per iteration, and every
    DP group's share must be a multiple of ``multiple_of`` (the pipeline depth for schedules that
    need it, else 1). The byte counts weigh the DP and PP traffic of a role swap (S3) and price a
    checkpoint-restart (S4); left out, the planner's settings stand in.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(ge=1, le=1 << 16)
    dp: int = Field(ge=1, le=1 << 16)
    pp: int = Field(ge=1, le=1 << 16)
    gpus_per_node: int = Field(ge=1, le=1024)
    microbatches: int = Field(ge=1, le=1 << 24)
    multiple_of: int = Field(default=1, ge=1, le=1 << 16)
    dp_allreduce_bytes: float | None = Field(default=None, ge=0, le=1e15)
    pp_activation_bytes: float | None = Field(default=None, ge=0, le=1e15)
    checkpoint_bytes: float | None = Field(default=None, ge=0, le=1e18)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @model_validator(mode="after")
    def _fits(self) -> JobLayout:
        if self.world > 1 << 20:
            raise ValueError(f"tp x dp x pp = {self.world} ranks is more than 2^20")
        if self.world % self.gpus_per_node:
            raise ValueError(f"gpus_per_node {self.gpus_per_node} must divide the world size "
                             f"{self.world}")
        if self.microbatches < self.dp * self.multiple_of or self.microbatches % self.multiple_of:
            raise ValueError(f"microbatches {self.microbatches} must be a multiple of "
                             f"multiple_of {self.multiple_of} and at least dp x multiple_of "
                             f"({self.dp * self.multiple_of})")
        return self


PlanStrategy = Literal["S2", "S3", "S4"]


class PlanMessage(Message):
    """What the job runs from now on: a plan, or the revert of one (``Subjects.plan(job)``).

    ``version`` numbers the job's deliveries (1, 2, ...): a job applies a message whose version
    is above the one it runs and ignores the rest, so a stale or repeated message does nothing.
    The state is absolute: ``microbatches`` per DP group (None: the job's own even split) and
    ``gpu_of_rank`` (None: every rank on its own GPU); ``swaps`` are the GPU pairs that exchange
    ranks, in order, to go from the previous version's layout to this one. ``cost_s`` is what the
    planner expects applying it to cost (the job reports what it really cost).
    """

    kind: Literal["plan"] = "plan"
    version: int = Field(ge=1, le=2**31 - 1)
    plan_id: str = Field(min_length=1, max_length=32)
    incident_id: str = Field(min_length=1, max_length=32)
    strategy: PlanStrategy
    action: Literal["apply", "revert"]
    microbatches: list[int] | None = None
    gpu_of_rank: list[int] | None = None
    swaps: list[tuple[int, int]] = Field(default_factory=list)
    cost_s: float | None = Field(default=None, ge=0)
    summary: str = ""


class PlanReport(Message):
    """A job's answer to a delivery (``Subjects.plan_report(job)``): it runs ``version`` from now
    (``applied``, with what applying it cost in seconds of training time) or it could not apply
    it (``failed``, with why). The planner learns each strategy's overhead from ``cost_s``."""

    kind: Literal["plan_report"] = "plan_report"
    version: int = Field(ge=1, le=2**31 - 1)
    outcome: Literal["applied", "failed"]
    cost_s: float | None = Field(default=None, ge=0, le=1e7)
    error: str | None = Field(default=None, max_length=2000)
    reporter: str = Field(default="", max_length=255, description="who reported (token name)")
