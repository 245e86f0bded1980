"""What the training workers call before they train: this machine's stack, and the NCCL log verdict."""

from __future__ import annotations

from trainlift.doctor.nccl_log import LogVerdict, classify_log_text
from trainlift.doctor.probe import probe
from trainlift.doctor.rules import Finding, stack_rules


def stack_findings(expect_fabric: str = "any") -> list[Finding]:
    """Probe this process's machine and judge it; `expect_fabric` is efa, socket or any."""
    return stack_rules(probe(), expect_fabric)


__all__ = ["Finding", "LogVerdict", "classify_log_text", "stack_findings"]
