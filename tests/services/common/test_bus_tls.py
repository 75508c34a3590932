"""TLS as docs/security.md turns it on: a server with the operator's certificates (here a
throw-away CA) that verifies clients; the settings' CA, certificate and key get a service in,
and a client that does not trust the server, or has no certificate, fails at once."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.bus.auth import BusAuthError, Credentials, tls_context
from services.common.bus.client import connect
from services.common.embedded import nats_server_binary
from services.common.runtime import Backends, start_service
from services.common.settings import Settings


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          signer: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                              name)]))
         .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(signer, hashes.SHA256())


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path.with_suffix(".crt"), path.with_suffix(".key")


@dataclass
class Pki:
    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]


def _pki(d: Path) -> Pki:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "greyhound test CA")])
    ca = _cert("greyhound test CA", ca_key, ca_name, ca_key, ca=True)
    ca_crt, _ = _write(d / "ca", ca_key, ca)
    out = []
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out.append(_write(d / name, key, _cert(name, key, ca_name, ca_key, ca=False)))
    return Pki(ca_crt, out[0], out[1])


@dataclass
class TlsServer:
    url: str
    pki: Pki


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    d = tmp_path_factory.mktemp("tls")
    pki = _pki(d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = d / "nats.conf"
    conf.write_text(f"""listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{d / 'js'}" }}
tls {{ cert_file: "{pki.server[0]}", key_file: "{pki.server[1]}", ca_file: "{pki.ca}",
      verify: true, timeout: 5 }}
authorization {{ users = [ {{ user: "tracker", password: "pw" }} ] }}
""")
    log = (d / "server.log").open("wb")
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=log)
    deadline = time.monotonic() + 15
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.05)
    yield TlsServer(f"tls://127.0.0.1:{port}", pki)
    proc.terminate()
    proc.wait(10)
    log.close()


async def test_a_service_with_the_settings_ca_and_certificate_connects(tls_server: TlsServer
                                                                       ) -> None:
    pki = tls_server.pki
    settings = Settings(nats_url=tls_server.url, nats_user="tracker", nats_password="pw",
                        nats_tls_ca=pki.ca, nats_tls_cert=pki.client[0],
                        nats_tls_key=pki.client[1])
    ctx = await start_service("tls-test", settings, need_db=False, backends=Backends(
        nats_url=tls_server.url, database_url="", nats_credentials=Credentials("tracker", "pw")))
    try:
        assert ctx.nc.is_connected
        await ctx.js.account_info()
    finally:
        await ctx.close()


@pytest.mark.parametrize("how", ["untrusted server", "no client certificate"])
async def test_a_client_that_fails_the_handshake_fails_at_once(tls_server: TlsServer,
                                                               how: str) -> None:
    pki = tls_server.pki
    if how == "untrusted server":  # the system's roots do not know this CA
        tls = tls_context(None, pki.client[0], pki.client[1])
    else:
        tls = tls_context(pki.ca, None, None)
    t0 = time.monotonic()
    with pytest.raises(BusAuthError):
        await asyncio.wait_for(connect(tls_server.url, name="tls-bad", tls=tls,
                                       credentials=Credentials("tracker", "pw")), 30)
    assert time.monotonic() - t0 < 15


def test_a_certificate_needs_its_key() -> None:
    with pytest.raises(ValueError, match="go together"):
        Settings(nats_tls_cert=Path("/x.crt"))
