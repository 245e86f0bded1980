"""What the rendered cluster lets in and hands out: Ray's token on every RayCluster, a NetworkPolicy around the Ray
pods, S3 grants that name exactly the folders the spec names, code the pods cannot rewrite, a submitter without the
S3 role, nodes whose pods get no instance metadata, an EKS endpoint limited to the caller, and no credentials in the
pods' plain environment.

No Kubernetes API server runs here: manifests are checked against the pinned CRDs and Kubernetes schemas; `kubectl`
is a script standing in for the API server where trainlift reads the token's Secret.
"""

from __future__ import annotations

import base64
import copy
import http.server
import json
import os
import stat
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.cloud.caller import public_cidr
from trainlift.cloud.capacity import Unknown
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError, TrainliftError
from trainlift.ops import apply_plan, jobs, plan_kube
from trainlift.ops.plan import Files, Observed, Op
from trainlift.render import JobInputs, render_cluster
from trainlift.render.eksctl import with_caller_address
from trainlift.render.s3_access import S3Use, s3_access_problems
from trainlift.render.validate import core_problems, crd_problems

BASE: dict[str, Any] = {
    "name": "train",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}],
    "storage": {"s3": {"uri": "s3://ckpt/runs", "read": ["s3://ckpt/code"]}},
}
JOB = JobInputs(name="sft", spec_path="job.yaml", workers=8, working_dir="s3://ckpt/code/job.zip",
                trainlift_uri="s3://ckpt/code/trainlift.zip")
# `kubectl port-forward ... LOCAL:8265` as a script: forwards the local port to a real HTTP server on this machine.
FORWARD = '''
import socket, threading
local = int(args[-1].split(":")[0])
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", local)); server.listen()
def pipe(a, b):
    while data := a.recv(65536):
        b.sendall(data)
    b.shutdown(socket.SHUT_WR)
while True:
    conn, _ = server.accept()
    up = socket.create_connection(("127.0.0.1", {target}))
    threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
    threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
'''


def make(**changes: Any):
    data = copy.deepcopy(BASE)
    data.update(changes)
    return parse_cluster_spec(data)


def with_s3(**s3: Any):
    return make(storage={"s3": s3})


def rendered(spec=None, job: JobInputs | None = None) -> dict[str, Any]:
    return {m.path: m.body for m in render_cluster(spec or make(), job)}


def refused(spec, job: JobInputs | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        render_cluster(spec, job)
    assert "\n" not in info.value.one_line()
    return info.value


def pods(raycluster_spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [raycluster_spec["headGroupSpec"], *raycluster_spec["workerGroupSpecs"]]
    return [g["template"]["spec"] for g in groups]


# --- Ray's token ----------------------------------------------------------------------------------

def test_the_raycluster_requires_rays_token_kept_in_a_secret_kuberay_writes():
    out = rendered()
    cluster = out["k8s/20-raycluster.yaml"]
    assert cluster["spec"]["authOptions"] == {"mode": "token"}  # no secretName: KubeRay generates the Secret
    assert crd_problems(cluster) == []
    # The token is nowhere in what render writes: no Secret, no secretName, no RAY_AUTH_TOKEN value in any pod.
    assert not [b for b in out.values() if isinstance(b, dict) and b.get("kind") == "Secret"]
    env = [e for p in pods(cluster["spec"]) for c in p["containers"] for e in c["env"]]
    assert not [e for e in env if e["name"].startswith("RAY_AUTH")]


def test_a_rayjob_that_brings_its_own_cluster_requires_the_token_too():
    job = JobInputs(**{**JOB.__dict__, "shutdown_after_finish": True})
    rayjob = rendered(make(scheduler="none"), job)["k8s/30-rayjob.yaml"]
    assert rayjob["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    assert crd_problems(rayjob) == []


@pytest.mark.parametrize("field, value, words", [
    ("image", {"uri": "example.com/ray:2.50", "ray_version": "2.50.0"}, "ray_version: 2.50.0 has no token"),
    ("versions", {"kuberay": "1.4.0"}, "versions.kuberay: 1.4.0 has no RayCluster authOptions"),
])
def test_a_ray_or_kuberay_without_token_authentication_is_refused(field, value, words):
    assert refused(make(**{field: value})).message.startswith(words)


# --- who reaches the Ray pods ---------------------------------------------------------------------

RAY_POD = {"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}


def port_set(ports: list[dict[str, Any]]) -> set[int]:
    return {p for entry in ports for p in range(entry["port"], entry.get("endPort", entry["port"]) + 1)}


def test_ray_pods_reach_each_other_on_rays_and_the_jobs_ports_only():
    policy = rendered()["k8s/05-networkpolicy.yaml"]
    assert core_problems(policy, "1.36") == []
    assert policy["metadata"]["namespace"] == "ray-train"
    spec = policy["spec"]
    assert spec["podSelector"] == RAY_POD["podSelector"] and spec["policyTypes"] == ["Ingress", "Egress"]
    ray_pods, _ = spec["ingress"]
    assert ray_pods["from"] == [RAY_POD]  # no namespaceSelector: this namespace only
    ports = port_set(ray_pods["ports"])
    assert {6379, 8265, 10001, 52365, 10002, 19999, 32768, 60999} <= ports
    assert not ports & {22, 80, 443, 2049, 6380, 8080, 9090, 20000, 32767, 61000}  # nothing else opens


def test_only_the_namespaces_pods_and_kuberays_operator_reach_the_dashboard():
    _, dashboard = rendered()["k8s/05-networkpolicy.yaml"]["spec"]["ingress"]
    assert dashboard["from"] == [{"podSelector": {}}, {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "kuberay-operator"}}}]
    assert dashboard["ports"] == [{"protocol": "TCP", "port": 8265}]


def test_the_ray_pods_egress_is_stated():
    spec = rendered()["k8s/05-networkpolicy.yaml"]["spec"]
    ray_pods, dns, https, private = spec["egress"]
    assert ray_pods["to"] == [RAY_POD] and port_set(ray_pods["ports"]) == port_set(spec["ingress"][0]["ports"])
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert port_set(dns["ports"]) == {53} and {p["protocol"] for p in dns["ports"]} == {"UDP", "TCP"}
    assert https == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}],
                     "ports": [{"protocol": "TCP", "port": 443}]}
    assert [t["ipBlock"]["cidr"] for t in private["to"]] == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]


def test_the_vpc_cni_enforces_network_policies():
    addons = rendered()["eksctl.yaml"]["addons"]
    cni = next(a for a in addons if a["name"] == "vpc-cni")
    assert json.loads(cni["configurationValues"]) == {"enableNetworkPolicy": "true"}


def test_cluster_up_applies_the_network_policy_before_any_node_group():
    steps = plan_kube.namespace_and_secrets(make(), Observed.nothing(), Files("out"))
    assert [s.key for s in steps][0] == "namespace" and steps[-1].key == "network-policy"
    assert [op.text() for op in steps[-1].ops] == [
        "kubectl --kubeconfig out/kubeconfig apply --server-side --field-manager=trainlift "
        "-f out/k8s/05-networkpolicy.yaml"]


# --- S3: the grant names the folders the spec names ---------------------------------------------------

@pytest.mark.parametrize("uri, words", [
    ("s3://bkt/*", "storage.s3.uri: s3://bkt/* holds a wildcard"),
    ("s3://bkt/runs?", "storage.s3.uri: s3://bkt/runs? holds a wildcard"),
    ("s3://bkt/x/../y", "storage.s3.uri: s3://bkt/x/../y has a '..' segment"),
    ("s3://bkt", "storage.s3.uri: s3://bkt is a whole bucket"),
    ("s3://bkt/", "storage.s3.uri: s3://bkt/ is a whole bucket"),
])
def test_a_storage_uri_that_would_widen_the_policy_is_refused_in_one_line(uri, words):
    error = refused(with_s3(uri=uri))
    assert error.message.startswith(words) and error.message.count("storage.s3.") == 1  # one problem
    assert error.hint and "e.g. s3://bkt/runs" in error.hint


def test_a_read_location_with_a_wildcard_is_refused():
    error = refused(with_s3(uri="s3://bkt/runs", read=["s3://data/*.jsonl"]))
    assert error.message.startswith("storage.s3.read[0]: s3://data/*.jsonl holds a wildcard")


def test_a_whole_bucket_needs_the_opt_in_and_then_gets_the_whole_bucket():
    assert "storage.s3.allow_whole_bucket: true" in (refused(with_s3(uri="s3://bkt")).hint or "")
    eksctl = rendered(with_s3(uri="s3://bkt", allow_whole_bucket=True))["eksctl.yaml"]
    policy = eksctl["iam"]["serviceAccounts"][0]["attachPolicy"]
    write = next(s for s in policy["Statement"] if "s3:PutObject" in s["Action"])
    assert write["Resource"] == "arn:aws:s3:::bkt/*"


def test_code_under_the_writable_prefix_is_refused_with_where_to_put_it():
    spec = with_s3(uri="s3://ckpt/runs")
    job = JobInputs(**{**JOB.__dict__, "working_dir": "s3://ckpt/runs/code/job.zip"})
    error = refused(spec, job)
    assert error.message.startswith("runtime_env.working_dir: s3://ckpt/runs/code/job.zip is under storage.s3.uri")
    assert error.hint == ("upload code outside it, e.g. s3://ckpt/code/, and list that folder in storage.s3.read of "
                          "the cluster spec (read-only)")
    # The same URIs are fine as data the job reads: only code is held to it.
    assert s3_access_problems(spec, [S3Use("data.train", "s3://ckpt/runs/code/job.zip")]) == []


def test_code_under_the_writable_prefix_is_refused_even_with_the_users_own_role():
    spec = with_s3(uri="s3://ckpt/runs", role_arn="arn:aws:iam::123456789012:role/train")
    problems = s3_access_problems(spec, [S3Use("runtime_env.py_modules", "s3://ckpt/runs/t.zip", code=True)])
    assert [p.path for p in problems] == ["runtime_env.py_modules"]


def test_the_submitter_runs_without_the_s3_role_and_without_an_api_token():
    for job in (JOB, JobInputs(**{**JOB.__dict__, "shutdown_after_finish": True})):
        rayjob = rendered(make(scheduler="none"), job)["k8s/30-rayjob.yaml"]
        submitter = rayjob["spec"]["submitterPodTemplate"]["spec"]
        assert "serviceAccountName" not in submitter and submitter["automountServiceAccountToken"] is False
        if "rayClusterSpec" in rayjob["spec"]:  # the Ray pods keep the S3 role: they read and write the run
            assert {p["serviceAccountName"] for p in pods(rayjob["spec"]["rayClusterSpec"])} == {"ray-train"}


# --- nodes, the EKS endpoint, containers --------------------------------------------------------------

def test_no_pod_gets_instance_metadata_on_any_node_group():
    groups = rendered()["eksctl.yaml"]["managedNodeGroups"]
    assert [g.get("disablePodIMDS") for g in groups] == [True, True]


def test_the_eks_endpoint_admits_the_listed_blocks_or_the_caller():
    listed = make(api_access_cidrs=["198.51.100.0/24"])
    assert rendered(listed)["eksctl.yaml"]["vpc"]["publicAccessCIDRs"] == ["198.51.100.0/24"]
    assert with_caller_address(listed, "203.0.113.7/32") is listed  # the spec's list wins
    caller = with_caller_address(make(), "203.0.113.7/32")
    assert rendered(caller)["eksctl.yaml"]["vpc"]["publicAccessCIDRs"] == ["203.0.113.7/32"]


def test_without_an_address_render_says_the_endpoint_is_open():
    manifest = next(m for m in render_cluster(make()) if m.path == "eksctl.yaml")
    assert "publicAccessCIDRs" not in manifest.body["vpc"]
    assert "open to every address" in manifest.text().splitlines()[1]


def test_a_bad_cidr_is_refused_at_parse_time():
    with pytest.raises(SpecError, match=r"^api_access_cidrs: not a CIDR block .* \(got '10\.0\.0\.1/24'\)"):
        make(api_access_cidrs=["10.0.0.1/24"])


def test_ray_containers_keep_no_capability_but_the_workers_ipc_lock():
    cluster = rendered()["k8s/20-raycluster.yaml"]["spec"]
    head, worker = (p["containers"][0]["securityContext"] for p in pods(cluster))
    default_seccomp = {"seccompProfile": {"type": "RuntimeDefault"}}
    assert head == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, **default_seccomp}
    assert worker == {"allowPrivilegeEscalation": False, "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]},
                      **default_seccomp}
    assert "runAsNonRoot" not in json.dumps(cluster)  # the image runs as root


def test_every_ray_pod_runs_under_the_default_seccomp_profile_without_an_api_token():
    own = JobInputs(**{**JOB.__dict__, "shutdown_after_finish": True})
    rayjob = rendered(make(scheduler="none"), own)["k8s/30-rayjob.yaml"]
    cluster = rendered()["k8s/20-raycluster.yaml"]
    assert crd_problems(rayjob) == [] and crd_problems(cluster) == []
    for spec in (cluster["spec"], rayjob["spec"]["rayClusterSpec"]):
        assert spec["enableInTreeAutoscaling"] is False  # the one Ray container that would need the API
        for pod in pods(spec):
            assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "ray-train"
            assert [c["securityContext"]["seccompProfile"] for c in pod["containers"]] == [{"type": "RuntimeDefault"}]
    submitter = rayjob["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert submitter["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_a_credentialed_uri_in_the_pods_environment_is_refused_without_echoing_it():
    error = refused(make(env={"MLFLOW_TRACKING_URI": "https://bob:plantedsecret@mlflow.example"}))
    assert error.message.startswith("env.MLFLOW_TRACKING_URI: holds a URI with credentials")
    assert "plantedsecret" not in error.one_line()
    assert "secretKeyRef" in (error.hint or "") and "secrets: [" in (error.hint or "")


# --- reaching the head with the token ----------------------------------------------------------------

def fake_kubectl(tmp_path: Path, monkeypatch, body: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "kubectl"
    path.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    return str(tmp_path / "kubeconfig")


SECRET_KUBECTL = '''
if args[4:7] == ["get", "secret", "train"] and args[3] == "ray-train":
    print({encoded!r}, end="")
else:
    sys.stderr.write('Error from server (NotFound): secrets "' + args[6] + '" not found\\n')
    sys.exit(1)
'''


def test_the_token_is_read_from_the_clusters_secret(tmp_path, monkeypatch):
    encoded = base64.b64encode(b"tok-123").decode()
    config = fake_kubectl(tmp_path, monkeypatch, SECRET_KUBECTL.format(encoded=encoded))
    assert jobs.cluster_token(config, "ray-train", "train") == "tok-123"
    assert jobs.cluster_token(config, "ray-train", "other") is None  # a cluster without token auth


def test_kubectl_failing_otherwise_is_one_line(tmp_path, monkeypatch):
    config = fake_kubectl(tmp_path, monkeypatch, 'sys.stderr.write("Forbidden: cannot get secrets\\n")\n'
                                                 'sys.exit(1)\n')
    with pytest.raises(TrainliftError) as info:
        jobs.cluster_token(config, "ray-train", "train")
    assert info.value.message.startswith("cannot read the Ray token from Secret ray-train/train")


class TokenDashboard(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        ok = self.headers.get("Authorization") == "Bearer tok-123"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_submit_to_a_cluster_sends_the_clusters_token_while_the_head_is_forwarded(tmp_path, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenDashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    forward = FORWARD.format(target=server.server_address[1])
    encoded = base64.b64encode(b"tok-123").decode()
    body = f'if "port-forward" in args:\n    exec({forward!r})\n' + SECRET_KUBECTL.format(encoded=encoded)
    config = fake_kubectl(tmp_path, monkeypatch, body)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "this-machines-local-token")
    try:
        with jobs.forwarded_head(Path(config), "ray-train", "train", "train") as url:
            request = urllib.request.Request(f"{url}/api/jobs/", headers=jobs.auth_headers())
            assert urllib.request.urlopen(request, timeout=5).status == 200
        with pytest.raises(urllib.error.HTTPError):  # without it the dashboard says 401
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/api/jobs/", timeout=5)
        assert os.environ["RAY_AUTH_TOKEN"] == "this-machines-local-token"  # restored after the block
    finally:
        server.shutdown()


def test_cluster_ups_doctor_gets_the_clusters_token(tmp_path, monkeypatch):
    encoded = base64.b64encode(b"tok-123").decode()
    config = fake_kubectl(tmp_path, monkeypatch, SECRET_KUBECTL.format(encoded=encoded))
    seen: list[str | None] = []
    monkeypatch.setattr(apply_plan, "_doctor", lambda op, echo, token: seen.append(token))
    files = Files(str(Path(config).parent))
    apply_plan._apply_op(Op("doctor", ("trainlift", "doctor")), make(), files, None, print)  # type: ignore[arg-type]
    assert seen == ["tok-123"]


# --- the caller's public address ---------------------------------------------------------------------

@pytest.mark.parametrize("answer, expected", [
    (b"203.0.113.7\n", "203.0.113.7/32"),
    (b"<html>captive portal</html>", Unknown("")),
])
def test_the_callers_address_becomes_a_single_address_block(answer, expected):
    class CheckIp(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CheckIp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        found = public_cidr(f"http://127.0.0.1:{server.server_address[1]}/", timeout=5)
    finally:
        server.shutdown()
    if isinstance(expected, Unknown):
        assert isinstance(found, Unknown) and "not an address" in found.reason
    else:
        assert found == expected


class JobsDashboard(http.server.BaseHTTPRequestHandler):
    """The Jobs API answers `jobs list` reads (the shapes of Ray 2.58's /api/version and /api/jobs/), only with the
    cluster's token."""

    def do_GET(self):  # noqa: N802
        if self.headers.get("Authorization") != "Bearer tok-123":
            return self._answer(401, b"")
        body = ({"version": "4", "ray_version": "2.58.0", "ray_commit": "0"} if self.path == "/api/version" else
                [{"type": "SUBMISSION", "submission_id": "sft-1", "job_id": "02000000", "status": "RUNNING",
                  "entrypoint": "trainlift train job.yaml", "start_time": 1760000000000}])
        self._answer(200, json.dumps(body).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_jobs_on_an_eks_cluster_are_read_with_its_token_and_no_address(tmp_path, monkeypatch):
    """`jobs list --cluster SPEC` forwards the head and sends the RayCluster's token itself; nothing is set by hand."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), JobsDashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    forward = FORWARD.format(target=server.server_address[1])
    encoded = base64.b64encode(b"tok-123").decode()
    cluster_dir = tmp_path / "cluster"
    cluster_dir.mkdir()
    fake_kubectl(cluster_dir, monkeypatch, f'if "port-forward" in args:\n    exec({forward!r})\n'
                 + SECRET_KUBECTL.format(encoded=encoded))
    spec = tmp_path / "cluster.yaml"
    spec.write_text(yaml.safe_dump(BASE))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")  # named on the command line, --cluster wins
    try:
        listed = CliRunner().invoke(app, ["jobs", "list", "--cluster", str(spec), "--dir", str(cluster_dir), "--json"])
        both = CliRunner().invoke(app, ["jobs", "list", "--cluster", str(spec), "--address", "http://x:8265"])
    finally:
        server.shutdown()
    assert listed.exit_code == 0, listed.output
    assert [(j["id"], j["status"]) for j in json.loads(listed.stdout)] == [("sft-1", "RUNNING")]
    assert "RAY_AUTH_TOKEN" not in os.environ
    assert "--cluster reaches the head by itself; drop --address" in both.exception.one_line()


def test_the_cluster_directory_is_private(tmp_path, monkeypatch):
    """It holds the cluster's kubeconfig and chart digests: created 0700, refused where others may write."""
    from trainlift.ops import lifecycle

    monkeypatch.chdir(tmp_path)
    root = lifecycle.cluster_dir(make(), None)
    files, written = lifecycle._render(make(), root, True)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and written
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(TrainliftError, match=rf"^{shared} is writable by users other than you"):
        lifecycle._render(make(), str(shared), True)
