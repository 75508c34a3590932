"""The token and webhook keys of a data directory, for the processes that use its embedded
Postgres: made on first use, kept in ``<data dir>/keys/`` (0600 in a 0700 folder), and used
unless the environment sets ``GREYHOUND_TOKEN_KEY`` / ``GREYHOUND_WEBHOOK_KEY``.

Without them token hashes used a key written in this repository (anyone able to write the
database could add a token of their own) and ``greyhound up`` could not create a webhook until
the user exported a key by hand. A data directory whose Postgres predates these files may hold
tokens hashed with that public key: it keeps that key, with a warning at every start, rather
than silently invalidating its tokens; deleting ``keys/token_key`` moves it to a private one.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from pydantic import SecretStr

from services.common.private_file import create_private, private_dir
from services.common.settings import Settings

log = logging.getLogger(__name__)

# The key every token hash used before data directories had their own (services.api.tokens).
LEGACY_TOKEN_KEY = "greyhound-api-token-v1"
TOKEN_KEY_FILE = "token_key"
WEBHOOK_KEY_FILE = "webhook_key"


def keys_dir(data_dir: Path) -> Path:
    return data_dir / "keys"


def _predates_keys(data_dir: Path) -> bool:
    """A cluster made before any key was kept here: its tokens, if any, used the public key."""
    return (data_dir / "pg" / "PG_VERSION").exists() and not keys_dir(data_dir).exists()


def with_data_dir_keys(settings: Settings) -> Settings:
    """``settings`` with the data directory's keys where the environment sets none; unchanged
    for a process on a configured database (production passes its keys in)."""
    if settings.database_url is not None or (
            settings.token_key is not None and settings.webhook_key is not None):
        return settings
    data_dir = Path(settings.data_dir)
    legacy = _predates_keys(data_dir)
    folder = private_dir(keys_dir(data_dir))
    update: dict[str, SecretStr] = {}
    if settings.token_key is None:
        token_key = create_private(folder / TOKEN_KEY_FILE,
                                   LEGACY_TOKEN_KEY if legacy else secrets.token_urlsafe(32))
        if token_key == LEGACY_TOKEN_KEY:
            log.warning("the API tokens of %s are hashed with the public default key (the data "
                        "directory predates per-directory keys, and its tokens keep working); "
                        "to move to a private key delete %s and make new tokens with `greyhound "
                        "token create`: the old ones then stop working", data_dir,
                        folder / TOKEN_KEY_FILE)
        update["token_key"] = SecretStr(token_key)
    if settings.webhook_key is None:
        update["webhook_key"] = SecretStr(create_private(folder / WEBHOOK_KEY_FILE,
                                                         secrets.token_urlsafe(32)))
    return settings.model_copy(update=update)
