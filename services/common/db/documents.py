"""The documents kept in JSONB columns, one typed model each: what one service writes there and
another reads is a contract, as strict as the bus's (``extra="forbid"``).

Where each lives and who writes it:

* ``incidents.culprit``: :class:`Culprit`; the analyzer (the detection's ranks, a hang's
  diagnosis, then the localisation's ranks, communicators, nodes and links) and the validator
  (the confirmed GPUs and links); read by the validator's guard, the planner, the API, the fleet
  view and the webhooks.
* ``incidents.evidence``: :class:`Evidence`, one section per step: ``detection`` and a hang's
  counter rows (the analyzer), ``localization`` (the analyzer's profile), ``validation`` (the
  validator), ``gpu_health`` and ``explanation`` (either, from NVML).
* ``incident_events.detail``: a :data:`Note`, the timeline entry of one step: a detection, a
  localisation, a validation, a plan step (:class:`PlanStep`, the mitigation's), an operator's
  note.
* ``plans.params``: :data:`PlanParams`, one model per kind of plan (the planner's).
* ``plan_deliveries.message``: the bus contract's ``PlanMessage`` itself (the planner writes
  it, the API serves it to the job).
* ``jobs.topology``: :class:`Topology`, the layout a job declared (the API's; the planner
  builds plans from it).

A model's fields are the keys its writers set; an algorithm's own facts (a localisation's
per-rank numbers, NVML samples, a hang diagnosis's records) are typed JSON values inside their
named field, kept for people to read. Stored and served, a document holds the keys its writer
set (``as_json``), so the REST API answers as it did before the columns were typed. The column
type (services.common.db.json_document) adds the schema version and upgrades older rows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from services.common.bus.contract import JobLayout, Suspicion

NodeLabel = int | str  # a node number where the job's placement gives one, else the host name
Facts = dict[str, JsonValue]  # an algorithm's own record, for people to read


def _empty() -> list[Any]:
    return []


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def as_json(self) -> dict[str, Any]:
        """The document as it is stored and served: the fields its writers set."""
        return self.model_dump(mode="json", exclude_unset=True)

    def merged(self, other: Self) -> Self:
        """This document with the fields ``other``'s writer set taken from ``other``."""
        return self.model_copy(update={k: getattr(other, k) for k in other.model_fields_set})


# ---- the culprit --------------------------------------------------------------------------------

class Gpu(Document):
    """A GPU the validator confirmed slow, and where it is (``host``/``device`` when the job's
    ranks are known; ``node`` is ``rank<r>`` when its placement is not)."""

    rank: int
    node: NodeLabel
    host: str | None = None
    device: int | None = None


class OtherHang(Document):
    """A further stalled communicator of a hang, named after its first cause."""

    kind: str
    comm_id: int
    seq: int
    ranks: list[int]


class Culprit(Document):
    """What an incident blames, as far as it is known.

    From the detection: ``ranks``. A hang: the stalled communicator (``comm_id``, unsigned),
    the call (``seq``, ``op``), the diagnosis's record, the further stalled communicators, and
    ``by`` when the GPUs' health named the ranks. A localised slowdown: ``compute_ranks``,
    ``comm_ids`` (unsigned), ``nodes`` and ``links`` (node pairs). A validated one adds the
    confirmed ``gpus``, the slow links' end ranks (``link_ranks``) and ``slow_ranks`` (both);
    ``ranks`` is then the slow GPUs' ranks, or the links' when no GPU is slow. A slowdown whose
    network links the profiler plugin's rates named slow carries them (``slow_links``, each
    greyhound.core.progress.SlowLink.evidence()), found without a pause."""

    ranks: list[int] = Field(default_factory=_empty)
    compute_ranks: list[int] = Field(default_factory=_empty)
    comm_ids: list[int] = Field(default_factory=_empty)
    nodes: list[NodeLabel] = Field(default_factory=_empty)
    links: list[tuple[NodeLabel, NodeLabel]] = Field(default_factory=_empty)
    gpus: list[Gpu] = Field(default_factory=_empty)
    link_ranks: list[tuple[int, int]] = Field(default_factory=_empty)
    slow_ranks: list[int] = Field(default_factory=_empty)
    comm_id: int | None = None
    seq: int | None = None
    op: str | None = None
    diagnosis: Facts | None = None
    others: list[OtherHang] = Field(default_factory=_empty)
    by: str | None = None
    slow_links: list[Facts] = Field(default_factory=_empty)


# ---- the evidence ---------------------------------------------------------------------------

class Detection(Document):
    """The tracker's detection as the analyzer recorded it (``change``: onset, further,
    partial or full; ``healthy_s``: the job's healthy level then), in the evidence and on the
    timeline. There, ``further`` names a second fault's own incident on the open ones, and the
    end of a hang says which communicators moved again (``by`` the hang watch). A slowdown's
    says its ``stage`` (suspected or confirmed) and the iteration it was first suspected at; a
    suspicion the job's level took back is resolved with ``result`` "withdrawn" (``by`` the
    tracker)."""

    event_id: str
    ranks: list[int]
    method: str
    first_iteration: int
    detected_iteration: int
    before_s: float
    after_s: float
    change: str | None = None
    healthy_s: float | None = None
    further: str | None = None
    comm_id: int | None = None
    by: str | None = None
    moved_comms: list[int] | None = None
    stage: str | None = None
    suspected_iteration: int | None = None
    result: str | None = None


class ProfileWindow(Document):
    """The profiling window: the agents asked and answering, what it gathered, how long."""

    agents: int
    agents_answered: int
    batches: int
    rows: int
    wall_s: float


class Timing(Document):
    """Which clock the profiled calls were timed on (greyhound.core.gpu_timeline)."""

    basis: str
    gpu_rows: int
    host_only_rows: int
    excluded_rows: int


class KnownCauses(Document):
    """What the job's other open incidents already named (a second fault's localisation)."""

    incidents: list[str]
    compute_ranks: list[int]
    comm_ids: list[int]
    links: list[list[str]]


class Localization(Document):
    """The analyzer's profile of a slowdown (greyhound.core.slow_localization's evidence, comm
    ids unsigned) with its window and clock. ``marks_off_ranks``: ranks of the job without GPU
    completion marks (their agents' hellos say so), whose calls were timed on the host only."""

    calls: int | None = None
    ranks_observed: int | None = None
    comms_observed: int | None = None
    iteration_before_s: float | None = None
    iteration_after_s: float | None = None
    iteration_profiled_s: float | None = None
    subiteration_period_s: float | None = None
    still_slow: bool | None = None
    late_threshold_ns: float | None = None
    gap_jitter_ns: float | None = None
    job_p: float | None = None
    compute: list[Facts] | None = None
    comms: list[Facts] | None = None
    groups: list[Facts] | None = None
    outside_nccl: Facts | None = None
    by_elimination: list[Facts] | None = None
    p: dict[str, float | None] | None = None
    known: KnownCauses | None = None
    known_only: bool | None = None
    window: ProfileWindow | None = None
    timing: Timing | None = None
    marks_off_ranks: list[int] | None = None


class GpuFinding(Document):
    kind: str
    index: int
    host: str
    ranks: list[int]
    words: str


class GpuHealth(Document):
    """NVML's view of the job's GPUs when the incident was written (greyhound.core.gpu_health):
    what explains it, the samples (the findings' first), the peers' median SM clock."""

    findings: list[GpuFinding]
    samples: list[Facts]
    gpus_sampled: int
    peer_sm_clock_mhz: float | None = None


class Validation(Document):
    """The validator's check of one suspicion: how the job was held, what was timed, the
    verdict (greyhound.core.verdict's evidence, prefixed ``gemm_`` and ``p2p_``), or why there
    is none (``outcome``). ``marks_off_ranks``: ranks checked that have no GPU completion marks
    (their GPU view rests on the host's)."""

    suspicion: str
    suspected: str | None = None
    pause_s: float | None = None
    outcome: str | None = None
    attempt: int | None = None
    pause_seq: dict[str, int] | None = None
    gemm_ranks: list[int] | None = None
    p2p_comms: list[int] | None = None
    p2p_reference_comms: list[int] | None = None
    p2p_rounds: int | None = None
    pause_budget_s: float | None = None
    job_timeout_s: float | None = None
    paused_after_s: float | None = None
    drain_s: dict[str, float] | None = None
    p2p_skipped: str | None = None
    gemm_s: dict[str, float] | None = None
    p2p_s: dict[str, list[float | None]] | None = None
    verdict: str | None = None
    gpus: list[int] | None = None
    links: list[list[int]] | None = None
    gemm_checked: int | None = None
    links_checked: int | None = None
    gemm_gpus_tested: int | None = None
    gemm_median_s: float | None = None
    gemm_reference_s: float | None = None
    gemm_threshold: float | None = None
    gemm_slow_gpus: list[int] | None = None
    gemm_slow_times_s: list[float | None] | None = None
    gemm_max_ratio: float | None = None
    p2p_links_tested: int | None = None
    p2p_reference_links: int | None = None
    p2p_threshold: float | None = None
    p2p_slow_links: list[list[int]] | None = None
    p2p_slow_ratios: list[float | None] | None = None
    p2p_max_ratio: float | None = None
    p2p_nvlink_links_tested: int | None = None
    p2p_nvlink_median_link_s: list[float | None] | None = None
    p2p_nvlink_reference_link_s: list[float | None] | None = None
    p2p_network_links_tested: int | None = None
    p2p_network_median_link_s: list[float | None] | None = None
    p2p_network_reference_link_s: list[float | None] | None = None
    gpu_health: GpuHealth | None = None
    marks_off_ranks: list[int] | None = None

    @property
    def confirmed(self) -> bool:
        """The checks reproduced a slow GPU or link (not transient, not failed)."""
        return self.verdict not in (None, "transient")


class Evidence(Document):
    """Why an incident says what it says, one section per step. A hang's also holds the tracker's
    view of it: the stalled communicators' counter and progress rows (columnar), the
    communicators, whether the waits are on the GPU or the host, the members without completion
    marks, and whether they are in a set-up call. A slowdown localised while only suspected
    holds its validation request until the confirmation."""

    detection: Detection | None = None
    while_open: list[str] | None = None  # a second fault: the incidents open when it began
    localization: Localization | None = None
    validation: Validation | None = None
    gpu_health: GpuHealth | None = None
    explanation: str | None = None
    counters: dict[str, list[JsonValue]] | None = None
    # the profiler plugin's rows of the stalled communicators (greyhound.core.progress, columnar;
    # empty lists where no plugin runs): where inside its collective each member stopped
    progress: dict[str, list[JsonValue]] | None = None
    stalled_comms: list[int] | None = None
    wait_basis: str | None = None
    marks_off_ranks: list[int] | None = None
    in_setup: bool | None = None
    # a localisation made while the slowdown was only suspected: its validation request, sent
    # once the slowdown is confirmed (never if it is withdrawn)
    held_suspicion: Suspicion | None = None


# ---- the timeline -------------------------------------------------------------------------------

class LocalizedNote(Document):
    kind: str
    culprit: Culprit
    evidence: Localization | None = None


class AnalyzerNote(Document):
    """A profile that named nothing: ``result`` says why (transient, known cause, unexplained)."""

    result: str
    by: str
    evidence: Localization


class PlanStep(Document):
    """A mitigation step on the incident's timeline: a plan proposed, decided, delivered,
    applied (the incident ``mitigated``), failed, reverted, withdrawn or expired."""

    plan_id: str
    strategy: str
    status: str | None = None
    version: int | None = None
    cost_s: float | None = None
    summary: str | None = None
    reason: str | None = None
    error: str | None = None
    loss_s: float | None = None
    overhead_s: float | None = None
    policy: str | None = None
    expires_at: str | None = None
    by: str | None = None
    note: str | None = None


class OperatorNote(Document):
    """An operator's acknowledgement or closing, with the note they gave."""

    by: str
    note: str
    manual: bool | None = None


class Empty(Document):
    """An entry with nothing to add."""


# The first model a detail fits (each asks for keys the ones before it do not have); a hang
# localised by its diagnosis keeps the culprit itself, hence Culprit last.
Note = Annotated[Detection | LocalizedNote | AnalyzerNote | Validation | PlanStep
                 | OperatorNote | Empty | Culprit, Field(union_mode="left_to_right")]


# ---- plans -----------------------------------------------------------------------------------

class PlanFacts(Document):
    """What every plan records besides its kind's parameters: what it does in words, and the
    escalation's reason to propose it (the loss that reached the strategy's overhead)."""

    summary: str | None = None
    loss_s: float | None = None
    overhead_s: float | None = None
    why: str | None = None


class MicrobatchParams(PlanFacts):
    """S2: micro-batches per DP group."""

    kind: Literal["microbatch"]
    microbatches: list[int]
    previous: list[int]
    times: list[float]
    multiple_of: int
    slow_dp_groups: list[int]
    makespan_before: float
    makespan_after: float


class RoleSwapParams(PlanFacts):
    """S3 for a slow link: node roles swapped so that it carries pipeline traffic."""

    kind: Literal["role_swap"]
    links: list[list[int]]
    node_pairs: list[list[int]]
    swaps: list[list[int]]
    gpu_of_rank: list[int]
    score_before: float
    score_after: float


class ConsolidateParams(PlanFacts):
    """S3 for slow GPUs: gathered into as few pipeline cells as possible."""

    kind: Literal["consolidate"]
    stragglers: dict[str, float]
    cells: list[list[int]]
    swaps: list[list[int]]
    gpu_of_rank: list[int]
    before_s: float
    after_s: float
    method: str


class RestartParams(PlanFacts):
    """S4, a recommendation only: what a checkpoint-restart should replace, at what cost."""

    kind: Literal["restart"]
    replace_gpus: list[int]
    replace_nodes: list[int]
    fallback_nodes: list[int]
    links: list[list[int]]
    cost_s: float
    priced: bool


PlanParams = Annotated[MicrobatchParams | RoleSwapParams | ConsolidateParams | RestartParams,
                       Field(discriminator="kind")]
_PLAN_PARAMS: TypeAdapter[PlanParams] = TypeAdapter(PlanParams)


def plan_params(data: dict[str, Any]) -> PlanParams:
    """A plan's parameters from a planning core's record (its ``kind`` says which model)."""
    return _PLAN_PARAMS.validate_python(data)


# ---- jobs ---------------------------------------------------------------------------------------

class Topology(Document):
    """What a job declared of itself: its parallel layout (``PUT /v1/jobs/{id}/layout``)."""

    layout: JobLayout | None = None
