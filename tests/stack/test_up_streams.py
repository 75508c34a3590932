"""``greyhound up`` applies the streams before it starts the services (which only check them):
on a fresh data directory, and on a reused one whose streams other settings made."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js.api import SubjectTransform

from services.common.bus.client import connect
from services.common.bus.streams import TELEMETRY
from services.common.embedded import OPERATOR
from services.common.settings import Settings
from stack.up import Stack


def _transform(stack: Stack) -> SubjectTransform | None:
    assert stack.backends is not None and stack.backends.embedded_nats is not None

    async def read() -> SubjectTransform | None:
        assert stack.backends is not None and stack.backends.embedded_nats is not None
        nc = await connect(stack.backends.nats_url, name="test-up-streams",
                           credentials=stack.backends.embedded_nats.credentials(OPERATOR))
        try:
            return (await nc.jetstream().stream_info(TELEMETRY)).config.subject_transform
        finally:
            await nc.close()

    return asyncio.run(read())


def test_the_stack_applies_its_settings_to_a_fresh_and_a_reused_data_directory(
        tmp_path: Path, fresh_db_url: str) -> None:
    base = Settings(data_dir=tmp_path / "data", database_url=fresh_db_url,
                    shm_dir=tmp_path / "shm")
    with Stack(base, services=()) as stack:  # fresh: the streams are made
        assert _transform(stack) is None
    two = base.model_copy(update={"tracker_partitions": 2})
    with Stack(two, services=()) as stack:  # reused, made with one partition: brought to two
        kept = _transform(stack)
        assert kept is not None and kept.dest.endswith("{{partition(2,1)}}")
    with Stack(base, services=()) as stack:  # and back
        assert _transform(stack) is None
