"""deploy/: the compose file against the Compose specification, the Dockerfile through hadolint,
and ``docker compose up`` played as local processes (no container engine runs on CI's machines):
the image built as its Dockerfile says, then each service's command and environment, with the
init step's files, against a real NATS and Postgres, in depends_on order; the API answers over
HTTPS with the first admin token, a training node joins with its bundle, an incident from a
fake-NCCL job arrives, and a webhook reaches a local receiver (tests/deploy/*.py say how each
container is stood for)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.common.embedded import nats_server_binary
from tests.deploy import postgres_image
from tests.deploy.compose_local import LocalCompose, Network, read_env_file
from tests.deploy.image import build, parse
from tests.deploy.processes import Processes

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy/compose.yaml"
DOCKERFILE = REPO / "deploy/Dockerfile"
BIN = REPO / ".venv/bin"
NATS_HOST = "greyhound-ctl.test"  # what deploy/.env names the host agents reach NATS by


def _tool(name: str) -> str:
    found = shutil.which(name, path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert found is not None, f"{name} is a dev dependency (pyproject.toml)"
    return found


def test_the_compose_file_follows_the_compose_specification() -> None:
    done = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerfile_passes_hadolint_and_keeps_our_rules() -> None:
    done = subprocess.run([_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    df = parse(DOCKERFILE)
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", df.base), "pin the base image"
    assert df.user.split(":")[0] not in ("", "0", "root"), "a service never runs as root"
    assert not [k for k in df.env if re.search("PASSWORD|TOKEN|KEY|SECRET", k)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Receiver(BaseHTTPRequestHandler):
    got: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Receiver.got.append({"headers": dict(self.headers), "body": json.loads(body)})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.got = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


def _nats_view(procs: Processes, compose: LocalCompose) -> list[str]:
    """nats-server's argv with the config it would read in its container: the mounted file,
    container paths and ports mapped as Docker maps them."""
    c = compose.container("nats")
    conf = Path(c.argv[c.argv.index("-c") + 1])
    text = re.sub(r'"(/[^"]*)"', lambda m: json.dumps(str(c.path(m.group(1)))), conf.read_text())
    view = c.rootfs / "nats.conf"
    view.parent.mkdir(parents=True, exist_ok=True)
    view.write_text(compose.network.rewrite(text, "nats"))
    return [nats_server_binary(), *(str(view) if a == str(conf) else a for a in c.argv)]


def _order(config: dict[str, Any]) -> list[str]:
    """Services without a profile, each after what it depends on."""
    services = {n: s for n, s in config["services"].items() if not s.get("profiles")}
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n, s in services.items() if n not in done
                 and set(s.get("depends_on") or {}) <= set(done)]
        assert ready, f"a depends_on cycle among {set(services) - set(done)}"
        done += ready
    return done


def _up(procs: Processes, compose: LocalCompose, pg_port: int) -> None:
    """``docker compose up``: each service once its dependencies meet their conditions."""
    def health_env(name: str) -> dict[str, str]:  # Docker's port mapping, for pg_isready
        return {"PGPORT": str(pg_port),
                "PATH": f"{postgres_image.BIN}:{procs.base_env['PATH']}"} \
            if name == "postgres" else {}

    for name in _order(compose.config):
        for dep, cond in (compose.config["services"][name].get("depends_on") or {}).items():
            procs.wait(dep, cond["condition"], health_env)
        c = compose.container(name)
        if name == "nats":
            procs.start(c, _nats_view(procs, compose))
        elif name == "postgres":
            procs.adopt(c, postgres_image.start(c, pg_port, procs.logs / "postgres.log"))
        else:
            procs.start(c)


def _join_node(procs: Processes, compose: LocalCompose, agent_id: str,
               base: dict[str, Any]) -> None:
    """docs/security.md's three steps: the bundle from init, unpacked where the agent service
    mounts it, the agent started with it as its env file; NATS reloaded for the new user."""
    bundle = procs.run(compose.container("init", command=["node", agent_id]))
    unpacked = compose.root / "project" / "agent"
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        tar.extractall(unpacked, filter="data")
    node = LocalCompose(COMPOSE, read_env_file(unpacked / "agent.env"), compose.root,
                        compose.network, compose.image)
    agent = node.container("agent")
    assert agent.mounts["/run/greyhound"] == unpacked
    nats = procs.procs["nats"]
    _nats_view(procs, compose)
    os.kill(nats.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while not procs.log_has("nats", "Reloaded server configuration"):
        assert time.monotonic() < deadline, "nats-server did not reload"
        time.sleep(0.2)
    # The image's default ring folder (/dev/shm/greyhound) is under the agent's /dev/shm bind.
    procs.extra_env["agent"] = {"GREYHOUND_SHM_DIR": str(agent.path("/dev/shm/greyhound"))}
    procs.start(agent)
    base["shm"] = agent.path("/dev/shm/greyhound")


@pytest.mark.timeout(480)
def test_compose_up_runs_as_the_file_says(tmp_path: Path, receiver: str) -> None:
    network = Network({"nats": {4222: _free_port(), 8222: _free_port()},
                       "postgres": {5432: _free_port()}, "api": {8443: _free_port()}},
                      aliases={NATS_HOST: "nats"})
    t0 = time.monotonic()
    built = build(DOCKERFILE, REPO, tmp_path / "image", background_after="make")
    assert {s.split(":")[0] for s in built.skipped} == {"apt-get", "useradd"}
    compose = LocalCompose(COMPOSE, {"GREYHOUND_DEPLOY_NATS_HOSTS": NATS_HOST}, tmp_path,
                           network, built.image)
    base_env = {"PATH": f"{built.image.bin_dir}:/usr/local/bin:/usr/bin:/bin",
                "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    # The later change that refuses loopback webhook destinations reads this allow-list.
    allow = {"GREYHOUND_WEBHOOK_ALLOW_HOSTS": "127.0.0.1"}
    procs = Processes(compose, tmp_path / "logs", base_env,
                      {"api": dict(allow), "notifier": dict(allow)})
    api = f"https://127.0.0.1:{network.ports['api'][8443]}"
    try:
        t_up = time.monotonic()
        _up(procs, compose, network.ports["postgres"][5432])
        procs.wait("api", "service_healthy", lambda _: {})
        api_after_s = time.monotonic() - t_up
        print(f"compose-local: the API answered {api_after_s:.1f} s after up "
              f"(build steps before it: {t_up - t0:.1f} s)")
        ca = compose.root / "volumes/deploy/api/ca.crt"
        tls = ssl.create_default_context(cafile=str(ca))
        token = procs.run(compose.container("init", command=["admin-token"])).decode().strip()
        assert procs.log_has("init", re.escape(token)), "init printed the first admin token"
        admin = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=api, verify=tls, timeout=10) as http:
            assert http.get("/v1/incidents").status_code == 401
            assert http.get("/metrics").status_code == 401
            assert http.get("/metrics", headers=admin).status_code == 200
            r = http.post("/v1/webhooks", headers=admin, json={
                "name": "oncall", "url": receiver, "events": ["incident.opened"]})
            assert r.status_code == 201, r.text
        where: dict[str, Any] = {}
        _join_node(procs, compose, "n1", where)
        job = f"compose-{uuid.uuid4().hex[:6]}"
        spec = FakeJobSpec(job_id=job, world_size=4, iters=2000, compute_ms=40.0)
        with FakeJob(spec, workdir=tmp_path / "job", hook=native_build_dir()
                     / "libgreyhound_hook.so", shm_dir=where["shm"]) as fj, \
                httpx.Client(base_url=api, verify=tls, timeout=10, headers=admin) as http:
            fj.wait_iteration(2, 100, timeout=120)
            fj.faults.set("slow_rank 2 2.0")
            deadline = time.monotonic() + 120
            incidents: list[dict[str, Any]] = []
            while not incidents or not _Receiver.got:
                assert not procs.dead(), f"exited: {procs.dead()}; logs in {procs.logs}"
                assert time.monotonic() < deadline, (
                    f"incidents {incidents}, webhooks {len(_Receiver.got)}; logs {procs.logs}")
                time.sleep(0.5)
                incidents = http.get("/v1/incidents", params={"job_id": job}).json()
        assert incidents[0]["job_id"] == job
        bodies = [g["body"] for g in _Receiver.got]
        assert any(b.get("event") == "incident.opened" for b in bodies), bodies
    finally:
        procs.stop_all()
    for proc in built.background:  # the rest of the build ran beside the stack
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    assert (built.image.workdir / "native/build/libgreyhound_hook.so").exists()
