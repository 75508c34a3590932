"""``greyhound run -- COMMAND``: the command runs with the hook preloaded, its job id, and what its
plan client needs (the API's address and a job token, made in the database when none is given)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.tokens import hash_token
from services.common.db import repository as repo
from stack.run import BUILT_HOOK

ROOT = Path(__file__).resolve().parents[2]
GREYHOUND = [sys.executable, "-m", "stack.cli"]
# What the training command sees: its Greyhound variables, whether the hook is mapped into it,
# and the plan client built from its environment.
PROBE = (
    "import json, os\n"
    "from greyhound.integrations.rest import PlanClient\n"
    "env = {k: v for k, v in os.environ.items() if k.startswith('GREYHOUND_') or k == 'LD_PRELOAD'}\n"
    "maps = open('/proc/self/maps').read()\n"
    "try:\n    client = PlanClient.from_env().job_id\nexcept ValueError as exc:\n    client = str(exc)\n"
    "print(json.dumps({'env': env, 'hook_mapped': 'libgreyhound_hook.so' in maps, 'client': client}))\n"
)

needs_hook = pytest.mark.skipif(not BUILT_HOOK.is_file(), reason="make native builds the hook")


def _run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("GREYHOUND_") and k != "LD_PRELOAD"}
    base.update(PYTHONPATH=str(ROOT), GREYHOUND_DATA_DIR=str(tmp / "data"), **env)
    return subprocess.run([*GREYHOUND, "run", *args], cwd=tmp, env=base, capture_output=True,
                          text=True, timeout=120, check=False)


@needs_hook
def test_the_command_runs_under_the_hook_with_its_job_id_and_keeps_its_preloads(tmp_path: Path) -> None:
    other = tmp_path / "libother.so"
    done = _run(["--job", "gpt-7", "--no-token", "--", sys.executable, "-c", PROBE], tmp_path,
                LD_PRELOAD=str(other), GREYHOUND_API_URL="http://planner:8000")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["hook_mapped"] is True
    assert seen["env"]["LD_PRELOAD"] == f"{BUILT_HOOK.resolve()}:{other}"
    assert seen["env"]["GREYHOUND_JOB_ID"] == "gpt-7"
    assert seen["env"]["GREYHOUND_SHM_DIR"] == "/dev/shm/greyhound"
    assert seen["env"]["GREYHOUND_API_URL"] == "http://planner:8000"
    assert "GREYHOUND_API_TOKEN" in seen["client"]  # no token: the client says what is missing
    assert "no token" in done.stderr


@needs_hook
def test_a_token_file_reaches_the_plan_client_and_the_exit_status_is_the_commands(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("gh_secret\n")
    done = _run(["--job", "j1", "--token-file", str(tmp_path / "token"), "--", sys.executable,
                 "-c", PROBE + "raise SystemExit(3)\n"], tmp_path)
    assert done.returncode == 3
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["env"]["GREYHOUND_API_TOKEN"] == "gh_secret"
    assert seen["client"] == "j1"
    assert seen["env"]["GREYHOUND_API_URL"] == "http://127.0.0.1:8000"


def test_what_stops_it_before_the_command_is_said(tmp_path: Path) -> None:
    missing = _run(["--hook", str(tmp_path / "nope.so"), "--", "true"], tmp_path)
    assert missing.returncode == 2 and "no hook library" in missing.stderr
    bad_job = _run(["--job", "a.b", "--no-hook", "--no-token", "--", "true"], tmp_path)
    assert bad_job.returncode == 2 and "job id 'a.b'" in bad_job.stderr
    empty = _run(["--no-hook"], tmp_path)
    assert empty.returncode == 2 and "no command" in empty.stderr
    absent = _run(["--no-hook", "--no-token", "--", str(tmp_path / "no-such-launcher")], tmp_path)
    assert absent.returncode == 127 and "cannot run" in absent.stderr


def test_a_job_id_is_made_from_the_training_script(tmp_path: Path) -> None:
    done = _run(["--no-hook", "--no-token", "--", sys.executable, "-c", PROBE, "pretrain_gpt.py"],
                tmp_path)
    job = json.loads(done.stdout.strip().splitlines()[-1])["env"]["GREYHOUND_JOB_ID"]
    assert job.startswith("pretrain_gpt-"), job


async def test_without_a_token_one_is_made_in_the_database_for_the_job(
        tmp_path: Path, sessions: async_sessionmaker[AsyncSession], fresh_db_url: str) -> None:
    done = _run(["--job", "train-3", "--no-hook", "--", sys.executable, "-c", PROBE], tmp_path,
                GREYHOUND_DATABASE_URL=fresh_db_url, GREYHOUND_TOKEN_KEY="run-test-key")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    secret = seen["env"]["GREYHOUND_API_TOKEN"]
    assert seen["client"] == "train-3" and "token job-train-3 made for the run" in done.stderr
    async with sessions() as session:
        (token,) = await repo.find_tokens(session, "job-train-3")
    assert token.role == "job" and token.token_hash == hash_token(secret, b"run-test-key")
    assert token.job_id == "train-3"  # it acts for this job only
    assert token.created_by == "greyhound run"
