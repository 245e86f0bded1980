"""Ray's failures turned into one line. The causes are text recorded from real runs in this repository's
integration tests (a lost node in test_lost_host.py, a stopped S3 server in test_storage_faults.py)."""

from trainlift.config.job import validate_job_spec
from trainlift.train.run.failures import explain

START_TIMEOUT = ("The worker group startup timed out after 10.0 seconds waiting for 2 workers. Potential causes "
                 "include: (1) temporary insufficient cluster resources while waiting for autoscaling")
S3_DOWN = ("When initiating multiple part upload for key 'runs/faulty/checkpoint_00000004/.metadata' in bucket "
           "'trainlift-faults': AWS Error NETWORK_CONNECTION during CreateMultipartUpload operation: curlCode: 56, "
           "Failure when receiving data from the peer")


def spec(storage: str):
    return validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "run": {"name": "r", "storage": storage}})


def wrapped(message: str) -> Exception:
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise Exception("Training failed due to controller error:") from inner
    except Exception as outer:  # noqa: BLE001
        return outer


def test_a_worker_group_that_cannot_start_is_named_with_the_elastic_fix():
    line = explain(spec("runs"), wrapped(START_TIMEOUT), "runs/r/driver.log").one_line()
    assert line.startswith("training failed: 2 workers no longer fit the cluster")
    assert "scaling.workers: [min, 2]" in line and "runs/r" in line


def test_a_lost_s3_endpoint_names_the_run_and_how_to_resume():
    line = explain(spec("s3://trainlift-faults/runs"), wrapped(S3_DOWN), "driver.log").one_line()
    assert "lost the connection to run.storage s3://trainlift-faults/runs/r" in line
    assert "Failure when receiving data from the peer, during CreateMultipartUpload" in line
    assert "rerun the same command to resume" in line and "\n" not in line


def test_anything_else_keeps_the_innermost_message():
    line = explain(spec("runs"), wrapped("CUDA out of memory"), "runs/r/driver.log").one_line()
    assert line.startswith("training failed: CUDA out of memory")
    assert "every line Ray printed is in runs/r/driver.log" in line


def test_a_ray_warning_before_the_failure_joins_the_line_once():
    said = "A worker died or was killed while executing a task by an unexpected system error."
    line = explain(spec("runs"), wrapped("ActorDiedError: The actor died unexpectedly"), "d.log", said).one_line()
    assert line.startswith("training failed: The actor died unexpectedly (before it, Ray said: A worker died")
    assert "\n" not in line
    same = explain(spec("runs"), wrapped(said), "d.log", said).one_line()
    assert same.count("A worker died") == 1
