"""`trainlift estimate` and `submit --cluster` on the examples: what a user reads before renting GPUs.

The model shapes come from examples/model-configs/ (the hub's config.json files), as no hub is reachable here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift import catalog
from trainlift.cli import app
from trainlift.errors import SpecError, UsageError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = EXAMPLES / "model-configs"
runner = CliRunner()


def estimate(*args: str):
    return runner.invoke(app, ["estimate", *args])


def test_the_reference_job_on_the_reference_cluster_fits_and_costs_both_node_groups():
    result = estimate(str(EXAMPLES / "qwen2.5-1.5b-eks.yaml"), "--cluster", str(EXAMPLES / "cluster-reference.yaml"),
                      "--model-config", str(CONFIGS / "qwen2.5-1.5b.json"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is True and data["workers"] == 8 and data["device"] == "cuda"
    region = yaml.safe_load((EXAMPLES / "cluster-reference.yaml").read_text()).get("region", "us-east-2")
    g6, system = catalog.on_demand_price("g6.12xlarge", region), catalog.on_demand_price("m7i.xlarge", region)
    assert data["usd_per_hour"] == pytest.approx(2 * g6.usd_per_hour + system.usd_per_hour, abs=0.01)
    start_h = sum(data["start_s"].values()) / 3600
    assert data["usd_total"] == pytest.approx((data["hours"] + start_h) * data["usd_per_hour"], rel=0.01)
    assert data["start_s"]["model_staging"] == pytest.approx(2 * 1.54e9 * 8 / 10e9, rel=0.05)  # bf16 at 10 Gb/s
    assert data["flops_per_token"] / 1e9 == pytest.approx(10.3, abs=0.05)
    assert set(data["per_gpu_gib"]) == {"parameters", "gradients", "optimizer", "unsharded", "activations", "loss",
                                        "runtime", "total"}


def test_an_unpriced_cluster_names_the_instance_type_it_has_no_price_for():
    """cluster-p5.yaml's group is called h100; a price is looked up by instance type, so that is what is named, and
    a Capacity Block group says why no on-demand price applies instead of suggesting --live."""
    result = estimate(str(EXAMPLES / "qwen2.5-1.5b-eks.yaml"), "--cluster", str(EXAMPLES / "cluster-p5.yaml"),
                      "--model-config", str(CONFIGS / "qwen2.5-1.5b.json"))
    assert result.exit_code == 0, result.output
    assert "p5.48xlarge: a Capacity Block is paid for when bought, at its own rate, not on demand" in result.output and "h100" not in result.output
    data = yaml.safe_load((EXAMPLES / "cluster-p5.yaml").read_text())
    data["workers"][0].pop("capacity_reservation_id", None)
    data["workers"][0].pop("capacity_block", None)


def test_a_70b_job_does_not_fit_one_p5_says_what_would_and_fits_four():
    """The 70B example as a full fine-tune (the example itself trains LoRA adapters)."""
    spec, config = str(EXAMPLES / "llama-3.1-70b-eks.yaml"), str(CONFIGS / "llama-3.1-70b.json")
    full = ("--set", "model.lora=null", "--model-config", config)
    one = estimate(spec, "--instance", "p5.48xlarge", "--nodes", "1", *full)
    assert one.exit_code == 1
    assert "does not fit" in one.output and "try  " in one.output and "nodes" in one.output
    four = estimate(spec, "--instance", "p5.48xlarge", "--nodes", "4", *full, "--json")
    data = json.loads(four.output)
    assert four.exit_code == 0 and data["fits"] and data["workers"] == 32
    assert data["usd_per_hour"] == pytest.approx(4 * catalog.on_demand_price("p5.48xlarge", "us-east-1").usd_per_hour)


def test_without_hardware_it_estimates_the_local_cpu_run_per_worker():
    result = estimate(str(EXAMPLES / "tiny-local.yaml"), "--json")
    data = json.loads(result.output)
    assert data["device"] == "cpu" and data["gpu_gib"] is None and data["hours"] is None
    assert data["host_gib_per_worker"] > 0 and data["per_gpu_gib"]["runtime"] == pytest.approx(0.444)


def test_submit_to_a_cluster_refuses_a_job_that_does_not_fit_before_anything_is_uploaded(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text('{"text": "x"}\n')
    spec = {"model": {"config": str(CONFIGS / "llama-3.1-70b.json"), "tokenizer": "t"},
            "data": {"train": "data/t.jsonl", "format": "text", "seq_len": 8192}, "train": {"micro_batch_size": 2},
            "scaling": {"workers": "auto"}, "run": {"storage": "s3://my-trainlift-checkpoints/ray-train"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    args = ["submit", str(tmp_path / "job.yaml"), "--cluster", str(EXAMPLES / "cluster-reference.yaml"),
            "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path), "--detach"]
    refused = runner.invoke(app, args)
    assert isinstance(refused.exception, UsageError), refused.output
    assert refused.exception.message.startswith("the job does not fit 2x g6.12xlarge (8x L4)")
    assert "estimate: DOES NOT FIT" in refused.output
    forced = runner.invoke(app, [*args, "--force"])
    # Past the estimate, the submit goes on to the (absent) cluster.
    assert not isinstance(forced.exception, UsageError) or "does not fit" not in forced.exception.message


def test_submit_to_a_cluster_refuses_a_shard_degree_its_nodes_cannot_hold(tmp_path):
    """3x p5.48xlarge (8 GPUs each), 24 workers as 2 replicas x 12 shards: a shard group would straddle nodes
    unevenly. `submit --cluster` says so in one line before anything is uploaded (the workers would only find out
    once placed)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text('{"text": "x"}\n')
    cluster = yaml.safe_load((EXAMPLES / "cluster-p5.yaml").read_text())
    cluster["workers"][0]["count"] = 3
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    spec = {"model": {"config": str(CONFIGS / "llama-3.1-8b.json"), "tokenizer": "t"},
            "data": {"train": "data/t.jsonl", "format": "text", "seq_len": 2048},
            "scaling": {"workers": 24}, "parallel": {"replicate": 2, "shard": 12},
            "run": {"storage": "s3://my-trainlift-checkpoints/ray-train"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    refused = runner.invoke(app, ["submit", str(tmp_path / "job.yaml"), "--cluster", str(tmp_path / "cluster.yaml"),
                                  "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path), "--detach"])
    assert isinstance(refused.exception, UsageError | SpecError), refused.output
    assert refused.exception.message == "parallel.shard: 12 does not divide the workers of a node (8 per node)"
