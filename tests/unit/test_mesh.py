"""The mesh `parallel` chooses (pure): HSDP within and across nodes when the sharded state fits a node, plain FSDP
otherwise; explicit degrees checked against the workers; an elastic run that shrank falls back to plain FSDP."""

from types import SimpleNamespace

import pytest

from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError
from trainlift.train.run import preflight
from trainlift.train.run.mesh import MeshError, choose_mesh, explicit_degrees, state_bytes, workers_per_node

GIB = 2**30
QWEN_1_5B = SimpleNamespace(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)
LLAMA_70B = SimpleNamespace(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                            num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                            tie_word_embeddings=False)
JOB = SimpleNamespace(train=SimpleNamespace(micro_batch_size=1), data=SimpleNamespace(seq_len=2048))


def on_nodes(*counts: int) -> list[int]:
    """Each rank's node, ranks grouped by node as Ray Train orders them."""
    return [node for node, count in enumerate(counts) for _ in range(count)]


def auto(config, nodes, worker_bytes=80 * GIB, **kw):
    return choose_mesh("auto", "auto", nodes, state_bytes(config, JOB, gpu=True, bf16=True), worker_bytes, **kw)


def test_state_is_sixteen_bytes_a_parameter_for_a_full_fine_tune():
    total = state_bytes(QWEN_1_5B, JOB, gpu=True, bf16=True)
    assert total / 16 == pytest.approx(1.54e9, rel=0.01)
    lora = state_bytes(QWEN_1_5B, JOB, gpu=True, bf16=True, lora_params=10**7)
    assert lora == pytest.approx(total / 16 * 2 + 16 * 10**7, rel=0.01)  # frozen bf16 base + fp32 adapter state


@pytest.mark.parametrize("config, nodes, shape", [
    (QWEN_1_5B, on_nodes(8, 8, 8, 8), (4, 8)),  # 1.5B on 4 nodes of 8 × 80 GiB: 3 GiB a GPU
    (LLAMA_70B, on_nodes(8, 8, 8, 8), (1, 32)),  # 70B: 140 GB a GPU over one node, so over all 32
    (QWEN_1_5B, on_nodes(8), (1, 8)),  # a single node
    (QWEN_1_5B, on_nodes(8, 4), (1, 12)),  # uneven nodes
    (QWEN_1_5B, on_nodes(2, 2), (2, 2)),  # the CPU test's 2 raylets
])
def test_auto_rule(config, nodes, shape):
    assert auto(config, nodes).shape == shape


def test_auto_needs_the_state_to_fit_half_a_worker():
    nodes = on_nodes(8, 8)
    fits = state_bytes(QWEN_1_5B, JOB, gpu=True, bf16=True) / 8 / 0.5
    assert auto(QWEN_1_5B, nodes, worker_bytes=fits).shape == (2, 8)
    assert auto(QWEN_1_5B, nodes, worker_bytes=fits * 0.99).shape == (1, 16)
    assert choose_mesh("auto", "auto", nodes, None, 80 * GIB).shape == (1, 16)  # a model the estimate cannot size


def test_nodes_must_hold_consecutive_ranks():
    assert workers_per_node([0, 0, 1, 1]) == 2
    assert workers_per_node([0, 1, 0, 1]) is None
    assert workers_per_node([0, 0, 0, 1]) is None


def test_explicit_degrees():
    assert explicit_degrees(2, 4, 8) == (2, 4)
    assert explicit_degrees("auto", 4, 8) == (2, 4)
    assert explicit_degrees(1, "auto", 8) == (1, 8)
    with pytest.raises(MeshError, match=r"replicate 2 × shard 3 = 6 workers, but the run has 8"):
        explicit_degrees(2, 3, 8)
    with pytest.raises(MeshError, match=r"parallel.shard: 3 does not divide the run's 8 workers"):
        explicit_degrees("auto", 3, 8)
    assert choose_mesh(1, "auto", on_nodes(4, 4), None, 0).shape == (1, 8)  # replicate 1 forces plain FSDP
    assert choose_mesh(4, 2, on_nodes(4, 4), None, 0).shape == (4, 2)  # two copies on each node


def test_shard_must_divide_a_node():
    with pytest.raises(MeshError, match=r"parallel.shard: 4 does not divide the workers of a node \(2 per node\)"):
        choose_mesh(2, 4, on_nodes(2, 2, 2, 2), None, 0)


def test_a_shrunk_elastic_group_falls_back_to_plain_fsdp():
    mesh = choose_mesh(2, 2, on_nodes(2, 1), None, 0, shrunk=True)
    assert mesh.shape == (1, 3) and "plain FSDP" in mesh.why and "3 workers left" in mesh.why
    assert auto(QWEN_1_5B, on_nodes(2, 1), shrunk=True).shape == (1, 3)
    assert choose_mesh(2, 2, on_nodes(2, 2), None, 0, shrunk=True).shape == (2, 2)  # still fits: kept


def spec(*parallel, workers="4"):
    raw = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "scaling": {"workers": workers},
           "parallel": dict(zip(("replicate", "shard"), parallel))}
    return validate_job_spec(raw)


def test_spec_section_and_driver_check():
    assert (spec().parallel.replicate, spec().parallel.shard) == ("auto", "auto")
    preflight.check_parallel(spec(2, 2), 4)
    preflight.check_parallel(spec(2, 3), None)  # workers: auto, checked once Ray counted them
    with pytest.raises(SpecError, match="replicate 2 × shard 3"):
        preflight.check_parallel(spec(2, 3), 4)
    with pytest.raises(SpecError, match="parallel.shard: must be at least 1|at least 1"):
        spec(1, 0)
