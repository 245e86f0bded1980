"""What a node runs (`python -m trainlift train`, `python -m trainlift doctor`) needs only the cluster image's
packages: run here with every installed package that the image's lock does not list hidden (tests/support/
image_only/sitecustomize.py), as inside the unmodified DLC. A quick check in this environment; test_image_env.py
trains in an environment built from the image's lock, where those packages are not installed at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "src" / "trainlift" / "catalog" / "images" / "ray-train-ml-cuda-v1.1.0.txt"


def image_only(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_IMAGE_LOCK": str(LOCK),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "support" / "image_only"),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_the_hidden_packages_are_really_gone(tmp_path):
    probe = ("import importlib.util as u, json, sys, trainlift.cli, trainlift.cli.train, trainlift.doctor.probe; "
             "print(json.dumps({'found': [m for m in ('peft', 'mlflow', 'tensorboard', 'kubernetes_validate', "
             "'pathspec', 'torch', 'ray', 'transformers') if u.find_spec(m)], "
             "'user_side': sorted(m for m in sys.modules if m.startswith(('trainlift.render', 'trainlift.cloud')))}))")
    done = image_only("-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"found": ["torch", "ray", "transformers"], "user_side": []}


def test_train_and_doctor_start_with_only_the_image_packages(tmp_path):
    for command in ("train", "doctor"):
        helped = image_only("-m", "trainlift", command, "--help", cwd=tmp_path)
        assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr[-2000:]
    doctor = image_only("-m", "trainlift", "doctor", "--json", cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    assert json.loads(doctor.stdout)["facts"]["ray"]
