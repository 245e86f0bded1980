"""Benchmark 18: how long a checkpoint holds the training loop, `checkpoint.mode: sync` against `async`, with the
run's storage on the local disk and on S3 (moto's server over HTTP on loopback).

    python bench/checkpoint_blocking.py [--saves 4] [--no-record]

`trainlift train` runs the demo data on a ~100M-parameter Llama built from `model.config` (random init, fp32,
untied head: ~1.2 GB per checkpoint) on 2 gloo workers, checkpointing every 2 steps. Each save writes an
`"event": "checkpoint"` row to metrics.jsonl with `checkpoint_blocked_s`, the time the loop waited: the whole
save (shard write, upload, barrier, COMPLETE) when sync; the copy to host memory and the hand-off when async. The
first async save of a run also starts DCP's checkpointing process on each worker, in the background. The end of
the run then waits for the last async upload; the wall time of each run is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

LLAMA_100M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
EVERY = 2
TARGET = 0.2


def run(storage: str, mode: str, saves: int, work: Path, env: dict[str, str]) -> dict:
    """One `trainlift train`; its checkpoint rows, summary and wall time."""
    name = f"{mode}-{'s3' if storage.startswith('s3://') else 'local'}"
    steps = EVERY * saves
    config = work / "llama-100m.json"
    config.write_text(json.dumps(LLAMA_100M))
    cmd = [str(bl.BIN / "trainlift"), "train", bl.DEMO_SPEC, "--json", "--set", f"run.name={name}",
           "--set", f"run.storage={storage}", "--set", "model.path=null", "--set", f"model.config={config}",
           "--set", "data.seq_len=64", "--set", "train.micro_batch_size=2", "--set", f"train.steps={steps}",
           "--set", "train.eval_every=0", "--set", f"checkpoint.every_steps={EVERY}", "--set", "checkpoint.keep=1",
           "--set", f"checkpoint.mode={mode}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=bl.REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(f"{storage}/{name}/metrics.jsonl")
    with fs.open_input_stream(path) as stream:
        rows = [json.loads(line) for line in stream.readall().decode().splitlines()]
    held = [r["checkpoint_blocked_s"] for r in rows if r.get("event") == "checkpoint"]
    steps_s = [r["step_time_s"] for r in rows if "loss" in r and r["step"] > 1]
    return {"held": held, "wall": wall, "step": bl.median(steps_s)}


def s3_server():
    """moto's S3 server in a process of its own, over HTTP on a free loopback port, with a bucket; returns (the
    process, env additions, storage URI). ARROW_IO_THREADS=1: one upload at a time, as moto's server drops parts
    of concurrent multipart uploads of this size."""
    import socket

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
           "ARROW_IO_THREADS": "1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:  # noqa: BLE001 - the server is still starting
            time.sleep(0.2)
    return server, env, "s3://bench/runs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=4, help="checkpoints per run")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-blocking-")
    server, s3_env, s3_uri = s3_server()
    results, loads = {}, []
    try:
        for storage_name, storage, extra in (("local disk", str(work / "runs"), {}), ("S3 (moto)", s3_uri, s3_env)):
            env = bl.clean_env(TRAINLIFT_HOME=str(work / "home"), **extra)
            os.environ.update(extra)  # this process reads the runs' metrics from the same storage
            for mode in ("sync", "async"):
                loads.append(bl.wait_for_quiet())
                results[storage_name, mode] = run(storage, mode, args.saves, work, env)
                print(storage_name, mode, results[storage_name, mode], file=sys.stderr, flush=True)
    finally:
        server.terminate()
    rows = []
    for storage_name in ("local disk", "S3 (moto)"):
        sync, asyn = results[storage_name, "sync"], results[storage_name, "async"]
        ratio = bl.median(asyn["held"]) / bl.median(sync["held"])
        rows.append([storage_name, f"{bl.median(sync['held']):.2f}", f"{bl.median(asyn['held']):.2f}",
                     f"**{ratio:.2f}**", ", ".join(f"{h:.2f}" for h in asyn["held"]),
                     f"{sync['step']:.2f} / {asyn['step']:.2f}", f"{sync['wall']:.0f} / {asyn['wall']:.0f}"])
    body = "\n".join([
        f"A ~100M-parameter Llama (fp32, untied head; 12 bytes a parameter per checkpoint), 2 gloo workers, "
        f"{args.saves} checkpoints per run, one every {EVERY} steps; every figure is rank 0's "
        f"`checkpoint_blocked_s` (the median over a run's saves). Target: async holds the loop at most "
        f"{TARGET}x as long as sync.\n",
        bl.table(["storage", "sync: loop held per save, s", "async: held, s", "async / sync",
                  "async, each save, s", "step s (sync / async)", "run wall s (sync / async)"], rows),
        "\nAsync's first save of a run also starts DCP's checkpointing process on each worker (in the background); "
        "its write and upload compete with the steps for the 2 cores, which shows in the step time, not in the "
        "time the loop is held. S3 is moto's server in a process of its own, uploads one at a time "
        "(`ARROW_IO_THREADS=1`: moto's server drops parts of concurrent multipart uploads of this size, and "
        "trainlift then rightly refuses to mark the checkpoint complete).",
    ])
    bl.record("18. Checkpoint blocking: sync against async", loads, body, key="checkpoint_blocking")


if __name__ == "__main__":
    main()
