"""`model.revision` pins a hub model to a commit on every fetch: each commit is a cache of its own, and the files
come from that commit. The Hugging Face hub cannot be reached from here, so `snapshot_download` is replaced by a
stand-in that serves two commits of a repository from local directories, taking `revision` as the hub does
(None: the main branch)."""

from __future__ import annotations

import json
import shutil

import pytest

from trainlift.config.job import load_job_spec
from trainlift.errors import SpecError
from trainlift.train.model import fetch

OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch):
    commits = {}
    for sha, layers in ((OLD, 2), (NEW, 4)):
        commit = tmp_path / "hub" / sha
        commit.mkdir(parents=True)
        (commit / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": layers}))
        (commit / "model.safetensors").write_bytes(b"weights of " + sha.encode())
        commits[sha] = commit
    commits[None] = commits[NEW]  # main points at the newest commit
    asked = []

    def snapshot_download(repo, revision=None, local_dir=None, allow_patterns=()):
        asked.append(revision)
        for f in commits[revision].iterdir():
            if any(fetch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, local_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    return asked


def test_each_commit_is_fetched_as_pinned_into_a_cache_of_its_own(hub):
    old = fetch.model_dir("org/model", revision=OLD)
    new = fetch.model_dir("org/model", revision=NEW)
    assert old != new
    assert json.loads((old / "config.json").read_text())["num_hidden_layers"] == 2
    assert (old / "model.safetensors").read_bytes() == b"weights of " + OLD.encode()
    assert json.loads((new / "config.json").read_text())["num_hidden_layers"] == 4
    assert hub == [OLD, OLD, NEW, NEW]  # metadata, then weights, each from the pinned commit
    assert fetch.model_dir("org/model", revision=OLD) == old and len(hub) == 4  # once per node
    assert fetch.cached_dir("org/model", OLD) == old and fetch.cached_dir("org/model") is None


def test_a_revision_must_be_a_commit_of_a_hub_model(tmp_path):
    spec = "examples/tiny-local.yaml"
    with pytest.raises(SpecError, match="model.revision: String should match pattern"):
        load_job_spec(spec, ["model.path=org/model", "model.revision=main"])
    with pytest.raises(SpecError, match="model.revision pins a hub model's commit"):
        load_job_spec(spec, ["model.path=s3://bucket/model", "model.config=null", f"model.revision={OLD}"])
    assert load_job_spec(spec, ["model.path=org/model", "model.config=null", f"model.revision={OLD}"]
                         ).model.revision == OLD
