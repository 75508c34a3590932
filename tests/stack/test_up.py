"""What ``greyhound up`` says when a service exits: the last error its log holds, whole (a
service that refuses to start says why there, in one record of several lines)."""

from __future__ import annotations

from pathlib import Path

from services.common.settings import Settings
from stack.up import Stack


def test_the_last_error_of_a_service_log_with_its_lines(tmp_path: Path) -> None:
    stack = Stack(Settings(data_dir=tmp_path))
    assert stack.last_error("tracker") is None  # no log yet
    log = stack.log_path("tracker")
    log.parent.mkdir(parents=True)
    log.write_text(
        "2026-01-01 10:00:00,000 ERROR services.common.bus.client: an old refusal\n"
        "2026-01-01 10:00:01,000 INFO services.tracker.service: started\n"
        "2026-01-01 10:00:02,000 ERROR greyhound: tracker cannot start: the server refuses bus "
        "user 'tracker' 1 thing(s) its code does:\n"
        "  - publish to $JS.API.STREAM.NAMES: read an object back\n"
        "the server's bus permissions lack this grant\n"
        "2026-01-01 10:00:03,000 INFO greyhound: exiting\n")
    said = stack.last_error("tracker")
    assert said is not None and said.startswith("2026-01-01 10:00:02,000 ERROR greyhound")
    assert said.splitlines()[1:] == ["  - publish to $JS.API.STREAM.NAMES: read an object back",
                                     "the server's bus permissions lack this grant"]
    stack.log_path("api").write_text("2026-01-01 10:00:00,000 INFO api: fine\n")
    assert stack.last_error("api") is None
