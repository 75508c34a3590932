"""The planner's knobs: what each strategy is expected to cost, who decides it, how long a
proposal waits, and how the end of a fault under a plan is checked.

Overheads are seconds of training time (the job's own clock: virtual seconds for the simulator)
and only start the estimates: each applied plan's reported cost moves them (greyhound.core
.escalation, an exponentially weighted average with weight ``alpha``), per job.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from greyhound.core.escalation import FailSlowKind
from greyhound.core.plan_build import PlanCosts
from services.common.ownership import GivenPartition, LeaseRetryS, LeaseValidS

Policy = Literal["automatic", "approval"]


class PlannerSettings(BaseSettings):
    """``GREYHOUND_PLANNER_<FIELD>``, e.g. ``GREYHOUND_PLANNER_S3_POLICY=automatic``."""

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_PLANNER_", extra="forbid",
                                      frozen=True)

    # the partition count is GREYHOUND_TRACKER_PARTITIONS, shared: services.common.ownership
    partition: GivenPartition = None
    lease_valid_s: LeaseValidS = 10.0
    lease_retry_s: LeaseRetryS = 1.0
    s2_overhead_s: float = Field(default=5.0, ge=0, description="re-balancing micro-batches")
    s3_overhead_s: float = Field(default=60.0, ge=0, description="a topology change: a pause")
    s4_overhead_s: float = Field(
        default=3600.0, ge=0, description="checkpoint-restart, unless the job's declared "
        "checkpoint size prices it (restart_* below)")
    tolerance: float = Field(default=0.1, ge=0, le=10,
                             description="an iteration within this of healthy is not slow")
    alpha: float = Field(default=0.5, gt=0, le=1, description="weight of an observed cost")
    trust: float = Field(
        default=0.5, gt=0, le=1, description="how far the escalation trusts the expected "
        "durations below (greyhound.core.escalation: a fault expected to outlast the break-even "
        "buys the next strategy at trust x its overhead, one expected to end before it at "
        "overhead / trust; 1: the published break-even, whatever the prediction)")
    expected_compute_s: float = Field(
        default=600.0, gt=0, description="how long a compute fail-slow lasts, on average "
        "(GREYHOUND's field study: 10 minutes)")
    expected_communication_s: float = Field(
        default=1440.0, gt=0, description="how long a congestion lasts, on average (the field "
        "study: sub-minute to over 100 minutes, 24 on average)")
    expected_mixed_s: float = Field(
        default=1440.0, gt=0, description="a compute and a link fault at once: as long as its "
        "congestion")
    s2_policy: Policy = "automatic"
    s3_policy: Policy = "approval"
    s4_policy: Literal["approval"] = Field(
        default="approval", description="a restart is only ever recommended")
    proposal_ttl_s: float = Field(default=900.0, gt=0,
                                  description="a proposal nobody decided expires after this")
    poll_s: float = Field(default=0.5, gt=0, description="how often decisions are looked for")
    recheck_s: float = Field(
        default=300.0, ge=0, description="while a plan for a slow GPU is in force, ask the "
        "validator this often whether the GPU is still slow (0: never)")
    recheck_timeout_s: float = Field(default=120.0, gt=0,
                                     description="a re-check with no answer by then is retried")
    settle_iterations: int = Field(
        default=20, ge=1, description="a recovery this soon after a plan took effect is the "
        "plan's doing, not the fault's end")
    hold_max_s: float = Field(
        default=1800.0, ge=0, description="a plan kept after its incident recovered under it is "
        "reverted after this long when nothing can check the fault (0: kept)")
    job_silent_s: float = Field(
        default=7200.0, ge=0, description="an escalation whose job has sent no iteration for "
        "this long (by the last batch's time, once its watch has read all there is) ends, its "
        "plans taken back: the job stopped or is gone. Longer than a checkpoint's write "
        "(GREYHOUND's 100 min for GPT2-100B), which stops iterations too (0: kept)")
    lookback_s: float = Field(default=120.0, gt=0,
                              description="how far back a job's iteration times are read")
    gradient_bytes: float = Field(default=1e9, gt=0,
                                  description="DP all-reduce bytes when the job declares none")
    activation_bytes: float = Field(default=1e7, gt=0,
                                    description="PP activation bytes when the job declares none")
    consolidate_time_limit_s: float = Field(default=5.0, gt=0)
    restart_write_bytes_per_s: float = Field(default=10e9, gt=0)
    restart_read_bytes_per_s: float = Field(default=20e9, gt=0)
    restart_overhead_s: float = Field(default=600.0, ge=0,
                                      description="scheduling, start, NCCL init, warm-up")

    def expected_s(self, kind: FailSlowKind) -> float:
        """The predicted duration of a fail-slow of ``kind``."""
        return {"compute": self.expected_compute_s, "communication": self.expected_communication_s,
                "mixed": self.expected_mixed_s}[kind]

    def plan_costs(self) -> PlanCosts:
        """What the planning cores weigh plans with (greyhound.core.plan_build)."""
        return PlanCosts(self.gradient_bytes, self.activation_bytes,
                         self.consolidate_time_limit_s, self.restart_write_bytes_per_s,
                         self.restart_read_bytes_per_s, self.restart_overhead_s, self.s4_overhead_s)

    def policy(self, strategy: str) -> Policy:
        return {"S2": self.s2_policy, "S3": self.s3_policy}.get(strategy, "approval")
