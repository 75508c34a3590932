"""Webhook signing secrets at rest: encrypted with a key from the settings, never in plain text.

A token can be stored as a hash because the server only ever compares it; a signing secret must
be read back to sign each delivery, so it is encrypted instead (Fernet: AES-128-CBC with an
HMAC-SHA256 tag). The Fernet key is derived with HKDF-SHA256 from ``GREYHOUND_WEBHOOK_KEY``, so
any long random string works as the setting.
"""

from __future__ import annotations

import base64

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_INFO = b"greyhound webhook signing secrets v1"


class SecretKeyError(RuntimeError):
    """The webhook key is missing or is not the one the secrets were encrypted with."""


class SecretBox:
    def __init__(self, key: str) -> None:
        if len(key) < 16:
            raise SecretKeyError("GREYHOUND_WEBHOOK_KEY must be at least 16 characters "
                                 "(use e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(key.encode())
        self._fernet = Fernet(base64.urlsafe_b64encode(raw))

    def encrypt(self, secret: str) -> str:
        return self._fernet.encrypt(secret.encode()).decode()

    def decrypt(self, token: str) -> str:
        if not token:
            raise SecretKeyError("this webhook has no stored secret (created before secrets were "
                                 "encrypted): delete it and create it again")
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken as exc:
            raise SecretKeyError("cannot decrypt a webhook secret: GREYHOUND_WEBHOOK_KEY is not "
                                 "the key it was encrypted with") from exc


def secret_box(key: str | None) -> SecretBox | None:
    return None if key is None else SecretBox(key)
