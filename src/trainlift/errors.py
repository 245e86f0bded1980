"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class TrainliftError(Exception):
    """A failure with a message for the user and, where one exists, a fix."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        from trainlift.redact import mask  # what an error says is shown: never a credential it came across

        message, hint = mask(message), None if hint is None else mask(hint)
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(TrainliftError):
    """Bad input: a spec, a flag, a file. Exit code 2, like a usage error."""

    exit_code = 2


class SpecError(UsageError):
    """A spec field that is wrong; the message starts with the field path."""
