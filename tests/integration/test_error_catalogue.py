"""Every user mistake in docs/ERRORS.md gets exactly its documented one-line message, its exit code, and no
traceback. The commands run in-process through the CLI's entry point, as the console script does.

TRAINLIFT_UPDATE_ERRORS=1 rewrites docs/ERRORS.md from what the commands print now.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from trainlift.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "ERRORS.md"
CHAT = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}


@pytest.fixture(scope="module")
def ws(tiny_assets, tmp_path_factory):
    """A workspace of good and bad files every case draws from."""
    root = tmp_path_factory.mktemp("errs")
    good = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64}, "run": {"storage": str(root / "runs")}}

    def spec(name: str, change=lambda s: None, raw: str | None = None) -> str:
        body = json.loads(json.dumps(good))
        change(body)
        (root / name).write_text(raw if raw is not None else yaml.safe_dump(body))
        return str(root / name)

    files = {
        "good": spec("good.yaml"),
        "unknown_key": spec("unknown_key.yaml", lambda s: s.update(train={"stepz": 3})),
        "wrong_type": spec("wrong_type.yaml", lambda s: s.update(train={"steps": "ten"})),
        "negative": spec("negative.yaml", lambda s: s.update(train={"micro_batch_size": 0})),
        "bad_format": spec("bad_format.yaml", lambda s: s["data"].update(format="chat")),
        "no_model": spec("no_model.yaml", lambda s: s.update(model={})),
        "bad_name": spec("bad_name.yaml", lambda s: s["run"].update(name="my run")),
        "bad_yaml": spec("bad_yaml.yaml", raw="model:\n  path: m\n data: [\n"),
        "not_mapping": spec("not_mapping.yaml", raw="- just\n- a list\n"),
        "no_data": spec("no_data.yaml", lambda s: s["data"].update(train=str(root / "missing.jsonl"))),
        "bad_json": spec("bad_json.yaml", lambda s: s["data"].update(train=str(root / "bad.jsonl"))),
        "no_key": spec("no_key.yaml", lambda s: s["data"].update(train=str(root / "nokey.jsonl"), format="messages")),
        "unknown_format": spec("unknown_format.yaml", lambda s: s["data"].update(train=str(root / "qa.jsonl"))),
        "unknown_speaker": spec("unknown_speaker.yaml", lambda s: s["data"].update(train=str(root / "speaker.jsonl"))),
        "no_split": spec("no_split.yaml", lambda s: s["data"].update(train=str(root / "saved-dict"))),
        "bad_hub_id": spec("bad_hub_id.yaml", lambda s: s["data"].update(train="hf://org/name")),
        "no_assistant": spec("no_assistant.yaml", lambda s: s["data"].update(train=str(root / "noassist.jsonl"))),
        "bad_parquet": spec("bad_parquet.yaml", lambda s: s["data"].update(train=str(root / "bad.parquet"),
                                                                            format="prompt_completion")),
        "parquet_columns": spec("parquet_columns.yaml", lambda s: s["data"].update(train=str(root / "qa.parquet"),
                                                                                   format="prompt_completion")),
        "long_seq": spec("long_seq.yaml", lambda s: s["data"].update(seq_len=4096)),
        "run_dir": spec("run_dir.yaml", lambda s: s["run"].update(storage=str(root / "blocked"))),
        "bad_model": spec("bad_model.yaml", lambda s: s["model"].update(path=str(root / "empty-model"))),
        "lora_target": spec("lora_target.yaml", lambda s: s["model"].update(lora={"target_modules": ["qkv"]})),
        "lora_rank": spec("lora_rank.yaml", lambda s: s["model"].update(lora={"r": 0})),
        "family_mamba": spec("family_mamba.yaml", lambda s: s.update(model={
            "config": {"model_type": "falcon_mamba", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 96},
            "tokenizer": str(tiny_assets / "model")})),
        "efa_cluster": str(root / "efa_cluster.yaml"),
        "inline_secret": str(root / "inline_secret.yaml"),
        "too_many_gpus": str(root / "too_many_gpus.yaml"),
        "no_efa": str(root / "no_efa.yaml"),
        "placement_no_kueue": str(root / "placement_no_kueue.yaml"),
        "cluster_key": str(root / "cluster_key.yaml"),
        "role_cluster": str(root / "role_cluster.yaml"),
        "whole_bucket": str(root / "whole_bucket.yaml"),
        "env_credentials": str(root / "env_credentials.yaml"),
        "s3_run": spec("s3_run.yaml", lambda s: s["run"].update(storage="s3://someone-elses-bucket/runs")),
        "model_dir": str(shutil.copytree(tiny_assets / "model", root / "model")),
        "quantized": spec("quantized.yaml", lambda s: s["model"].update(path=str(root / "fp8-model"))),
    }
    fp8 = json.loads((shutil.copytree(tiny_assets / "model", root / "fp8-model") / "config.json").read_text())
    fp8["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (root / "fp8-model" / "config.json").write_text(json.dumps(fp8))
    (root / "bad.jsonl").write_text(json.dumps(CHAT) + "\n{oops\n")
    (root / "nokey.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": [" x", None]}), root / "bad.parquet")
    pq.write_table(pa.table({"question": ["a"], "answer": [" x"]}), root / "qa.parquet")
    (root / "noassist.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    (root / "prefs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n"
                                      + json.dumps({"prompt": "p", "chosen": 3, "rejected": "r"}) + "\n")
    (root / "qa.jsonl").write_text(json.dumps({"question": "x", "answer": "y"}) + "\n")
    (root / "speaker.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "x"},
                                                                      {"from": "narrator", "value": "y"}]}) + "\n")
    import datasets

    rows = datasets.Dataset.from_list([CHAT])
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(root / "saved-dict")
    (root / "blocked").mkdir()
    (root / "blocked" / "run").write_text("a file where the run directory goes")
    (root / "empty-model").mkdir()
    (root / "weird.log").mkdir()
    (root / "shared-home").mkdir()
    (root / "shared-home").chmod(0o777)
    cluster = {"name": "c", "region": "us-east-2", "availability_zones": ["us-east-2a", "us-east-2b"],
               "workers": [{"name": "g", "instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}]}

    def cluster_file(name, change):
        body = json.loads(json.dumps(cluster))
        change(body)
        (root / f"{name}.yaml").write_text(yaml.safe_dump(body))

    cluster_file("efa_cluster", lambda c: c["workers"][0].update(availability_zones=["us-east-2a", "us-east-2b"]))
    cluster_file("inline_secret", lambda c: c.update(
        secrets=[{"env": "HF_TOKEN", "secret": "hf-token", "key": "token", "value": "hf_abcdefabcdefabcdef"}]))
    cluster_file("too_many_gpus", lambda c: c["workers"][0].update(gpus=8))
    cluster_file("no_efa", lambda c: (c["workers"][0].update(instance_type="g6.4xlarge"), c.update(fabric="efa")))
    cluster_file("placement_no_kueue", lambda c: c.update(scheduler="none", placement="required"))
    cluster_file("cluster_key", lambda c: c.update(regoin="us-east-1"))
    cluster_file("role_cluster", lambda c: c.update(storage={"s3": {"uri": "s3://my-trainlift-checkpoints/ray-train"}}))
    cluster_file("whole_bucket", lambda c: c.update(storage={"s3": {"uri": "s3://my-trainlift-checkpoints"}}))
    cluster_file("env_credentials", lambda c: c.update(
        env={"MLFLOW_TRACKING_URI": "https://bob:plantedsecret@mlflow.example"}))
    return root, files


# id -> argv built from the workspace's files (f) and root (r)
CASES = {
    "spec-file-missing": lambda f, r: ["train", f"{r}/nope.yaml"],
    "spec-not-yaml": lambda f, r: ["train", f["bad_yaml"]],
    "spec-not-a-mapping": lambda f, r: ["train", f["not_mapping"]],
    "spec-unknown-key": lambda f, r: ["train", f["unknown_key"]],
    "spec-wrong-type": lambda f, r: ["train", f["wrong_type"]],
    "spec-out-of-range": lambda f, r: ["train", f["negative"]],
    "spec-bad-choice": lambda f, r: ["train", f["bad_format"]],
    "spec-no-model": lambda f, r: ["train", f["no_model"]],
    "spec-bad-run-name": lambda f, r: ["train", f["bad_name"]],
    "set-without-equals": lambda f, r: ["train", f["good"], "--set", "train.steps"],
    "set-through-a-value": lambda f, r: ["train", f["good"], "--set", "run.name.x=1"],
    "set-uri-with-credentials": lambda f, r: ["train", f["good"], "--set",
                                              "run.mlflow_uri=https://bob:plantedsecret@mlflow.example"],
    "data-file-missing": lambda f, r: ["train", f["no_data"]],
    "data-bad-json-line": lambda f, r: ["train", f["bad_json"]],
    "data-missing-format-keys": lambda f, r: ["train", f["no_key"]],
    "data-no-assistant-turn": lambda f, r: ["train", f["no_assistant"]],
    "dpo-format-not-preference": lambda f, r: ["train", f["good"], "--set", "train.objective=dpo",
                                               "--set", "data.format=messages"],
    "dpo-rows-not-preference": lambda f, r: ["train", f["good"], "--set", "train.objective=dpo",
                                             "--set", f"data.train={r}/nokey.jsonl"],
    "dpo-bad-preference-row": lambda f, r: ["train", f["good"], "--set", "train.objective=dpo",
                                            "--set", f"data.train={r}/prefs.jsonl"],
    "data-bad-parquet-row": lambda f, r: ["train", f["bad_parquet"]],
    "data-parquet-column-missing": lambda f, r: ["train", f["parquet_columns"]],
    "data-format-not-told": lambda f, r: ["train", f["unknown_format"]],
    "data-sharegpt-unknown-speaker": lambda f, r: ["train", f["unknown_speaker"]],
    "data-dataset-split-not-chosen": lambda f, r: ["train", f["no_split"]],
    "data-hub-id-malformed": lambda f, r: ["train", f["bad_hub_id"]],
    "seq-len-above-model-max": lambda f, r: ["train", f["long_seq"]],
    "run-dir-unwritable": lambda f, r: ["train", f["run_dir"]],
    "model-dir-without-config": lambda f, r: ["train", f["bad_model"]],
    "model-checkpoint-quantized": lambda f, r: ["train", f["quantized"]],
    "lora-unknown-target": lambda f, r: ["train", f["lora_target"]],
    "parallel-degrees-not-the-workers": lambda f, r: ["train", f["good"], "--set", "parallel.replicate=2",
                                                      "--set", "parallel.shard=3"],
    "lora-rank-zero": lambda f, r: ["train", f["lora_rank"]],
    "model-family-refused": lambda f, r: ["train", f["family_mamba"]],
    "eval-not-a-model": lambda f, r: ["eval", r, "--data", f"{r}/bad.jsonl"],
    "eval-data-missing": lambda f, r: ["eval", f["model_dir"], "--data", f"{r}/missing.jsonl"],
    "eval-limit-zero": lambda f, r: ["eval", f["model_dir"], "--data", f"{r}/bad.jsonl", "--limit", "0"],
    "train-workers-zero": lambda f, r: ["train", f["good"], "--workers", "0"],
    "flag-value-out-of-range": lambda f, r: ["train", f["good"], "--log-every", "-1"],
    "flag-unknown": lambda f, r: ["train", f["good"], "--stepz", "3"],
    "argument-missing": lambda f, r: ["report"],
    "command-unknown": lambda f, r: ["trian", f["good"]],
    "runs-no-such-directory": lambda f, r: ["runs", f"{r}/nope"],
    "package-upload-not-s3": lambda f, r: ["package", "--upload", f"{r}/code"],
    "cluster-spec-missing": lambda f, r: ["cluster", "status", f"{r}/nope.yaml"],
    "rehearse-not-a-render": lambda f, r: ["rehearse", f"{r}/nope"],
    "local-up-bad-port": lambda f, r: ["local", "up", "--port", "99999"],
    "home-writable-by-others": lambda f, r: ["local", "status"],
    "doctor-mlflow-uri-with-credentials": lambda f, r: ["doctor", "--mlflow-uri", "https://bob:pw@mlflow.example"],
    "submit-spec-outside-workdir": lambda f, r: ["submit", f["good"], "--working-dir", f"{r}/blocked"],
    "submit-no-address": lambda f, r: ["submit", "good.yaml", "--working-dir", r],
    "submit-bad-env": lambda f, r: ["submit", "good.yaml", "--working-dir", r, "--env", "MY-VAR=1",
                                    "--address", "http://127.0.0.1:9"],
    "submit-storage-outside-the-role": lambda f, r: ["submit", f["s3_run"], "--working-dir", r, "--address",
                                                     "http://127.0.0.1:9", "--cluster", f["role_cluster"]],
    "submit-secret-on-command-line": lambda f, r: ["submit", "good.yaml", "--working-dir", r, "--env",
                                                   "HF_TOKEN=hf_plantedsecretvalue0123456789"],
    "submit-env-not-in-shell": lambda f, r: ["submit", "good.yaml", "--working-dir", r, "--env",
                                             "TRAINLIFT_UNSET_VARIABLE"],
    "jobs-unreachable-address": lambda f, r: ["jobs", "list", "--address", "http://127.0.0.1:9"],
    "jobs-status-head-gone": lambda f, r: ["jobs", "status", "trainlift-run-1", "--address", "http://127.0.0.1:9"],
    "jobs-status-kubeconfig-missing": lambda f, r: ["jobs", "status", "fine-tune", "--kubeconfig", f"{r}/nope"],
    "submit-env-uri-with-credentials": lambda f, r: ["submit", "good.yaml", "--working-dir", r, "--env",
                                                     "MLFLOW_TRACKING_URI=https://bob:plantedsecret@mlflow.example"],
    "submit-head-gone": lambda f, r: ["submit", "good.yaml", "--working-dir", r, "--address", "http://127.0.0.1:9"],
    "doctor-topology-kubeconfig-missing": lambda f, r: ["doctor", "topology", "job-raycluster", "--kubeconfig",
                                                        f"{r}/nope"],
    "doctor-unreachable-address": lambda f, r: ["doctor", "--address", "127.0.0.1:9"],
    "doctor-log-unreadable": lambda f, r: ["doctor", "nccl-log", f"{r}/missing.log"],
    "doctor-log-is-a-directory": lambda f, r: ["doctor", "nccl-log", f"{r}/weird.log"],
    "doctor-unknown-instance": lambda f, r: ["doctor", "fabric", "--instance-type", "g9.huge"],
    "doctor-bad-sizes": lambda f, r: ["doctor", "fabric", "--sizes", "1Q"],
    "cluster-unknown-key": lambda f, r: ["render", f["cluster_key"], "--check"],
    "cluster-efa-several-azs": lambda f, r: ["render", f["efa_cluster"], "--check"],
    "cluster-efa-without-efa": lambda f, r: ["render", f["no_efa"], "--check"],
    "cluster-placement-without-kueue": lambda f, r: ["render", f["placement_no_kueue"], "--check"],
    "cluster-too-many-gpus": lambda f, r: ["render", f["too_many_gpus"], "--check"],
    "cluster-inline-secret": lambda f, r: ["render", f["inline_secret"], "--check"],
    "cluster-s3-whole-bucket": lambda f, r: ["render", f["whole_bucket"], "--check"],
    "cluster-env-uri-with-credentials": lambda f, r: ["render", f["env_credentials"], "--check"],
    "capacity-unknown-region": lambda f, r: ["capacity", "g6.12xlarge", "--region", "mars-1"],
    "capacity-no-credentials": lambda f, r: ["capacity", "g6.12xlarge", "--region", "us-east-2"],
    "price-not-in-catalog": lambda f, r: ["price", "p5.48xlarge", "--region", "eu-west-1"],
    "estimate-unknown-instance": lambda f, r: ["estimate", f["good"], "--instance", "p9.huge"],
    "estimate-instance-without-gpus": lambda f, r: ["estimate", f["good"], "--instance", "m7i.xlarge"],
    "estimate-model-config-unreadable": lambda f, r: ["estimate", f["good"], "--model-config", r + "/nope.json"],
    "estimate-more-workers-than-gpus": lambda f, r: ["estimate", f["good"], "--instance", "g6.12xlarge",
                                                     "--set", "scaling.workers=16"],
    "price-live-no-credentials": lambda f, r: ["price", "g6.12xlarge", "--region", "us-east-1", "--live"],
    "price-live-unreachable": lambda f, r: ["price", "g6.12xlarge", "--region", "us-east-1", "--live"],
}

# id -> environment the mistake needs on top of the isolated one; the documented command shows it.
CASE_ENV = {
    "home-writable-by-others": {"TRAINLIFT_HOME": "shared-home"},
    "price-live-unreachable": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                               "AWS_MAX_ATTEMPTS": "1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
}


def run_cli(argv: list[str], cwd: str) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = ["trainlift", *argv]
    code = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, err.getvalue() + out.getvalue()


def documented() -> dict[str, tuple[int, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| `([a-z0-9-]+)` \| `[^`]*` \| (\d+) \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = (int(match.group(2)), match.group(3).replace("\\|", "|"))
    return rows


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "RAY_ADDRESS",
                 "AWS_ENDPOINT_URL", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("TRAINLIFT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def recorded():
    """In update mode, what each case printed, written to docs/ERRORS.md at the end."""
    rows: dict[str, tuple[str, int, str]] = {}
    yield rows
    if os.environ.get("TRAINLIFT_UPDATE_ERRORS") and rows:
        table = [f"| `{case}` | `{command}` | {code} | {message.replace('|', chr(92) + '|')} |"
                 for case, (command, code, message) in sorted(rows.items())]
        DOC.write_text(DOC_HEAD + "\n".join(table) + "\n")


DOC_HEAD = """# User mistakes and what trainlift says

Each row is a mistake, the command it was made with (`<ws>` is a scratch
directory holding the files named; `NAME=value` before `trainlift` is the
environment it ran with), the exit code, and the exact line printed.
Exit code 2 means bad input (a spec, a flag, a file); 1 means something outside
the input is wrong (an unreachable cluster, missing credentials). No mistake
prints a traceback; `--debug` shows one. `tests/integration/test_error_catalogue.py`
runs every row.

| mistake | command | exit | message |
| --- | --- | --- | --- |
"""


def test_catalogue_has_at_least_30_mistakes():
    assert len(CASES) >= 30
    if not os.environ.get("TRAINLIFT_UPDATE_ERRORS"):
        assert set(documented()) == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_mistake_gets_its_documented_line(case, ws, isolated, recorded, monkeypatch):
    root, files = ws
    argv = CASES[case](files, str(root))
    for name, value in CASE_ENV.get(case, {}).items():
        monkeypatch.setenv(name, value)
    code, output = run_cli(argv, cwd=str(root))
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and code != 0, output
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, output
    message = errors[0].removeprefix("error: ").replace(str(root), "<ws>")
    assert "plantedsecret" not in output  # a refused secret is not echoed back
    if os.environ.get("TRAINLIFT_UPDATE_ERRORS"):
        env = "".join(f"{name}={value} " for name, value in CASE_ENV.get(case, {}).items())
        recorded[case] = (env + "trainlift " + " ".join(argv).replace(str(root), "<ws>"), code, message)
        return
    assert (code, message) == documented()[case]
