"""Dead letters fit under the server's max_payload, however the failed payload encodes."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from services.common.bus.client import Consumer
from services.common.bus.contract import DeadLetter, IterationBatch, Subjects
from services.common.bus.dead_letters import CLOSE_ENOUGH, HEADER_ROOM, encode_dead_letter
from services.common.bus.streams import TELEMETRY, ConsumerSpec
from tests.conftest import Bus
from tests.services.common.support import jetstream, letters_for, until


def _encode(data: bytes, max_payload: int, reason: str = "schema: bad") -> tuple[bytes, DeadLetter]:
    out = encode_dead_letter(stream="S", consumer="c", subject="gh.v1.j.iter.a", reason=reason,
                             data=data, max_payload=max_payload)
    return out, DeadLetter.model_validate_json(out)


def test_small_payload_is_kept_whole() -> None:
    _, letter = _encode(b'{"job_id": "j"}', 1 << 20)
    assert letter.payload == '{"job_id": "j"}'
    assert letter.payload_bytes == 15 and letter.payload_cut_bytes == 0


@pytest.mark.parametrize("unit", [b"a", b"\x01", b"\xff", "é".encode(), "€".encode()],
                         ids=["ascii", "control (6-byte escape)", "invalid (3-byte U+FFFD)",
                              "2-byte char", "3-byte char"])
def test_cut_payload_fits_and_says_how_much(unit: bytes) -> None:
    max_payload = 64 * 1024
    data = unit * (max_payload // len(unit))
    out, letter = _encode(data, max_payload)
    assert len(out) <= max_payload - HEADER_ROOM
    assert letter.payload_bytes == len(data)
    kept = len(data) - letter.payload_cut_bytes
    assert 0 < kept < len(data)
    assert kept % len(unit) == 0  # never half a character
    assert letter.payload == data[:kept].decode("utf-8", "replace")
    # Nearly as much as fits: within CLOSE_ENOUGH raw bytes (each at most 6 encoded) of it.
    assert len(out) > max_payload - HEADER_ROOM - 6 * CLOSE_ENOUGH - 16


def test_long_reason_is_shortened_and_impossible_limit_refused() -> None:
    _, letter = _encode(b"x" * 100, 1 << 20, reason="handler_error: " + "y" * 10_000)
    assert len(letter.reason) == 2000
    out, letter = _encode(b"x" * 10_000, HEADER_ROOM + 900, reason="r" * 5000)
    assert len(out) <= 900 and len(letter.reason) == 200
    with pytest.raises(ValueError, match="no room"):
        _encode(b"x", HEADER_ROOM + 10)


async def test_oversized_message_dead_letter_fits_under_max_payload(bus: Bus) -> None:
    """A message as large as the server allows, of bytes that JSON escapes six times over."""
    job = f"big{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-bigdlq")

    async def handler(_subject: str, msg: IterationBatch) -> None:
        raise AssertionError("an invalid message reached the handler")

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"big-{job}", filter_subjects=(subject,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    payload = b'{"job_id": "' + b"\x01" * (nc.max_payload - 4096) + b'"}'
    try:
        await js.publish(subject, payload)
        await until(lambda: consumer.stats.dead_lettered == 1, what="the dead letter")
        assert consumer.stats.dead_letter_failures == 0
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    [letter] = await letters_for(js, TELEMETRY, subject)
    assert len(letter.model_dump_json().encode()) <= nc.max_payload - HEADER_ROOM
    assert letter.reason.startswith("invalid_json")
    assert letter.payload_bytes == len(payload)
    assert letter.payload_cut_bytes > len(payload) // 2  # ~5/6 of it: each byte became 6
    assert letter.payload == payload[:len(payload) - letter.payload_cut_bytes].decode()
    await nc.drain()


def test_random_payloads_fit() -> None:
    """Seeded mixtures of ASCII, escapes, invalid bytes and multi-byte characters."""
    rng = random.Random(7)
    pieces = [b"a", b'"', b"\\", b"\x01", b"\n", b"\xff", "é".encode(), "€".encode(), "😀".encode()]
    for _ in range(20):
        data = b"".join(rng.choice(pieces) * rng.randint(1, 500) for _ in range(rng.randint(1, 400)))
        max_payload = rng.randint(2_000, 40_000)
        out, letter = _encode(data, max_payload)
        kept = len(data) - letter.payload_cut_bytes
        assert len(out) <= max_payload - HEADER_ROOM
        assert letter.payload == data[:kept].decode("utf-8", "replace")
        if kept < len(data):  # cut only as far as needed
            assert len(out) > max_payload - HEADER_ROOM - 6 * CLOSE_ENOUGH - 32
