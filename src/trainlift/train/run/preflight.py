"""Checks a worker runs before it trains: the software stack, then the NCCL transport actually chosen."""

from __future__ import annotations

from trainlift.doctor.nccl_log import classify_log_text
from trainlift.doctor.probe import own_nccl_log, probe
from trainlift.doctor.rules import stack_rules


class PreflightError(RuntimeError):
    """The worker's environment cannot run this job as specified."""


def check_stack(expect_fabric: str) -> None:
    errors = [f for f in stack_rules(probe(), expect_fabric) if f.severity == "error"]
    if errors:
        details = "; ".join(" ".join((f.message + (f" (fix: {f.fix})" if f.fix else "")).split()) for f in errors)
        raise PreflightError(f"trainlift doctor found {len(errors)} error(s) on this worker: {details}; "
                             "rerun with --skip-doctor to train anyway")


def check_transport(log_prefix: str | None, expect_fabric: str) -> str:
    """Classify this worker's NCCL log after the first collective; EFA expected but not used is fatal."""
    verdict = classify_log_text(own_nccl_log(log_prefix))
    if expect_fabric == "efa" and verdict.transport != "efa":
        evidence = " | ".join(verdict.evidence[:2]) or "no NET lines in the NCCL log"
        raise PreflightError(f"NCCL chose the {verdict.transport} transport, not EFA ({evidence}); "
                             "check the EFA device, the aws-ofi-nccl plugin and NCCL_NET (trainlift doctor)")
    return verdict.transport
