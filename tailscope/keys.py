"""Secrets the gateway is started with, checked and kept out of sight.

A deployment file that ships a placeholder key (``REPLACE-ME``) is applied as it is more often
than anyone admits, and a public admin key reads every prompt through ``/debug/query``; so a
key that is short or reads like a placeholder is refused at start, not warned about.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MIN_KEY_CHARS = 16
# words that mark a value somebody meant to replace
_PLACEHOLDER = re.compile(r"replace|change-?me|placeholder|example|your[-_ ]|xxxx|<|>",
                          re.IGNORECASE)


def check_key(name: str, value: str | None) -> None:
    """``ValueError`` naming ``name`` when ``value`` is set but short or a placeholder."""
    if not value:
        return
    if _PLACEHOLDER.search(value):
        raise ValueError(f"{name} is a placeholder ({value[:4]}...): set a real secret, e.g. "
                         "`openssl rand -hex 32`")
    if len(value) < MIN_KEY_CHARS:
        raise ValueError(f"{name} has {len(value)} characters: a key needs at least "
                         f"{MIN_KEY_CHARS} (e.g. `openssl rand -hex 32`)")


def redact_url(url: str) -> str:
    """``url`` without a password in its userinfo (``user:***@host``); unchanged otherwise."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None and "@" not in parts.netloc:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}" if user else f"***@{host}"))
