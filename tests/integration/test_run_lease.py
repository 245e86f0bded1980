"""One driver per run, when drivers start at the same moment: processes released together by a barrier claim one
run's driver record, on a local directory and on S3 (a real moto server over HTTP, which implements S3's
If-None-Match and If-Match), and exactly one holds it; the others are told who does. A dead driver's record is
taken over by exactly one of them too."""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
from pathlib import Path

import boto3
import pytest

from trainlift import run_lease

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
RACERS = 6
DEAD = 2**22 + 7


def race(uri: str) -> list[str]:
    """Each racer's outcome: `held` or `refused by <pid>`."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()

    def racer(n: int) -> None:
        barrier.wait()
        try:
            run_lease.claim(uri, {"pid": os.getpid(), "racer": n}, lambda holder: holder.get("pid") != DEAD)
            results.put("held")
        except run_lease.RunHeld as held:
            results.put(f"refused by {held.holder['racer']}")

    procs = [ctx.Process(target=racer, args=(n,)) for n in range(RACERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    return sorted(results.get(timeout=5) for _ in procs)


@pytest.fixture(params=["local", "s3"])
def run_uri(request, tmp_path, monkeypatch):
    if request.param == "local":
        return str(tmp_path / "runs" / "raced")
    h.use(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="raced-runs")
    return "s3://raced-runs/runs/raced"


def read_record(uri: str) -> dict:
    if uri.startswith("s3://"):
        body = boto3.client("s3", region_name="us-east-1").get_object(Bucket="raced-runs", Key="runs/raced/driver.json")
        return json.loads(body["Body"].read())
    return json.loads((Path(uri) / "driver.json").read_text())


def test_of_drivers_starting_together_exactly_one_holds_the_run(run_uri):
    outcomes = race(run_uri)
    winner = read_record(run_uri)["racer"]
    assert outcomes == ["held"] + [f"refused by {winner}"] * (RACERS - 1)


def test_a_dead_drivers_record_is_taken_over_by_exactly_one(run_uri):
    run_lease.claim(run_uri, {"pid": DEAD, "racer": -1}, lambda holder: True)
    outcomes = race(run_uri)
    winner = read_record(run_uri)["racer"]
    assert winner != -1 and outcomes == ["held"] + [f"refused by {winner}"] * (RACERS - 1)
    run_lease.release(run_uri)
    assert run_lease.claim(run_uri, {"pid": 1, "racer": 9}, lambda holder: True) is None  # released: free again
