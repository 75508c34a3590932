"""Two stacks on one machine: the second ``greyhound up`` or ``sim run`` on the same port or ring
directory is refused before it starts anything, naming the setting to change."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.settings import Settings
from stack.claims import Collision, check_port, claim_file, ring_dir_claim
from stack.sim_live import run_live
from tests.sim.helpers import job, scenario

# Holds the ring directory's claim the way a running stack does, until killed.
HOLDER = ("import sys, time; from pathlib import Path; from stack.claims import ring_dir_claim\n"
          "with ring_dir_claim(Path(sys.argv[1]), Path(sys.argv[2])):\n"
          "    print('held', flush=True); time.sleep(600)")


def _listening() -> socket.socket:
    """A listener bound as uvicorn binds the API's (SO_REUSEADDR)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_port_in_use_is_refused_and_a_released_one_is_not() -> None:
    s = _listening()
    port = s.getsockname()[1]
    with pytest.raises(Collision, match=f"port {port} .* --port"):
        check_port("127.0.0.1", port)
    with socket.create_connection(("127.0.0.1", port)) as c:  # leave a connection in TIME_WAIT
        conn, _ = s.accept()
        conn.close()
        c.close()
    s.close()
    check_port("127.0.0.1", port)


def test_the_ring_directory_is_held_until_its_holder_dies(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(shm), str(tmp_path / "first")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(Collision) as refused, ring_dir_claim(shm, tmp_path / "second"):
            pass
        why = str(refused.value)
        assert str(shm) in why and str(tmp_path / "first") in why and "GREYHOUND_SHM_DIR" in why
        assert f"pid {holder.pid}" in why
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with ring_dir_claim(shm, tmp_path / "second"):  # the OS released the dead one's lock
        assert claim_file(shm).exists() and not shm.exists()  # the claim sits beside it


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GREYHOUND_")}
    return env | {"GREYHOUND_DATA_DIR": str(tmp / "data"), **extra}


def test_a_second_greyhound_up_is_refused(tmp_path: Path) -> None:
    """What a first stack holds: its ring directory's claim, and its port (a listener here)."""
    shm = tmp_path / "shm"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(shm), str(tmp_path / "first")],
                              stdout=subprocess.PIPE, text=True)
    api = _listening()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for env, words in (
                (_env(tmp_path, GREYHOUND_SHM_DIR=str(shm)), ("ring directory", str(shm))),
                (_env(tmp_path, GREYHOUND_SHM_DIR=str(tmp_path / "other"),
                      GREYHOUND_API_PORT=str(api.getsockname()[1])), ("port", "--port"))):
            second = subprocess.Popen([sys.executable, "-m", "stack.cli", "up"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
            try:
                _, err = second.communicate(timeout=120)
            except subprocess.TimeoutExpired:  # it started a stack: the collision went unseen
                os.killpg(second.pid, signal.SIGTERM)
                second.communicate(timeout=60)
                raise AssertionError("a second greyhound up started") from None
            assert second.returncode == 2, err
            assert all(w in err for w in words), err
        assert not (tmp_path / "data" / "nats").exists()  # refused before starting anything
    finally:
        api.close()
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_second_sim_run_is_refused(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    sc = scenario(job(), duration_s=5.0, name="collide")
    settings = Settings(nats_url="nats://127.0.0.1:1", database_url="postgresql://x@127.0.0.1:1/x",
                        data_dir=tmp_path / "data", shm_dir=shm)
    with ring_dir_claim(shm, tmp_path / "first"):
        out, err = io.StringIO(), io.StringIO()
        t0 = time.monotonic()
        rc = run_live(sc, settings, port=0, speed=None, as_json=True, out=out, err=err)
        assert rc == 2 and "ring directory" in err.getvalue(), err.getvalue()
        assert time.monotonic() - t0 < 30 and out.getvalue() == ""
