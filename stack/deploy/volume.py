"""The init volume of deploy/compose.yaml: every secret and certificate of a deployment, made
once by ``greyhound deploy init`` and kept.

``state/`` is the init step's own (the CA's key, every password and key, the first admin
token); each other folder is what one container mounts (volume ``subpath``) and holds only
what that container needs, as files named after the settings they fill (``GREYHOUND_SECRETS_DIR``
reads them: services.common.settings). A compromised tracker therefore holds the tracker's bus
password and certificate, not the validator's, which may pause jobs.

Running init again keeps what exists: it adds what is missing (a service registered since, an
agent), applies what deploy/.env sets (stack.deploy.settings), re-issues a certificate whose
names changed or whose CA was replaced, and rewrites the per-container folders and the NATS
configuration from ``state/``.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from services.api.tokens import display_prefix, hash_token, new_token
from services.common.bus.auth import agent_of_user, agent_user
from services.common.bus.permissions import service_users
from services.common.bus.server_config import render
from services.common.private_file import private_dir, write_private
from services.registry import SERVICES
from stack.deploy import pki
from stack.deploy.settings import DeploySettings

OWN = "/run/greyhound"  # where a container mounts its own folder of the volume
NATS_OWN = "/etc/nats/greyhound"  # ... the NATS container's
NATS_STORE = "/data"  # the NATS container's JetStream volume
FIRST_ADMIN = "first_admin.json"
# The keys only these services read (services.common.settings: token and webhook keys).
KEYS_FOR: dict[str, tuple[str, ...]] = {"api": ("token_key", "webhook_key"),
                                        "notifier": ("webhook_key",)}
Rotatable = Literal["bus", "tls", "token-key"]


def _plain(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def secret_file(setting: str) -> str:
    """The file GREYHOUND_SECRETS_DIR holds for a setting of services.common.settings."""
    return f"greyhound_{setting}"


@dataclass
class Said:
    """What a run made, kept or changed, for its log."""

    made: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    new_admin_token: str | None = None


class DeployVolume:
    def __init__(self, root: Path, settings: DeploySettings) -> None:
        self.root = root
        self.settings = settings
        self.state = private_dir(root / "state")
        self.said = Said()

    # --- state/ --------------------------------------------------------------------------

    def _value(self, name: str, override: str | None = None, make: str | None = None) -> str:
        """``state/<name>``: set to ``override`` when given, else kept, else ``make``."""
        path = self.state / name
        if override is not None:
            if not path.exists() or path.read_text() != override:
                write_private(path, override)
                self.said.made.append(f"{name} (from deploy/.env)")
            return override
        if path.exists():
            self.said.kept.append(name)
            return path.read_text()
        value = make if make is not None else secrets.token_urlsafe(32)
        write_private(path, value)
        self.said.made.append(name)
        return value

    def _issued(self, name: str, ca: pki.Issued | None, make: pki.Issued | None = None,
                *, names: list[str] | None = None) -> pki.Issued:
        """``state/<name>.crt`` and ``.key``: kept while signed by ``ca`` and (for a server
        certificate) naming exactly ``names``; issued anew otherwise (``make`` for the CA)."""
        crt, key = self.state / f"{name}.crt", self.state / f"{name}.key"
        if crt.exists() and key.exists():
            have = pki.Issued(crt.read_bytes(), key.read_bytes())
            fresh = ca is None or pki.signed_by(have.cert, ca)
            if fresh and (names is None or sorted(pki.server_names(have.cert)) == sorted(names)):
                self.said.kept.append(f"{name} certificate")
                return have
        if ca is None:
            issued = make or pki.new_ca()
        elif names is not None:
            issued = pki.issue(ca, name, server_names=names)
        else:
            issued = pki.issue(ca, name, client=True)
        write_private(key, issued.key)
        write_private(crt, issued.cert)
        self.said.made.append(f"{name} certificate")
        return issued

    def _bus_passwords(self, extra_users: list[str]) -> dict[str, str]:
        path = self.state / "bus.json"
        known: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        agents = [a for a in map(agent_of_user, [*known, *extra_users]) if a is not None]
        users = list(service_users(agents=agents))
        added = [u for u in users if u not in known]
        known.update({u: secrets.token_urlsafe(24) for u in added})
        if added:
            write_private(path, json.dumps(known, indent=1, sort_keys=True))
            self.said.made.append(f"bus passwords of {', '.join(added)}")
        return known

    # --- the containers' folders -----------------------------------------------------------

    def _folder(self, name: str, files: dict[str, str | bytes]) -> None:
        folder = private_dir(self.root / name)
        for fname, data in files.items():
            write_private(folder / fname, data)

    def init(self, *, extra_agents: tuple[str, ...] = ()) -> Said:
        s = self.settings
        ca = self._issued("ca", None)
        keys = {"token_key": self._value("token_key", _plain(s.token_key)),
                "webhook_key": self._value("webhook_key", _plain(s.webhook_key))}
        pg_password = self._value("postgres_password", _plain(s.postgres_password))
        bus = self._bus_passwords([agent_user(a) for a in extra_agents])
        nats_names = ["nats", "localhost", "127.0.0.1", *s.nats_names()]
        nats_cert = self._issued("nats-server", ca, names=list(dict.fromkeys(nats_names)))
        api_names = ["api", "localhost", "127.0.0.1", *s.api_names()]
        api_cert = self._issued("api-https", ca, names=list(dict.fromkeys(api_names)))
        agents = sorted(a for a in map(agent_of_user, bus) if a is not None)
        tls = {"cert_file": f"{NATS_OWN}/server.crt", "key_file": f"{NATS_OWN}/server.key",
               "ca_file": f"{NATS_OWN}/ca.crt", "verify": True, "timeout": 5}
        conf = render(agents, store_dir=NATS_STORE, passwords=bus, tls=tls,
                      command="greyhound deploy init")
        self._folder("nats", {"nats.conf": conf, "ca.crt": ca.cert, "server.crt": nats_cert.cert,
                              "server.key": nats_cert.key})
        self._folder("postgres", {"password": pg_password})
        for service in SERVICES:
            if service.bus.per_agent:
                continue
            client = self._issued(f"client-{service.name}", ca)
            files: dict[str, str | bytes] = {
                secret_file("nats_password"): bus[service.bus_user()], "ca.crt": ca.cert,
                "client.crt": client.cert, "client.key": client.key}
            if service.postgres:
                files[secret_file("database_password")] = pg_password
            files.update({secret_file(k): keys[k] for k in KEYS_FOR.get(service.name, ())})
            if service.http:
                files.update({"https.crt": api_cert.cert, "https.key": api_cert.key})
            self._folder(service.name, files)
        self._folder("migrate", {secret_file("database_password"): pg_password,
                                 FIRST_ADMIN: self._first_admin(keys["token_key"])})
        for agent in agents:
            self._issued(f"client-{agent_user(agent)}", ca)
        return self.said

    def _first_admin(self, token_key: str) -> str:
        """The first admin token's record for the migrate step, which seeds it into an empty
        database: its hash and prefix only (the secret stays in state/)."""
        path = self.state / "admin_token"
        if not path.exists():
            self.said.new_admin_token = self._value("admin_token", make=new_token())
        token = path.read_text()
        return json.dumps({"name": "admin", "prefix": display_prefix(token),
                           "hash": hash_token(token, token_key.encode())})

    # --- what an operator asks for -----------------------------------------------------------

    def admin_token(self) -> str:
        path = self.state / "admin_token"
        if not path.exists():
            raise FileNotFoundError("no admin token yet: run `greyhound deploy init` first")
        return path.read_text()

    def node_bundle(self, agent_id: str) -> bytes:
        """A training node's credentials as a tar (its agent's bus user, added if new, with its
        password and client certificate, the CA, and ``agent.env``); the NATS configuration is
        rewritten with the new user, which the running server reads on SIGHUP."""
        user = agent_user(agent_id)
        self.init(extra_agents=(agent_id,))
        bus = json.loads((self.state / "bus.json").read_text())
        names = self.settings.nats_names()
        env = (f"GREYHOUND_AGENT_ID={agent_id}\n"
               f"GREYHOUND_NATS_URL=tls://{names[0] if names else 'nats'}:"
               f"{self.settings.nats_port}\n")
        files = {"agent.env": env.encode(), secret_file("nats_password"): bus[user].encode(),
                 "ca.crt": (self.state / "ca.crt").read_bytes(),
                 "client.crt": (self.state / f"client-{user}.crt").read_bytes(),
                 "client.key": (self.state / f"client-{user}.key").read_bytes()}
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o600
                info.uid, info.gid = os.getuid(), os.getgid()
                tar.addfile(info, io.BytesIO(data))
        return out.getvalue()

    def rotate(self, what: Rotatable) -> Said:
        """Forget ``what`` and make it anew: every bus password, the CA and every certificate,
        or the token key (every API token then stops working)."""
        doomed = {"bus": ["bus.json"], "token-key": ["token_key"],
                  "tls": [p.name for p in self.state.glob("*.crt")]
                  + [p.name for p in self.state.glob("*.key")]}[what]
        bus = self.state / "bus.json"
        users = json.loads(bus.read_text()) if bus.exists() else {}
        agents = tuple(a for a in map(agent_of_user, users) if a is not None)
        for name in doomed:
            (self.state / name).unlink(missing_ok=True)
        return self.init(extra_agents=agents)
