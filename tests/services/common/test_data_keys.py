"""The embedded mode's token and webhook keys: made once per data directory, private, kept;
the environment wins; a data directory older than them keeps the public key its tokens were
hashed with, and says so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.api.tokens import hash_token
from services.common.data_keys import LEGACY_TOKEN_KEY, with_data_dir_keys
from services.common.settings import Settings, get_settings


def test_a_new_data_dir_gets_private_keys_it_keeps(tmp_path: Path) -> None:
    first = with_data_dir_keys(Settings(data_dir=tmp_path))
    assert first.token_key is not None and first.webhook_key is not None
    token_key = first.token_key.get_secret_value()
    assert token_key != LEGACY_TOKEN_KEY and len(token_key) >= 32
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    for name in ("token_key", "webhook_key"):
        assert (tmp_path / "keys" / name).stat().st_mode & 0o777 == 0o600
    again = with_data_dir_keys(Settings(data_dir=tmp_path))
    assert again.token_key == first.token_key and again.webhook_key == first.webhook_key
    other = with_data_dir_keys(Settings(data_dir=tmp_path / "other"))
    assert other.token_key != first.token_key


def test_the_environment_and_a_configured_database_win(tmp_path: Path) -> None:
    mine = with_data_dir_keys(Settings(data_dir=tmp_path, token_key="k" * 20))
    assert mine.token_key is not None and mine.token_key.get_secret_value() == "k" * 20
    configured = Settings(data_dir=tmp_path / "prod", database_url="postgresql://db/x")
    assert with_data_dir_keys(configured) is configured
    assert not (tmp_path / "prod").exists()


def test_a_data_dir_older_than_its_keys_keeps_the_public_one_and_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "pg").mkdir()
    (tmp_path / "pg" / "PG_VERSION").write_text("16\n")  # a cluster made before keys existed
    old_hash = hash_token("gh_made-before", None)
    with caplog.at_level(logging.WARNING):
        settings = with_data_dir_keys(Settings(data_dir=tmp_path))
    assert settings.token_key is not None
    assert hash_token("gh_made-before", settings.token_key.get_secret_value().encode()) == old_hash
    assert "public default key" in caplog.text
    (tmp_path / "keys" / "token_key").unlink()  # the documented way to a private key
    moved = with_data_dir_keys(Settings(data_dir=tmp_path))
    assert moved.token_key is not None
    assert moved.token_key.get_secret_value() != LEGACY_TOKEN_KEY


def test_the_command_line_hands_them_to_commands_on_the_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stack.cli import _db_settings

    monkeypatch.setenv("GREYHOUND_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("GREYHOUND_DATABASE_URL", raising=False)
    monkeypatch.delenv("GREYHOUND_WEBHOOK_KEY", raising=False)
    get_settings.cache_clear()
    try:
        assert _db_settings().webhook_key is not None
    finally:
        get_settings.cache_clear()
