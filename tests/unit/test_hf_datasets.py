"""Data from the Hugging Face ecosystem: a directory `datasets` saved, a local directory in the hub's layout, and a
hub dataset `hf://datasets/<org>/<name>`, fetched once per node and per revision. The hub cannot be reached from
here, so `snapshot_download` is replaced by a stand-in that writes each commit of a repository in the hub's
layout, taking `revision` as the hub does (None: the main branch)."""

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import load_job_spec, validate_job_spec
from trainlift.errors import SpecError, UsageError
from trainlift.train.data import cache as datacache, examples as data, hub, source as datasource

REPO = Path(__file__).resolve().parents[2]
ALPACA = [{"instruction": f"add {i} {i + 1}", "input": "", "output": str(2 * i + 1)} for i in range(24)]
CHATS = [{"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]}
         for r in ALPACA]
OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


def reference(tmp_path, tokenizer, rows=CHATS):
    path = tmp_path / "reference.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data.prepare(str(path), "messages", tokenizer, 32).rows


def saved(path, rows=ALPACA, **splits):
    if splits:
        datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in splits.items()}).save_to_disk(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(path)
    return str(path)


def hub_layout(path, **splits):
    (path / "data").mkdir(parents=True)
    for name, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), path / "data" / f"{name}-00000-of-00001.parquet")
    return str(path)


def test_a_saved_dataset_yields_the_same_examples_as_the_same_rows_in_jsonl(tmp_path, tokenizer):
    expected = reference(tmp_path, tokenizer)
    assert data.prepare(saved(tmp_path / "saved"), "auto", tokenizer, 32).rows == expected
    whole = saved(tmp_path / "dict", train=ALPACA, test=ALPACA[:3])
    chosen = datasource.SourceSpec(whole, split="train")
    assert data.prepare(chosen, "auto", tokenizer, 32).rows == expected
    assert len(list(data.records(datasource.SourceSpec(whole, split="test")))) == 3


def test_a_saved_dataset_dict_needs_a_split_chosen_among_its_own(tmp_path):
    whole = saved(tmp_path / "dict", train=ALPACA, test=ALPACA[:3])
    with pytest.raises(UsageError) as err:
        list(data.records(whole))
    assert err.value.one_line() == (f"data.train: {whole} holds the splits train, test: choose one "
                                    f"(write data.train as {{source: {whole}, split: train}})")
    with pytest.raises(UsageError, match=r"data\.eval: .* has no split validation \(it holds train, test\)"):
        list(data.records(datasource.SourceSpec(whole, split="validation", field="data.eval")))
    single = saved(tmp_path / "one", train=ALPACA)  # a DatasetDict of one split needs no choice
    assert len(list(data.records(single))) == len(ALPACA)


def test_a_bad_row_of_a_saved_dataset_is_named_by_its_source_and_row(tmp_path):
    rows = [dict(r) for r in ALPACA[:3]]
    rows[1]["output"] = None
    path = saved(tmp_path / "bad", rows)
    with pytest.raises(UsageError, match=rf"^{path}:row 2: output must be text \(got NoneType\)$"):
        list(data.records(path, "alpaca"))


def test_a_hub_layout_directory_is_read_through_datasets(tmp_path, tokenizer):
    expected = reference(tmp_path, tokenizer)
    layout = hub_layout(tmp_path / "layout", train=ALPACA, test=ALPACA[:2])
    assert datasource.resolve(layout)[0].dataset
    assert data.prepare(datasource.SourceSpec(layout, split="train"), "auto", tokenizer, 32).rows == expected
    with pytest.raises(UsageError, match=r"holds the splits train, test: choose one"):
        list(data.records(layout))


def test_a_hub_layout_directory_with_configs_in_its_readme(tmp_path):
    root = tmp_path / "configs"
    for config, rows in (("short", ALPACA[:2]), ("long", ALPACA)):
        (root / config).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), root / config / "train-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: short\n  data_files:\n  - split: train\n"
                                    "    path: short/*.parquet\n- config_name: long\n  data_files:\n"
                                    "  - split: train\n    path: long/*.parquet\n---\n# Sums\n")
    assert hub.kind_of(str(root)) == "hub_dir"
    assert len(list(data.records(datasource.SourceSpec(str(root), config="short", split="train")))) == 2
    assert len(list(data.records(datasource.SourceSpec(str(root), config="long")))) == len(ALPACA)
    with pytest.raises(UsageError, match=r"datasets cannot load .* \(config medium\)"):
        list(data.records(datasource.SourceSpec(str(root), config="medium", split="train")))


def test_split_and_config_are_refused_where_there_is_nothing_to_choose(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(CHATS[0]) + "\n")
    with pytest.raises(UsageError, match=r"data\.train: .*rows\.jsonl is not a dataset with configs or splits"):
        list(data.records(datasource.SourceSpec(str(path), split="train")))
    with pytest.raises(UsageError, match=r"was saved by datasets and has no configs"):
        list(data.records(datasource.SourceSpec(saved(tmp_path / "s"), config="x")))


def test_the_cache_key_follows_a_saved_datasets_content_and_split(tmp_path):
    def key(source):
        return datacache.cache_key(datacache.Split((source,), 64), "tok")

    whole = saved(tmp_path / "dict", train=ALPACA, test=ALPACA[:3])
    train, test = datasource.SourceSpec(whole, split="train"), datasource.SourceSpec(whole, split="test")
    assert key(train) != key(test)
    before = key(train)
    saved(tmp_path / "dict2", train=ALPACA[:-1], test=ALPACA[:3])
    assert key(datasource.SourceSpec(str(tmp_path / "dict2"), split="train")) != before
    assert key(datasource.SourceSpec(saved(tmp_path / "copy", train=ALPACA, test=[ALPACA[0]]), split="train")) == before


def parquet_bytes(rows) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


CARD = ("---\nconfigs:\n- config_name: sums\n  default: true\n  data_files:\n  - split: train\n    path: sums/train-*\n"
        "  - split: test\n    path: sums/test-*\n- config_name: big\n  data_files:\n  - split: train\n"
        "    path: big/*.parquet\n---\n# Sums\n")


def repository(repo_id: str, revision: str | None) -> dict[str, bytes]:
    """The files of a stand-in hub repository at a revision: org/sums in the hub's default layout (no card), two
    commits; org/cards with a README.md naming two configs, one with two splits."""
    if repo_id == "org/cards":
        return {"README.md": CARD.encode(), "sums/train-00000-of-00001.parquet": parquet_bytes(ALPACA),
                "sums/test-00000-of-00001.parquet": parquet_bytes(ALPACA[:3]),
                "big/train-00000-of-00002.parquet": parquet_bytes(ALPACA * 4),
                "big/train-00001-of-00002.parquet": parquet_bytes(ALPACA * 4)}
    rows = ALPACA[:5] if revision == OLD else ALPACA  # main is the newest commit
    return {"data/train-00000-of-00001.parquet": parquet_bytes(rows)}


@pytest.fixture
def hub_repo(tmp_path, monkeypatch):
    """A stand-in hub serving `repository`'s files, filtered by allow_patterns as huggingface_hub filters them
    (fnmatch on the repository path); returns its calls."""
    from fnmatch import fnmatch

    calls = []

    def snapshot_download(repo_id, repo_type=None, revision=None, local_dir=None, allow_patterns=None, **kwargs):
        calls.append({"repo_id": repo_id, "repo_type": repo_type, "revision": revision,
                      "allow_patterns": allow_patterns})
        for path, content in repository(repo_id, revision).items():
            if allow_patterns is None or any(fnmatch(path, pattern) for pattern in allow_patterns):
                (Path(local_dir) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(local_dir) / path).write_bytes(content)
        (Path(local_dir) / ".cache").mkdir(exist_ok=True)  # huggingface_hub's bookkeeping, which is not data

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "dataset-cache"))
    return calls


def test_a_hub_dataset_is_fetched_at_its_revision_into_a_cache_per_revision(hub_repo, tmp_path):
    old = datasource.SourceSpec("hf://datasets/org/sums", split="train", revision=OLD)
    new = datasource.SourceSpec("hf://datasets/org/sums", split="train", revision=NEW)
    assert [r["messages"][1]["content"] for r in data.records(old)] == [r["output"] for r in ALPACA[:5]]
    assert len(list(data.records(new))) == len(ALPACA)
    # the card first, then (no configs named in it) the whole repository
    assert [(c["repo_id"], c["repo_type"], c["revision"], c["allow_patterns"]) for c in hub_repo] == [
        ("org/sums", "dataset", OLD, ["README.md"]), ("org/sums", "dataset", OLD, None),
        ("org/sums", "dataset", NEW, ["README.md"]), ("org/sums", "dataset", NEW, None)]
    list(data.records(old))
    assert len(hub_repo) == 4  # once per node and revision
    copies = sorted(p.name for p in (tmp_path / "dataset-cache").iterdir() if p.is_dir())
    assert [name.rsplit("-", 1)[0] for name in copies] == [f"datasets--org--sums--{OLD}", f"datasets--org--sums--{NEW}"]
    where = [w for w, _ in datasource.rows_of(old)]
    assert where[:2] == ["hf://datasets/org/sums:row 1", "hf://datasets/org/sums:row 2"]


def test_a_pinned_hub_dataset_keys_the_cache_by_its_revision_without_fetching(hub_repo):
    def key(revision):
        source = datasource.SourceSpec("hf://datasets/org/sums", split="train", revision=revision)
        return datacache.cache_key(datacache.Split((source,), 64), "tok")

    assert key(OLD) != key(NEW) and key(OLD) == key(OLD)
    assert hub_repo == []
    unpinned = key(None)  # the main branch: fetched once, keyed by its files
    assert len(hub_repo) == 2 and {c["revision"] for c in hub_repo} == {None}
    assert key(None) == unpinned and len(hub_repo) == 2
    assert unpinned not in (key(OLD), key(NEW))


def test_a_hub_dataset_trains_through_the_data_cache(hub_repo, tmp_path, tokenizer):
    spec = validate_job_spec({"model": {"path": "unused"}, "run": {"storage": str(tmp_path / "runs")}, "data": {
        "train": {"source": "hf://datasets/org/sums", "split": "train", "revision": NEW}, "seq_len": 32}})
    keys = datacache.prepare_splits(spec, lambda: tokenizer)
    train, _ = datacache.load_splits(spec, lambda: tokenizer, rank=0, keys=keys)
    assert [[int(t) for t in r["input_ids"]] for r in train.rows] == [r["input_ids"] for r in reference(tmp_path, tokenizer)]
    [source] = datacache.composition(spec, keys)["train"]
    assert source["source"] == "hf://datasets/org/sums" and source["revision"] == NEW and source["format"] == "alpaca"
    assert source["drawn"] == len(ALPACA) and source["weight"] == 1.0


def test_a_hub_card_with_configs_fetches_only_the_chosen_config(hub_repo, tmp_path):
    """Only the files the card names for the chosen config come down (all its splits: datasets resolves them all),
    one copy per config; a config the card does not have costs the card alone, and datasets names the ones it has."""
    test = datasource.SourceSpec("hf://datasets/org/cards", split="test", revision=NEW)  # the default config
    assert len(list(data.records(test))) == 3
    train = datasource.SourceSpec("hf://datasets/org/cards", config="sums", split="train", revision=NEW)
    assert len(list(data.records(train))) == len(ALPACA)
    assert [c["allow_patterns"] for c in hub_repo] == [["README.md"], ["README.md", "sums/train-*", "sums/test-*"],
                                                       ["README.md"], ["README.md", "sums/train-*", "sums/test-*"]]
    cache = tmp_path / "dataset-cache"
    fetched = {str(p.relative_to(cache)).split("/", 1)[1] for p in cache.rglob("*.parquet")}
    assert fetched == {"sums/test-00000-of-00001.parquet", "sums/train-00000-of-00001.parquet"}  # nothing of big/
    missing = datasource.SourceSpec("hf://datasets/org/cards", config="huge", split="train", revision=NEW)
    with pytest.raises(UsageError, match=r"datasets cannot load hf://datasets/org/cards \(config huge\)"):
        list(data.records(missing))
    assert hub_repo[-1]["allow_patterns"] == ["README.md"]


def test_which_files_a_card_names(tmp_path):
    readme = tmp_path / "README.md"
    assert hub.data_file_patterns(readme, None) is None  # no card: the layout decides, all is fetched
    readme.write_text(CARD)
    assert hub.data_file_patterns(readme, None) == ["sums/train-*", "sums/test-*"]
    assert hub.data_file_patterns(readme, "big") == ["big/*.parquet"]
    assert hub.data_file_patterns(readme, "small") == []
    readme.write_text("---\nconfigs:\n- config_name: a\n  data_files: a.jsonl\n- config_name: b\n"
                      "  data_files: {train: [b1.jsonl, b2.jsonl], validation: bv.jsonl}\n- config_name: c\n"
                      "  data_dir: c/\n---\n")
    assert hub.data_file_patterns(readme, "a") == ["a.jsonl"]
    assert hub.data_file_patterns(readme, "b") == ["b1.jsonl", "b2.jsonl", "bv.jsonl"]
    assert hub.data_file_patterns(readme, "c") == ["c/*"]
    assert hub.data_file_patterns(readme, None) is None  # several configs, none the default: datasets says


def test_hub_ids_and_revisions_in_the_spec(tmp_path):
    base = {"model": {"path": "m"}}
    with pytest.raises(SpecError, match=r"data\.train: not a hub dataset id: write hf://datasets/<org>/<name>"):
        validate_job_spec({**base, "data": {"train": "hf://org/name"}})
    with pytest.raises(SpecError, match=r"data\.train\.revision: String should match pattern"):
        validate_job_spec({**base, "data": {"train": {"source": "hf://datasets/org/name", "revision": "main"}}})
    with pytest.raises(SpecError, match=r"data\.eval: revision pins a hub dataset's commit; e\.jsonl is not hf://"):
        validate_job_spec({**base, "data": {"train": "t.jsonl", "eval": {"source": "e.jsonl", "revision": OLD}}})
    (tmp_path / "job.yaml").write_text(json.dumps({**base, "data": {
        "train": [{"source": "data/saved", "split": "train"}, {"source": "hf://datasets/org/name", "weight": 2}],
        "eval": "data/eval.jsonl"}}))
    data_section = load_job_spec(tmp_path / "job.yaml").data
    assert data_section.locations() == [("data.train[0]", str(tmp_path / "data" / "saved")),
                                        ("data.train[1]", "hf://datasets/org/name"),
                                        ("data.eval", str(tmp_path / "data" / "eval.jsonl"))]
    moved = data_section.with_locations(lambda location: location.replace(str(tmp_path), "/elsewhere"))
    assert [location for _, location in moved.locations()] == [
        "/elsewhere/data/saved", "hf://datasets/org/name", "/elsewhere/data/eval.jsonl"]
    assert moved.train[0].split == "train" and moved.train[1].weight == 2
