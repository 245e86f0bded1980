"""Every example job fits the example cluster it is written for, by the real `trainlift estimate --json`.

This runs `estimate` on every (job, cluster) example pair that the docs pair (the `estimate`, `render --job` and
`submit --cluster` commands of README.md and docs/*.md) and that the job files' headers pair (their commands and their `estimate: X of Y GiB per
GPU on CLUSTER` line), through the CLI a user runs, and asserts the estimate's own verdict and its numbers: the
per-GPU total under the GPU's memory. No Hugging Face hub is reachable here, so each job's model config.json is
replaced by the copy shipped in examples/model-configs/ (`--model-config`): the same shapes the hub serves, and the
estimate reads nothing else of a model. The pairs no example intends (a 70B job on 8 L4s) are estimated too: they may
not fit, and then estimate must say so (exit code 1, `fits: false`, changes that would fit) rather than crash, which
shows the check can fail.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift import catalog
from trainlift.cli import app
from trainlift.config.cluster import cluster_spec_from_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "model-configs"
docs_text = runpy.run_path(str(ROOT / "tests" / "docs_text.py"))["docs_text"]  # README.md and docs/*.md
runner = CliRunner()

# The shipped config.json of each hub model the examples name.
SHIPPED_CONFIGS = {"Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b.json", "meta-llama/Llama-3.1-70B": "llama-3.1-70b.json"}
INTENDED = {
    ("qwen2.5-1.5b-eks.yaml", "cluster-reference.yaml"),
    ("qwen2.5-1.5b-lora-eks.yaml", "cluster-reference.yaml"),
    ("qwen2.5-1.5b-dpo-eks.yaml", "cluster-reference.yaml"),
    ("llama-3.1-70b-eks.yaml", "cluster-p5.yaml"),
}


def _raw(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


CLUSTERS = sorted(p.name for p in EXAMPLES.glob("*.yaml") if "workers" in _raw(p.name))
JOBS = sorted(p.name for p in EXAMPLES.glob("*.yaml") if "workers" not in _raw(p.name))
CLUSTER_JOBS = sorted({job for job, _ in INTENDED})
UNINTENDED = sorted((job, cluster) for job in CLUSTER_JOBS for cluster in CLUSTERS if (job, cluster) not in INTENDED)
HEADER_ESTIMATE = re.compile(r"^# estimate: ([\d.]+) of ([\d.]+) GiB per (\w+) on (cluster-[\w.-]+\.yaml)"
                             r"(?: \((?:HSDP (\d+) x (\d+)|FSDP over (\d+))\))?", re.M)


def estimate(job: str, *args: str):
    model_path = _raw(job)["model"].get("path")
    shipped = ["--model-config", str(CONFIGS / SHIPPED_CONFIGS[model_path])] if model_path in SHIPPED_CONFIGS else []
    return runner.invoke(app, ["estimate", str(EXAMPLES / job), *args, *shipped])


def estimate_json(job: str, cluster: str, *args: str) -> tuple[int, dict]:
    result = estimate(job, "--cluster", str(EXAMPLES / cluster), *args, "--json")
    # Exit code 1 is the "does not fit" verdict; anything else (an exception, a usage error) is a crash.
    assert result.exit_code in (0, 1) and (result.exception is None or isinstance(result.exception, SystemExit)), \
        result.output
    return result.exit_code, json.loads(result.output)


def _pairs_in(text: str, job_file: str | None = None) -> set[tuple[str, str]]:
    """(job, cluster) example pairs named together on one `trainlift estimate|render|submit` command line, or by a
    job file's `# estimate: ... on CLUSTER` line."""
    text = re.sub(r"\\\n[#\s]*", " ", text)  # join continued command lines
    pairs = set()
    for line in re.findall(r"trainlift (?:estimate|render|submit) [^\n]*", text):
        names = re.findall(r"([\w.-]+\.yaml)\b", line)
        jobs, clusters = [n for n in names if n in JOBS], [n for n in names if n in CLUSTERS]
        pairs |= {(j, c) for j in jobs[:1] for c in clusters[:1]}
        if job_file and clusters and not jobs and "--cluster" in line:
            pairs.add((job_file, clusters[0]))
    if job_file:
        pairs |= {(job_file, m.group(4)) for m in HEADER_ESTIMATE.finditer(text)}
    return pairs


def test_the_readme_and_the_job_files_pair_exactly_the_intended_examples():
    readme = _pairs_in(docs_text())
    headers = set().union(*(_pairs_in((EXAMPLES / job).read_text(), job) for job in JOBS))
    assert ("qwen2.5-1.5b-eks.yaml", "cluster-reference.yaml") in readme
    assert ("llama-3.1-70b-eks.yaml", "cluster-p5.yaml") in readme
    assert readme | headers == INTENDED
    # Every cluster job's header pairs it, and every cluster example has a job written for it.
    assert {job for job, _ in headers} == set(CLUSTER_JOBS)
    assert {cluster for _, cluster in INTENDED} == set(CLUSTERS)
    # The rest run on this machine (`trainlift train`): the demo's model is built from an inline `model.config`, and
    # the other local jobs train the demo's export.
    for job in set(JOBS) - set(CLUSTER_JOBS):
        model = _raw(job)["model"]
        assert isinstance(model.get("config"), dict) or model["path"] == "../runs/tiny-demo/final", job
    assert {_raw(job)["model"]["path"] for job in CLUSTER_JOBS} <= set(SHIPPED_CONFIGS)
    assert all((CONFIGS / name).is_file() for name in SHIPPED_CONFIGS.values())


@pytest.mark.parametrize(("job", "cluster"), sorted(INTENDED), ids=lambda name: name.removesuffix(".yaml"))
def test_each_example_job_fits_the_cluster_it_is_written_for(job, cluster):
    code, data = estimate_json(job, cluster)
    spec = cluster_spec_from_yaml((EXAMPLES / cluster).read_text())
    (group,) = spec.workers
    profile = group.profile
    assert code == 0 and data["fits"] is True and data["advice"] == [], data
    assert data["device"] == "cuda" and data["target"].startswith(f"{group.count}x {profile.instance_type} ")
    assert 0 < data["workers"] <= spec.gpu_count
    # The verdict's numbers: the items' total against the whole GPU's memory (the runtime item carries the CUDA
    # context, NCCL buffers and the allocator's slack, the only headroom estimate takes).
    gpu_gib, per_gpu = data["gpu_gib"], data["per_gpu_gib"]
    assert gpu_gib == pytest.approx(profile.gpu_memory_mib / 1024, abs=0.01)
    assert 0 < per_gpu["total"] <= gpu_gib
    parts = sum(value for key, value in per_gpu.items() if key != "total")
    if _raw(job)["train"]["grad_accum"] > 1:  # gradients held across micro-batches: every item coexists
        assert per_gpu["total"] == pytest.approx(parts, abs=0.01)
    else:
        assert per_gpu["total"] <= parts + 0.01
    assert per_gpu["runtime"] > 0 and data["staging_fits"] is True
    # The job file's header quotes this figure.
    (quoted,) = [m for m in HEADER_ESTIMATE.finditer((EXAMPLES / job).read_text()) if m.group(4) == cluster]
    assert float(quoted.group(1)) == pytest.approx(per_gpu["total"], abs=0.051)
    assert float(quoted.group(2)) == pytest.approx(gpu_gib, abs=0.051) and quoted.group(3) == profile.gpu_model
    if quoted.group(5):
        assert (data["mesh"]["replicate"], data["mesh"]["shard"]) == (int(quoted.group(5)), int(quoted.group(6)))


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda name: name.removesuffix(".yaml"))
def test_each_clusters_cost_is_looked_up_by_instance_type(cluster):
    """A price is looked up by instance type, not by node group name (an estimate once said "no price for h100",
    cluster-p5.yaml's group). A Capacity Block's group has no on-demand price."""
    job = next(j for j, c in sorted(INTENDED) if c == cluster)
    _, data = estimate_json(job, cluster)
    spec = cluster_spec_from_yaml((EXAMPLES / cluster).read_text())
    groups = [(spec.system.instance_type, spec.system.count, False),
              *((w.instance_type, w.count, w.capacity_block) for w in spec.workers)]
    prices = [(t, n, None if block else catalog.on_demand_price(t, spec.region)) for t, n, block in groups]
    unknown = list(dict.fromkeys(t for t, _, price in prices if price is None))
    if unknown:
        assert data["usd_per_hour"] is None and data["usd_total"] is None
        blocks = [w.instance_type for w in spec.workers if w.capacity_block]
        assert data["price_source"] == (f"{blocks[0]}: a Capacity Block is paid for when bought, at its own rate, "
                                        "not on demand" if blocks else
                                        f"no price for {', '.join(unknown)} in {spec.region} (pass --live)")
    else:
        assert data["usd_per_hour"] == pytest.approx(sum(n * price.usd_per_hour for _, n, price in prices), abs=0.01)
        start_h = sum(data["start_s"].values()) / 3600  # the nodes' start is billed too
        assert data["usd_total"] == pytest.approx((data["hours"] + start_h) * data["usd_per_hour"], rel=0.01)
    assert not any(re.search(rf"\b{re.escape(w.name)}\b", data["price_source"]) for w in spec.workers)


def test_the_p5_cluster_names_p5_48xlarge_as_unpriced_in_the_text_a_user_reads():
    """Today: cluster-p5.yaml's only GPU group is a Capacity Block, which no on-demand price (catalog or --live)
    covers."""
    result = estimate("llama-3.1-70b-eks.yaml", "--cluster", str(EXAMPLES / "cluster-p5.yaml"))
    assert result.exit_code == 0, result.output
    (cost,) = [line for line in result.output.splitlines() if line.startswith("cost ")]
    assert cost == "cost   unknown: p5.48xlarge: a Capacity Block is paid for when bought, at its own rate, not on demand"  # --live cannot price a Capacity Block


@pytest.mark.parametrize(("job", "cluster"), UNINTENDED, ids=lambda name: name.removesuffix(".yaml"))
def test_a_pair_no_example_intends_gets_a_clear_verdict(job, cluster):
    code, data = estimate_json(job, cluster)
    assert data["fits"] == (data["per_gpu_gib"]["total"] <= data["gpu_gib"])
    assert code == (0 if data["fits"] else 1)
    assert bool(data["advice"]) != data["fits"]


@pytest.mark.parametrize(("job", "cluster", "args"), [
    ("llama-3.1-70b-eks.yaml", "cluster-reference.yaml", ()),  # 70B on 8x L4 24 GB
    ("llama-3.1-70b-eks.yaml", "cluster-p5.yaml", ("--set", "model.lora=null")),  # the example before LoRA
], ids=["70b-on-8-l4", "70b-full-on-16-h100"])
def test_a_job_too_big_for_a_cluster_is_told_it_does_not_fit(job, cluster, args):
    code, data = estimate_json(job, cluster, *args)
    assert code == 1 and data["fits"] is False
    assert data["per_gpu_gib"]["total"] > data["gpu_gib"]
    assert data["advice"] and all(a["per_gpu_gib"] > 0 for a in data["advice"])
    text = estimate(job, "--cluster", str(EXAMPLES / cluster), *args)
    assert text.exit_code == 1 and "does not fit" in text.output and "try  " in text.output


@pytest.mark.parametrize("job", sorted(set(JOBS) - set(CLUSTER_JOBS)), ids=lambda name: name.removesuffix(".yaml"))
def test_the_local_examples_fit_this_machine(job, tmp_path):
    """The tiny demo jobs run on this machine's CPUs (`trainlift train`); without hardware, estimate sizes that. The
    jobs that train the demo's export are given its config (`--model-config`) as the demo builds it, the export not
    being there before the demo ran."""
    from trainlift.config.job import load_job_spec
    from trainlift.train.model.build import build_config, load_tokenizer

    args = []
    if _raw(job)["model"].get("config") is None:
        demo = load_job_spec(EXAMPLES / "tiny-local.yaml").model
        (tmp_path / "config.json").write_text(build_config(demo.config, load_tokenizer(demo)).to_json_string())
        args = ["--model-config", str(tmp_path / "config.json")]
    result = estimate(job, "--json", *args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is True and data["device"] == "cpu"
    assert 0 < data["per_gpu_gib"]["total"] <= data["host_gib_per_worker"]
