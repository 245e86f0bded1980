"""The one place trainlift starts a subprocess.

`run` gathers facts: a missing tool or a command that runs past its timeout is a
result, not an exception, so callers that gather facts record it and carry on.

`check` acts: a missing tool, a timeout or a non-zero exit becomes an error that
names the command (secrets redacted), its exit status and the tail of its stderr;
a missing tool's error says how to install it. Only failures known to be
transient (an API server still starting, throttling, a dropped connection) are
retried. `redact` is how every command line is shown or logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from trainlift.errors import TrainliftError
from trainlift.redact import uri_credentials

log = logging.getLogger("trainlift.ops")

INSTALL = {
    "eksctl": "install eksctl: https://eksctl.io/installation/",
    "helm": "install Helm 3: https://helm.sh/docs/intro/install/",
    "kubectl": "install kubectl: https://kubernetes.io/docs/tasks/tools/",
    "aws": "install the AWS CLI v2: https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html",
}

# Failures that a retry can fix; anything else is reported at once.
TRANSIENT = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"connection refused",
    r"connection reset by peer",
    r"i/o timeout",
    r"TLS handshake timeout",
    r"unable to connect to the server",
    r"the server is currently unable to handle the request",
    r"etcdserver: request timed out",
    r"net/http: request canceled",
    r"Throttling|Rate exceeded|RequestLimitExceeded|TooManyRequests",
    r"no matching resources found",
    r"context deadline exceeded",
    r"failed calling webhook",
))

STDERR_TAIL = 800


@dataclass(frozen=True)
class Completed:
    cmd: tuple[str, ...]
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    absent: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class ToolMissing(TrainliftError):
    """A command-line tool trainlift drives is not on PATH."""

    def __init__(self, tool: str):
        super().__init__(f"{tool} not found on PATH", hint=INSTALL.get(tool, f"install {tool}"))
        self.tool = tool


class CommandFailed(TrainliftError):
    """A command exited non-zero or ran past its timeout; the message carries its stderr."""

    def __init__(self, result: Completed, timeout: float):
        shown = display(result.cmd)
        if result.timed_out:
            message = f"`{shown}` ran past its {timeout:g} s timeout"
        else:
            message = f"`{shown}` exited {result.returncode}"
        tail = _tail(result.stderr or result.stdout)
        super().__init__(f"{message}: {tail}" if tail else message)
        self.result = result


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Completed:
    """Run `cmd` without a shell and capture its text output."""
    argv = tuple(cmd)
    _log_command(argv)
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=None if env is None else {**os.environ, **env},
            stdin=subprocess.DEVNULL,
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        return Completed(argv, None, stderr=str(exc), absent=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Completed(argv, None, stdout=out, stderr=err, timed_out=True)
    return Completed(argv, proc.returncode, proc.stdout, proc.stderr)


def stream(cmd: Sequence[str], timeout: float, echo: Callable[[str], None],
           env: dict[str, str] | None = None) -> Completed:
    """Like `run`, for long commands: each output line goes to `echo` as it comes (stderr merged)."""
    argv = tuple(cmd)
    _log_command(argv)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=None if env is None else {**os.environ, **env}, stdin=subprocess.DEVNULL,
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        return Completed(argv, None, stderr=str(exc), absent=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        text = "".join(lines)
        return Completed(argv, None, text, text, timed_out=True)
    reader.join(5)
    text = "".join(lines)
    return Completed(argv, proc.returncode, text, text)


def is_transient(result: Completed) -> bool:
    text = result.stderr + "\n" + result.stdout
    return not result.absent and any(p.search(text) for p in TRANSIENT)


def check(
    cmd: Sequence[str],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    attempts: int = 3,
    backoff_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    echo: Callable[[str], None] | None = None,
) -> Completed:
    """Run `cmd` and return its result only when it succeeded; retry transient failures.

    With `echo`, output lines are passed on as they come (for commands that take minutes).
    """
    for attempt in range(1, attempts + 1):
        result = run(list(cmd), timeout, env) if echo is None else stream(cmd, timeout, echo, env)
        if result.ok:
            return result
        if result.absent:
            raise ToolMissing(os.path.basename(cmd[0]))
        if result.timed_out or attempt == attempts or not is_transient(result):
            raise CommandFailed(result, timeout)
        log.info("transient failure of `%s` (attempt %d of %d): %s", display(cmd), attempt, attempts,
                 _tail(result.stderr, 200))
        sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


class Background:
    """A long-running helper process (a port-forward) that lives for a `with` block."""

    def __init__(self, cmd: Sequence[str]):
        self.cmd = tuple(cmd)
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise ToolMissing(os.path.basename(self.cmd[0])) from exc
        _log_command(self.cmd, background=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> str:
        """Stop the process; its stderr so far comes back."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read() if self.proc.stderr else ""

    def __enter__(self) -> "Background":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set while the block runs, as it was afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn_detached(cmd: Sequence[str], log_path: str, env: dict[str, str] | None = None,
                   inherit_env: bool = True) -> subprocess.Popen:
    """Start a process that outlives this one, in its own session (so its whole group can be ended), with
    stdout and stderr appended to `log_path`. `env` adds to this process's environment, or with
    `inherit_env=False` is the whole of it."""
    _log_command(tuple(cmd), background=True)
    if env is not None and inherit_env:
        env = {**os.environ, **env}
    with open(log_path, "ab") as out:
        try:
            return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        except (FileNotFoundError, PermissionError) as exc:
            raise ToolMissing(os.path.basename(cmd[0])) from exc


def missing_tools(tools: Iterable[str]) -> list[str]:
    from shutil import which

    return [t for t in tools if which(t) is None]


# --- redaction -------------------------------------------------------------------------------

MASK = "***"
_SECRET_FLAG = re.compile(r"(token|password|passwd|secret|credential|api-?key|access-?key|private-?key)", re.I)


def _secret(name: str, value: str) -> bool:
    from trainlift.render.rules import looks_secret

    return looks_secret(name.replace("-", "_").replace(".", "_"), value)


def _redact_assignment(token: str) -> str:
    """`KEY=VALUE` (an env assignment, --from-literal, --set) with a secret-looking key or value."""
    key, _, value = token.partition("=")
    return f"{key}={MASK}" if _secret(key.rsplit(".", 1)[-1], value) else token


def redact(cmd: Sequence[str]) -> list[str]:
    """The command with values of secret-looking flags, assignments and tokens masked, and the credentials of
    every URI in it (`https://user:pw@host` shows as `https://***@host`)."""
    return [uri_credentials(token) for token in _redact_secrets(cmd)]


def _redact_secrets(cmd: Sequence[str]) -> list[str]:
    out: list[str] = []
    mask_next = False
    for token in cmd:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        if token.startswith("--") and "=" in token:
            flag, _, value = token.partition("=")
            if _SECRET_FLAG.search(flag):
                out.append(f"{flag}={MASK}")
            elif "=" in value:
                out.append(f"{flag}={_redact_assignment(value)}")
            else:
                out.append(token if not _secret("", value) else f"{flag}={MASK}")
            continue
        if token.startswith("-") and _SECRET_FLAG.search(token):
            out.append(token)
            mask_next = True
            continue
        if "=" in token and not token.startswith("-"):
            out.append(_redact_assignment(token))
            continue
        out.append(MASK if _secret("", token) else token)
    return out


def _log_command(cmd: Sequence[str], background: bool = False) -> None:
    """The command at debug level; formatted (which loads the secret rules) only when someone listens."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("$ %s%s", display(cmd), " &" if background else "")


def display(cmd: Sequence[str]) -> str:
    """A copy-pasteable, redacted command line."""
    return shlex.join(redact(cmd))


def _tail(text: str, limit: int = STDERR_TAIL) -> str:
    """A command's output in one line, with the credentials of any URI it echoed masked."""
    text = uri_credentials(" ".join(line.strip() for line in text.strip().splitlines() if line.strip()))
    return text if len(text) <= limit else "…" + text[-limit:]
