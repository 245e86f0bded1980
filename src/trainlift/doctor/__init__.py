"""Prove the stack and the fabric: probe facts, judge them, classify NCCL transport, time collectives."""

from trainlift.doctor.nccl_log import LogVerdict, classify_log_text
from trainlift.doctor.rules import Finding

__all__ = ["Finding", "LogVerdict", "classify_log_text"]
