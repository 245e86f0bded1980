"""model.path: s3://bucket/prefix, as a user runs it: `trainlift train` (a subprocess) against moto over HTTP on
loopback, whose WSGI app is wrapped to record every request. The model is saved in shards with an index, beside a
stale `model.safetensors` the index does not name. Two workers on one node: each weight file is fetched from S3
once (one process per node downloads, the other waits on the cache's lock), the stale file never, and the run
(LoRA) trains to its end from the fetched weights; its merged export keeps the source's generation config and its
adapter names the URI as its base."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

BUCKET, PREFIX = "trainlift-models", "base/tiny-qwen2"


class CountingS3:
    """moto on a free loopback port; `requests` counts (method, object key) of every request it serves."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.requests: Counter = Counter()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.url = f"http://{host}:{port}"
        srv = self.moto._server
        app = srv.app

        def counted(environ, start_response):
            key = environ["PATH_INFO"].lstrip("/").split("/", 1)
            self.requests[environ["REQUEST_METHOD"], key[1] if len(key) == 2 else ""] += 1
            return app(environ, start_response)

        srv.app = counted

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def gets(self, name: str) -> int:
        return self.requests["GET", f"{PREFIX}/{name}"]


@pytest.fixture
def s3():
    server = CountingS3()
    yield server
    server.moto.stop()


def sharded_model(tiny_assets, out: Path) -> list[str]:
    """The tiny model saved in several safetensors files with an index; returns the weight files' names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model")
    model.save_pretrained(out, max_shard_size="20KB")
    for name in os.listdir(tiny_assets / "model"):
        if not name.endswith(".safetensors") and not (out / name).exists():
            shutil.copy(tiny_assets / "model" / name, out / name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_on_s3_is_fetched_once_per_node_indexed_files_only_and_trains(s3, tiny_assets, tmp_path):
    local = tmp_path / "model"
    shards = sharded_model(tiny_assets, local)
    assert len(shards) >= 2
    stale = "model.safetensors"  # an older single-file save left beside the shards: not in the index
    shutil.copy(tiny_assets / "model" / stale, local / stale)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "max_length": 77, "temperature": 0.3, "do_sample": True}
    (local / "generation_config.json").write_text(json.dumps(generation))  # the export must keep the source's
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
    s3.requests.clear()

    uri = f"s3://{BUCKET}/{PREFIX}"
    spec = {"model": {"path": uri, "lora": {"r": 4, "alpha": 8}},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 2, "micro_batch_size": 2, "warmup_steps": 1},
            "scaling": {"workers": 2}, "checkpoint": {"every_steps": 0},
            "run": {"name": "from-s3", "storage": str(tmp_path / "runs"), "max_failures": 0}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    staging = tmp_path / "staging"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-creds"),
               RAY_ADDRESS="", TRAINLIFT_HOME=str(tmp_path / "home"), TRAINLIFT_STAGING_DIR=str(staging))
    result = subprocess.run([sys.executable, "-m", "trainlift", "train", str(job), "--json"], env=env,
                            capture_output=True, text=True, timeout=280)
    print(sorted(s3.requests.items()))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["finished"] and summary["steps"] == 2
    exported = json.loads((tmp_path / "runs" / "from-s3" / "final" / "generation_config.json").read_text())
    assert {k: exported[k] for k in generation} == generation
    adapter = json.loads((tmp_path / "runs" / "from-s3" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == uri  # portable: the URI, not the node's cache

    assert {name: s3.gets(name) for name in shards} == {name: 1 for name in shards}  # once per node, not per rank
    assert s3.gets(stale) == 0 and s3.requests["HEAD", f"{PREFIX}/{stale}"] == 0
    # The driver read the config and tokenizer (preflight, data cache) into its own config-only cache; the
    # workers' node cache holds the indexed weights beside them, and nothing else.
    assert s3.gets("config.json") == 2 and s3.gets("tokenizer.json") == 2
    cached = {p.name for p in (staging / "models").iterdir() if p.is_dir()}
    assert len(cached) == 2 and any(name.endswith(".config") for name in cached)
    full = next(staging / "models" / name for name in cached if not name.endswith(".config"))
    assert {p.name for p in full.glob("*.safetensors")} == set(shards)


@pytest.mark.slow
def test_each_node_is_asked_whether_it_reads_a_local_model(ray_local, tiny_assets, tmp_path):
    """The probe behind the refusal of a local model.path: a task pinned to each node looks for config.json there."""
    from trainlift.train.run.preflight import nodes_without_model

    ips = {node["NodeManagerAddress"] for node in ray_local.nodes() if node["Alive"]}
    assert nodes_without_model(str(tiny_assets / "model"), ips) == set()
    assert nodes_without_model(str(tmp_path / "only-on-another-disk"), ips) == ips
    assert nodes_without_model(str(tiny_assets / "model"), {"10.255.0.9"}) == set()  # not a node: not named
