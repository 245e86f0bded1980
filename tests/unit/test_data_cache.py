"""The data cache: built once, reused, rebuilt when its input changes or it is damaged, and read back as exactly
the rows `data.prepare` packs in memory."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import validate_job_spec
from trainlift.train.data import cache as datacache, examples as data

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


@pytest.fixture
def job(tmp_path):
    """A spec over 300 demo rows (train) and 60 (eval), storage in tmp_path; takes data section overrides."""
    lines = (REPO / "examples" / "data" / "tasks-train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "train.jsonl").write_text("".join(lines[:300]))
    (tmp_path / "eval.jsonl").write_text("".join(lines[300:360]))

    def make(**data_section):
        section = {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl"), "seq_len": 64,
                   **data_section}
        return validate_job_spec({"model": {"path": "unused"}, "data": section,
                                  "run": {"storage": str(tmp_path / "runs")}})

    return make


def cache_dir(spec, key):
    return Path(datacache.root_of(spec.run.storage)[1]) / key


def as_lists(packed):
    rows = [{k: [int(t) for t in r[k]] for k in ("input_ids", "labels", "position_ids")} | {"num_tokens": r["num_tokens"]}
            for r in packed.rows]
    return rows, [list(m) for m in packed.examples_per_row], packed.truncated, packed.tokens


def test_cached_rows_equal_the_in_memory_packing_exactly(job, tokenizer):
    spec = job(seq_len=16)  # short rows: some examples are truncated, which the cache must count the same
    train, _ = datacache.load_splits(spec, lambda: tokenizer, rank=0)
    expected = data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len)
    assert as_lists(train) == as_lists(expected) and expected.truncated > 0
    assert isinstance(train.rows[0]["input_ids"], np.memmap)  # mapped from the file, not loaded into lists
    batch, reference = data.collate([train.rows[i] for i in (3, 0, 7)]), data.collate([expected.rows[i] for i in (3, 0, 7)])
    assert all(torch_equal(batch[k], reference[k]) for k in ("input_ids", "labels", "position_ids"))
    assert batch["num_tokens"] == reference["num_tokens"]


def no_tokenizer():
    raise AssertionError("the tokenizer was loaded, though the driver's cache keys were given and the cache is sound")


def torch_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_a_second_run_reuses_the_cache_and_a_changed_input_rebuilds_it(job, tokenizer, tmp_path):
    spec = job()
    first = datacache.prepare_splits(spec, lambda: tokenizer)
    assert first["train"]["built"] and first["eval"]["built"]
    manifest = cache_dir(spec, first["train"]["key"]) / "manifest.json"
    written = manifest.stat().st_mtime_ns
    again = datacache.prepare_splits(spec, lambda: tokenizer)
    assert again == {name: {**entry, "built": False} for name, entry in first.items()}
    assert manifest.stat().st_mtime_ns == written
    datacache.load_splits(spec, no_tokenizer, rank=0, keys=again)  # a worker given the driver's keys
    assert manifest.stat().st_mtime_ns == written

    with open(spec.data.train, "a") as fh:  # the data file changes
        fh.write(json.dumps({"messages": [{"role": "user", "content": "sort 2 1"},
                                          {"role": "assistant", "content": "1 2"}]}) + "\n")
    changed_data = datacache.prepare_splits(spec, lambda: tokenizer)
    assert changed_data["train"]["built"] and changed_data["train"]["key"] != first["train"]["key"]
    assert not changed_data["eval"]["built"]

    longer = datacache.prepare_splits(job(seq_len=96), lambda: tokenizer)
    assert longer["train"]["built"] and longer["train"]["key"] != changed_data["train"]["key"]

    templated = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    templated.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    other_tokenizer = datacache.prepare_splits(spec, lambda: templated)
    assert other_tokenizer["train"]["built"] and other_tokenizer["train"]["key"] != changed_data["train"]["key"]


def damage_flip_a_byte(directory):
    path = directory / "rows-00000.npy"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(raw))


def damage_no_manifest(directory):
    (directory / "manifest.json").unlink()  # a build that stopped before its commit marker


def damage_short_file(directory):
    path = directory / "meta-00000.npy"
    path.write_bytes(path.read_bytes()[:-16])


@pytest.mark.parametrize("damage", [damage_flip_a_byte, damage_no_manifest, damage_short_file])
def test_a_damaged_cache_is_rebuilt_never_read(job, tokenizer, damage):
    spec = job()
    keys = datacache.prepare_splits(spec, lambda: tokenizer)
    directory = cache_dir(spec, keys["train"]["key"])
    damage(directory)
    assert datacache.verified(str(directory), keys["train"]["key"]) is None
    train, _ = datacache.load_splits(spec, lambda: tokenizer, rank=0, keys=keys)  # rank 0 finds it unsound and rebuilds
    assert as_lists(train) == as_lists(data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len))
    assert datacache.verified(str(directory), keys["train"]["key"]) is not None
    damage(directory)
    assert datacache.prepare_splits(spec, lambda: tokenizer)["train"]["built"]  # the driver's check catches it too


def test_eval_examples_caps_examples_before_packing(job, tokenizer):
    """Before: the recipe kept the first `eval_examples` packed rows, each holding several examples."""
    spec = job(eval_examples=7)
    _, evaluation = datacache.load_splits(spec, lambda: tokenizer, rank=0)
    assert sum(len(m) for m in evaluation.examples_per_row) == 7
    first_seven = data.prepare(spec.data.eval, spec.data.format, tokenizer, spec.data.seq_len, limit=7)
    assert as_lists(evaluation) == as_lists(first_seven)


def test_a_cache_left_half_built_does_not_hide_the_real_one(job, tokenizer):
    spec = job()
    keys = datacache.prepare_splits(spec, lambda: tokenizer)
    root = Path(datacache.root_of(spec.run.storage)[1])
    (root / f".{keys['train']['key']}.partial-deadbeef").mkdir()  # a build killed before its rename
    assert not datacache.prepare_splits(spec, lambda: tokenizer)["train"]["built"]
    assert sorted(os.listdir(cache_dir(spec, keys["train"]["key"]))) == ["manifest.json", "meta-00000.npy", "rows-00000.npy"]


def test_a_local_tokenizer_directory_keys_the_cache_without_loading_the_tokenizer(job, tokenizer, tmp_path):
    """The driver finds an existing cache with no transformers import: the tokenizer directory's files are hashed
    as they are. Weights next to them do not change the key; a changed chat template does."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(REPO / "examples" / "tiny" / "tokenizer", directory)
    (directory / "model.safetensors").write_bytes(b"weights")
    spec = job().model_copy(update={"model": job().model.model_copy(update={"path": str(directory)})})
    assert datacache.prepare_splits(spec, lambda: tokenizer)["train"]["built"]
    again = datacache.prepare_splits(spec, no_tokenizer)
    assert not again["train"]["built"] and not again["eval"]["built"]

    (directory / "model.safetensors").write_bytes(b"trained weights")
    assert datacache.prepare_splits(spec, no_tokenizer) == again
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    changed = datacache.prepare_splits(spec, lambda: AutoTokenizer.from_pretrained(directory))
    assert changed["train"]["built"] and changed["train"]["key"] != again["train"]["key"]


def test_two_runs_building_one_key_never_pull_the_cache_from_under_a_reader(job, tokenizer, monkeypatch):
    """Run B checked before run A committed, so both build. A's committed cache, which A's workers are reading, is
    never removed or replaced by B: it stays sound at every rename B makes, keeps its files (same inodes), and B
    returns A's manifest and leaves no staging directory behind."""
    spec = job()
    split = datacache.splits(spec)["train"]
    fs, root = datacache.root_of(spec.run.storage)
    key = datacache.cache_key(split, "tok")
    winner = datacache.build(fs, root, key, split, tokenizer)
    final = os.path.join(root, key)
    inode = os.stat(os.path.join(final, "rows-00000.npy")).st_ino
    sound_at_each_rename = []
    rename, rmtree = os.rename, shutil.rmtree

    def checked(change):
        def run(*args, **kwargs):
            sound_at_each_rename.append(datacache.verified(final, key) is not None)
            return change(*args, **kwargs)
        return run

    monkeypatch.setattr(os, "rename", checked(rename))
    monkeypatch.setattr(shutil, "rmtree", checked(rmtree))
    loser = datacache.build(fs, root, key, split, tokenizer)
    assert sound_at_each_rename and all(sound_at_each_rename)
    assert loser == winner and os.stat(os.path.join(final, "rows-00000.npy")).st_ino == inode
    assert sorted(os.listdir(root)) == [key]
