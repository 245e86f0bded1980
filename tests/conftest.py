"""Shared fixtures. One Ray instance serves every test that needs Ray (starting Ray on 2 cores is slow)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls workers every 2 s by default: each boundary report() and each failure waits for
# that poll. Polling faster changes no outcome, only how long the suite waits (it reaches subprocesses too).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# The session's moto server keeps the requests a rehearsal records (rehearse_s3.py) in a file: a temporary one, not
# moto's default `moto_recording` in the working directory. Set before anything imports moto.
os.environ.setdefault("MOTO_RECORDER_FILEPATH", os.path.join(tempfile.gettempdir(),
                                                             f"trainlift-tests-moto-recording-{os.getpid()}"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The rehearsal's mirror of the cluster image's packages: built once (about a minute) and kept beside the venv, so
# every test that rehearses, in this session and the next, finds it built.
os.environ.setdefault("TRAINLIFT_IMAGE_ENVS", os.path.join(REPO, ".venv", "image-envs"))
DLC = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0"


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance shared across the session (4 logical CPUs on 2 cores)."""
    import ray

    from trainlift.ops import localray

    if not ray.is_initialized():
        localray.start_in_process(num_cpus=4)
    yield ray
    ray.shutdown()


TINY_CONFIG = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128, "tie_word_embeddings": True,
}


@pytest.fixture(scope="session")
def image_env():
    """The virtualenv mirroring the DLC's locked packages (CPU builds), as `trainlift rehearse` builds it."""
    from trainlift.catalog.packages import image_lock
    from trainlift.ops import image_env as image_envs

    return image_envs.ensure(image_lock(DLC))


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """A small slice of the demo data and a tiny Qwen2 model saved with save_pretrained."""
    from trainlift.train.model.build import materialize

    root = tmp_path_factory.mktemp("tiny")
    for split, n in (("train", 240), ("eval", 40)):
        with open(os.path.join(REPO, "examples", "data", f"tasks-{split}.jsonl")) as src:
            lines = src.readlines()[:n]
        (root / f"{split}.jsonl").write_text("".join(lines))
    tokenizer = os.path.join(REPO, "examples", "tiny", "tokenizer")
    materialize(str(root / "model"), TINY_CONFIG, tokenizer, seed=0)
    return root


@pytest.fixture(scope="session")
def tiny_spec_at(tiny_assets):
    """A job spec for the tiny model with its run under a given storage: `tiny_spec_at(storage, *overrides)`."""
    from trainlift.config.job import apply_overrides, validate_job_spec

    def make(storage, *overrides: str):
        raw = {
            "model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "eval": str(tiny_assets / "eval.jsonl"), "seq_len": 64},
            "train": {"steps": 6, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
            "scaling": {"workers": 2},
            "checkpoint": {"every_steps": 3, "keep": 2},
            "run": {"name": "run", "storage": str(storage), "max_failures": 0},
        }
        return validate_job_spec(apply_overrides(raw, overrides))

    return make


@pytest.fixture
def tiny_spec(tiny_spec_at, tmp_path):
    """A job spec for the tiny model, its run under tmp_path: returns a function taking dotted overrides."""
    return lambda *overrides: tiny_spec_at(tmp_path / "runs", *overrides)


MLFLOW_TOKEN = "test-token-4f2a"  # what the MLflow fixture server accepts; a test value, not a credential


@pytest.fixture(scope="session")
def mlflow_auth_server():
    """An HTTP server answering MLflow's REST API as a server behind authentication does: 401 with the body and
    WWW-Authenticate header of MLflow's basic-auth app (recorded from mlflow 2.x) without the right credentials,
    an empty search result with them. Yields {"url", "token"}: it accepts `Bearer <token>`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if self.headers.get("Authorization") == f"Bearer {MLFLOW_TOKEN}":
                self._answer(200, b'{"experiments": []}', {"Content-Type": "application/json"})
            else:
                self._answer(401, b"You are not authenticated. Please see https://www.mlflow.org/docs/latest/"
                             b"auth/index.html#authenticating-to-mlflow on how to authenticate.",
                             {"WWW-Authenticate": 'Basic realm="mlflow"'})

        def _answer(self, status, body, headers):
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "token": MLFLOW_TOKEN}
    server.shutdown()
