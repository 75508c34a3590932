"""deploy/nats/greyhound.conf is what the generator makes from the registry, nats-server accepts
it, and compose gives every service its own user with its password from the environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.bus.server_config import add_passwords, main, password_var, render
from services.common.bus.streams import STREAMS, stream_configs
from services.common.embedded import nats_server_binary
from services.registry import SERVICES

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "deploy/nats/greyhound.conf"
EXAMPLE_AGENTS = ["node0", "node1"]


def test_the_committed_config_is_the_generated_one() -> None:
    command = "python -m services.common.bus.server_config --agent node0 --agent node1"
    assert CONF.read_text() == render(EXAMPLE_AGENTS, command=command), (
        f"regenerate it: {command} > deploy/nats/greyhound.conf")


def test_every_stream_a_service_declares_is_granted() -> None:
    """A stream missing from STREAMS is refused to every service that declares the streams on
    start, so ``greyhound up`` with the embedded (authenticating) NATS dies at once."""
    from services.common.settings import Settings

    assert {c.name for c in stream_configs(Settings())} == set(STREAMS)
    for name in STREAMS:
        assert f'"$JS.API.STREAM.CREATE.{name}"' in CONF.read_text(), name


def test_nats_server_accepts_it_with_passwords_from_its_environment(tmp_path: Path) -> None:
    conf = tmp_path / "g.conf"
    conf.write_text(CONF.read_text().replace('"/data"', f'"{tmp_path / "js"}"'))
    users = [s.bus_user() for s in SERVICES if not s.bus.per_agent]
    env = {**os.environ, **{password_var(u): "pw" for u in
                            (*users, "agent-node0", "agent-node1")}}
    ok = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], env=env,
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    text = CONF.read_text()
    assert "no_auth_user" not in text and '"password": "' not in text  # no secret in it


def test_compose_gives_each_service_its_own_user() -> None:
    """Each central service connects as itself, its password a file in its own folder of the
    init volume (never in its environment, where docker inspect shows it)."""
    compose: dict[str, Any] = yaml.safe_load((REPO / "deploy/compose.yaml").read_text())
    services = compose["services"]
    nats = services["nats"]
    assert nats["command"] == ["-c", "/etc/nats/greyhound/nats.conf"]
    assert {"type": "volume", "source": "deploy", "target": "/etc/nats/greyhound",
            "read_only": True, "volume": {"subpath": "nats"}} in nats["volumes"]
    for s in SERVICES:
        env = services[s.name]["environment"]
        assert not any("PASSWORD" in k for k in env), f"{s.name}: a password in its environment"
        if s.bus.per_agent:
            assert env["GREYHOUND_NATS_USER"] == "agent-${GREYHOUND_AGENT_ID:-}"
            assert "--agent-id" in services[s.name]["command"]
            continue
        assert env["GREYHOUND_NATS_USER"] == s.name
        (own,) = [v for v in services[s.name]["volumes"] if isinstance(v, dict)]
        assert own["volume"] == {"subpath": s.name} and own["read_only"] is True
        assert env["GREYHOUND_SECRETS_DIR"] == own["target"]


def test_passwords_are_added_once_and_kept_private(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    env = tmp_path / ".env"
    assert main(["--agent", "n1", "--env-file", str(env)]) == 0
    first = env.read_text()
    assert env.stat().st_mode & 0o777 == 0o600
    assert f"{password_var('agent-n1')}=" in first and f"{password_var('tracker')}=" in first
    assert add_passwords(env, ["tracker", "agent-n2"]) == ["agent-n2"]
    assert env.read_text().startswith(first)  # existing passwords are never replaced
    assert "agent-n1" in capsys.readouterr().out


def test_users_that_would_share_a_password_variable_are_refused() -> None:
    with pytest.raises(ValueError, match="share"):
        render(["a-b", "a_b"])
