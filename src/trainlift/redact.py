"""Masking what must not be printed or stored."""

from __future__ import annotations

import re


def uri_credentials(text: str) -> str:
    """URIs with user:password@ lose the credentials."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", text)
