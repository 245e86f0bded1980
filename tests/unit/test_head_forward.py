"""`submit --cluster` reaches the head by itself: without --address it runs `kubectl port-forward` to the head's
ClusterIP Service with the kubeconfig `cluster up` wrote, for as long as the command runs.

No Kubernetes API server runs here: `kubectl` is a script that forwards the local port it is given to a real HTTP
server on this machine (as the real port-forward forwards to the head's dashboard), or fails with kubectl's words
for a missing Service."""

from __future__ import annotations

import http.server
import os
import stat
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.errors import TrainliftError, UsageError
from trainlift.ops.forward import head_dashboard

ROOT = Path(__file__).resolve().parents[2]
FORWARDER = '''#!{python}
import socket, sys, threading
local = int(sys.argv[-1].split(":")[0])
target = ("127.0.0.1", {target})
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", local)); server.listen()
open({log!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
def pipe(a, b):
    while data := a.recv(65536):
        b.sendall(data)
    b.shutdown(socket.SHUT_WR)
while True:
    conn, _ = server.accept()
    up = socket.create_connection(target)
    threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
    threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
'''


class Dashboard(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b'{"ray_version": "2.58.0"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def dashboard():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def kubectl(tmp_path: Path, monkeypatch, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "kubectl"
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    return tmp_path / "kubeconfig"


def test_the_head_is_reached_through_a_port_forward_that_ends_with_the_block(tmp_path, monkeypatch, dashboard):
    log = tmp_path / "kubectl.log"
    config = kubectl(tmp_path, monkeypatch, FORWARDER.format(python=sys.executable, target=dashboard, log=str(log)))
    with head_dashboard(config, "ray-train", "ray-train") as url:
        assert urllib.request.urlopen(f"{url}/api/version", timeout=5).read() == b'{"ray_version": "2.58.0"}'
        port = url.rsplit(":", 1)[1]
    assert log.read_text().split() == ["--kubeconfig", str(config), "-n", "ray-train", "port-forward",
                                       "svc/ray-train-head-svc", f"{port}:8265"]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/api/version", timeout=2)


def test_a_missing_service_is_one_line_with_kubectls_words(tmp_path, monkeypatch):
    config = kubectl(tmp_path, monkeypatch, '#!/bin/sh\necho \'Error from server (NotFound): services '
                     '"ray-train-head-svc" not found\' >&2\nexit 1\n')
    with pytest.raises(TrainliftError) as caught:
        with head_dashboard(config, "ray-train", "ray-train"):
            pass
    assert caught.value.message == ('port-forward to the Ray head failed: Error from server (NotFound): services '
                                    '"ray-train-head-svc" not found')


def test_without_the_files_of_cluster_up_the_forward_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(UsageError) as caught:
        with head_dashboard(tmp_path / ".trainlift" / "ray-train" / "kubeconfig", "ray-train", "ray-train"):
            pass
    assert "no kubeconfig at" in caught.value.message and "cluster up" in caught.value.message
    help_text = CliRunner().invoke(app, ["submit", "--help"]).output
    assert "port-forward" in help_text
