"""The validator's guard: which suspicions may pause a job (pure, no bus, no database)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from services.common.bus.contract import Suspicion
from services.common.db.documents import Culprit
from services.common.db.models import Incident
from services.validator.guard import CULPRIT_CAP, refusal

JOB = "guardjob"
RANKS = set(range(8))
COMM = (1 << 63) + 5  # comm ids are unsigned 64-bit hashes


def _incident(status: str = "localized", job: str = JOB, **culprit: Any) -> Incident:
    return Incident(id="inc1", job_id=job, status=status, kind="compute_slow",
                    culprit=Culprit.model_validate({"compute_ranks": [2], "comm_ids": [COMM],
                                                    **culprit}))


def _suspect(*, unchecked: bool = False, **kw: Any) -> Suspicion:
    """``unchecked``: past the contract's bounds (which the consumer enforces first), to show
    the guard holds on its own."""
    fields: dict[str, Any] = {"job_id": JOB, "incident_id": "inc1", "kind": "mixed_slow",
                              "ranks": [2], "comm_ids": [COMM]}
    fields.update(kw)
    return Suspicion.model_construct(**fields) if unchecked else Suspicion(**fields)


def test_a_suspicion_of_what_was_localised_may_pause() -> None:
    assert refusal(_suspect(), _incident(), RANKS) is None
    assert refusal(_suspect(), _incident("validated"), RANKS) is None
    assert refusal(_suspect(ranks=[], comm_ids=[COMM]), _incident(), RANKS) is None


def test_the_planner_may_recheck_a_mitigated_gpu_wherever_its_ranks_moved() -> None:
    """Under a role swap the slow GPU runs other ranks than those localised: a GEMM re-check
    of them may pause; one naming communicators may not."""
    recheck = _suspect(kind="compute_slow", ranks=[5], comm_ids=[])
    assert refusal(recheck, _incident("mitigated"), RANKS) is None
    assert refusal(recheck, _incident("mitigated"), {0, 1}) is not None  # still the job's ranks


def test_the_planner_may_recheck_a_gpu_whose_slowdown_its_plan_hid() -> None:
    """An S2 plan brought the iteration time back: the tracker's recovery resolved the incident,
    the plan stays, and the planner asks every recheck_s whether the GPU is still slow. Its
    re-check may pause (GEMMs only); anything else on a resolved incident may not."""
    recheck = _suspect(kind="compute_slow", ranks=[5], comm_ids=[],
                       evidence={"by": "planner", "recheck": ["plan1"]})
    assert refusal(recheck, _incident("resolved"), RANKS) is None
    why = refusal(recheck.model_copy(update={"comm_ids": [COMM]}), _incident("resolved"), RANKS)
    assert why is not None and "names communicators" in why
    plain = _suspect(kind="compute_slow", ranks=[5], comm_ids=[])
    why = refusal(plain, _incident("resolved"), RANKS)
    assert why is not None and "resolved" in why
    why = refusal(recheck, _incident("detected"), RANKS)
    assert why is not None and "not localised" in why


@pytest.mark.parametrize(("suspicion", "incident", "reason"), [
    (_suspect(), None, "no incident"),
    (_suspect(), _incident("resolved"), "resolved"),
    (_suspect(), _incident("detected"), "not localised"),
    (_suspect(), _incident("mitigated"), "names communicators"),
    (_suspect(), _incident(job="otherjob"), "otherjob"),
    (_suspect(ranks=[], comm_ids=[]), _incident(), "every GPU"),
    (_suspect(ranks=[2, 2]), _incident(), "repeats"),
    (_suspect(ranks=list(range(9))), _incident(compute_ranks=list(range(9))), "not ranks of"),
    (_suspect(ranks=[2, 1 << 19]), _incident(), "not ranks of"),
    (_suspect(ranks=[3]), _incident(), "not localised"),
    (_suspect(comm_ids=[COMM + 1]), _incident(), "communicators"),
    (_suspect(unchecked=True, ranks=[2], comm_ids=[1 << 64]), _incident(), "64 bits"),
    (_suspect(unchecked=True, slow_groups=list(range(8 * 64 + 1))), _incident(), "slow groups"),
    (_suspect(), Incident(id="inc1", job_id=JOB, status="localized", culprit=Culprit(ranks=[])),
     "not localised"),
], ids=["missing", "resolved", "detected", "mitigated", "wrong-job", "empty", "repeated",
        "more-ranks-than-the-job", "huge-rank", "other-rank", "other-comm", "comm-overflow",
        "absurd-groups", "no-localisation-recorded"])
def test_refused(suspicion: Suspicion, incident: Incident | None, reason: str) -> None:
    why = refusal(suspicion, incident, RANKS)
    assert why is not None and reason in why, why


def test_a_full_culprit_list_is_not_held_against_a_suspicion() -> None:
    """The analyzer caps culprit lists at CULPRIT_CAP: past it, only the job's ranks bound."""
    big = set(range(4 * CULPRIT_CAP))
    full = _incident(compute_ranks=list(range(CULPRIT_CAP)))
    assert refusal(_suspect(ranks=[CULPRIT_CAP + 5]), full, big) is None
    assert refusal(_suspect(ranks=[len(big) + 1]), full, big) is not None


def test_a_slowdown_only_suspected_may_not_pause_until_confirmed() -> None:
    """Localised while a short transient could still explain it: refused; once the tracker
    confirmed it, the same suspicion may pause. An incident from before there were two stages
    (neither moment) counts as confirmed."""
    inc = _incident()
    inc.suspected_at = datetime.now(UTC)
    why = refusal(_suspect(), inc, RANKS)
    assert why is not None and "only suspected" in why
    inc.confirmed_at = datetime.now(UTC)
    assert refusal(_suspect(), inc, RANKS) is None
    assert refusal(_suspect(), _incident(), RANKS) is None
