"""The validator's knobs: benchmark sizes, repeats, the verdict threshold and its patience.

Real GPUs and the simulator take the defaults (the paper's sizes). The CPU fake NCCL runs a
naive SGEMM, so jobs on it want a small GEMM, more repeats and a looser threshold for the CPU's
noise: :func:`for_cpu_fake`.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from greyhound.core.verdict import THRESHOLD


class ValidatorSettings(BaseSettings):
    """``GREYHOUND_VALIDATOR_<FIELD>``, e.g. ``GREYHOUND_VALIDATOR_GEMM_N=256``."""

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_VALIDATOR_", extra="forbid",
                                      frozen=True)

    gemm_n: int = Field(default=2048, gt=0, description="GEMM matrix dimension N")
    gemm_repeat: int = Field(default=3, ge=1, le=64)
    p2p_bytes: list[int] = Field(default=[16 << 20, 32 << 20, 64 << 20], min_length=1,
                                 description="sizes of each P2P check, bytes")
    p2p_repeat: int = Field(default=3, ge=1, le=64)
    threshold: float = Field(default=THRESHOLD, gt=0, description="slower than peers by this: slow")
    status_timeout_s: float = Field(default=5.0, gt=0)
    pause_timeout_s: float = Field(default=10.0, gt=0)
    bench_timeout_s: float = Field(default=30.0, gt=0)
    pause_budget_s: float = Field(
        default=20.0, gt=0, le=600, description=(
            "the longest a validation holds the job, pause and benchmarks together (the hooks' "
            "lease); never more than a quarter of the job's collective timeout, which the ranks "
            "report (a pause counts toward the collective the rank parked in)"))
    min_pause_s: float = Field(
        default=1.0, gt=0, description=(
            "a validation whose budget (as the job's collective timeout bounds it) is shorter "
            "is refused: the job is not paused"))
    poll_s: float = Field(default=0.02, gt=0, description="how often parking is checked")
    claim_lease_s: float = Field(
        default=30.0, gt=0, description=(
            "a validation's claim lasts this long unless renewed (every third of it while the "
            "validator works): a dead validator's claim lapses this long after it died"))
    max_attempts: int = Field(
        default=2, ge=1, le=10, description=(
            "validations of one suspicion interrupted by a dead validator before it is given up"))
    resume_every_s: float = Field(
        default=10.0, gt=0, description="how often lapsed claims and lost suspicions are looked for")
    unclaimed_after_s: float = Field(
        default=300.0, gt=0, description=(
            "a suspicion published this long ago that no validator claimed is validated from "
            "the outbox (its bus copy was lost)"))
    record_patience_s: float = Field(
        default=300.0, gt=0, description="how long a result waits for the database to come back")


# What suits the CPU fake NCCL (see the module docstring).
CPU_FAKE = {"gemm_n": 256, "gemm_repeat": 9, "threshold": 0.25,
            "p2p_bytes": [1 << 20, 2 << 20, 4 << 20]}


def for_cpu_fake(chosen: ValidatorSettings | None = None) -> ValidatorSettings:
    """Settings for jobs on the CPU fake NCCL: :data:`CPU_FAKE`, except where the operator set a
    value (in the environment, or in ``chosen``)."""
    base = chosen if chosen is not None else ValidatorSettings()
    return base.model_copy(update={k: v for k, v in CPU_FAKE.items()
                                   if k not in base.model_fields_set})
