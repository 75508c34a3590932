"""A loopback TCP proxy in front of Postgres, so a test can take the database away and back.

Stopping the proxy closes its port and cuts every connection through it, as a database restart
or a network partition does; starting it again listens on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import parse_qs, urlsplit


class PgProxy:
    def __init__(self, db_url: str) -> None:
        parts = urlsplit(db_url)
        self._db = parts.path.lstrip("/")
        self._user = parts.username or "postgres"
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        self._target_port = parts.port or 5432
        self._unix = f"{socket_dir}/.s.PGSQL.{self._target_port}" if socket_dir else None
        self._target_host = parts.hostname or "127.0.0.1"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self._user}@127.0.0.1:{self.port}/{self._db}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()
        self._server = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._unix is not None:
                up_r, up_w = await asyncio.open_unix_connection(self._unix)
            else:
                up_r, up_w = await asyncio.open_connection(self._target_host, self._target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._writers.discard(writer)
