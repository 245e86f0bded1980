"""The one detector of credentials in what trainlift shows, ships or is given: URIs, `--set`, `--env`, spec fields,
commands and error messages. It finds them by shape, wherever they stand in a text:

- a URI's `user:password@` (the password may hold `/ # ? "` and `@`) or `token@`;
- `NAME=VALUE` where NAME says credential (DB_PASS, PGPASS, X-Amz-Signature, AccountKey, ?token=...);
- `Bearer`/`Basic` authorization values;
- values shaped like tokens: AWS key ids and 40-character secrets, GitHub, Hugging Face, OpenAI, GitLab and Slack
  tokens, JSON web tokens, Slack webhooks.

`mask` shows each as `***`; `credential_kind` says which one a text holds, for a refusal that does not echo it.
"""

from __future__ import annotations

import re

from trainlift.errors import UsageError

MASK = "***"
# scheme://user:password@host: the password runs to the last @ that a host follows (no @ before its end).
_USER_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<user>[^\s/?#@:\"'<>]+):\S*?@"
                            r"(?=[^\s@/?#]*(?:[/?#\s\"'<>]|$))")
_USER_ONLY = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)?://(?P<user>[^\s/?#@:\"'<>]+)@")
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<value>[^\s&;,\"'<>]+)")
_AUTHORIZATION = re.compile(r"\b(?P<scheme>Bearer|Basic)\s+(?P<value>[A-Za-z0-9._~+/=-]{16,})", re.I)
_TOKENS = re.compile(
    r"(?<![A-Za-z0-9_])(?:(?:AKIA|ASIA)[0-9A-Z]{16}|github_pat_[A-Za-z0-9_]{22,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|glpat-[A-Za-z0-9_-]{20,}|xox[abeprs]-[A-Za-z0-9-]{10,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|https://hooks\.slack\.com/services/[A-Za-z0-9/]+)")
_BASE64_RUN = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "PGPASS", "PWD", "PASSPHRASE", "CREDENTIAL",
                 "CREDENTIALS", "APIKEY", "SIGNATURE", "SIG", "AUTHORIZATION"}
_KEY_QUALIFIERS = {"API", "ACCESS", "PRIVATE", "SECRET", "SIGNING", "ACCOUNT", "SHARED"}

URI_CREDENTIALS = "the URI holds credentials, which would be shown wherever it is passed"
URI_CREDENTIALS_FIX = ("drop user:password@ and give the job its credentials through the environment, from a "
                       "Kubernetes Secret on a cluster; for MLflow: MLFLOW_TRACKING_USERNAME/_PASSWORD (or _TOKEN) "
                       "and run.mlflow_secret")
CREDENTIAL = "it holds a credential (a password, token, key or signature), which would be shown wherever it is passed"
CREDENTIAL_FIX = ("give credentials through the environment of the machine or, on a cluster, a Kubernetes Secret "
                  "(the cluster spec's `secrets`), never in a spec, flag or URI")


def _words(name: str) -> list[str]:
    """A name's words, upper-cased: DB_PASS, X-Amz-Signature, AccountKey and apiKey alike."""
    return [w.upper() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)]


def secret_name(name: str) -> bool:
    """Whether a variable's, field's or parameter's name says it holds a credential."""
    words = set(_words(name))
    if words <= {"PWD", "OLD"}:  # the shell's working directory
        return False
    return bool(words & _SECRET_WORDS) or any(w.endswith(("PASSWORD", "PASSWD")) for w in words) or (
        "KEY" in words and bool(words & _KEY_QUALIFIERS))


def _aws_secret(text: str) -> bool:
    """40 characters of base64, mixed case with a digit (not a hex digest), at most three slashes (not a path)."""
    return (not text.startswith("/") and text.count("/") <= 3 and any(c.isupper() for c in text)
            and any(c.islower() for c in text) and any(c.isdigit() for c in text))


def secret_value(value: str) -> bool:
    """Whether a value, whole, is shaped like a token or key."""
    value = value.strip()
    return bool(_TOKENS.fullmatch(value)) or (bool(_BASE64_RUN.fullmatch(value)) and _aws_secret(value))


def _user_only(match: re.Match) -> bool:
    """token@ is a credential; a bare user of ssh (git+ssh://git@github.com) names an account, not a secret."""
    return not (match["scheme"] or "").lower().endswith("ssh")


def credential_kind(text: str) -> str | None:
    """"uri" when `text` holds a URI's credentials, "credential" for any other credential, None when it holds
    none."""
    if _USER_PASSWORD.search(text) or any(_user_only(m) for m in _USER_ONLY.finditer(text)):
        return "uri"
    if (any(secret_name(m["name"]) for m in _ASSIGNMENT.finditer(text)) or _AUTHORIZATION.search(text)
            or _TOKENS.search(text) or any(_aws_secret(m[0]) for m in _BASE64_RUN.finditer(text))):
        return "credential"
    return None


def has_credentials(text: str) -> bool:
    return credential_kind(text) is not None


def mask(text: str) -> str:
    """`text` with every credential in it shown as ***: `s3://***@bucket`, `AccountKey=***`, `Bearer ***`."""
    text = _USER_PASSWORD.sub(lambda m: f"{m['scheme']}://{MASK}@", text)
    text = _USER_ONLY.sub(lambda m: f"{m['scheme'] or ''}://{MASK}@" if _user_only(m) else m[0], text)
    text = _TOKENS.sub(MASK, text)
    text = _ASSIGNMENT.sub(lambda m: f"{m['name']}={MASK}" if secret_name(m["name"]) else m[0], text)
    text = _AUTHORIZATION.sub(lambda m: f"{m['scheme']} {MASK}", text)
    return _BASE64_RUN.sub(lambda m: MASK if _aws_secret(m[0]) else m[0], text)


def credential_problem(text: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) when `text` holds a credential; the text itself is not in either."""
    kind = credential_kind(text)
    if kind is None:
        return None
    return (URI_CREDENTIALS, URI_CREDENTIALS_FIX) if kind == "uri" else (CREDENTIAL, CREDENTIAL_FIX)


def refuse_credentials(where: str, text: str) -> None:
    """One line naming `where` (a flag, a field) when `text` holds a credential; the value is not echoed."""
    problem = credential_problem(text)
    if problem is not None:
        raise UsageError(f"{where}: {problem[0]}", hint=problem[1])


# The names the rest of trainlift calls them by.
uri_credentials = mask
has_uri_credentials = has_credentials
refuse_uri_credentials = refuse_credentials
