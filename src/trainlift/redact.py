"""Masking what must not be printed or stored, and the one refusal of a URI that carries credentials."""

from __future__ import annotations

import re

from trainlift.errors import UsageError

# A URI's userinfo: everything between :// and the last @ before the host ends (a password may hold an @).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)?://(?P<userinfo>[^/?#\s\"'<>]*)@")

URI_CREDENTIALS = "the URI holds credentials, which would be shown wherever it is passed"
URI_CREDENTIALS_FIX = ("drop user:password@ and give the job its credentials through the environment, from a "
                       "Kubernetes Secret on a cluster; for MLflow: MLFLOW_TRACKING_USERNAME/_PASSWORD (or _TOKEN) "
                       "and run.mlflow_secret")


def _is_credential(match: re.Match) -> bool:
    """user:password@ or token@; a bare user of ssh (git+ssh://git@github.com) names an account, not a secret."""
    return ":" in match["userinfo"] or not (match["scheme"] or "").lower().endswith("ssh")


def uri_credentials(text: str) -> str:
    """URIs with user:password@ (or token@) lose the credentials."""
    return _USERINFO.sub(lambda m: f"{m['scheme'] or ''}://***@" if _is_credential(m) else m[0], text)


def has_uri_credentials(text: str) -> bool:
    """Whether the text holds a URI with user:password@ (or a token@) in it."""
    return any(_is_credential(m) for m in _USERINFO.finditer(text))


def refuse_uri_credentials(where: str, text: str) -> None:
    """One line naming `where` (a flag, a field) when `text` holds a credentialed URI; the value is not echoed."""
    if has_uri_credentials(text):
        raise UsageError(f"{where}: {URI_CREDENTIALS}", hint=URI_CREDENTIALS_FIX)
