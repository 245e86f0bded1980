"""Job and cluster specs report a bad field the same way: its path, the problem, the bad value once."""

from __future__ import annotations

import pytest

from trainlift.config.cluster import parse_cluster_spec
from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError

JOB = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}


def job_error(**sections) -> str:
    with pytest.raises(SpecError) as err:
        validate_job_spec({**JOB, **sections})
    return err.value.message


def test_a_value_the_validator_already_quotes_is_not_repeated():
    assert job_error(scaling={"workers": [3, 1]}) == \
        "spec: scaling.workers: a range [min, max] needs 1 <= min <= max (got [3, 1])"


def test_a_bad_list_value_is_shown():
    assert job_error(model={"path": "m", "config": [1]}).startswith(
        "spec: model.config.dict[str,any]: Input should be a valid dictionary (got [1])")


def test_list_positions_read_as_indices_in_both_specs():
    with pytest.raises(SpecError) as err:
        parse_cluster_spec({"name": "c", "workers": [{"instance_type": "g6.12xlarge", "count": "many"}]})
    assert err.value.message.startswith("workers[0].count: ")
