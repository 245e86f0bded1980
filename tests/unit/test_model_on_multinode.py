"""model.config + model.path builds the model on the driver's disk: a run whose workers sit on other hosts is
refused before any worker starts, and so is a local model.path the other hosts answer they cannot read. The node
addresses are given as `ray.nodes()` reports them; no multi-host cluster runs here (every local Ray node shares
this machine's disk: the Ray probe itself is in tests/integration/test_model_from_s3.py)."""

from __future__ import annotations

import pytest

from trainlift.errors import UsageError
from trainlift.train.run.preflight import check_model_readable_by_workers


CONFIG = '{"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}'


def built_model_spec(tiny_spec, tmp_path, model_path):
    return tiny_spec(f"model.path={model_path}", f"model.config={CONFIG}", f"run.storage={tmp_path / 'shared'}")


def test_a_model_built_on_the_driver_is_refused_when_workers_are_on_other_hosts(tiny_spec, tmp_path):
    spec = built_model_spec(tiny_spec, tmp_path, tmp_path / "base")
    with pytest.raises(UsageError, match=r"model\.path: .*/base would be built on this machine's disk, which "
                                         r"workers on 2 other node\(s\) cannot read") as err:
        check_model_readable_by_workers(spec, {"10.0.0.1", "10.0.0.2", "10.0.0.3"}, driver_ip="10.0.0.1")
    assert "drop model.path" in err.value.hint
    assert not (tmp_path / "base").exists()


@pytest.mark.parametrize("nodes, model_under_storage, config", [
    ({"127.0.0.1"}, False, True),         # every node on this machine
    ({"10.0.0.1", "10.0.0.2"}, True, True),  # under the run's shared volume
    ({"10.0.0.1", "10.0.0.2"}, False, False),  # a model that already exists is not built here
])
def test_models_every_worker_can_read_pass(tiny_spec, tmp_path, tiny_assets, nodes, model_under_storage, config):
    path = tmp_path / "shared" / "base" if model_under_storage else tmp_path / "base"
    spec = built_model_spec(tiny_spec, tmp_path, path) if config else tiny_spec()
    check_model_readable_by_workers(spec, nodes, driver_ip=min(nodes))


def test_a_local_model_other_hosts_cannot_read_is_refused(tiny_spec):
    """The other nodes answer that model.path is not on their disk: put it on S3 or on storage they mount."""
    asked = []

    def unreadable_on(path, ips):
        asked.append((path, ips))
        return {"10.0.0.3"}

    spec = tiny_spec()  # model.path: the tiny model's local directory, not under run.storage
    with pytest.raises(UsageError, match=r"model\.path: .*/model is a directory on this machine's disk, which "
                                         r"workers on 1 other node\(s\) cannot read \(10\.0\.0\.3\)") as err:
        check_model_readable_by_workers(spec, {"10.0.0.1", "10.0.0.2", "10.0.0.3"}, "10.0.0.1", unreadable_on)
    assert "s3://" in err.value.hint and "run.storage" in err.value.hint
    assert asked == [(spec.model.path, {"10.0.0.2", "10.0.0.3"})]


@pytest.mark.parametrize("path", ["s3://models/tiny", "Qwen/Qwen2.5-0.5B", None])
def test_models_every_node_fetches_or_reads_pass_without_asking(tiny_spec, tiny_assets, tmp_path, path):
    """S3 and hub models are fetched by each node; a local one that every node reads (shared storage) passes."""
    spec = tiny_spec(f"model.path={path}") if path else tiny_spec()

    def unreadable_on(model_path, ips):
        assert path is None, "only a local model.path is asked about"
        return set()

    check_model_readable_by_workers(spec, {"10.0.0.1", "10.0.0.2"}, "10.0.0.1", unreadable_on)
