"""The contract's bounds: what decodes is safe to size arrays by, to store and to serve."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.common.bus.bounds import MAX_LISTED, MAX_RANK, MAX_ROWS
from services.common.bus.contract import (
    AgentHello,
    BenchItem,
    CounterBatch,
    DetectionEvent,
    IncidentEvent,
    IterationBatch,
    Suspicion,
)


def iterations(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"job_id": "j", "agent_id": "a", "rank": [0, 1], "iteration": [1, 1],
                            "end_ns": [10, 11], "duration_s": [0.1, 0.1]}
    body.update(over)
    return body


def detection(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"job_id": "j", "kind": "slowdown", "ranks": [0], "first_iteration": 3,
                            "detected_iteration": 5, "before_s": 0.1, "after_s": 0.15,
                            "detected_ns": 1}
    body.update(over)
    return body


def test_a_valid_batch_and_detection_decode() -> None:
    IterationBatch.model_validate_json(json.dumps(iterations()))
    det = DetectionEvent.model_validate_json(json.dumps(detection()))
    assert det.slowdown == pytest.approx(1.5)


def test_a_detection_without_a_stage_is_confirmed_and_stages_are_checked() -> None:
    """An event from a tracker before two stages parses as a confirmed slowdown; a stage is one
    of two, a suspected iteration an iteration, and a withdrawal is a recovery that says so."""
    old = DetectionEvent.model_validate_json(json.dumps(detection()))
    assert (old.stage, old.suspected_iteration, old.confirms, old.withdrawn) == (
        "confirmed", None, None, False)
    seen = DetectionEvent.model_validate(detection(stage="suspected", suspected_iteration=5,
                                                   suspected_ns=1))
    later = DetectionEvent.model_validate(detection(detected_iteration=7, suspected_iteration=5,
                                                    confirms=seen.event_id))
    assert seen.stage == "suspected" and later.confirms == seen.event_id
    back = DetectionEvent.model_validate(detection(kind="recovery",
                                                   evidence={"change": "withdrawn"}))
    assert back.withdrawn
    for bad in ({"stage": "probable"}, {"suspected_iteration": -2}, {"suspected_ns": -1}):
        with pytest.raises(ValidationError):
            DetectionEvent.model_validate(detection(**bad))


@pytest.mark.parametrize("rank", [-1, MAX_RANK, 2**31 - 1, 2**63])
def test_ranks_out_of_range_are_refused(rank: int) -> None:
    with pytest.raises(ValidationError, match="rank"):
        IterationBatch.model_validate_json(json.dumps(iterations(rank=[0, rank])))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '"inf"', "0", "-0.1", "1e300"])
def test_iteration_times_must_be_finite_and_positive(text: str) -> None:
    raw = json.dumps(iterations()).replace("[0.1, 0.1]", f"[0.1, {text}]")
    with pytest.raises(ValidationError, match="duration_s"):
        IterationBatch.model_validate_json(raw)


@pytest.mark.parametrize("field", ["before_s", "after_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_detection_levels_must_be_finite_and_positive(field: str, value: float) -> None:
    """before_s=0 made a severity of inf, which the API failed to serve (500)."""
    raw = json.dumps(detection(**{field: value}))  # json writes NaN/Infinity literals
    with pytest.raises(ValidationError, match=field):
        DetectionEvent.model_validate_json(raw)


def test_infinity_in_a_counter_age_is_refused() -> None:
    cols: dict[str, list[Any]] = {c: [0] for c in CounterBatch.COLUMNS}
    cols.update(nranks=[1], inflight_s=[0.0], gpu_pending_s=[float("inf")])
    raw = json.dumps({"job_id": "j", "agent_id": "a", "sampled_ns": 1, **cols})
    with pytest.raises(ValidationError, match="gpu_pending_s"):
        CounterBatch.model_validate_json(raw)


def test_lists_are_bounded() -> None:
    n = MAX_ROWS + 1
    with pytest.raises(ValidationError, match="at most"):
        IterationBatch(job_id="j", agent_id="a", rank=[0] * n, iteration=[1] * n,
                       end_ns=[1] * n, duration_s=[0.1] * n)
    with pytest.raises(ValidationError, match="at most"):
        Suspicion(job_id="j", incident_id="i", kind="compute_slow",
                  ranks=list(range(MAX_LISTED + 1)), comm_ids=[])


@pytest.mark.parametrize(("model", "body"), [
    (IterationBatch, iterations(agent_id="a.b")),  # a dot would split the subject
    (IterationBatch, iterations(agent_id="a\r\nNats-Msg-Id: x")),
    (IterationBatch, iterations(event_id="abcdefgh\r\nX-Evil: 1")),  # header injection
    (IterationBatch, iterations(event_id="short")),
    (IncidentEvent, {"job_id": "j", "incident_id": "x" * 65, "stage": "detected", "kind": "k",
                     "severity": 1.0, "summary": ""}),
    (IncidentEvent, {"job_id": "j", "incident_id": "i", "stage": "detected", "kind": "k",
                     "severity": 1.0, "summary": "a\x00b"}),
    (AgentHello, {"job_id": "j", "agent_id": "a", "host": "h\x1b[31m", "ranks": []}),
    (AgentHello, {"job_id": "j", "agent_id": "a", "host": "h" * 256, "ranks": []}),
    (DetectionEvent, detection(evidence={"note": "a\x00b"})),  # Postgres cannot store NUL
    (DetectionEvent, detection(evidence={"x\x00": 1})),
    (DetectionEvent, detection(evidence={"deep": [[[[1.0, float("nan")]]]]})),
    (DetectionEvent, detection(method="m" * 300)),
])
def test_hostile_strings_and_values_are_refused(model: Any, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps(body))


def test_a_lone_surrogate_in_evidence_is_refused() -> None:
    """On the wire the JSON parser refuses it; a producer building the message is stopped too."""
    raw = json.dumps(detection(evidence={"s": "x"})).replace('"x"', '"\\ud800"')
    with pytest.raises(ValidationError):
        DetectionEvent.model_validate_json(raw)
    with pytest.raises(ValidationError, match="UTF-8"):
        DetectionEvent.model_validate(detection(evidence={"s": "\ud800"}))


def test_evidence_nesting_is_bounded() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ValidationError):
        DetectionEvent.model_validate(detection(evidence={"d": deep}))


@pytest.mark.parametrize(("kind", "size", "ok"), [
    ("gemm", 16_384, True), ("gemm", 16_385, False), ("gemm", 2**31, False),
    ("send", 1 << 30, True), ("recv", (1 << 30) + 1, False), ("gemm", 0, False)])
def test_benchmark_sizes_are_bounded(kind: str, size: int, ok: bool) -> None:
    body = {"rank": 0, "kind": kind, "size": size}
    if ok:
        BenchItem.model_validate(body)
    else:
        with pytest.raises(ValidationError):
            BenchItem.model_validate(body)


def test_keep_valid_drops_only_the_bad_rows() -> None:
    cols: dict[str, list[Any]] = {
        "rank": [0, 1, -3, 2, 3], "iteration": [1, 1, 1, 1, 1], "end_ns": [1, 2, 3, 4, 5],
        "duration_s": [0.1, float("inf"), 0.1, 0.0, 0.2]}
    batch, dropped = IterationBatch.keep_valid(cols, job_id="j", agent_id="a")
    assert batch is not None and dropped == 3
    assert batch.rank == [0, 3] and batch.duration_s == [0.1, 0.2]
    none, dropped = IterationBatch.keep_valid({**cols, "duration_s": [0.0] * 5}, job_id="j",
                                              agent_id="a")
    assert none is None and dropped == 5
    with pytest.raises(ValidationError):  # the envelope is the producer's to get right
        IterationBatch.keep_valid(cols, job_id="not a token", agent_id="a")


def test_keep_valid_cuts_an_oversized_batch_to_the_bound() -> None:
    n = MAX_ROWS + 10
    batch, dropped = IterationBatch.keep_valid(
        {"rank": [0] * n, "iteration": [1] * n, "end_ns": [1] * n, "duration_s": [0.1] * n},
        job_id="j", agent_id="a")
    assert batch is not None and len(batch) == MAX_ROWS and dropped == 10
