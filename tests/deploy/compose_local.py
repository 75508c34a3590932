"""deploy/compose.yaml read as Compose reads it, for running its containers as local processes.

No container engine runs on CI's machines, so the test does what Compose and Docker would:
interpolates ``${VAR}`` from the environment file, merges the anchors, gives each container its
volumes (a named volume with a ``subpath`` is a folder of a local folder), its image's
``ENTRYPOINT`` and ``ENV``, and its service's ``command`` and ``environment`` unchanged except
where Docker itself would differ from this machine: a container path becomes the local folder
mounted there, a service name and container port (``nats:4222``) a loopback port, ``0.0.0.0``
loopback. Everything else, arguments, variables and the files init wrote, is what a container
would get, so the test breaks when compose.yaml and the code disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}")


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is missing: Compose refuses the file."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's interpolation: ``${V}``, ``${V:-d}``/``${V-d}`` (default when unset, or also
    when empty with the colon), ``${V:?e}``/``${V?e}`` (refused), ``$$`` a dollar."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, colon, op, arg = m.groups()
        have = env.get(name)
        missing = have is None or (colon == ":" and have == "")
        if op == "-":
            return arg if missing else str(have)
        if op == "?" and missing:
            raise InterpolationError(f"{name}: {arg}")
        return have or ""

    return _VAR.sub(one, value)


def load(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    loaded: dict[str, Any] = interpolate(yaml.safe_load(path.read_text()), env)
    return loaded


def read_env_file(path: Path) -> dict[str, str]:
    """A ``.env`` as Compose reads it: ``NAME=value`` lines, comments and blanks skipped."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


@dataclass
class Network:
    """Where each service's container ports are on this machine (Docker's DNS and port
    mapping): ``{"nats": {4222: 40001}}``; aliases are other names for a service (the host
    name training nodes use for NATS)."""

    ports: dict[str, dict[int, int]]
    aliases: dict[str, str] = field(default_factory=dict)

    def of(self, host: str, own: str) -> dict[int, int]:
        if host in ("localhost", "127.0.0.1", "0.0.0.0"):
            return self.ports.get(own, {})
        return self.ports.get(self.aliases.get(host, host), {})

    def rewrite(self, text: str, own: str) -> str:
        """``nats:4222`` -> ``127.0.0.1:<its port here>`` wherever a known service and port are
        named; a bind-all address becomes loopback (tests listen on loopback only)."""
        def one(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            mapped = self.of(host, own).get(port)
            return m.group(0) if mapped is None else f"127.0.0.1:{mapped}"

        text = re.sub(r"(?<![\w.-])([A-Za-z0-9_.-]+):(\d+)", one, text)
        return "127.0.0.1" if text == "0.0.0.0" else text


@dataclass
class Container:
    """One service as a local process: what it runs, with what, where its paths are."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path]  # container path -> local folder
    rootfs: Path  # the container's own files (outside its mounts)
    healthcheck: list[str] | None
    spec: dict[str, Any]

    def path(self, container_path: str) -> Path:
        for target in sorted(self.mounts, key=len, reverse=True):
            if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
                return self.mounts[target] / container_path[len(target):].lstrip("/")
        if container_path.startswith(("/dev/", "/proc/")):  # the kernel's, as in a container
            return Path(container_path)
        return self.rootfs / container_path.lstrip("/")


@dataclass
class Image:
    """What the Dockerfile gives a container: its entry point, environment and work dir,
    and the local folder its ``WORKDIR`` and ``PATH`` stand for."""

    entrypoint: list[str]
    env: dict[str, str]
    workdir: Path
    bin_dir: Path


class LocalCompose:
    def __init__(self, file: Path, env: Mapping[str, str], root: Path, network: Network,
                 image: Image) -> None:
        self.file = file
        self.config = load(file, env)
        self.root = root
        self.network = network
        self.image = image

    def _mounts(self, name: str, spec: dict[str, Any]) -> dict[str, Path]:
        named = set(self.config.get("volumes") or {})
        mounts: dict[str, Path] = {}
        for v in spec.get("volumes", []):
            if isinstance(v, str):
                source, target = v.split(":")[:2]
                sub = ""
            else:
                source, target = v["source"], v["target"]
                sub = (v.get("volume") or {}).get("subpath", "")
            if source in named:
                host = self.root / "volumes" / source / sub
            elif source.startswith("/"):  # a bind of the host's own path (/dev/shm)
                host = self.root / "host" / source.lstrip("/")
            else:  # a bind relative to the compose file's folder
                host = self.root / "project" / source
            host.mkdir(parents=True, exist_ok=True)
            mounts[target] = host
        return mounts

    def container(self, name: str, *, command: list[str] | None = None) -> Container:
        """``name`` as ``docker compose run`` / ``up`` would start it (``command`` replaces the
        service's, as ``docker compose run SERVICE CMD...`` does)."""
        spec: dict[str, Any] = self.config["services"][name]
        mounts = self._mounts(name, spec)
        c = Container(name, [], {}, mounts, self.root / "rootfs" / name,
                      None, spec)
        built = "build" in spec
        entry = spec.get("entrypoint", self.image.entrypoint if built else [])
        argv = [*entry, *(command if command is not None else spec.get("command", []))]
        own = self.network.ports.get(name, {})
        c.argv = [str(own.get(int(a), a)) if prev == "--port" and a.isdigit()
                  else self._value(c, a) for prev, a in zip(["", *argv], argv, strict=False)]
        env = {**(self.image.env if built else {}), **{k: str(v) for k, v in
                                                       (spec.get("environment") or {}).items()}}
        c.env = {k: self._value(c, v) for k, v in env.items()}
        test = (spec.get("healthcheck") or {}).get("test")
        if test:
            assert test[0] == "CMD", f"{name}: a health check as an argv, not a shell line"
            c.healthcheck = [self._value(c, a) for a in test[1:]]
        return c

    def _value(self, c: Container, value: str) -> str:
        if value.startswith("/"):
            return str(c.path(value))
        return self.network.rewrite(value, c.name)
