"""The image exists in its registry before anything bills (cloud/ecr.py): `render` (with AWS credentials) and
`cluster up` stop in one line when its tag is absent, naming the closest tags the repository has.

Private ECR runs on moto's server over HTTP. ECR Public cannot be reached from here and moto has no ecr-public, so
its anonymous registry API is a local HTTP server answering in the shapes AWS and the OCI distribution spec give:
`GET /token/?service=public.ecr.aws&scope=repository:<repo>:pull` -> {"token": ...}; a manifest HEAD -> 200 with
Docker-Content-Digest, or 404; `GET /v2/<repo>/tags/list` -> {"name": ..., "tags": [...]} (the answer shown in
aws/containers-roadmap#1262, where AWS opened tag listing to anonymous callers), paginated with a
`Link: <...>; rel="next"` header, and 404 {"errors": [{"code": "NAME_UNKNOWN"}]} for a repository that does not
exist. The tags are the Ray DLC's as its changelogs publish them (docs/ray-train/changelog/index.md,
docs/ray/changelog/index.md in aws/deep-learning-containers).
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.cloud import ecr
from trainlift.cloud.capacity import Unknown
from trainlift.cloud.ecr import ImageLookup, check_image, closest_tags
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.placement import Placement

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "examples" / "cluster-reference.yaml"
DLC = "public.ecr.aws/deep-learning-containers/ray"
PUBLISHED = ["train-ml-cuda", "train-ml-cuda-v1", "train-ml-cuda-v1.0", "train-ml-cuda-v1.0.0", "train-ml-cuda-v1.1",
             "serve-ml-cuda", "serve-ml-cuda-v1", "serve-ml-cuda-v1.4", "serve-ml-cpu-v1.4",
             "serve-ml-sagemaker-cuda-v1.4"]
DIGEST = "sha256:" + "d" * 64
runner = CliRunner()


class Registry(http.server.BaseHTTPRequestHandler):
    """ECR Public's anonymous registry API for one repository, its tags in pages of 4."""

    repository = "deep-learning-containers/ray"
    tags: list[str] = PUBLISHED
    requests: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, status: int, body: dict | None = None, headers: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        type(self).requests.append(self.path)
        if url.path == "/token/":
            assert query["service"] == ["public.ecr.aws"]
            return self._answer(200, {"token": "anonymous-pull-token"})
        if self.headers.get("Authorization") != "Bearer anonymous-pull-token":
            return self._answer(401, {"errors": [{"code": "DENIED"}]})
        prefix = f"/v2/{self.repository}/"
        if not url.path.startswith(prefix):
            return self._answer(404, {"errors": [{"code": "NAME_UNKNOWN", "message": "repository not found"}]})
        rest = url.path[len(prefix):]
        if rest.startswith("manifests/"):
            if rest[len("manifests/"):] in self.tags + [DIGEST]:
                return self._answer(200, {}, {"Docker-Content-Digest": DIGEST})
            return self._answer(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "Requested image not found"}]})
        if rest == "tags/list":
            start = self.tags.index(query["last"][0]) + 1 if "last" in query else 0
            page = self.tags[start:start + 4]
            more = start + 4 < len(self.tags)
            link = {"Link": f'</v2/{self.repository}/tags/list?last={page[-1]}&n=4>; rel="next"'} if more else {}
            return self._answer(200, {"name": self.repository, "tags": page}, link)
        return self._answer(404, {"errors": [{"code": "NOT_FOUND"}]})


@pytest.fixture
def public_registry(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Registry.requests, Registry.tags = [], PUBLISHED
    monkeypatch.setattr(ecr, "PUBLIC_REGISTRY_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield Registry
    server.shutdown()


def test_closest_tags_are_the_release_siblings():
    assert closest_tags("train-ml-cuda-v1.1.0", PUBLISHED) == ["train-ml-cuda-v1.1", "train-ml-cuda-v1.0.0",
                                                               "train-ml-cuda-v1.0"]
    assert closest_tags("serve-ml-cuda-v1.4.0", PUBLISHED)[0] == "serve-ml-cuda-v1.4"


def test_public_tag_found_with_its_digest(public_registry):
    found = check_image(f"{DLC}:train-ml-cuda-v1.1")
    assert found == ImageLookup(f"{DLC}:train-ml-cuda-v1.1", True, digest=DIGEST)
    assert check_image(f"{DLC}@{DIGEST}").found


def test_public_tag_absent_names_the_closest_tags_across_pages(public_registry):
    found = check_image(f"{DLC}:train-ml-cuda-v1.1.0")
    assert isinstance(found, ImageLookup) and not found.found
    assert found.tags == tuple(PUBLISHED)  # all three pages followed through their Link headers
    assert found.absent_line() == (
        f"image {DLC}:train-ml-cuda-v1.1.0 does not exist: {DLC} has no tag train-ml-cuda-v1.1.0; closest tags it "
        "has: train-ml-cuda-v1.1, train-ml-cuda-v1.0.0, train-ml-cuda-v1.0")
    assert sum("tags/list" in r for r in public_registry.requests) == 3


def test_public_repository_absent(public_registry):
    found = check_image("public.ecr.aws/deep-learning-containers/rayy:train-ml-cuda")
    assert found.absent_line() == ("image public.ecr.aws/deep-learning-containers/rayy:train-ml-cuda does not "
                                   "exist: public.ecr.aws has no repository deep-learning-containers/rayy")


def test_public_registry_unreachable_is_unknown_not_absent(monkeypatch):
    monkeypatch.setattr(ecr, "PUBLIC_REGISTRY_URL", "http://127.0.0.1:9")  # the discard port: refused
    found = check_image(f"{DLC}:train-ml-cuda-v1.1.0")
    assert isinstance(found, Unknown) and "public.ecr.aws did not answer" in found.reason


def test_other_registries_are_not_looked_up():
    found = check_image("ghcr.io/acme/ray:1")
    assert isinstance(found, Unknown) and "ghcr.io" in found.reason


@pytest.fixture(scope="module")
def moto_url():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def private_ecr(moto_url, monkeypatch, tmp_path):
    """moto's ECR over HTTP with `team/ray` tagged v1, v1.1 and v2.0; yields the image name without a tag."""
    import boto3

    for name, value in (("AWS_ENDPOINT_URL", moto_url), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_EC2_METADATA_DISABLED", "true"),
                        ("AWS_CONFIG_FILE", str(tmp_path / "none")),
                        ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("ecr", region_name="us-east-2")
    if "team/ray" not in [r["repositoryName"] for r in client.describe_repositories()["repositories"]]:
        client.create_repository(repositoryName="team/ray")
        for i, tag in enumerate(("v1", "v1.1", "v2.0")):
            manifest = json.dumps({
                "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 7,
                           "digest": "sha256:" + str(i) * 64}, "layers": []})
            client.put_image(repositoryName="team/ray", imageManifest=manifest, imageTag=tag)
    return "123456789012.dkr.ecr.us-east-2.amazonaws.com/team/ray"


def test_private_ecr_tag_found_and_absent(private_ecr):
    found = check_image(f"{private_ecr}:v1.1")
    assert found.found and found.digest.startswith("sha256:")
    absent = check_image(f"{private_ecr}:v1.2")
    assert not absent.found and absent.tags == ("v1", "v1.1", "v2.0")
    assert absent.absent_line().endswith("has no tag v1.2; closest tags it has: v1.1, v1, v2.0")
    missing = check_image("123456789012.dkr.ecr.us-east-2.amazonaws.com/team/nothing:v1")
    assert missing.repository_missing


def test_render_with_credentials_stops_in_one_line_on_an_absent_tag(public_registry, tmp_path, monkeypatch, capsys):
    """Through the console script's entry point, in this process (the registry server is this test's)."""
    from trainlift.cli.app import main

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    public_registry.tags = [t for t in PUBLISHED if t != "train-ml-cuda-v1.1.0"]  # what the issue feared
    monkeypatch.setattr("sys.argv", ["trainlift", "render", str(REFERENCE), "--check"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2  # a spec field that is wrong (SpecError)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: image.uri: image {DLC}:train-ml-cuda-v1.1.0 does not exist: {DLC} has no tag "
        "train-ml-cuda-v1.1.0; closest tags it has: train-ml-cuda-v1.1, train-ml-cuda-v1.0.0, "
        "train-ml-cuda-v1.0"), err


def test_render_with_credentials_pins_a_public_tag_by_its_digest(public_registry, tmp_path, monkeypatch):
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    public_registry.tags = PUBLISHED + ["train-ml-cuda-v1.1.0"]
    result = runner.invoke(app, ["render", str(REFERENCE), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    raycluster = (tmp_path / "out" / "k8s" / "20-raycluster.yaml").read_text()
    assert f"image: {DLC}:train-ml-cuda-v1.1.0@{DIGEST}\n" in raycluster


def test_render_without_credentials_asks_no_registry(public_registry, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = runner.invoke(app, ["render", str(REFERENCE), "--check"])
    assert result.exit_code == 0, result.output
    assert public_registry.requests == []


SPEC = cluster_spec_from_yaml(REFERENCE.read_text())
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned in the spec; offered there")}


def test_cluster_up_observes_the_image_and_blocks_before_anything_bills(public_registry, private_ecr, tmp_path):
    """`cluster up`'s observations as `lifecycle.prepare` makes them (EKS on moto over HTTP, then the image on the
    registry server) and the plan: the absent tag blocks every step, so apply creates nothing."""
    from trainlift.cloud.aws import Aws
    from trainlift.errors import TrainliftError
    from trainlift.ops import apply_plan, lifecycle

    public_registry.tags = [t for t in PUBLISHED if t != "train-ml-cuda-v1.1.0"]
    files, aws = Files(str(tmp_path)), Aws("us-east-2")
    seen = lifecycle.observe_image(SPEC, lifecycle.observe(SPEC, files, aws))
    assert seen.absent and seen.image is not None and not seen.image.found
    seen = replace(seen, tools=dict.fromkeys(seen.tools or {}, True))  # every tool there: only the image blocks
    prepared = lifecycle.Prepared(SPEC, seen, {}, PLACED, files, [], aws)
    plan = plan_up(SPEC, seen, PLACED, files)
    step = next(s for s in plan.steps if s.key == "image")
    assert step.action == "blocked" and step in plan.blocked
    assert "closest tags it has: train-ml-cuda-v1.1," in step.note
    plan = replace(plan, steps=tuple(s for s in plan.steps if s.key not in ("tools", "pins")))  # no helm here
    assert plan.blocked == [step]
    with pytest.raises(TrainliftError) as raised:
        apply_plan.apply(prepared, plan, echo=lambda line: None)
    assert raised.value.message.startswith(f"container image: image {DLC}:train-ml-cuda-v1.1.0 does not exist")


def test_cluster_up_goes_on_when_the_image_exists_or_cannot_be_asked():
    found = ImageLookup(f"{DLC}:train-ml-cuda-v1.1.0", True, digest=DIGEST)
    plan = plan_up(SPEC, Observed.nothing(), PLACED, Files(".trainlift/ray-train"))
    assert next(s for s in plan.steps if s.key == "image").action == "nothing"  # not asked: not blocked
    plan = plan_up(SPEC, replace(Observed.nothing(), image=found), PLACED, Files(".trainlift/ray-train"))
    step = next(s for s in plan.steps if s.key == "image")
    assert (step.action, step.observed) == ("nothing", f"{DLC}:train-ml-cuda-v1.1.0 exists ({DIGEST})")
    assert not [s for s in plan.blocked if s.key != "tools"]
