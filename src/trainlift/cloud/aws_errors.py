"""How botocore failures become user errors: credentials that are missing or rejected and endpoints that cannot be
reached are one clear line; other API errors are named by their code and message."""

from __future__ import annotations

from trainlift.errors import TrainliftError

REJECTED_CODES = {
    "AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "IncompleteSignature", "InvalidAccessKeyId", "ExpiredToken", "ExpiredTokenException", "RequestExpired",
}
CREDENTIALS_HINT = "set AWS_PROFILE, run `aws configure` or `aws sso login`, or export AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"


class CredentialsError(TrainliftError):
    """No usable AWS credentials."""


def error_code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "") or type(exc).__name__


def error_message(exc: Exception) -> str:
    response = getattr(exc, "response", {}) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0)
    text = (response.get("Error") or {}).get("Message") or str(exc)
    if status >= 500 or "<html" in text.lower() or "Unable to parse response" in text:
        return f"the endpoint failed{f' with HTTP {status}' if status else ''} (the API may not be implemented there)"
    return " ".join(text.split())[:300]


def fatal_error(exc: Exception, what: str) -> Exception | None:
    """The user-facing error for credential and connection failures; None for other API errors."""
    from botocore import exceptions as bce

    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return CredentialsError("no AWS credentials found", hint=CREDENTIALS_HINT)
    unloadable = tuple(getattr(bce, n) for n in ("TokenRetrievalError", "SSOError", "ProfileNotFound") if hasattr(bce, n))
    if isinstance(exc, unloadable):
        return CredentialsError(f"AWS credentials could not be loaded ({exc})", hint=CREDENTIALS_HINT)
    if isinstance(exc, bce.ClientError) and error_code(exc) in REJECTED_CODES:
        return CredentialsError(f"AWS rejected the credentials ({error_code(exc)}: {error_message(exc)})", hint=CREDENTIALS_HINT)
    if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ReadTimeoutError)):
        return TrainliftError(f"{what}: cannot reach AWS ({exc})", hint="check the network, the region and AWS_ENDPOINT_URL")
    return None


def is_api_error(exc: Exception) -> bool:
    from botocore import exceptions as bce
    from botocore.parsers import ResponseParserError

    return isinstance(exc, (bce.ClientError, ResponseParserError, bce.ParamValidationError))
