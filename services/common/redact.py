"""Credentials out of everything we print or log: one helper for URLs and the text around them.

Operators set ``GREYHOUND_NATS_URL=nats://user:password@host:4222`` and
``GREYHOUND_DATABASE_URL=postgresql://user:password@host/db``; a settings error, a start-up log
line or an exception message that repeats such a URL hands the password to whoever reads the logs.
Every place that shows a URL passes it through :func:`redact` (or :func:`redact_text` for
messages that may contain one).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# userinfo of any scheme://user:secret@ or scheme://token@
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
_SECRET_PARAMS = frozenset({"password", "pass", "pwd", "token", "secret", "sslpassword",
                            "nkey", "jwt", "user_password"})
_PARAM = re.compile(r"(?P<key>\b(?:" + "|".join(sorted(_SECRET_PARAMS)) + r"))=(?P<value>[^&\s]+)",
                    re.IGNORECASE)


# Schemes whose URL may carry a lone token as its userinfo (NATS token authentication); in the
# others a lone userinfo is a user name, which is no secret.
_TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})


def _userinfo(info: str, scheme: str) -> str:
    """``user:secret`` -> ``user:***``; a lone NATS ``token`` -> ``***``; a lone user stays."""
    user, sep, _ = info.partition(":")
    if sep:
        return f"{user}:{MASK}"
    return MASK if scheme.lower().rstrip(":/") in _TOKEN_SCHEMES else info


def redact(url: str | None) -> str:
    """``url`` with its password (or token) and secret query parameters masked; "" for None.

    Anything that does not parse as a URL goes through :func:`redact_text` instead, so a
    malformed setting is still shown without what looks like a secret.
    """
    if url is None:
        return ""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            info, _, host = netloc.rpartition("@")
            netloc = f"{_userinfo(info, parts.scheme)}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs],
                              safe="*/")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return redact_text(url)


def redact_text(text: str) -> str:
    """Every URL credential and ``password=...``-style value in free text masked."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{_userinfo(m['userinfo'], m['scheme'])}@", text)
    return _PARAM.sub(lambda m: f"{m['key']}={MASK}", text)
