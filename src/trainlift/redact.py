"""Masking what must not be printed or stored."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(://)[^/@\s]+@")


def uri_credentials(text: str) -> str:
    """URIs with user:password@ lose the credentials."""
    return _USERINFO.sub(r"\1***@", text)


def has_uri_credentials(text: str) -> bool:
    """Whether the text holds a URI with user:password@ (or a token@) in it."""
    return bool(_USERINFO.search(text))
