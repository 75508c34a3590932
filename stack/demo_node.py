"""The demo's second node (``--fault bench-peer-dies``) and what the demo reads of the rings.

A second node is a second agent process, with its own agent id and its own ring directory (the
ranks it serves write their rings there), connected to the stack's bus as ``agent-<id>``. The
demo kills it with SIGKILL once the validator's P2P checks begin on the first node's ranks, as a
node agent dies mid-benchmark, and reads every ring's control block to see the job resumed and
what the hooks did (benchmark communicators aborted, pauses cut at the job's timeout).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

from greyhound import hookabi as H
from services.common.bus.auth import agent_user
from stack.up import Stack

P2P_KINDS = (int(H.BenchKind.SEND), int(H.BenchKind.RECV))


class SecondNode:
    """An agent process for the rings under ``shm_dir``; a context manager (started on enter,
    killed on exit if still running)."""

    def __init__(self, stack: Stack, agent_id: str, shm_dir: Path) -> None:
        self.stack = stack
        self.agent_id = agent_id
        self.shm_dir = shm_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed_at: float | None = None  # time.monotonic() of the kill

    def start(self) -> None:
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        env = self.stack.env(bus_user=agent_user(self.agent_id))
        env["GREYHOUND_SHM_DIR"] = str(self.shm_dir)
        logdir = Path(self.stack.settings.data_dir) / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        with (logdir / f"agent-{self.agent_id}.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stack.cli", "agent", "--agent-id", self.agent_id],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.stack.lifeline.watch_group(self.proc.pid)  # it ends with the demo, killed or not

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.killed_at = self.killed_at or time.monotonic()

    def __enter__(self) -> SecondNode:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()


def _blocks(rings: list[Path]) -> list[H.RingReader]:
    return [H.RingReader(p) for p in rings]


class KillOnTransfer(threading.Thread):
    """Kills ``node``'s agent as soon as a transfer (send or receive) is submitted to one of the
    ``rings`` (ranks of the other node): the validator's P2P checks have begun."""

    def __init__(self, rings: list[Path], node: SecondNode, *, poll_s: float = 0.002) -> None:
        super().__init__(name="kill-on-transfer", daemon=True)
        self.readers = _blocks(rings)
        self.node = node
        self.poll_s = poll_s
        self.done = threading.Event()

    def run(self) -> None:
        # Slots keep their last request: only ones submitted from now on count.
        seen = [int(r.control_block()["slots"]["req_id"].max()) for r in self.readers]
        while not self.done.is_set():
            for r, before in zip(self.readers, seen, strict=True):
                slots = r.control_block()["slots"]
                if any(int(k) in P2P_KINDS and int(q) > before for k, q in
                       zip(slots["kind"], slots["req_id"], strict=True)):
                    self.node.kill()
                    self.done.set()
                    return
            time.sleep(self.poll_s)

    def stop(self) -> None:
        self.done.set()


def control_totals(readers: list[H.RingReader]) -> dict[str, int]:
    """What the hooks counted over the job's ranks: pauses, benchmark communicators made and
    aborted, pauses cut at the job's timeout, ranks parked now."""
    out = {"pauses": 0, "bench_comms_made": 0, "bench_comms_aborted": 0, "pauses_shortened": 0,
           "parked": 0}
    for r in readers:
        b = r.control_block()
        out["pauses"] += int(b["pause_count"])
        out["bench_comms_made"] += int(b["bench_comms_made"])
        out["bench_comms_aborted"] += int(b["bench_comms_aborted"])
        out["pauses_shortened"] += int(b["pause_shortened"])
        out["parked"] += int(b["paused"])
    return out
