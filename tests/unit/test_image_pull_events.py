"""`cluster up` ends by saying how long each node took to pull the image, read from kubelet's `Pulled` events.

No kubelet runs here: the events are `kubectl get events -o json` objects carrying kubelet's own message text
(kubernetes pkg/kubelet/images/image_manager.go: `Successfully pulled image "IMG" in D (D including waiting).
Image size: N bytes.` and `Container image "IMG" already present on machine`), served by a `kubectl` script."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import yaml

from trainlift.config.cluster import parse_cluster_spec
from trainlift.ops.kube import go_duration_s, parse_pull_events
from trainlift.ops.apply_plan import image_pull_line
from trainlift.ops.steps import Files

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0"


def event(pod: str, node: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Event", "reason": "Pulled", "type": "Normal", "message": message,
            "involvedObject": {"kind": "Pod", "name": pod, "namespace": "ray-train"},
            "source": {"component": "kubelet", "host": node}}


EVENTS = json.dumps({"apiVersion": "v1", "kind": "List", "items": [
    event("ray-train-head-x7k2p", "ip-10-0-1-10", f'Successfully pulled image "{IMAGE}" in 4m12.381s (4m12.381s '
          "including waiting). Image size: 14862301542 bytes."),
    event("ray-train-gpu-workers-worker-abcde", "ip-10-0-2-11", f'Successfully pulled image "{IMAGE}" in '
          "5m48.07s (5m51.2s including waiting). Image size: 14862301542 bytes."),
    event("ray-train-gpu-workers-worker-fghij", "ip-10-0-2-12", f'Container image "{IMAGE}" already present on '
          "machine"),
]})


def test_kubelets_messages_are_read_into_seconds_per_node():
    pulls = parse_pull_events(EVENTS)
    assert [(p.node, p.seconds) for p in pulls] == [("ip-10-0-1-10", 252.381), ("ip-10-0-2-11", 348.07),
                                                    ("ip-10-0-2-12", None)]
    assert go_duration_s("850ms") == 0.85 and go_duration_s("1h2m3s") == 3723


def test_cluster_up_prints_the_pull_time_of_each_node(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "events.json").write_text(EVENTS)
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"#!/bin/sh\ncat {tmp_path / 'events.json'}\n")
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spec = parse_cluster_spec(yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text()))
    assert image_pull_line(spec, Files(str(tmp_path))) == (
        f"image pull: 5m48s on ip-10-0-2-11, 4m12s on ip-10-0-1-10; already on 1 node(s) ({IMAGE}, from kubelet's "
        "events)")
