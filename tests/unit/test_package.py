"""trainlift shipped to a cluster as a wheel in runtime_env `py_modules`: built reproducibly, importable in the
layout Ray itself makes of it on a node, and uploaded to S3 (moto) by `trainlift package --upload`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import trainlift
from trainlift.cli import app
from trainlift.errors import UsageError
from trainlift.ops import package

SOURCE = Path(trainlift.__file__).parent
runner = CliRunner()

READ_CATALOG = ("import importlib.resources, trainlift; "
                "print(trainlift.__file__); "
                "print(len((importlib.resources.files('trainlift') / 'catalog' / 'platform.yaml').read_text()))")


def ray_node_layout(artifact: Path, resources: Path) -> str:
    """What a Ray node puts on PYTHONPATH for a remote py_modules URI: Ray's own plugin downloads and unpacks (or
    pip-installs) the artifact, then sets PYTHONPATH. A file:// URI takes the same branch as s3://."""
    from ray._private.runtime_env.context import RuntimeEnvContext
    from ray._private.runtime_env.py_modules import PyModulesPlugin

    uri = artifact.resolve().as_uri()
    plugin = PyModulesPlugin(str(resources), gcs_client=None)
    context = RuntimeEnvContext(env_vars={})
    os.environ.pop("PYTHONPATH", None)
    asyncio.run(plugin.create(uri, {"py_modules": [uri]}, context))
    plugin.modify_context([uri], {"py_modules": [uri]}, context)
    return context.env_vars["PYTHONPATH"]


def fresh_python(pythonpath: str, cwd: Path) -> subprocess.CompletedProcess:
    """A new interpreter that sees only `pythonpath`: no site-packages (-S), so no installed trainlift."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-S", "-c", READ_CATALOG], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=60)


def hand_made_zip(path: Path) -> Path:
    """The layout of `cd src && zip -r trainlift.zip trainlift`: one top-level folder `trainlift/`."""
    with zipfile.ZipFile(path, "w") as zf:
        for file in sorted(SOURCE.rglob("*")):
            if "__pycache__" not in file.parts:
                zf.write(file, Path("trainlift") / file.relative_to(SOURCE))
    return path


def test_the_wheel_imports_in_rays_unpacked_layout_and_the_hand_made_zip_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # Ray runs `pip`
    wheel = package.build_wheel(tmp_path / "dist")
    layout = ray_node_layout(wheel, tmp_path / "node-a")
    result = fresh_python(layout, tmp_path)
    assert result.returncode == 0, result.stderr
    module_file, catalog_chars = result.stdout.split()
    assert Path(module_file).is_relative_to(layout) and int(catalog_chars) > 100

    old = ray_node_layout(hand_made_zip(tmp_path / "trainlift.zip"), tmp_path / "node-b")
    result = fresh_python(old, tmp_path)
    assert result.returncode == 1 and "ModuleNotFoundError: No module named 'trainlift'" in result.stderr
    assert (Path(old) / "catalog" / "platform.yaml").is_file()  # Ray unpacked the folder's contents


def test_the_build_is_reproducible_and_its_name_carries_the_content(tmp_path):
    first = package.build_wheel(tmp_path / "a")
    second = package.build_wheel(tmp_path / "b")
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    assert first.name.startswith(f"trainlift-{trainlift.__version__}-") and first.name.endswith("-py3-none-any.whl")

    edited = tmp_path / "src" / "trainlift"
    shutil.copytree(SOURCE, edited, ignore=shutil.ignore_patterns("__pycache__"))
    (edited / "catalog" / "platform.yaml").write_text("edited: true\n")
    # Ray caches a wheel on each node by its file name: new content must mean a new name.
    assert package.build_wheel(tmp_path / "c", source=edited).name != first.name


def test_the_wheel_holds_the_package_data_and_declares_no_dependencies(tmp_path):
    """pip installs py_modules wheels on every node: a declared dependency would pull torch over the image's."""
    names = zipfile.ZipFile(package.build_wheel(tmp_path)).namelist()
    assert "trainlift/catalog/platform.yaml" in names and "trainlift/__main__.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Requires-Dist" not in zipfile.ZipFile(package.build_wheel(tmp_path)).read(metadata).decode()


def test_package_command_prints_the_wheel_it_wrote(tmp_path):
    result = runner.invoke(app, ["package", "--output-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["uri"] == report["wheel"] == str(next(tmp_path.glob("*.whl")))
    assert report["version"] == trainlift.__version__
    plain = runner.invoke(app, ["package", "--output-dir", str(tmp_path)])
    assert plain.stdout.strip() == report["uri"]  # one line, for URI=$(trainlift package)


def test_package_upload_puts_the_wheel_under_the_s3_prefix(tmp_path, monkeypatch):
    """S3 is moto's in-process mock."""
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-2")
        s3.create_bucket(Bucket="ckpt", CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
        result = runner.invoke(app, ["package", "--output-dir", str(tmp_path), "--upload", "s3://ckpt/code/"])
        assert result.exit_code == 0, result.output
        uri = result.stdout.strip().splitlines()[-1]
        wheel = next(tmp_path.glob("*.whl"))
        assert uri == f"s3://ckpt/code/{wheel.name}"
        assert s3.get_object(Bucket="ckpt", Key=f"code/{wheel.name}")["Body"].read() == wheel.read_bytes()


@pytest.mark.parametrize("destination", ["ckpt/code", "s3://ckpt/code/trainlift.whl", "s3://"])
def test_upload_destination_must_be_an_s3_folder(destination):
    with pytest.raises(UsageError, match="--upload"):
        package.s3_destination(destination, "trainlift-0.1.0-123-py3-none-any.whl")
