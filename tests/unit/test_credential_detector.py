"""One credential detector (redact.py) for URIs, `--set`, `--env`, spec fields and error messages: each credential
of the table is found, masked where it is shown, refused where it would be shipped (a spec field, `--set`, `--env`),
and kept out of every message, whatever odd characters its password holds. Things that only look alike (a
commit hash, a path, TOKENIZERS_PARALLELISM) are left alone."""

from __future__ import annotations

import pytest

from trainlift import rundir
from trainlift.config.job import apply_overrides, validate_job_spec
from trainlift.errors import SpecError, UsageError
from trainlift.ops.jobs import parse_env
from trainlift.redact import has_credentials, mask, secret_name

AWS_ID, AWS_SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ0cmFpbmxpZnQifQ.c2lnbmF0dXJlX29mX3RoZV90b2tlbg"

# (case, text, the part that must never be shown)
TABLE = [
    ("password with /", f"s3://{AWS_ID}:{AWS_SECRET}@bucket/runs", AWS_SECRET),
    ("password with #", f"s3://{AWS_ID}:pa#ss9word@bucket/runs", "ss9word"),
    ("password with ?", f"s3://{AWS_ID}:pa?ss9word@bucket/runs", "ss9word"),
    ('password with "', f's3://{AWS_ID}:pa"ss9word@bucket/runs', "ss9word"),
    ("password with @", "https://alice:p@ss9word@mlflow.example/api", "ss9word"),
    ("DB_PASS", "DB_PASS=hunter2pw", "hunter2pw"),
    ("PGPASS", "PGPASS=hunter2pw", "hunter2pw"),
    ("Azure connection string", "DefaultEndpointsProtocol=https;AccountName=acct;"
                                "AccountKey=c2VjcmV0S2V5/Zm9y+QXp1cmU==;EndpointSuffix=core.windows.net", "c2VjcmV0S2V5"),
    ("GitHub fine-grained token", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ",
     "11ABCDEFG0123456789"),
    ("AWS secret under another name", AWS_SECRET, AWS_SECRET),
    ("presigned URL", "https://bucket.s3.amazonaws.com/model.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
                      "ASIAEXAMPLEEXAMPLE00%2F20260101%2Fus-east-2%2Fs3%2Faws4_request&X-Amz-Security-Token=IQoJb3Jp"
                      "Z2luX2VjEXAMPLE&X-Amz-Signature=0a1b2c3d4e5f60718293a4b5c6d7e8f9", "IQoJb3Jp"),
    ("presigned signature", "https://bucket.s3.amazonaws.com/model.bin?X-Amz-Date=20260101T000000Z&X-Amz-Signature="
                            "0a1b2c3d4e5f60718293a4b5c6d7e8f9", "0a1b2c3d4e5f6071"),
    ("Slack webhook", "https://hooks.slack.com/services/T0123ABCD/B0123ABCD/abcdefghij0123456789ABCD", "abcdefghij01"),
    ("token in a query", "https://mlflow.example/api/2.0?token=t0k3nvalue99", "t0k3nvalue99"),
    ("Bearer token", f"Authorization: Bearer {JWT}", "c2lnbmF0dXJl"),
]
IDS = [case for case, _, _ in TABLE]
LOOKALIKES = ["https://mlflow.example:5000/api", "s3://bucket/runs/tiny-demo", "0123456789abcdef0123456789abcdef01234567",
              "/home/alice/Models/Qwen2/checkpoint_00000003", "TOKENIZERS_PARALLELISM=false", "train.lr=0.0002",
              "git+ssh://git@github.com/o/r.git", "https://host/a?to=b@c", "Basic setup"]


@pytest.mark.parametrize("case, text, secret", TABLE, ids=IDS)
def test_the_detector_finds_it_and_masks_it(case, text, secret):
    assert has_credentials(text)
    assert secret not in mask(text) and "***" in mask(text)


@pytest.mark.parametrize("case, text, secret", TABLE, ids=IDS)
def test_a_spec_field_and_a_set_holding_it_are_refused_without_echoing_it(case, text, secret):
    given = {"model": {"path": "m"}, "data": {"train": text}}
    set_on_the_command_line = apply_overrides({"model": {"path": "m"}, "data": {}}, [f"data.train={text}"])
    for raw in (given, set_on_the_command_line):
        with pytest.raises(SpecError) as refused:
            validate_job_spec(raw, overrides=[f"data.train={text}"] if raw is set_on_the_command_line else ())
        line = refused.value.one_line()
        assert "data.train" in line and "credential" in line and secret not in line


@pytest.mark.parametrize("case, text, secret", TABLE, ids=IDS)
def test_an_env_holding_it_is_refused_without_echoing_it(case, text, secret):
    with pytest.raises(UsageError) as refused:
        parse_env([f"SOME_SETTING={text}"], {})
    line = refused.value.one_line()
    assert line.startswith("--env SOME_SETTING: ") and secret not in line


@pytest.mark.parametrize("case, text, secret", TABLE, ids=IDS)
def test_no_error_message_shows_it(case, text, secret):
    error = UsageError(f"cannot read {text} (it said: {text})", hint=f"check {text}")
    assert secret not in error.one_line() and secret not in str(error)


@pytest.mark.parametrize("password", [AWS_SECRET, "pa#ss9word", "pa?ss9word", 'pa"ss9word'])
def test_opening_run_storage_with_credentials_in_its_uri_does_not_print_them(password):
    with pytest.raises(UsageError) as refused:
        rundir.open_uri(f"s3://{AWS_ID}:{password}@bucket/runs")
    assert refused.value.one_line().startswith("cannot open s3://***@bucket/runs")
    assert password not in refused.value.one_line() and AWS_ID not in refused.value.one_line()


@pytest.mark.parametrize("name", ["DB_PASS", "PGPASS", "MYSQL_PWD", "AZURE_STORAGE_ACCOUNT_KEY", "apiKey"])
def test_a_name_that_says_credential_is_refused_whatever_its_value(name):
    assert secret_name(name)
    with pytest.raises(UsageError, match=rf"^--env {name}: a secret passed to the job"):
        parse_env([f"{name}=plain"], {})


@pytest.mark.parametrize("text", LOOKALIKES)
def test_what_only_looks_like_a_credential_is_left_alone(text):
    assert not has_credentials(text) and mask(text) == text


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "PWD", "NCCL_DEBUG", "KEY_FIELD", "RAY_AUTH_MODE"])
def test_names_that_do_not_say_credential(name):
    assert not secret_name(name)
