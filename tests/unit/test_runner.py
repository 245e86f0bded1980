"""The runner with real subprocesses: timeouts, failures with stderr, missing tools, retries, redaction."""

from __future__ import annotations

import sys

import pytest

from trainlift.ops.run import (
    Background, CommandFailed, ToolMissing, check, display, redact, run, stream,
)

PY = sys.executable


def test_run_keeps_its_original_contract():
    assert run([PY, "-c", "print('hi')"], timeout=10).stdout == "hi\n"
    failed = run([PY, "-c", "import sys; sys.exit(3)"], timeout=10)
    assert failed.returncode == 3 and not failed.ok
    absent = run(["no-such-tool-trainlift"], timeout=5)
    assert absent.absent and absent.returncode is None


def test_check_raises_with_the_command_and_its_stderr():
    with pytest.raises(CommandFailed) as info:
        check([PY, "-c", "import sys; sys.stderr.write('boom: bad flag\\n'); sys.exit(2)"], timeout=10)
    message = info.value.one_line()
    assert "exited 2" in message and "boom: bad flag" in message and PY in message


def test_check_timeout_names_the_limit():
    with pytest.raises(CommandFailed, match=r"ran past its 0.5 s timeout"):
        check([PY, "-c", "import time; time.sleep(5)"], timeout=0.5)


def test_missing_tool_names_it_and_how_to_install():
    with pytest.raises(ToolMissing) as info:
        check(["eksctl-not-installed-here"], timeout=5)
    assert "eksctl-not-installed-here not found on PATH" in info.value.one_line()
    with pytest.raises(ToolMissing) as info:
        check(["/nonexistent/bin/helm", "version"], timeout=5)
    assert info.value.tool == "helm" and "helm.sh/docs/intro/install" in info.value.one_line()


def _flaky(tmp_path, message: str, failures: int) -> list[str]:
    counter = tmp_path / "count"
    code = (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        f"if n < {failures}:\n"
        f"    sys.stderr.write({message!r}); sys.exit(1)\n"
        "print('ok')\n"
    )
    return [PY, "-c", code]


def test_transient_failures_are_retried(tmp_path):
    waits: list[float] = []
    cmd = _flaky(tmp_path, "Unable to connect to the server: dial tcp: connection refused", failures=2)
    result = check(cmd, timeout=10, attempts=3, sleep=waits.append)
    assert result.stdout == "ok\n" and waits == [2.0, 4.0]


def test_other_failures_are_not_retried(tmp_path):
    waits: list[float] = []
    cmd = _flaky(tmp_path, 'Error: INSTALLATION FAILED: chart "nope" not found', failures=1)
    with pytest.raises(CommandFailed, match="chart"):
        check(cmd, timeout=10, attempts=3, sleep=waits.append)
    assert waits == [] and (tmp_path / "count").read_text() == "1"


def test_stream_passes_lines_on_and_keeps_them():
    lines: list[str] = []
    result = stream([PY, "-c", "import sys; print('one'); sys.stderr.write('two\\n')"], 10, lines.append)
    assert result.ok and lines == ["one", "two"] and "two" in result.stderr
    with pytest.raises(CommandFailed, match="exited 4: late failure"):
        check([PY, "-c", "import sys; print('late failure'); sys.exit(4)"], 10, echo=lines.append)


def test_background_process_stops_with_its_block():
    with Background([PY, "-c", "import time; time.sleep(30)"]) as proc:
        assert proc.alive()
    assert not proc.alive()
    with pytest.raises(ToolMissing):
        Background(["kubectl-not-installed-here", "port-forward"])


@pytest.mark.parametrize("cmd, shown", [
    (["kubectl", "create", "secret", "generic", "hf", "--from-literal=token=hf_abcdefghijklmnopqrstuvwxyz"],
     "--from-literal=token=***"),
    (["helm", "upgrade", "--install", "x", "y", "--set", "auth.password=hunter2"], "auth.password=***"),
    (["tool", "--token", "s3cr3t-value"], "--token '***'"),
    (["tool", "--api-key=abc123"], "--api-key=***"),
    (["env", "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz", "run"], "HF_TOKEN=***"),
    (["echo", "AKIAIOSFODNN7EXAMPLE"], "echo '***'"),
])
def test_redaction_hides_secret_values(cmd, shown):
    text = display(cmd)
    assert shown in text
    assert "hunter2" not in text and "s3cr3t" not in text and "abc123" not in text and "AKIA" not in text


def test_redaction_leaves_ordinary_commands_alone():
    cmd = ["kubectl", "--kubeconfig", "k", "apply", "--server-side", "--field-manager=trainlift", "-f", "a.yaml",
           "-l", "ray.io/cluster=x,ray.io/node-type=head", "--for=condition=Ready"]
    assert redact(cmd) == cmd
