"""Rows from the Hugging Face `datasets` ecosystem, by what a `data.train`/`data.eval` location holds:

  saved    a directory `save_to_disk` wrote: `dataset_info.json` and `state.json` (one Dataset) or
           `dataset_dict.json` (a DatasetDict, whose split must be chosen unless it holds one); read with
           `datasets.load_from_disk`
  hub_dir  a local directory in the hub's layout (`data/train-00000-of-00001.parquet`, or a README.md whose YAML
           names `configs:`), or any local directory given a config or split; read with
           `datasets.load_dataset(path, name=config, split=split, streaming=True)`, so nothing is written beside it
  hub_id   `hf://datasets/<org>/<name>`: fetched once per node (`snapshot_download`, at `revision` when given) into
           this user's dataset cache, then read as a hub_dir; the chosen config's files only where the README names
           configs

A dataset is identified by its files (every file of the directory, or of the chosen split of a saved DatasetDict),
except a hub id pinned to a revision: the commit is enough, and nothing is fetched to name it.

`datasets` is imported inside the functions that read: importing it takes a second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

from trainlift import hub_fetch
from trainlift.errors import UsageError

HUB_PREFIX = "hf://datasets/"
HUB_ID = re.compile(r"hf://datasets/(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")
SAVED_DATASET = ("dataset_info.json", "state.json")
SAVED_DICT = "dataset_dict.json"
HUB_SHARD = re.compile(r"[\w.-]+-\d{5}-of-\d{5}\.\w+")  # how the hub names a split's files under data/
CACHE_ENV = "TRAINLIFT_DATASET_CACHE"
NOT_A_DATASET = ("split, config and revision choose within a dataset: a directory saved by datasets, one in the "
                 "hub's layout, or hf://datasets/<org>/<name>")


def kind_of(location: str, config: str | None = None, split: str | None = None,
            field: str = "data.train") -> str | None:
    """saved, hub_dir or hub_id for a `datasets` source; None for today's files (refused with a config or split)."""
    if location.startswith(HUB_PREFIX):
        return "hub_id"
    path = Path(location).expanduser()
    if "://" not in location and path.is_dir():
        if (path / SAVED_DICT).is_file() or all((path / name).is_file() for name in SAVED_DATASET):
            if config is not None:
                raise UsageError(f"{field}: {location} was saved by datasets and has no configs",
                                 hint=f"drop {field}.config")
            return "saved"
        if config is not None or split is not None or in_hub_layout(path):
            return "hub_dir"
    if config is not None or split is not None:
        raise UsageError(f"{field}: {location} is not a dataset with configs or splits", hint=NOT_A_DATASET)
    return None


def in_hub_layout(path: Path) -> bool:
    """A README.md whose YAML header names `configs:`, or split files named as the hub names them under data/."""
    readme = path / "README.md"
    if readme.is_file():
        header = readme.read_text(errors="replace").split("\n---", 1)[0]
        if header.startswith("---") and re.search(r"^configs:", header, re.M):
            return True
    data = path / "data"
    return data.is_dir() and any(HUB_SHARD.fullmatch(entry.name) for entry in data.iterdir())


def files(kind: str, location: str, config: str | None, split: str | None, revision: str | None,
          field: str) -> list[tuple[str, int, int]]:
    """(path or URI, size, mtime_ns) of what identifies the dataset: a pinned hub id by its commit alone."""
    if kind == "hub_id":
        if revision is not None:
            return [(f"{location}@{revision}", 0, 0)]
        return _files_under(hub_copy(location, None, field, config))
    path = Path(location).expanduser()
    return _files_under(saved_split_dir(path, split, location, field) if kind == "saved" else path)


def _files_under(directory: Path) -> list[tuple[str, int, int]]:
    out = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith("."):
                stat = os.stat(os.path.join(root, name))
                out.append((os.path.join(root, name), stat.st_size, stat.st_mtime_ns))
    return sorted(out)


def saved_split_dir(path: Path, split: str | None, location: str, field: str) -> Path:
    """The directory of the chosen split of a saved DatasetDict (its only one when none is chosen); a saved
    Dataset's own directory."""
    if not (path / SAVED_DICT).is_file():
        if split is not None:
            raise UsageError(f"{field}: {location} holds one dataset saved by datasets, with no splits",
                             hint=f"drop {field}.split")
        return path
    splits = json.loads((path / SAVED_DICT).read_text())["splits"]
    return path / choose_split(splits, split, location, field)


def choose_split(splits: list[str], split: str | None, location: str, field: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None:
        raise UsageError(f"{field}: {location} holds the splits {', '.join(splits)}: choose one",
                         hint=f"write {field} as {{source: {location}, split: {splits[0]}}}")
    if split not in splits:
        raise UsageError(f"{field}: {location} has no split {split} (it holds {', '.join(splits)})",
                         hint=f"set {field}.split to one of them")
    return split


def rows(kind: str, location: str, config: str | None, split: str | None, revision: str | None,
         field: str) -> Iterator[tuple[str, Any]]:
    """(`<location>:row N`, row) for every row of the chosen split, in the dataset's order."""
    dataset = open_dataset(kind, location, config, split, revision, field)
    for n, row in enumerate(dataset, 1):
        yield f"{location}:row {n}", row


def open_dataset(kind: str, location: str, config: str | None, split: str | None, revision: str | None, field: str):
    import datasets

    if kind == "saved":
        return datasets.load_from_disk(str(saved_split_dir(Path(location).expanduser(), split, location, field)))
    path = str(hub_copy(location, revision, field, config) if kind == "hub_id" else Path(location).expanduser())
    named = f"{location}{f' (config {config})' if config else ''}"
    try:
        split = choose_split(datasets.get_dataset_split_names(path, config_name=config), split, location, field)
        return datasets.load_dataset(path, name=config, split=split, streaming=True)
    except UsageError:
        raise
    except Exception as exc:  # datasets raises many kinds for a bad directory, config or split; all are the input's
        raise UsageError(f"{field}: datasets cannot load {named} ({str(exc).splitlines()[0]})",
                         hint=f"check its data files and README.md configs, and {field}'s config and split") from None


def hub_copy(location: str, revision: str | None, field: str, config: str | None = None) -> Path:
    """This node's copy of hub dataset `location` at `revision` (None: the main branch when first fetched here), with
    the data files of `config` only where its README.md's `configs:` name them (`data_file_patterns`), so one copy
    per config."""
    if not HUB_ID.fullmatch(location):
        raise UsageError(f"{field}: {location} is not a hub dataset id", hint="write hf://datasets/<org>/<name>")
    chosen = f" config={config}" if config else ""
    target = hub_fetch.node_cache("datasets", CACHE_ENV) / hub_fetch.cache_name(location + chosen, revision)
    return hub_fetch.fetch_once(target, lambda out: _download(location, revision, out, field, config),
                                {"source": location, "revision": revision, "config": config})


def data_file_patterns(readme: Path, config: str | None) -> list[str] | None:
    """The repository paths (fnmatch patterns) of the data files a hub README.md's `configs:` names for `config`
    (the default one, or the only one, when None), every split of it: datasets resolves them all whichever split
    is read. [] for a config it does not have (datasets then names those it has). None where the README names no
    configs, or no default among several: datasets finds the files by their layout, so the whole repository is
    needed."""
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    if not text.startswith("---"):
        return None
    import yaml

    header = yaml.safe_load(text[3:].split("\n---", 1)[0]) or {}
    configs = [c for c in header.get("configs") or [] if isinstance(c, dict)] if isinstance(header, dict) else []
    if not configs:
        return None
    if config is None:
        defaults = [c for c in configs if c.get("default")] or [c for c in configs if c.get("config_name") == "default"]
        chosen = defaults[0] if defaults else configs[0] if len(configs) == 1 else None
        if chosen is None:
            return None
    else:
        chosen = next((c for c in configs if c.get("config_name") == config), None)
        if chosen is None:
            return []
    if "data_files" not in chosen:
        return [f"{chosen['data_dir'].strip('/')}/*"] if chosen.get("data_dir") else None
    return [pattern for patterns in _data_files_by_split(chosen["data_files"]).values() for pattern in patterns]


def _data_files_by_split(data_files: Any) -> dict[str, list[str]]:
    """A config's `data_files` as the hub card writes it (a path, a list of paths, a list of {split, path}, or a
    mapping of split to path or paths), by split; bare paths are the train split's."""
    def paths(value: Any) -> list[str]:
        return [value] if isinstance(value, str) else [str(v) for v in value or []]

    if isinstance(data_files, dict):
        return {str(name): paths(value) for name, value in data_files.items()}
    if isinstance(data_files, str) or all(isinstance(entry, str) for entry in data_files or []):
        return {"train": paths(data_files)}
    return {str(entry.get("split", "train")): paths(entry.get("path"))
            for entry in data_files if isinstance(entry, dict)}


def _download(location: str, revision: str | None, out: Path, field: str, config: str | None) -> list[str]:
    from huggingface_hub import snapshot_download

    repo = location.removeprefix(HUB_PREFIX)
    try:
        snapshot_download(repo, repo_type="dataset", revision=revision, local_dir=out, allow_patterns=["README.md"])
        patterns = data_file_patterns(out / "README.md", config)
        if patterns != []:
            snapshot_download(repo, repo_type="dataset", revision=revision, local_dir=out,
                              allow_patterns=None if patterns is None else ["README.md", *patterns])
    except Exception as exc:  # not found, gated, offline, a bad revision: huggingface_hub's errors share no base
        raise UsageError(f"{field}: cannot fetch {location}{f'@{revision}' if revision else ''} "
                         f"({str(exc).splitlines()[0]})",
                         hint="check the id and revision, HF_TOKEN for a gated or private dataset, and that this "
                              "node reaches the hub (HF_ENDPOINT)") from None
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping of the local dir
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
