"""Resuming from S3: each rank reads only its own part of a checkpoint, straight from storage.

A real S3-compatible server (moto, over HTTP on loopback) with one counting HTTP proxy per rank in front of it,
so the bytes each rank pulls are counted on the wire. Two real processes (gloo, FSDP2) save a checkpoint, upload
it, and load it back with `checkpoint.load` (what `resume` calls) reading through their own proxy.
"""

from __future__ import annotations

import http.client
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
JOB = Path(__file__).with_name("resume_reads_job.py")
HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive"}


class CountingProxy(ThreadingHTTPServer):
    """Forwards every request to the moto server and counts the response body bytes it passes back."""

    def __init__(self, upstream: str):
        host, port = upstream.split("://", 1)[1].split(":")
        self.upstream, self.bytes_out, self.lock = (host, int(port)), 0, threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        upstream.request(self.command, self.path, body=body,
                         headers={k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP})
        response = upstream.getresponse()
        payload = response.read()
        upstream.close()
        with self.server.lock:
            self.server.bytes_out += len(payload)
        self.send_response(response.status)
        for key, value in response.getheaders():  # a HEAD's Content-Length is the object's size: keep it
            if key.lower() not in HOP_BY_HOP | ({"content-length"} if self.command != "HEAD" else set()):
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3(monkeypatch, tmp_path):
    return h.use_bucket(monkeypatch, tmp_path, "ckpts")


def test_each_rank_reads_only_its_part_of_an_s3_checkpoint(s3, tiny_assets, tmp_path):
    world, port, out = 2, free_port(), tmp_path / "result.json"
    proxies = [CountingProxy(s3["AWS_ENDPOINT_URL"]) for _ in range(world)]
    env = {**os.environ, **s3, "AWS_REGION": "us-east-1"}
    ranks = [subprocess.Popen([sys.executable, str(JOB), str(rank), str(world), str(port), str(tiny_assets / "model"),
                               "s3://ckpts/run/checkpoint_00000001", proxies[rank].url, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0] * world, logs[0][-3000:] + logs[1][-3000:]
    result = json.loads(out.read_text())
    assert result["weights_restored"] and (result["step"], result["cursor"]) == (1, 8)

    sizes = result["sizes"]
    whole = sum(sizes.values())
    for rank, proxy in enumerate(proxies):
        other_shard = sizes[f"__{1 - rank}_0.distcp"]
        # Its own shard, the metadata and the small files, plus what the other rank's file holds only once
        # (replicated values DCP stores on rank 0); never the other rank's shard as a whole, nor everything.
        print(f"rank {rank}: read {proxy.bytes_out} bytes of a {whole}-byte checkpoint {sizes}")
        assert proxy.bytes_out < whole - other_shard / 2, (rank, proxy.bytes_out, sizes)
    for proxy in proxies:
        proxy.shutdown()
