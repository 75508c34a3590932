"""Passwords never reach an error message or a log line: the settings' errors, the start-up log."""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import ValidationError

from services.common.embedded import OPERATOR
from services.common.redact import MASK, redact, redact_text
from services.common.runtime import Backends, start_service
from services.common.settings import Settings
from tests.conftest import Bus

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(("url", "shown"), [
    (f"nats://alice:{SECRET}@bus.example:4222", f"nats://alice:{MASK}@bus.example:4222"),
    (f"nats://{SECRET}@bus.example:4222", f"nats://{MASK}@bus.example:4222"),
    (f"postgresql://gh:{SECRET}@db:5432/gh?sslmode=require",
     f"postgresql://gh:{MASK}@db:5432/gh?sslmode=require"),
    (f"postgresql://db/gh?user=gh&password={SECRET}", f"postgresql://db/gh?user=gh&password={MASK}"),
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ("postgresql+asyncpg://postgres@/gh?host=/tmp/x", "postgresql+asyncpg://postgres@/gh?host=/tmp/x"),
])
def test_redact_masks_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert SECRET not in redact(url)


def test_redact_text_masks_urls_and_secret_parameters_inside_messages() -> None:
    text = (f"could not connect to postgresql://gh:{SECRET}@db/gh (password={SECRET}); "
            f"tls://{SECRET}@bus:4222 refused")
    out = redact_text(text)
    assert SECRET not in out
    assert out.count(MASK) == 3 and "postgresql://gh:" in out and "db/gh" in out


@pytest.mark.parametrize("field", ["nats_url", "database_url"])
def test_a_bad_url_setting_is_refused_without_its_password(field: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(**{field: f"mysql://root:{SECRET}@db:3306/x"})
    assert SECRET not in str(err.value)
    assert "mysql://root:" in str(err.value)  # still says which URL was wrong


def test_the_start_up_log_line_shows_no_password(bus: Bus, caplog: pytest.LogCaptureFixture) -> None:
    """The NATS URL as an operator writes it, with a user and password in it: the log line
    names the server without them."""
    host = bus.url.removeprefix("nats://")
    secret = bus.creds(OPERATOR).password
    url = f"nats://{OPERATOR}:{secret}@{host}"

    async def scenario() -> None:
        ctx = await start_service("redact-test", Settings(nats_url=url), need_db=False,
                                  backends=Backends(nats_url=url, database_url=""))
        await ctx.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert any("redact-test connected" in line and host in line for line in lines), lines
    assert not any(secret in line for line in lines)
