"""Every ``curl`` line in the docs runs as written against a live API (uvicorn on loopback, the
real Postgres and NATS): only the address, the tokens and the ids a reader would fill in are
substituted, and each must answer 2xx. A doc line that a reader cannot paste (a missing
``Content-Type``, a route that moved) fails here; so does a new placeholder this test does not
know, until it is given a value below."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services.api.conftest import Api
from tests.services.api.live import serve_api
from tests.services.notifier.receiver import free_port

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
JOB = "gpt-40b"  # the docs' example job


@dataclass(frozen=True)
class Line:
    where: str  # file:line
    command: str


def _complete(command: str) -> bool:
    """A shell command is complete when no quote is left open (a JSON body may span lines)."""
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def curl_lines(path: Path) -> list[Line]:
    """The curl commands of a document's fenced blocks, in order: backslash continuations and
    quoted strings over several lines joined as the shell joins them."""
    out: list[Line] = []
    fenced, pending, start = False, "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.strip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        if not pending:
            start = n
            raw = raw.strip()
        if raw.endswith("\\"):
            pending += raw[:-1]
            continue
        command = pending + raw
        if not _complete(command):
            pending = command + "\n"
            continue
        pending = ""
        if command.startswith("curl "):
            out.append(Line(f"{path.name}:{start}", command))
    return out


def test_the_docs_have_curl_lines_to_check() -> None:
    found = {line.where.split(":")[0] for p in DOCS for line in curl_lines(p)}
    assert {"mitigation.md", "webhooks.md"} <= found, found


async def _seed(api: Api) -> dict[str, str]:
    """What the docs' lines act on: the job with a delivered version 3 it has not reported, and
    a proposal awaiting a decision."""
    await api.job(JOB, world_size=4)
    incident = await api.incident(JOB, kind="comm_slow", stages=("localized", "validated"))
    delivered = await api.plan(incident, JOB, strategy="S2")
    await api.deliver(delivered, JOB, version=3, microbatches=[16, 16, 16, 16])
    proposed = await api.plan(incident, JOB, strategy="S3")
    return {"<id>": proposed}


async def _run(command: str, env: dict[str, str], tmp: Path) -> tuple[int, str]:
    body = tmp / "body"
    body.unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", f"{command} -sS -o {body} -w '%{{http_code}}'", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    code = int(out.decode() or 0)
    return code, (body.read_text() if body.exists() else "") + err.decode()


async def test_every_curl_line_runs_as_written(api: Api, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the docs' curl lines cannot be run here")
    ids = await _seed(api)
    port = free_port()
    job_token = await api.token("job", f"job-{JOB}", job_id=JOB)  # the docs' job's own
    env = {**os.environ, "API": f"http://127.0.0.1:{port}", "JOB_TOKEN": job_token,
           "OP_TOKEN": api.tokens["operator"], "ADMIN_TOKEN": api.tokens["admin"]}
    ran: list[str] = []
    async with serve_api(api.ctx, port):
        for path in DOCS:
            for line in curl_lines(path):
                command = line.command.replace("localhost:8000", f"127.0.0.1:{port}")
                for placeholder, value in ids.items():
                    command = command.replace(placeholder, value)
                unknown = [v for v in re.findall(r"\$\{?(\w+)", command) if v not in env]
                unknown += re.findall(r"<\w+>", command)
                assert not unknown, f"{line.where}: give {unknown} a value in this test"
                code, answer = await _run(command, env, tmp_path)
                assert 200 <= code < 300, f"{line.where}: {line.command}\n-> {code} {answer}"
                if code == 201:  # what the next lines call $ID: the object just created
                    env["ID"] = json.loads(answer.split("\n")[0])["id"]
                ran.append(line.where)
    assert len(ran) >= 7, ran
