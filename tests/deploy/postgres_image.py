"""What the official Postgres image's entry point does with compose's variables, with
pgserver's Postgres binaries: ``initdb`` as ``POSTGRES_USER`` with the password read from
``POSTGRES_PASSWORD_FILE`` (read as root, as the entry point does before it drops to its own
user), password (scram-sha-256) authentication for every TCP connection, ``POSTGRES_DB``
created, then the server. As root the server runs as pgserver's system user (Postgres refuses
root), as it runs as ``postgres`` in the image."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pgserver
from pgserver.utils import ensure_prefix_permissions, ensure_user_exists

from tests.deploy.compose_local import Container

BIN = Path(pgserver.__file__).parent / "pginstall" / "bin"
DATA = "/var/lib/postgresql/data"


def _as_server_user() -> tuple[str | None, int | None]:
    if os.geteuid() != 0:
        return None, None
    entry = ensure_user_exists("pgserver")
    assert entry is not None
    return "pgserver", entry.pw_uid


def start(c: Container, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = c.env
    user, db = env["POSTGRES_USER"], env["POSTGRES_DB"]
    password = Path(env["POSTGRES_PASSWORD_FILE"]).read_text().strip()
    pgdata = c.path(DATA)
    run_as, uid = _as_server_user()
    c.rootfs.mkdir(parents=True, exist_ok=True)
    pwfile = c.rootfs / "pwfile"
    pwfile.write_text(password)
    if uid is not None:
        ensure_prefix_permissions(pgdata)
        for p in (pgdata, pwfile):
            os.chown(p, uid, -1)
    pgdata.chmod(0o700)
    subprocess.run([str(BIN / "initdb"), "-D", str(pgdata), "-U", user, f"--pwfile={pwfile}",
                    "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8"],
                   check=True, user=run_as, capture_output=True)
    pwfile.unlink()
    out = log.open("ab")
    proc = subprocess.Popen([str(BIN / "postgres"), "-D", str(pgdata), "-p", str(port),
                             "-c", "listen_addresses=127.0.0.1",
                             # TCP only, as the services connect: a Unix socket's path under
                             # pytest's temporary folder can pass the 107 bytes a socket may have
                             "-k", ""],
                            user=run_as, stdout=out, stderr=out, start_new_session=True)
    out.close()
    deadline = time.monotonic() + 60
    while subprocess.run([str(BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                         capture_output=True).returncode != 0:
        assert proc.poll() is None and time.monotonic() < deadline, f"postgres: see {log}"
        time.sleep(0.2)
    if db != "postgres":  # over TCP, so the password is checked as the services' will be
        subprocess.run([str(BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user,
                        db], check=True, env={**os.environ, "PGPASSWORD": password},
                       capture_output=True)
    return proc
