"""Training on data as users keep it: a mixture of a Parquet file with its own column names and a directory in the
Hugging Face hub's layout (data/train-00000-of-00001.parquet), its composition recorded in the run; ShareGPT conversations saved by `datasets` (the format told from the rows), and a
directory of JSONL files on S3 (a real S3-compatible server, moto, over HTTP on loopback). The S3 part of the data cache (arrays
uploaded under s3:// storage, downloaded once per node) is checked here too, without Ray."""

import json
import math
import os
import runpy
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import validate_job_spec
from trainlift.train.data import cache as datacache, examples as data
from trainlift.train.launch import run_training

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
REPO = Path(__file__).resolve().parents[2]
BUCKET = "trainlift-data"


@pytest.fixture
def s3(monkeypatch, tmp_path):
    h.use(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    return client


def rows_of(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def short_run(tiny_assets, tmp_path, **data_section):
    return validate_job_spec({
        "model": {"path": str(tiny_assets / "model")},
        "data": {"seq_len": 64, **data_section},
        "train": {"steps": 2, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every_steps": 0},
        "run": {"name": "formats", "storage": str(tmp_path / "runs"), "max_failures": 0},
    })


def assert_trained(summary, spec):
    assert summary["finished"] and summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    root = Path(datacache.root_of(spec.run.storage)[1])
    for entry in summary["data_cache"].values():
        assert entry["built"] and (root / entry["key"] / "manifest.json").is_file()


def as_sharegpt(row):
    return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                              for m in row["messages"]]}


@pytest.mark.usefixtures("ray_local")
def test_a_mixture_with_renamed_columns_and_a_saved_sharegpt_dataset_train(tiny_assets, tmp_path):
    import datasets

    conversations = [{"conversation": r["messages"]} for r in rows_of(tiny_assets / "train.jsonl")]
    pq.write_table(pa.Table.from_pylist(conversations), tmp_path / "train.parquet")
    eval_rows = [as_sharegpt(r) for r in rows_of(tiny_assets / "eval.jsonl")]
    datasets.Dataset.from_list(eval_rows).save_to_disk(tmp_path / "eval")
    hub_layout = tmp_path / "hub-tasks" / "data"
    hub_layout.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows_of(tiny_assets / "train.jsonl")), hub_layout / "train-00000-of-00001.parquet")
    train = [{"source": str(tmp_path / "train.parquet"), "weight": 0.6, "columns": {"messages": "conversation"}},
             {"source": str(tmp_path / "hub-tasks"), "split": "train", "weight": 0.4}]
    spec = short_run(tiny_assets, tmp_path, train=train, eval=str(tmp_path / "eval"))
    summary = run_training(spec)
    assert_trained(summary, spec)
    assert summary["eval_loss"] is not None and math.isfinite(summary["eval_loss"])
    recorded = json.loads((Path(spec.run_uri) / "data.json").read_text())
    assert recorded == datacache.composition(spec, summary["data_cache"])
    assert recorded["eval"][0]["format"] == "sharegpt"
    drawn = [source["drawn"] for source in recorded["train"]]
    assert [s["source"] for s in recorded["train"]] == [e["source"] for e in train] and all(n > 0 for n in drawn)


@pytest.mark.usefixtures("ray_local")
def test_jsonl_on_s3_trains(s3, tiny_assets, tmp_path):
    lines = (tiny_assets / "train.jsonl").read_text().splitlines(keepends=True)
    for i in range(2):
        s3.put_object(Bucket=BUCKET, Key=f"data/train/part-{i}.jsonl", Body="".join(lines[i::2]).encode())
    spec = short_run(tiny_assets, tmp_path, train=f"s3://{BUCKET}/data/train/")
    assert_trained(run_training(spec), spec)


def test_a_cache_on_s3_storage_is_uploaded_once_and_downloaded_once_per_node(s3, tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node-tmp"))  # this "node"'s local cache directory
    (tmp_path / "node-tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    spec = validate_job_spec({"model": {"path": "unused"}, "run": {"storage": f"s3://{BUCKET}/runs"},
                              "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64}})
    keys = datacache.prepare_splits(spec, lambda: tokenizer)
    key = keys["train"]["key"]
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/.cache/data/{key}/")["Contents"]
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed if not o["Key"].endswith("/"))  # not folder markers
    assert names == ["manifest.json", "meta-00000.npy", "rows-00000.npy"]
    assert not datacache.prepare_splits(spec, lambda: tokenizer)["train"]["built"]

    train, _ = datacache.load_splits(spec, lambda: tokenizer, rank=0, keys=keys)
    expected = data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len)
    assert [r["input_ids"].tolist() for r in train.rows] == [r["input_ids"] for r in expected.rows]
    local = tmp_path / "node-tmp" / f"trainlift-{os.geteuid()}" / "data-cache" / key
    copied = (local / "rows-00000.npy").stat().st_ino
    datacache.load_splits(spec, lambda: tokenizer, rank=1, keys=keys)  # another worker on the node: no second download
    assert (local / "rows-00000.npy").stat().st_ino == copied

    raw = bytearray((local / "rows-00000.npy").read_bytes())
    raw[-3] ^= 0xFF
    (local / "rows-00000.npy").write_bytes(bytes(raw))  # a damaged local copy is fetched again, not read
    again, _ = datacache.load_splits(spec, lambda: tokenizer, rank=1, keys=keys)
    assert [r["input_ids"].tolist() for r in again.rows] == [r["input_ids"] for r in expected.rows]


def test_two_runs_building_one_key_on_s3_never_delete_the_committed_cache(s3, tiny_assets, monkeypatch):
    """On an object store both builders of one key upload; the cache a reader found stays whole throughout: before
    every upload of the second builder the first one's manifest and arrays are all there, nothing is deleted, and
    the cache that ends up committed is sound and reads back the same rows."""
    import pyarrow.fs as pafs

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    spec = validate_job_spec({"model": {"path": "unused"}, "run": {"storage": f"s3://{BUCKET}/runs"},
                              "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64}})
    split = datacache.splits(spec)["train"]
    fs, root = datacache.root_of(spec.run.storage)
    key = datacache.cache_key(split, "tok")
    first = datacache.build(fs, root, key, split, tokenizer)
    objects = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/")["Contents"]}

    sound_before_each_upload = []
    copy_files, read_manifest = pafs.copy_files, datacache.read_manifest

    def upload(*args, **kwargs):
        sound_before_each_upload.append(read_manifest(fs, f"{root}/{key}", key) is not None)
        return copy_files(*args, **kwargs)

    monkeypatch.setattr(pafs, "copy_files", upload)
    monkeypatch.setattr(datacache, "read_manifest", lambda *a: None)  # the second builder saw no cache when it began
    second = datacache.build(fs, root, key, split, tokenizer)
    monkeypatch.undo()
    assert sound_before_each_upload and all(sound_before_each_upload)
    assert objects <= {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/")["Contents"]}
    committed = datacache.read_manifest(fs, f"{root}/{key}", key)
    assert committed == second and committed["rows"] == first["rows"]
