"""What ``greyhound up`` started ends when it is killed (stack.lifeline): its services, its
agent, its nats-server and the watcher itself are gone soon after a kill -9 of ``greyhound up``.
Before, they ran on as orphans (an agent for an hour)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stack.lifeline import GRACE_S, _end, _stop_cluster, running, start_time
from tests.conftest import new_database
from tests.services.notifier.receiver import free_port

UP_WITHIN_S = 180.0  # four services and the agent importing on a loaded 2-core machine
# SIGTERM, then SIGKILL after GRACE_S to what is left, services first and the server after:
# two graces at most, plus the watcher's own start and a loaded machine's slack.
GONE_WITHIN_S = 2 * GRACE_S + 30.0


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def test_kill9_of_greyhound_up_ends_its_children(pg_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    with new_database(pg_url, "life") as db:
        env = dict(os.environ, GREYHOUND_DATABASE_URL=db, GREYHOUND_DATA_DIR=str(data),
                   GREYHOUND_SHM_DIR=str(tmp_path / "shm"))
        env.pop("GREYHOUND_NATS_URL", None)  # the embedded, authenticated one it starts
        up = subprocess.Popen([sys.executable, "-m", "stack.cli", "up", "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
        children: set[int] = set()
        try:
            deadline = time.monotonic() + UP_WITHIN_S
            assert up.stdout is not None
            for raw in up.stdout:
                if b"greyhound is up" in raw:
                    break
                assert time.monotonic() < deadline, "greyhound up did not come up"
            else:
                raise AssertionError(f"greyhound up exited with {up.wait()}")
            children = _children(up.pid)
            nats = int(json.loads((data / "nats" / "server.json").read_text())["pid"])
            # the services and the agent, the nats-server, the watcher
            assert nats in children and len(children) >= 4, children
            up.send_signal(signal.SIGKILL)
            up.wait(timeout=30)
            t0 = time.monotonic()
            while any(map(running, children)) and time.monotonic() - t0 < GONE_WITHIN_S:
                time.sleep(0.2)
            left = sorted(p for p in children if running(p))
            assert not left, (f"still running {GONE_WITHIN_S:.0f}s after greyhound up was "
                              f"killed: {[Path(f'/proc/{p}/cmdline').read_bytes() for p in left]}")
            print(f"lifeline: {len(children)} children of greyhound up gone "
                  f"{time.monotonic() - t0:.1f}s after its kill -9")
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
            for pid in children:  # whatever the check found left, so that the test leaves none
                if running(pid):
                    os.kill(pid, signal.SIGKILL)


def _sleeper() -> subprocess.Popen[bytes]:
    """A stand-in process that dies of SIGINT as a postmaster would, even when the tests run
    with SIGINT ignored (a shell's background job passes SIG_IGN on to its children): exec
    resets a handled signal to its default and keeps only an ignored one, so the child is
    started while this process handles SIGINT."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(["sleep", "600"], start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_pid_given_to_another_process_is_not_signalled() -> None:
    p = _sleeper()
    try:
        _end({p.pid: "1"}, group=True)  # recorded as started at tick 1: not this process
        assert p.poll() is None
        _end({p.pid: start_time(p.pid)}, group=True)
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_embedded_cluster_is_stopped_only_when_no_live_user_holds_it(
        tmp_path: Path) -> None:
    """pgserver's list of a cluster's users, with the killed parent's pid left in it: that pid
    leaves the list, and the postmaster (a stand-in process here) is stopped once no live user
    is left, as pgserver's last user does on a clean exit."""
    postmaster = _sleeper()
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        (tmp_path / "postmaster.pid").write_text(f"{postmaster.pid}\n{tmp_path}\n")
        users = tmp_path / ".handle_pids.json"
        users.write_text(json.dumps([gone.pid, os.getpid()]))  # a live user: this test
        _stop_cluster(tmp_path)
        assert json.loads(users.read_text()) == [os.getpid()]
        assert postmaster.poll() is None
        users.write_text(json.dumps([gone.pid]))
        _stop_cluster(tmp_path)
        assert json.loads(users.read_text()) == []
        assert postmaster.wait(timeout=10) == -signal.SIGINT
    finally:
        if postmaster.poll() is None:
            postmaster.kill()
            postmaster.wait()
