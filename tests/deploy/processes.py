"""The local processes that stand for compose's containers: started in depends_on order, their
health checks run as Docker runs them, all of them ended however the test ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.deploy.compose_local import Container, LocalCompose

HEALTH_TIMEOUT_S = 180.0  # a service's start_period is 120 s; a busy 2-core machine is slower


class Processes:
    def __init__(self, compose: LocalCompose, logs: Path, base_env: dict[str, str],
                 extra_env: dict[str, dict[str, str]]) -> None:
        self.compose = compose
        self.logs = logs
        self.base_env = base_env
        self.extra_env = extra_env  # per service: what the test adds (said where it is built)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.containers: dict[str, Container] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def env_of(self, c: Container) -> dict[str, str]:
        return {**self.base_env, **c.env, **self.extra_env.get(c.name, {})}

    def start(self, c: Container, argv: list[str] | None = None, *,
              user: str | None = None) -> subprocess.Popen[bytes]:
        out = (self.logs / f"{c.name}.log").open("ab")
        proc = subprocess.Popen(argv or c.argv, env=self.env_of(c), stdout=out, stderr=out,
                                cwd=self.compose.image.workdir, start_new_session=True,
                                user=user)
        out.close()
        self.procs[c.name], self.containers[c.name] = proc, c
        return proc

    def adopt(self, c: Container, proc: subprocess.Popen[bytes]) -> None:
        self.procs[c.name], self.containers[c.name] = proc, c

    def run(self, c: Container) -> bytes:
        """A one-shot (``docker compose run --rm``): its stdout; its stderr goes to its log."""
        with (self.logs / f"{c.name}.log").open("ab") as err:
            done = subprocess.run(c.argv, env=self.env_of(c), stdout=subprocess.PIPE,
                                  stderr=err, cwd=self.compose.image.workdir, timeout=120)
        assert done.returncode == 0, f"{c.argv}: exit {done.returncode}; see {self.logs}"
        return done.stdout

    def healthy(self, name: str, env: dict[str, str] | None = None) -> bool:
        c = self.containers[name]
        assert c.healthcheck is not None, f"{name} has no health check"
        done = subprocess.run(c.healthcheck, env={**self.env_of(c), **(env or {})},
                              capture_output=True, timeout=30)
        return done.returncode == 0

    def wait(self, name: str, condition: str, health_env: Callable[[str], dict[str, str]]
             ) -> None:
        """Until ``name`` meets a depends_on condition."""
        proc = self.procs[name]
        if condition == "service_completed_successfully":
            rc = proc.wait(timeout=HEALTH_TIMEOUT_S)
            assert rc == 0, f"{name} exited {rc}; see {self.logs / name}.log"
            return
        if condition == "service_healthy":
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while not self.healthy(name, health_env(name)):
                assert proc.poll() is None, f"{name} exited {proc.returncode}; see its log"
                assert time.monotonic() < deadline, f"{name} not healthy; see its log"
                time.sleep(0.5)

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items()
                if p.poll() is not None and p.returncode != 0]

    def log_has(self, name: str, pattern: str) -> bool:
        return re.search(pattern, (self.logs / f"{name}.log").read_text(errors="replace")) \
            is not None

    def stop_all(self) -> None:
        """Every process group ends: SIGTERM (SIGINT for Postgres: a fast shutdown), then
        SIGKILL after 15 s."""
        for name, proc in reversed(self.procs.items()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT if name == "postgres" else signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
