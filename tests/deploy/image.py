"""deploy/Dockerfile read and built the way ``docker build`` would, without an engine.

Its instructions are parsed; ``COPY`` takes files from the repository as the build context gives
them (.dockerignore applied); ``RUN`` steps run as a script in the copy, in order, with two
exceptions said where they happen: ``apt-get`` (it needs root and Debian's network; what it
installs, a C compiler and make, is what this machine builds native/ with) and ``useradd``
(it would add a user to this machine; the uid is checked against ``USER`` instead). ``pip`` is
a fresh virtualenv whose dependencies are the test interpreter's (the packages ``pip install .``
would download are there already, and nothing is downloaded: ``PIP_NO_INDEX``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tests.deploy.compose_local import Image

SKIPPED = {"apt-get": "needs root and Debian's network; its compiler and make are this machine's",
           "useradd": "would add a user to this machine"}


@dataclass
class Dockerfile:
    base: str = ""
    steps: list[tuple[str, str]] = field(default_factory=list)  # (instruction, its text)
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    user: str = ""
    workdir: str = "/"


def parse(path: Path) -> Dockerfile:
    df = Dockerfile()
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        lines.append(raw)
    joined = "\n".join(lines).replace("\\\n", " ")
    for line in joined.splitlines():
        op, _, rest = line.strip().partition(" ")
        rest = " ".join(rest.split())
        if op == "FROM":
            df.base = rest
        elif op == "ENV":
            name, _, value = rest.partition("=")
            df.env[name] = value
        elif op == "ENTRYPOINT":
            df.entrypoint = json.loads(rest)
        elif op == "USER":
            df.user = rest
        else:
            df.steps.append((op, rest))
    return df


def _ignored(rel: PurePosixPath, patterns: list[str]) -> bool:
    return any(p == str(rel) or str(rel).startswith(p + "/")
               or rel.match(p.removeprefix("**/")) for p in patterns)


def _copy(context: Path, src: str, dest: Path, patterns: list[str]) -> None:
    root = context / src
    items = [root] if root.is_file() else sorted(root.rglob("*"))
    for item in items:
        rel = PurePosixPath(item.relative_to(context).as_posix())
        if item.is_dir() or any(_ignored(PurePosixPath(*rel.parts[:i + 1]), patterns)
                                for i in range(len(rel.parts))):
            continue
        target = dest / item.relative_to(root) if item != root else dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item, target)


def _venv(root: Path) -> Path:
    """A virtualenv whose dependencies are this interpreter's; its ``pip`` is pip from there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(root), "platbase": str(root)})["purelib"])
    (site / "zz-base-image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = root / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{root}/bin/python" -m pip "$@"\n')
    pip.chmod(0o755)
    return root / "bin"


@dataclass
class Build:
    image: Image
    skipped: list[str]
    background: list[subprocess.Popen[bytes]]  # RUN steps after the first that needs no wait


def build(dockerfile: Path, context: Path, root: Path, *, background_after: str) -> Build:
    """Run the build; RUN steps from the one starting with ``background_after`` on run in the
    background (the caller waits for them), in order, one script."""
    df = parse(dockerfile)
    patterns = [ln.strip() for ln in (context / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    bin_dir = _venv(root / "venv")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_NO_INDEX": "1",
           "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_WARN_SCRIPT_LOCATION": "1"}
    workdir = root / "fs"
    skipped: list[str] = []
    later: list[str] = []
    for op, text in df.steps:
        if op == "WORKDIR":
            df.workdir = text
            (workdir / text.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *sources, dest = shlex.split(text)
            where = workdir / df.workdir.lstrip("/") / dest
            for src in sources:
                _copy(context, src, where / Path(src).name if len(sources) > 1 else where,
                      patterns)
        elif op == "RUN":
            first = text.split()[0]
            if first in SKIPPED:
                skipped.append(f"{first}: {SKIPPED[first]}")
            elif later or text.startswith(background_after):
                later.append(text)
            else:
                subprocess.run(["bash", "-euo", "pipefail", "-c", text], env=env, check=True,
                               cwd=workdir / df.workdir.lstrip("/"), stdout=subprocess.DEVNULL)
    procs = [subprocess.Popen(["bash", "-euo", "pipefail", "-c", " && ".join(later)], env=env,
                              cwd=workdir / df.workdir.lstrip("/"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)] if later else []
    image = Image(df.entrypoint, df.env, workdir / df.workdir.lstrip("/"), bin_dir)
    return Build(image, skipped, procs)
