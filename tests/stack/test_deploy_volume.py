"""greyhound deploy init: everything once, private, kept on a second run; deploy/.env wins; a
certificate follows its names and its CA; a node's bundle; rotation."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from stack.deploy import pki
from stack.deploy.settings import DeploySettings
from stack.deploy.volume import DeployVolume


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_second_run_keeps_every_secret_and_all_is_private(tmp_path: Path) -> None:
    said = DeployVolume(tmp_path, DeploySettings()).init()
    assert said.new_admin_token is not None and said.new_admin_token.startswith("gh_")
    first = _files(tmp_path)
    for p in tmp_path.rglob("*"):
        assert p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600), p
    again = DeployVolume(tmp_path, DeploySettings()).init()
    assert again.made == [] and again.new_admin_token is None
    assert _files(tmp_path) == first
    # each container's folder holds its own bus password and no other's
    bus = json.loads(first["state/bus.json"])
    assert first["tracker/greyhound_nats_password"].decode() == bus["tracker"]
    assert not (tmp_path / "tracker/greyhound_token_key").exists()
    assert bus["validator"].encode() not in b"".join(
        v for k, v in first.items() if k.startswith("tracker/"))
    record = json.loads(first["migrate/first_admin.json"])
    assert said.new_admin_token not in first["migrate/first_admin.json"].decode()
    assert said.new_admin_token.startswith(record["prefix"])


def test_deploy_env_wins_and_certificates_follow_their_names(tmp_path: Path) -> None:
    DeployVolume(tmp_path, DeploySettings()).init()
    old_cert = (tmp_path / "nats/server.crt").read_bytes()
    chosen = DeploySettings(token_key="t" * 20, nats_hosts="ctl.example, 10.0.0.5")
    DeployVolume(tmp_path, chosen).init()
    assert (tmp_path / "api/greyhound_token_key").read_text() == "t" * 20
    cert = (tmp_path / "nats/server.crt").read_bytes()
    assert cert != old_cert and {"ctl.example", "10.0.0.5", "nats"} <= set(pki.server_names(cert))
    ca = pki.Issued((tmp_path / "state/ca.crt").read_bytes(), (tmp_path / "state/ca.key").read_bytes())
    assert pki.signed_by(cert, ca)


def test_a_node_bundle_and_rotation(tmp_path: Path) -> None:
    volume = DeployVolume(tmp_path, DeploySettings(nats_hosts="ctl.example", nats_port=14222))
    volume.init()
    with tarfile.open(fileobj=io.BytesIO(volume.node_bundle("n7"))) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
        assert all(m.mode == 0o600 for m in tar.getmembers())
    assert b"GREYHOUND_NATS_URL=tls://ctl.example:14222" in files["agent.env"]
    assert b'"user": "agent-n7"' in (tmp_path / "nats/nats.conf").read_bytes()
    old = dict(json.loads((tmp_path / "state/bus.json").read_text()))
    old_ca = (tmp_path / "state/ca.crt").read_bytes()
    volume.rotate("bus")
    new = json.loads((tmp_path / "state/bus.json").read_text())
    assert set(new) == set(old) and all(new[u] != old[u] for u in old)  # the node kept its user
    volume.rotate("tls")
    assert (tmp_path / "state/ca.crt").read_bytes() != old_ca
    ca = pki.Issued((tmp_path / "state/ca.crt").read_bytes(), (tmp_path / "state/ca.key").read_bytes())
    assert pki.signed_by((tmp_path / "tracker/client.crt").read_bytes(), ca)
