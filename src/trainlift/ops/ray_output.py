"""Where what Ray and the libraries print goes during a run: every line into the run's log file, none onto the
console unless `--verbose` (trainlift's own lines from the workers excepted), and the last warning Ray gave kept
to explain a failure.

Two streams carry those lines to the driver: its own loggers (`ray`, Python warnings) and the workers' stdout and
stderr, which Ray forwards to the driver through a handler list in a private module:

| private symbol | checked with Ray | without it |
| --- | --- | --- |
| `ray._private.ray_logging.global_worker_stdstream_dispatcher` (`add_handler`, `remove_handler`) | 2.58, 2.60 | workers' lines stay in Ray's session logs (not forwarded) |
| its `handlers` list and the name of Ray's own printer in it, `ray_print_logs` | 2.58, 2.60 | idem |
| `ray._private.worker.print_to_stdstream`, which also prints the raylet's notices (a worker died) | 2.58, 2.60 | those notices reach the console, not the log |
"""

from __future__ import annotations

import collections
import io
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from trainlift.home import trainlift_home
from trainlift.rundir import open_local

RAY_PRINT_HANDLER = "ray_print_logs"
OWN_HANDLER = "trainlift_run_log"
OWN_PREFIX = "trainlift:"  # what the recipe prints for the user: shown even when the rest is quiet
DRIVER_LOGGERS = ("ray", "py.warnings")
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
# Ray's log format (`2026-12-06 01:02:03,456 WARNING file.py:12 -- text`), and the raylet's notices of a worker's
# death (which carry no level).
_RAY_WARNING = re.compile(r"\b(?P<level>WARNING|ERROR|CRITICAL)\b\s+\S+\.py:\d+ -- (?P<text>.*)")
_WORKER_DIED = re.compile(r"(A worker died or was killed.*|.*\bout of memory\b.*|.*\bOOM\b.*)", re.I)
SHOWN_CHARS = 240
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def dispatcher():
    """Ray's list of handlers for forwarded worker output, or None where this Ray has no such list."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    has_api = hasattr(global_worker_stdstream_dispatcher, "add_handler") and hasattr(
        global_worker_stdstream_dispatcher, "remove_handler")
    return global_worker_stdstream_dispatcher if has_api else None


def forwards_worker_lines() -> bool:
    """Whether `ray.init(log_to_driver=True)` is safe to ask for: its lines can be taken off the console."""
    return dispatcher() is not None


def ray_warning(line: str) -> str | None:
    """The text of a Ray WARNING/ERROR log line or a worker-death notice; None for any other line."""
    match = _RAY_WARNING.search(line)
    if match:
        return match["text"].strip()
    died = _WORKER_DIED.search(line)
    return died.group(0).strip() if died and "trainlift" not in line else None


class RunOutput:
    """Context manager around a run. `attach_workers()` once Ray is up; `warning_since(t)` for a failure."""

    def __init__(self, log_path: Path, verbose: bool):
        self.log_path, self.verbose = log_path, verbose
        self.recent: collections.deque[tuple[float, str]] = collections.deque(maxlen=20)
        self._muted: list[logging.Handler] = []
        self._loggers: list[logging.Logger] = []
        self._saved_env: dict[str, str | None] = {}
        self._file: Any = None
        self._handlers: list[logging.Handler] = []
        self._ray_printers: list[tuple[str, Any]] = []
        self._ray_notices: tuple[Any, Any] | None = None

    def __enter__(self) -> "RunOutput":
        import ray  # noqa: F401 - Ray puts its console handler on the `ray` logger when imported: mute it after

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = io.TextIOWrapper(open_local(str(self.log_path), append=True), encoding="utf-8",
                                      line_buffering=True)  # not through a link planted in the run directory
        self._file.write(f"--- trainlift run log, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}\n")
        self._handlers = [_LineHandler(self)] + ([logging.StreamHandler(sys.stderr)] if self.verbose else [])
        logging.captureWarnings(True)  # Python warnings become records of the `py.warnings` logger
        for name in DRIVER_LOGGERS:
            logger = logging.getLogger(name)
            if not self.verbose:
                self._mute_console(logger)
            for handler in self._handlers if name == "py.warnings" else self._handlers[:1]:
                logger.addHandler(handler)
            self._loggers.append(logger)
        if not self.verbose:
            self._quiet_libraries()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach_workers()
        for logger in self._loggers:
            for handler in self._handlers:
                logger.removeHandler(handler)
        for handler in self._muted:
            handler.removeFilter(_mute)
        logging.captureWarnings(False)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._file.close()

    def _mute_console(self, logger: logging.Logger) -> None:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.addFilter(_mute)
                self._muted.append(handler)

    def _quiet_libraries(self) -> None:
        """Progress bars and advisories of the Hugging Face libraries off, here and in the workers (which inherit
        the driver's environment on a local Ray)."""
        for key, value in QUIET_ENV.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ.setdefault(key, value)
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()

    def attach_workers(self) -> None:
        """Take the workers' forwarded lines off Ray's console printer and into the log (and, verbose, onto
        stderr without colour). Ray must be up, started with log_to_driver where `forwards_worker_lines()`."""
        lines = dispatcher()
        if lines is None:
            self.write("this Ray has no forwarded-output handlers; workers' lines stay in Ray's session logs")
            return
        lines.remove_handler(OWN_HANDLER)
        self._ray_printers = [pair for pair in getattr(lines, "handlers", []) if pair[0] == RAY_PRINT_HANDLER]
        lines.remove_handler(RAY_PRINT_HANDLER)  # it colours every line, terminal or not; verbose prints plain
        lines.add_handler(OWN_HANDLER, self._worker_batch)
        worker_module = sys.modules.get("ray._private.worker")
        if worker_module is not None and hasattr(worker_module, "print_to_stdstream"):
            self._ray_notices = (worker_module, worker_module.print_to_stdstream)
            worker_module.print_to_stdstream = lambda data, ignore_prefix=False: self._worker_batch(data)

    def detach_workers(self) -> None:
        """Our handler off, Ray's printer back (a Ray instance that outlives the run prints as before)."""
        lines = dispatcher()
        if lines is None:
            return
        lines.remove_handler(OWN_HANDLER)
        for name, handler in self._ray_printers:
            lines.add_handler(name, handler)
        self._ray_printers = []
        if self._ray_notices is not None:
            module, printer = self._ray_notices
            module.print_to_stdstream = printer
            self._ray_notices = None

    def _worker_batch(self, data: dict) -> None:
        pid = data.get("pid")
        if pid in ("raylet", "autoscaler"):
            prefix = f"({pid}) "
        else:
            prefix = f"({data.get('actor_name') or data.get('task_name') or 'worker'} pid={pid}, {data.get('ip')}) "
        for line in data.get("lines", []):
            self.write(prefix + line)
            self.remember(line)
            if self.verbose:
                print(prefix + line, file=sys.stderr, flush=True)
            elif line.startswith(OWN_PREFIX):
                print(line, file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        """A line into driver.log, without the colour codes Ray and the workers' loggers put in for a terminal."""
        if self._file is not None and not self._file.closed:
            self._file.write(_ANSI.sub("", line.rstrip("\n")) + "\n")

    def remember(self, line: str) -> None:
        text = ray_warning(line)
        if text:
            self.recent.append((time.time(), text))

    def warning_since(self, since: float) -> str | None:
        """The last Ray warning or error after `since`: its first sentence, on one line."""
        found = [text for at, text in self.recent if at >= since]
        if not found:
            return None
        text = " ".join(found[-1].split())
        first = re.match(r".{30,}?[.!?](?= |$)", text)
        text = first.group(0) if first else text
        return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


def _mute(record: logging.LogRecord) -> bool:
    return False


class _LineHandler(logging.Handler):
    """Driver log records into the run log, Ray's warnings remembered."""

    def __init__(self, output: RunOutput):
        super().__init__(logging.DEBUG)
        self.output = output
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.output.write(self.format(record))
        if record.levelno >= logging.WARNING and record.name.startswith("ray"):
            self.output.recent.append((record.created, " ".join(record.getMessage().split())))


# A line Ray wrote: a forwarded worker or raylet line (ours or Ray's own, coloured, prefix) or a Ray log record.
_RAY_LINE = re.compile(r"^(\x1b\[\d+m)?\((raylet|autoscaler|[\w.:-]+ pid=[^)]*)\)|"
                       r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+\s+(DEBUG|INFO|WARNING|ERROR)\b")


def is_ray_line(line: str) -> bool:
    return bool(_RAY_LINE.match(line))


def in_ray_job() -> bool:
    """Whether this process is a Ray job's entrypoint, whose output Ray keeps as the job's log."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def home_log_path(name: str) -> Path:
    return trainlift_home() / "logs" / f"{name}.log"


def run_log_path(run_uri: str, run_name: str) -> Path:
    """<run dir>/driver.log for a run on a local disk; for object storage, $TRAINLIFT_HOME/logs/<run name>.log."""
    if "://" not in run_uri or run_uri.startswith("file://"):
        return Path(run_uri.removeprefix("file://")) / "driver.log"
    return home_log_path(run_name)
