"""What a job installs on the cluster comes from the package index by name and version: a runtime.pip line or a
`submit --pip` requirement that installs from a URL (a VCS checkout, an archive, a file), whose content no version
pins, is refused in one line before anything is submitted."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError, UsageError

URL_REQUIREMENTS = ["liger-kernel @ git+https://github.com/linkedin/Liger-Kernel.git@main",
                    "peft @ https://files.example/peft-0.21.2-py3-none-any.whl",
                    "mylib @ file:///home/alice/mylib"]


@pytest.mark.parametrize("line", URL_REQUIREMENTS)
def test_a_runtime_pip_line_from_a_url_is_refused(line):
    with pytest.raises(SpecError) as refused:
        validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "runtime": {"pip": [line]}})
    one_line = refused.value.one_line()
    assert "runtime.pip" in one_line and "installs from a URL" in one_line and "==VERSION" in one_line


def test_a_runtime_pip_line_naming_a_release_is_kept():
    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "runtime": {"pip": ["liger-kernel==0.6.4"]}})
    assert spec.runtime.pip == ["liger-kernel==0.6.4"]


@pytest.mark.parametrize("line", URL_REQUIREMENTS)
def test_submit_refuses_a_pip_requirement_from_a_url(tmp_path, monkeypatch, line):
    (tmp_path / "job.yaml").write_text("model: {path: m}\ndata: {train: t.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["submit", "job.yaml", "--address", "http://127.0.0.1:9", "--dry-run",
                                      "--pip", line])
    assert isinstance(result.exception, UsageError), result.output
    assert result.exception.one_line().startswith("--pip: ") and "installs from a URL" in result.exception.one_line()
