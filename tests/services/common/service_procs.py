"""``greyhound <service>`` processes, as deployed, on a test's bus and database: started with
the service's own bus user and the settings a test gives, each logging to a file of its own,
told apart by the pid their lease connection names (services.common.leases)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.common.leases import owner_pid, owners
from stack.up import end_processes
from tests.conftest import Bus

ROOT = Path(__file__).resolve().parents[3]


async def until(what: str, timeout_s: float, check: Callable[[], Awaitable[object]]) -> None:
    """Poll ``check`` until it returns something truthy."""
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


class ServiceProcesses:
    def __init__(self, service: str, bus: Bus, db_url: str, tmp: Path,
                 settings: dict[str, str]) -> None:
        creds = bus.creds(service)
        self.service = service
        self.db_url = db_url
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GREYHOUND_")}
        self.env.update({
            "PYTHONPATH": str(ROOT), "GREYHOUND_NATS_URL": bus.url,
            "GREYHOUND_NATS_USER": creds.user, "GREYHOUND_NATS_PASSWORD": creds.password,
            "GREYHOUND_DATABASE_URL": db_url, "GREYHOUND_DATA_DIR": str(tmp),
            "GREYHOUND_LOG_LEVEL": "INFO", **settings})
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int) -> None:
        for _ in range(n):
            with self._path(len(self.procs)).open("ab") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "stack.cli", self.service], cwd=ROOT, env=self.env,
                    stdout=out, stderr=out, start_new_session=True))

    def _path(self, i: int) -> Path:
        return self.tmp / f"{self.service}-{i}.log"

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self._path(self.procs.index(proc)).read_text()

    async def owner(self, partition: int = 0) -> subprocess.Popen[bytes] | None:
        """The process holding the partition's lease now, if one of these does."""
        held = await owners(self.db_url, self.service)
        pid = owner_pid(held[partition]) if partition in held else None
        return next((p for p in self.procs if p.pid == pid), None)

    async def owner_and_standby(self, timeout_s: float) -> tuple[subprocess.Popen[bytes],
                                                                 subprocess.Popen[bytes]]:
        """Two processes started: the one that took partition 0, and the other once it has
        asked for the lease and been refused (standing by)."""
        self.start(2)
        await until("an owner", timeout_s, self.owner)
        owner = await self.owner()
        assert owner is not None
        standby = next(p for p in self.procs if p is not owner)

        async def standing_by() -> bool:
            return "standing by" in self.log(standby)

        await until("the standby to stand by", timeout_s, standing_by)
        return owner, standby

    def stop(self) -> None:
        end_processes(self.procs)
