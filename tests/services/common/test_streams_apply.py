"""One step changes the streams (``greyhound streams apply``); a service only checks them and
refuses to start on a stream configured otherwise than its settings say, leaving it as it is."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from nats.js.api import SubjectTransform

from services.common.bus.contract import Subjects
from services.common.bus.streams import (
    TELEMETRY,
    StreamMismatch,
    stream_configs,
    stream_mismatches,
)
from services.common.runtime import Backends, apply_streams, start_service
from services.common.settings import Settings
from tests.conftest import new_bus


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stack.cli", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_service_with_other_partitions_refuses_and_leaves_the_stream_alone() -> None:
    """`greyhound streams apply` with two tracker partitions; a tracker started with one (the
    default) refuses with the difference and the setting, in one line and exit status 2,
    and the partitioned telemetry stream keeps its transform; applying one partition on
    purpose changes it, and so does applying two again, after which a tracker of the two
    partitions starts."""
    with new_bus("gh-apply-", tracker_partitions=2) as bus:
        creds = bus.creds("tracker")
        env = {"GREYHOUND_NATS_URL": bus.url, "GREYHOUND_NATS_USER": creds.user,
               "GREYHOUND_NATS_PASSWORD": creds.password, "GREYHOUND_DATA_DIR": str(bus.data_dir),
               "GREYHOUND_TRACKER_PARTITIONS": "2"}
        applied = _cli("streams", "apply", env=env)
        assert applied.returncode == 0, applied.stderr
        assert f"stream {TELEMETRY}: created" in applied.stdout
        again = _cli("streams", "apply", env=env)
        assert f"stream {TELEMETRY}: unchanged" in again.stdout, again.stderr

        one = {**env, "GREYHOUND_TRACKER_PARTITIONS": "1"}
        refused = _cli("tracker", env=one)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert f"stream {TELEMETRY} on the server differs" in refused.stderr
        assert "subject_transform" in refused.stderr
        assert "GREYHOUND_TRACKER_PARTITIONS" in refused.stderr
        assert "greyhound streams apply" in refused.stderr
        assert "Traceback" not in refused.stderr

        async def transform() -> SubjectTransform | None:
            nc = await bus.connect()
            try:
                return (await nc.jetstream().stream_info(TELEMETRY)).config.subject_transform
            finally:
                await nc.close()

        kept = asyncio.run(transform())
        assert kept is not None and kept.dest.endswith("{{partition(2,1)}}")

        back = _cli("streams", "apply", env=one)
        assert f"stream {TELEMETRY}: updated" in back.stdout, back.stderr
        assert asyncio.run(transform()) is None
        assert "updated" in _cli("streams", "apply", env=env).stdout  # two partitions again

        async def starts() -> None:  # a tracker of the two partitions passes the check
            ctx = await start_service(
                "tracker", Settings(nats_url=bus.url, tracker_partitions=2, tracker_partition=1),
                need_db=False, backends=Backends(nats_url=bus.url, database_url="",
                                                 nats_credentials=creds))
            await ctx.close()

        asyncio.run(starts())


async def test_a_check_creates_missing_streams_and_names_every_difference() -> None:
    """On a bare bus a service's check creates the streams (nothing to disagree with); a
    second process whose settings differ in two ways hears both, and the stream is as the
    first left it."""
    with new_bus("gh-check-", tracker_partitions=3) as bus:
        first = Settings(nats_url=bus.url, tracker_partitions=3)
        ctx = await start_service("tracker", first, need_db=False,
                                  backends=bus.backends("tracker"))
        await ctx.close()
        other = Settings(nats_url=bus.url, telemetry_max_bytes=1024**3)
        with pytest.raises(StreamMismatch) as refused:
            await start_service("tracker", other, need_db=False,
                                backends=bus.backends("tracker"))
        assert refused.value.stream == TELEMETRY
        assert [d.split(" ")[0] for d in refused.value.differences] == [
            "subject_transform", "max_bytes"]
        nc = await bus.connect()
        try:
            have = (await nc.jetstream().stream_info(TELEMETRY)).config
        finally:
            await nc.close()
        assert not stream_mismatches(stream_configs(first)[0], have)
        # apply_streams as the person at the machine would run it: the data directory's bus
        assert (await apply_streams(other, bus.backends("tracker")))[TELEMETRY] == "updated"


def test_the_replica_count_is_a_setting_and_a_difference() -> None:
    """Pure: every stream has GREYHOUND_STREAM_REPLICAS copies, and a stream with another
    count on the server is a difference naming that setting."""
    three = stream_configs(Settings(stream_replicas=3))
    assert {c.num_replicas for c in three} == {3}
    one = stream_configs(Settings())
    assert {c.num_replicas for c in one} == {1}
    (line,) = stream_mismatches(three[1], one[1])
    assert line.startswith("num_replicas is 1 there, 3 here") and "GREYHOUND_STREAM_REPLICAS" in line
    assert stream_mismatches(one[1], replace(one[1], num_replicas=None)) == []  # the default
    assert Subjects.ALL_ITERATIONS in (three[0].subjects or [])
