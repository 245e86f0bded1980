"""What the training workers call before they train: this machine's stack, and the NCCL log verdict."""

from __future__ import annotations

import glob
import os

from trainlift.doctor.nccl_log import LogVerdict, classify_log_text
from trainlift.doctor.probe import probe
from trainlift.doctor.rules import Finding, stack_rules


def stack_findings(expect_fabric: str = "any") -> list[Finding]:
    """Probe this process's machine and judge it; `expect_fabric` is efa, socket or any."""
    return stack_rules(probe(), expect_fabric)


def own_nccl_log(prefix: str | None) -> str:
    """This process's NCCL log, written to `NCCL_DEBUG_FILE=<prefix>.%h.%p.log`; the file is removed once read."""
    if not prefix:
        return ""
    text = []
    for path in glob.glob(f"{prefix}.*.{os.getpid()}.log"):
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text.append(fh.read())
            os.unlink(path)
        except OSError:
            continue
    return "".join(text)


__all__ = ["Finding", "LogVerdict", "classify_log_text", "own_nccl_log", "stack_findings"]
