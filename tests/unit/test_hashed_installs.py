"""What a job installs on the cluster, and what `make install` installs here, is pinned and hash-checked.

The job's runtime_env `pip` carries each package as `NAME==VERSION --hash=sha256:…` with `--require-hashes` among
Ray's `pip_install_options` (Ray writes the packages into a requirements file and appends the options to `pip
install -r`: ray/_private/runtime_env/pip.py); the features' packages and the dependencies the image lacks come
hashed from the catalog, and an unhashed or unpinned `runtime.pip` line or `submit --pip` requirement is refused in
one line saying how to hash it. The Makefile installs pip and torch from hashed files too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift.catalog.packages import (HASHED_PIP_OPTIONS, hashed_packages, image_lock, install_problem,
                                        normalize, runtime_pip)
from trainlift.cli import app
from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError, UsageError
from trainlift.render.job_launch import job_runtime_env

ROOT = Path(__file__).resolve().parents[2]
DLC = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1"
DIGEST = "0" * 64
HASHED = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)( --hash=sha256:[0-9a-f]{64})+$")


def spec(**sections):
    return validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, **sections})


REFUSED = [
    ("liger-kernel==0.6.4", "has no --hash=sha256:"),
    ("liger-kernel>=0.6.4 --hash=sha256:" + DIGEST, "is not pinned to one release"),
    ("liger-kernel==0.6.* --hash=sha256:" + DIGEST, "is not pinned to one release"),
    ("liger-kernel", "is not pinned to one release"),
    ("liger-kernel==0.6.4 --hash=sha256:abc", "is not a pip requirement"),
    ("liger-kernel==0.6.4 --hash=md5:" + "0" * 32, "is not a pip requirement"),
    ("liger-kernel==0.6.4 --index-url=https://pkgs.example/simple --hash=sha256:" + DIGEST, "is not a pip requirement"),
    ("-e .", "is not a pip requirement"),
]


@pytest.mark.parametrize("line, why", REFUSED)
def test_a_runtime_pip_line_without_pin_and_hash_is_refused_before_the_job_is_built(line, why):
    with pytest.raises((SpecError, ValueError)) as refused:
        runtime_pip(spec(runtime={"pip": [line]}), image_lock(DLC))
    message = refused.value.one_line() if isinstance(refused.value, SpecError) else str(refused.value)
    assert why in message and "\n" not in message, message


@pytest.mark.parametrize("line, why", REFUSED[:4])
def test_submit_refuses_an_unhashed_pip_requirement_in_one_line(tmp_path, monkeypatch, line, why):
    (tmp_path / "job.yaml").write_text("model: {path: m}\ndata: {train: t.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["submit", "job.yaml", "--address", "http://127.0.0.1:9", "--dry-run",
                                      "--pip", line])
    assert isinstance(result.exception, UsageError), result.output
    assert result.exception.one_line().startswith("--pip: ") and why in result.exception.one_line()
    assert "--hash=sha256:DIGEST" in result.exception.hint and "pip hash" in result.exception.hint


def test_a_hashed_pinned_line_travels_as_written():
    line = "liger-kernel==0.6.4 --hash=sha256:" + DIGEST + " --hash=sha256:" + "1" * 64
    assert install_problem(line) is None
    assert runtime_pip(spec(runtime={"pip": [line]}), image_lock(DLC)) == [line]


def test_every_line_the_features_bring_is_pinned_and_hashed():
    job = spec(model={"path": "m", "lora": {}}, run={"trackers": ["tensorboard", "mlflow"]})
    for lock in (image_lock(DLC), None):
        lines = runtime_pip(job, lock)
        assert lines and all(HASHED.match(line) for line in lines), lines
        assert {"peft", "tensorboard", "mlflow-skinny"} <= {normalize(HASHED.match(x)[1]) for x in lines}
    have = image_lock(DLC).packages
    assert not [x for x in runtime_pip(job, image_lock(DLC)) if normalize(HASHED.match(x)[1]) in have]


def test_the_runtime_env_installs_with_pips_hash_checking_mode_as_ray_takes_it():
    from ray._private.runtime_env.validation import parse_and_validate_pip

    lines = runtime_pip(spec(model={"path": "m", "lora": {}}), image_lock(DLC))
    env = job_runtime_env("s3://b/code.zip", ["s3://b/t.whl"], pip=lines)
    parsed = parse_and_validate_pip(env["pip"])
    assert parsed["packages"] == lines and parsed["pip_install_options"][0] == "--require-hashes"
    assert tuple(parsed["pip_install_options"]) == HASHED_PIP_OPTIONS
    assert "pip" not in job_runtime_env("s3://b/code.zip", [], pip=[])


def test_the_catalogs_hashes_cover_each_feature_at_its_pinned_release_and_nothing_the_image_has():
    packages = hashed_packages()
    pins = yaml.safe_load((ROOT / "src/trainlift/catalog/job_packages.yaml").read_text())["packages"]
    for name, entry in pins.items():
        assert packages[normalize(name)].version == entry["version"] and packages[normalize(name)].features == (name,)
    have = image_lock(DLC).packages
    assert not set(packages) & set(have)
    assert all(p.sha256 and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in p.sha256) for p in packages.values())
    assert all(set(p.features) <= set(pins) for p in packages.values())


# --- the Makefile ---------------------------------------------------------------------------------------------------

def install_recipe() -> list[str]:
    make = (ROOT / "Makefile").read_text()
    recipe = make.split("$(STAMP):", 1)[1].split("\ninstall:", 1)[0]
    return [line.strip() for line in recipe.replace("\\\n", " ").splitlines() if "pip install" in line]


def hashed_entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    entries, current = {}, None
    for line in path.read_text().splitlines():
        if found := re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", line):
            current = normalize(found[1])
            entries[current] = (found[2], [])
        elif line.strip().startswith("--hash=sha256:"):
            entries[current][1].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
    return entries


def test_make_install_hash_checks_pip_and_torch_too():
    installs = install_recipe()
    from_index = [line for line in installs if "-e ." not in line]
    assert len(from_index) >= 3 and all("--require-hashes" in line for line in from_index), from_index
    assert any("-r requirements-pip.txt" in line for line in installs)
    torch = [cmd for line in installs for cmd in line.split("||") if "torch==" in cmd]
    assert len(torch) == 2 and all("--require-hashes" in cmd and "-c requirements-torch.txt torch==$(TORCH_VERSION)"
                                   in cmd for cmd in torch)  # a build in pip's find-links first, else the index's


def test_the_pip_and_torch_files_pin_what_the_makefile_names_with_pypis_hashes():
    make = (ROOT / "Makefile").read_text()
    torch_version = re.search(r"^TORCH_VERSION := (\S+)$", make, re.M)[1]
    cuda = set(re.search(r"^TORCH_PACKAGES := (.*?)\n\n", make, re.M | re.S)[1].replace("\\", " ").split())
    pip = hashed_entries(ROOT / "requirements-pip.txt")
    assert list(pip) == ["pip"] and pip["pip"][1]
    torch = hashed_entries(ROOT / "requirements-torch.txt")
    assert torch["torch"][0] == torch_version and set(torch) == {normalize(n) for n in cuda}
    # PyPI's torch 2.13.0 wheel for CPython 3.11 on Linux x86_64 (https://pypi.org/simple/torch/)
    assert "60fcdcb2f3876e21146cb4524ef06397d727ca9ad5f020818547e25075fe3cb7" in torch["torch"][1]
    assert all(hashes for _, hashes in torch.values())
