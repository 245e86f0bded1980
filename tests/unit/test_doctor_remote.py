"""`doctor --address http://HEAD:8265` reads the report of its probe job back from the job's log."""

import json

from trainlift.doctor.remote import doctor_entrypoint, report_from_logs


def test_the_report_of_a_doctor_job_is_read_back_from_among_rays_log_lines():
    report = {"address": "auto", "nodes": [{"name": "10.0.0.5/ab12cd34 (head)", "facts": {"python": "3.13.5"}}],
              "differences": {}, "findings": [{"rule": "ray", "severity": "ok", "message": "Ray 2.58.0"}], "ok": True}
    logs = "\n".join([
        "2026-12-05 10:00:01,123\tINFO job_manager.py:530 -- Runtime env is setting up.",
        "2026-12-05 10:00:09,456\tINFO worker.py:1832 -- Connecting to existing Ray cluster at address: 10.0.0.5:6379...",
        json.dumps({"not": "the report"}, indent=2),
        json.dumps(report, indent=2, sort_keys=True),
        "2026-12-05 10:00:15,789\tINFO worker.py:2004 -- Disconnected from the Ray cluster.",
    ])
    assert report_from_logs(logs) == report
    assert report_from_logs("Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'x'") is None


def test_the_job_probes_from_inside_the_cluster():
    assert doctor_entrypoint("efa") == "python -m trainlift doctor --address auto --expect-fabric efa --json"
