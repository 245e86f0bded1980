"""The trainlift code a node runs, on the cluster image's releases: the virtualenv `trainlift rehearse` builds from
the DLC's locked packages (Ray 2.58, transformers 5.13, torch 2.13's CPU build; no trainlift, peft or trackers),
with trainlift from this checkout on PYTHONPATH as py_modules puts it on a node. The suite's own environment runs
newer releases (Ray 2.60, transformers 5.25): what differs between them fails here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def in_image(image_env, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update({"RAY_ADDRESS": "", "PYTHONPATH": str(REPO / "src"), "TRAINLIFT_HOME": str(cwd / "home"),
                "PATH": f"{image_env.bin_dir}{os.pathsep}{env.get('PATH', '')}"})
    return subprocess.run([str(image_env.bin_dir / "python"), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_the_environment_holds_the_images_releases_and_not_this_ones(image_env, tmp_path):
    probe = ("import json, importlib.util as u, importlib.metadata as m; print(json.dumps({'versions': {n: m.version(n) "
             "for n in ('ray', 'transformers', 'torch', 'datasets', 'pydantic')}, 'absent': [n for n in ('peft', "
             "'mlflow', 'tensorboard', 'kubernetes_validate', 'pathspec') if u.find_spec(n) is None]}))")
    done = in_image(image_env, "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["versions"] == {"ray": "2.58.0", "transformers": "5.13.0", "torch": "2.13.0+cpu",
                                 "datasets": "5.0.0", "pydantic": "2.13.4"}
    assert found["absent"] == ["peft", "mlflow", "tensorboard", "kubernetes_validate", "pathspec"]


def test_every_private_ray_name_trainlift_uses_is_in_the_images_ray(image_env, tmp_path):
    probe = ("import json; from trainlift.train.run import raytrainer as r; "
             "names = {**r.BACKEND_NAMES, **r.TRAINER_NAMES, **r.COORDINATOR_NAMES, **r.SIGNAL_NAMES}; "
             "import ray._private.worker as w, ray._private.ray_logging as l; "
             "print(json.dumps({'missing': r.private_names_missing(names), 'checked': sum(map(len, names.values())), "
             "'output': [hasattr(w, 'print_to_stdstream'), hasattr(l, 'global_worker_stdstream_dispatcher')]}))")
    done = in_image(image_env, "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["missing"] == [] and found["checked"] >= 5 and found["output"] == [True, True]


def test_doctor_probes_on_the_images_releases(image_env, tmp_path):
    """Training, checkpoints and the export on the image's releases run in test_rehearse.py, the RayJob's own way
    (Jobs API, S3); doctor is what a cluster runs on each node before it."""
    doctor = in_image(image_env, "-m", "trainlift", "doctor", "--json", cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    facts = json.loads(doctor.stdout)["facts"]
    assert (facts["ray"], facts["transformers"], facts["python"]) == ("2.58.0", "5.13.0", image_env.python)
