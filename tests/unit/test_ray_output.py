"""Where Ray's lines go, without starting Ray: the driver's `ray` logger, the forwarded-output handlers (fed by
hand with batches shaped as Ray's log monitor sends them), and the private Ray names this relies on."""

from __future__ import annotations

import logging
import sys

from trainlift.ops import ray_output


def test_the_private_ray_names_used_are_in_the_pinned_ray():
    lines = ray_output.dispatcher()
    assert lines is not None and isinstance(lines.handlers, list)
    import ray._private.worker as worker

    assert callable(worker.print_to_stdstream)


def test_rays_console_lines_go_to_the_log_file_and_not_the_console(tmp_path, capfd):
    log = tmp_path / "run" / "driver.log"
    with ray_output.RunOutput(log, verbose=False) as output:
        logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
        printer = sys.modules["ray._private.worker"].print_to_stdstream
        output.attach_workers()
        output._worker_batch({"pid": 41, "ip": "10.0.0.1", "actor_name": "RayTrainWorker",
                              "lines": ["Setting up process group", "trainlift: the tensorboard tracker did not start",
                                        "\x1b[33m(raylet)\x1b[0m [2026-12-07 W] coloured for a terminal"]})
        sys.modules["ray._private.worker"].print_to_stdstream(
            {"pid": "raylet", "lines": ["A worker died or was killed while executing a task by an unexpected system "
                                        "error. To troubleshoot the problem, check the logs."], "is_err": False})
        said = output.warning_since(0)
    console = capfd.readouterr()
    assert "Token authentication" not in console.err + console.out and "Setting up" not in console.err + console.out
    assert console.err.strip() == "trainlift: the tensorboard tracker did not start"  # the user's own line shows
    text = log.read_text()
    assert "Token authentication is enabled" in text and "(RayTrainWorker pid=41, 10.0.0.1) Setting up" in text
    assert "(raylet) A worker died" in text
    assert "\x1b" not in text and "(raylet) [2026-12-07 W] coloured for a terminal" in text  # plain text in the file
    assert said == "A worker died or was killed while executing a task by an unexpected system error."
    assert all(name != ray_output.OWN_HANDLER for name, _ in ray_output.dispatcher().handlers)  # detached
    assert sys.modules["ray._private.worker"].print_to_stdstream is printer  # Ray's own again


def test_verbose_shows_every_line_plainly(tmp_path, capfd):
    with ray_output.RunOutput(tmp_path / "driver.log", verbose=True) as output:
        output.attach_workers()
        output._worker_batch({"pid": 7, "ip": "h", "task_name": "probe", "lines": ["hello"]})
    assert capfd.readouterr().err == "(probe pid=7, h) hello\n"


def test_ray_lines_are_told_from_the_users_and_logs_live_with_the_run():
    assert ray_output.is_ray_line("\x1b[36m(RayTrainWorker pid=5)\x1b[0m x")
    assert ray_output.is_ray_line("(raylet) A worker died")
    assert ray_output.is_ray_line("2026-12-06 00:55:39,966\tINFO worker.py:2038 -- Started a local Ray instance.")
    assert not ray_output.is_ray_line("step 40/400  loss 1.2345") and not ray_output.is_ray_line("error: bad")
    assert ray_output.run_log_path("/r/runs/x", "x").as_posix() == "/r/runs/x/driver.log"
    assert ray_output.run_log_path("s3://b/runs/x", "x").name == "x.log"
