"""The node's model cache (train/model/fetch.py): one process per node downloads, the others wait and reuse it; a
download that was cut off is never taken for a complete one. The downloader is replaced by one that writes a file
slowly and records each call (the S3 download itself is in tests/integration/test_model_from_s3.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trainlift.train.model import fetch

RACER = textwrap.dedent("""
    import os, sys, time
    from trainlift.train.model import fetch

    def slow_download(path, out, weights, revision=None):
        with open(sys.argv[1], "a") as log:
            log.write(f"{os.getpid()}\\n")
        time.sleep(1.5)  # long enough for the other process to reach the lock
        (out / "config.json").write_text("{}")
        return ["config.json"]

    fetch.download_hub = slow_download
    print(fetch.model_dir("org/tiny-model"))
""")


def test_two_processes_racing_on_one_cache_download_once(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    log = tmp_path / "downloads.log"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(log)], stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    dirs = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert [racer.returncode for racer in racers] == [0, 0]
    assert len(log.read_text().splitlines()) == 1  # one download; the other process waited on the lock
    assert dirs == {str(tmp_path / "cache" / fetch.cache_name("org/tiny-model"))}
    assert fetch.is_complete(fetch.cache_root() / fetch.cache_name("org/tiny-model"))


def test_a_cut_off_download_is_started_over(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def cut_off(path, out, weights):
        calls.append(weights)
        (out / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError("connection reset")

    monkeypatch.setattr(fetch, "download_s3", cut_off)
    with pytest.raises(OSError, match="connection reset"):
        fetch.model_dir("s3://models/tiny")
    target = fetch.cache_root() / fetch.cache_name("s3://models/tiny")
    assert not target.exists() and not fetch.is_complete(target)

    def whole(path, out, weights):
        calls.append(weights)
        assert not any(out.iterdir())  # the half file is gone
        (out / "config.json").write_text("{}")
        return ["config.json"]

    monkeypatch.setattr(fetch, "download_s3", whole)
    assert fetch.model_dir("s3://models/tiny") == target and fetch.is_complete(target)
    assert fetch.model_dir("s3://models/tiny", weights=False) == target  # the whole cache serves the driver too
    assert calls == [True, True]


def test_local_directories_are_used_in_place_and_the_cache_is_under_the_staging_root(tmp_path, monkeypatch):
    assert fetch.model_dir(str(tmp_path)) == tmp_path
    monkeypatch.delenv(fetch.CACHE_ENV, raising=False)
    monkeypatch.setenv(fetch.STAGING_ENV, str(tmp_path / "nvme"))
    assert fetch.staging_root() == str(tmp_path / "nvme")
    assert fetch.cache_root() == tmp_path / "nvme" / "models"
    assert fetch.cache_name("s3://bucket/models/Qwen 2") != fetch.cache_name("s3://bucket/models/Qwen-2")
    assert fetch.cache_name("s3://bucket/models/qwen").startswith("bucket--models--qwen-")
