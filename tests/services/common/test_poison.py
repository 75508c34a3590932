"""Poison on the bus, through the real tracker and analyzer on a real nats-server and Postgres:
huge ranks, infinities, zero durations and levels, oversized payloads, hostile strings, a job
with more ranks than allowed, and a flood of malformed messages. Each one is dead-lettered once
with its reason; the process's memory stays bounded (a rank of 2^31-1 once sized a 16 GiB array);
a healthy job in the middle of it is still detected; and the API keeps answering 200 or 4xx,
never 500 (a detection with before_s=0 once made a severity of inf that it could not serve)."""

from __future__ import annotations

import json
import random
import resource
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.common.bus.auth import agent_user
from services.common.bus.contract import CounterBatch, DeadLetter, Subjects
from services.common.bus.streams import DEAD_LETTERS, EVENTS, TELEMETRY
from tests.conftest import Bus
from tests.services.common.pipeline import Pipeline, StandInJob, pipeline

FLOOD = 1500
MAX_RANKS = 64


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def iterations(job: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "iterations", "job_id": job, "agent_id": "evil",
                            "rank": [0], "iteration": [1], "end_ns": [1], "duration_s": [0.1]}
    body.update(over)
    return body


def counters(job: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "counters", "job_id": job, "agent_id": "evil",
                            "sampled_ns": 1, **{c: [0] for c in CounterBatch.COLUMNS}}
    body.update(nranks=[1], **over)
    return body


def detection(job: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"job_id": job, "kind": "slowdown", "ranks": [0], "first_iteration": 1,
                            "detected_iteration": 2, "before_s": 0.1, "after_s": 0.2,
                            "detected_ns": 1}
    body.update(over)
    return body


def poison(job: str) -> list[tuple[str, str, bytes, str]]:
    """(name, subject, payload, expected reason) of each hostile message."""
    it, cnt, det = (Subjects.iterations(job, "evil"), Subjects.counters(job, "evil"),
                    Subjects.detection(job))
    raw = [
        ("rank 2^31-1", it, iterations(job, rank=[2**31 - 1]), "schema"),
        ("rank 2^63", it, iterations(job, rank=[2**63]), "schema"),
        ("negative rank", it, iterations(job, rank=[-5]), "schema"),
        ("zero duration", it, iterations(job, duration_s=[0.0]), "schema"),
        ("huge world", Subjects.hello(job, "evil"),
         {"kind": "hello", "job_id": job, "agent_id": "evil", "host": "h", "ranks": [],
          "world_size": 2**40}, "schema"),
        ("control chars in host", Subjects.hello(job, "evil"),
         {"kind": "hello", "job_id": job, "agent_id": "evil", "host": "h\x1b[2J\r\n", "ranks": []},
         "schema"),
        ("header injection in event id", it,
         iterations(job, event_id="aaaaaaaa\r\nNats-Msg-Id: forged"), "schema"),
        ("a dot in the agent id", it, iterations(job, agent_id="a.b.>"), "schema"),
        ("wait of 1e300 s", cnt, counters(job, gpu_pending_s=[1e300]), "schema"),
        ("oversized", it, iterations(job, padding="x" * 900_000), "schema"),
        ("before_s=0", det, detection(job, before_s=0.0), "schema"),
        ("NUL in evidence", det, detection(job, evidence={"note": "a\x00b"}), "schema"),
        ("too many ranks for one job", it,
         iterations(job, rank=list(range(MAX_RANKS + 1)), iteration=[1] * (MAX_RANKS + 1),
                    end_ns=[1] * (MAX_RANKS + 1), duration_s=[0.1] * (MAX_RANKS + 1)),
         "handler_error"),
    ]
    out = [(name, subj, json.dumps(body).encode(), why) for name, subj, body, why in raw]
    # JSON's non-finite literals, which Python's json writes and pydantic used to accept
    out += [
        ("duration Infinity", it,
         json.dumps(iterations(job)).replace("[0.1]", "[Infinity]").encode(), "schema"),
        ("duration NaN", it, json.dumps(iterations(job)).replace("[0.1]", "[NaN]").encode(),
         "schema"),
        ("pending Infinity", cnt, json.dumps(counters(job, gpu_pending_s=[7.5])).replace(
            "7.5", "Infinity").encode(), "schema"),
        ("after_s Infinity", det, json.dumps(detection(job)).replace("0.2", "Infinity").encode(),
         "schema"),
    ]
    return out


def flood(job: str, n: int, seed: int = 7) -> list[tuple[str, bytes]]:
    """Malformed messages of every shape: random bytes, cut JSON, wrong kinds, wrong types."""
    rng = random.Random(seed)
    it = Subjects.iterations(job, "junk")
    good = json.dumps(iterations(job)).encode()
    makers = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
        lambda: good[: rng.randint(1, len(good) - 1)],
        lambda: json.dumps({"kind": "nonsense", "job_id": job}).encode(),
        lambda: json.dumps(iterations(job, rank=["x"])).encode(),
        lambda: json.dumps([1, 2, 3]).encode(),
        lambda: b"",
    ]
    return [(it, makers[i % len(makers)]()) for i in range(n)]


async def all_letters(js: JetStreamContext) -> list[DeadLetter]:
    sub = await js.pull_subscribe(Subjects.ALL_DEAD_LETTERS, durable=None, stream=DEAD_LETTERS,
                                  config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL,
                                                        ack_policy=AckPolicy.NONE))
    out: list[DeadLetter] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(512, timeout=0.5)
            except TimeoutError:
                return out
            out += [DeadLetter.model_validate_json(m.data) for m in msgs]
    finally:
        await sub.unsubscribe()


async def assert_api_serves(client: httpx.AsyncClient, job: str) -> None:
    for path in ("/healthz", "/v1/incidents", f"/v1/incidents?job_id={job}", "/v1/jobs",
                 f"/v1/jobs/{job}"):
        r = await client.get(path)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
    for path in ("/v1/incidents?limit=-1", "/v1/incidents/nope", "/v1/incidents/a%00b"):
        r = await client.get(path)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])


async def test_poison_is_dead_lettered_counted_and_contained(
        own_bus: Bus, fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GREYHOUND_TRACKER_MAX_RANKS", str(MAX_RANKS))
    job, healthy = f"evil-{uuid.uuid4().hex[:6]}", f"good-{uuid.uuid4().hex[:6]}"
    async with pipeline(own_bus, fresh_db_url, tmp_path, services=("tracker", "analyzer")) as p:
        app = create_app(p.ctx.db(), settings=p.settings, api=ApiSettings(api_anonymous_role="viewer"),
                         nc=p.ctx.nc, js=p.ctx.js)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://api") as client:
            await run_poison(p, client, job, healthy)


async def run_poison(p: Pipeline, client: httpx.AsyncClient, job: str, healthy: str) -> None:
    js = p.ctx.js  # the operator's, to read every dead letter
    # the poison comes from the users that may publish it: a bad agent's, a bad tracker's
    senders = {"evil": await p.bus.connect(agent_user("evil")),
               "junk": await p.bus.connect(agent_user("junk")),
               "detect": await p.bus.connect("tracker")}

    async def send(subject: str, payload: bytes) -> None:
        await senders[subject.rsplit(".", 1)[1]].jetstream().publish(subject, payload)

    agents = StandInJob(p.bus, healthy)
    await agents.start()
    await agents.iterations(0, 60)
    rss0 = _rss_mb()
    bad = poison(job)
    for _, subject, payload, _ in bad:
        await send(subject, payload)
    junk = flood(job, FLOOD)
    for i in range(0, len(junk), 250):
        for subject, payload in junk[i:i + 250]:
            await send(subject, payload)
        await assert_api_serves(client, healthy)
    # a valid detection whose ratio is extreme: served with a severity at the bound, not inf
    await send(Subjects.detection(job), json.dumps(
        detection(job, before_s=1e-6, after_s=1e6)).encode())
    await agents.iterations(60, 200, slow=(100, 10**9))  # the healthy job slows down meanwhile

    expected = len(bad) + FLOOD

    async def lettered() -> list[DeadLetter] | None:
        letters = await all_letters(js)
        return letters if len(letters) >= expected else None

    letters: list[DeadLetter] = await p.wait("every poison message dead-lettered", lettered, 120)
    assert len(letters) == expected  # each once
    by_stream = Counter(letter.stream for letter in letters)
    assert by_stream == {TELEMETRY: expected - 3, EVENTS: 3}, by_stream
    reasons = Counter(letter.reason.split(":", 1)[0] for letter in letters)
    (refused,) = [x for x in letters if x.reason.startswith("handler_error")]
    assert f"more than the {MAX_RANKS} a job may have" in refused.reason
    assert reasons["schema"] + reasons["invalid_json"] == expected - 1, reasons
    (oversized,) = [x for x in letters if (x.payload_bytes or 0) > 800_000]
    assert oversized.reason.startswith("schema") and oversized.consumer == "tracker"
    growth = _rss_mb() - rss0
    print(f"poison: {expected} messages dead-lettered, {dict(reasons)}; resident memory "
          f"{rss0:.0f} MB -> {rss0 + growth:.0f} MB")
    assert growth < 300, f"resident memory grew by {growth:.0f} MB"

    inc = await p.stage(healthy, "localized", timeout_s=90)  # the healthy job was still served
    assert inc.culprit.ranks == [2]
    extreme = await p.wait("the extreme detection's incident", lambda: p.incidents(job), 30)
    assert extreme[0].severity == 1e6
    await assert_api_serves(client, job)
    r = await client.get(f"/v1/incidents/{extreme[0].id}")
    assert r.status_code == 200 and r.json()["severity"] == 1e6
    await agents.close()
    for nc in senders.values():
        await nc.close()
