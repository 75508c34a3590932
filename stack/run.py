"""``greyhound run -- COMMAND ...``: a training command with Greyhound added, in one word.

The command (``torchrun ...``, ``srun python train.py``, anything) is executed in place of this
process (``exec``: its signals, its exit status) with:

* ``LD_PRELOAD`` holding the hook (``--hook``, ``$GREYHOUND_HOOK_LIB``, else the one ``make
  native`` builds in this checkout), ahead of what was preloaded already: every process the
  launcher starts records its NCCL calls in its ring;
* ``GREYHOUND_JOB_ID`` (``--job``, else the environment's, else one made from the command and the
  time) and ``GREYHOUND_SHM_DIR`` (where the agent reads the rings);
* what ``greyhound.integrations.rest.PlanClient.from_env()`` reads to follow plans:
  ``GREYHOUND_API_URL`` and a ``job`` token in ``GREYHOUND_API_TOKEN``. The token is the
  environment's if set, else ``--token-file``'s, else one made for this run in Greyhound's
  database when this machine reaches it (``GREYHOUND_DATABASE_URL``, or the embedded one of a
  ``greyhound up`` in the data directory), as ``greyhound token create --role job --job <id>``
  would (scoped to this job: it acts for no other); with
  none of these the job runs without plans (its telemetry is still recorded) and says so.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from greyhound.ids import check_token, slug
from services.common.settings import Settings

HOOK_NAME = "libgreyhound_hook.so"
BUILT_HOOK = Path(__file__).resolve().parents[1] / "native" / "build" / HOOK_NAME


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run a training command with the hook, a job id and a plan "
                       "client (greyhound run -- torchrun ...)",
                       description="Run a training command with Greyhound added: the hook "
                       "preloaded, a job id, and the API address and job token its plan client "
                       "reads.")
    p.add_argument("--job", default=None, help="the job id (default: $GREYHOUND_JOB_ID, else "
                   "made from the command and the time)")
    p.add_argument("--hook", type=Path, default=None, help=f"the hook library (default: "
                   f"$GREYHOUND_HOOK_LIB, else native/build/{HOOK_NAME} of this checkout)")
    p.add_argument("--no-hook", action="store_true", help="do not preload the hook")
    p.add_argument("--api-url", default=None, help="the REST API the job follows plans from "
                   "(default: $GREYHOUND_API_URL, else GREYHOUND_API_PUBLIC_URL, else the API's "
                   "own host and port)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="a file holding the job's token (default: $GREYHOUND_API_TOKEN, else one "
                   "made for the run)")
    p.add_argument("--no-token", action="store_true", help="never make a token")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")


class RunError(Exception):
    """What stops ``greyhound run`` before the command starts (exit status 2)."""


def job_id(explicit: str | None, env: Mapping[str, str], command: Sequence[str]) -> str:
    if explicit or env.get("GREYHOUND_JOB_ID"):
        return check_token(explicit or env["GREYHOUND_JOB_ID"], "job id")
    words = [w for w in command if not w.startswith("-")]
    script = next((w for w in words[1:] if w.endswith(".py")), words[0] if words else "job")
    stem = slug(Path(script).stem, 40) or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def hook_path(explicit: Path | None, env: Mapping[str, str]) -> Path:
    path = explicit or (Path(env["GREYHOUND_HOOK_LIB"]) if env.get("GREYHOUND_HOOK_LIB") else BUILT_HOOK)
    if not path.is_file():
        raise RunError(f"no hook library at {path}: build it (make native), pass --hook PATH, or "
                       "--no-hook to run without recording NCCL calls")
    return path.resolve()


def api_url(explicit: str | None, env: Mapping[str, str], settings: Settings) -> str:
    if explicit or env.get("GREYHOUND_API_URL"):
        return explicit or env["GREYHOUND_API_URL"]
    if settings.api_public_url:
        return settings.api_public_url
    from services.api.settings import ApiSettings

    api = ApiSettings()
    host = "127.0.0.1" if api.api_host in ("0.0.0.0", "::", "") else api.api_host
    return f"http://{host}:{api.api_port}"


def make_token(settings: Settings, job: str) -> str | None:
    """A job token in the database this machine reaches, or None when it reaches none."""
    from services.api.tokens import token_key
    from services.common.embedded import EmbeddedPostgres
    from stack.sim_plans import mint_token

    key = token_key(settings)
    if settings.database_url:
        return mint_token(settings.database_url, role="job", name=f"job-{job}", token_key=key,
                          created_by="greyhound run", job_id=job)
    if not (settings.data_dir / "pg").is_dir():
        return None  # no stack on this machine: never start a database just for a token
    pg = EmbeddedPostgres(settings.data_dir)
    try:
        return mint_token(pg.start(), role="job", name=f"job-{job}", token_key=key,
                          created_by="greyhound run", job_id=job)
    finally:
        pg.stop()


def environment(args: argparse.Namespace, env: Mapping[str, str], settings: Settings,
                note: TextIO = sys.stderr) -> dict[str, str]:
    """The command's environment (raises RunError when it cannot be made)."""
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    out = dict(env)
    job = job_id(args.job, env, command)
    out["GREYHOUND_JOB_ID"] = job
    out["GREYHOUND_SHM_DIR"] = str(env.get("GREYHOUND_SHM_DIR") or settings.shm_dir)
    what = [f"job {job}"]
    if not args.no_hook:
        hook = str(hook_path(args.hook, env))
        preloaded = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != hook]
        out["LD_PRELOAD"] = ":".join([hook, *preloaded])
        what.append(f"hook {hook}")
    out["GREYHOUND_API_URL"] = api_url(args.api_url, env, settings)
    token = env.get("GREYHOUND_API_TOKEN")
    if not token and args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise RunError(f"--token-file: {exc}") from None
        if not token:
            raise RunError(f"--token-file {args.token_file} is empty")
    if not token and not args.no_token:
        try:
            token = make_token(settings, job)
        except Exception as exc:  # the job runs without plans rather than not at all
            print(f"greyhound run: could not make a job token ({exc}); the job runs without "
                  "plans", file=note)
        else:
            if token:
                what.append(f"token job-{job} made for the run")
    if token:
        out["GREYHOUND_API_TOKEN"] = token
        what.append(f"plans from {out['GREYHOUND_API_URL']}")
    else:
        what.append("no token: plans are not followed (--token-file or $GREYHOUND_API_TOKEN)")
    print(f"greyhound run: {', '.join(what)}", file=note)
    return out


def run(args: argparse.Namespace, settings: Settings) -> int:
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if not command:
        print("greyhound run: no command (greyhound run [options] -- COMMAND ...)", file=sys.stderr)
        return 2
    try:
        env = environment(args, os.environ, settings)
    except (RunError, ValueError) as exc:
        print(f"greyhound run: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"greyhound run: cannot run {shlex.join(command)}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process
