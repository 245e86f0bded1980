"""Benchmark 19: HSDP against plain FSDP over 2 nodes: step time, and the bytes each rank sends across nodes per
step, computed from the mesh and the parameter bytes and checked against a counted trace of the collectives.

    python bench/hsdp_bytes.py [--steps 6] [--no-record]

Two local raylets of 2 CPUs each (tests/integration/ray_nodes.py) stand for 2 nodes; a tiny Llama (random init,
fp32 on CPU, gloo) trains on 4 workers through `run_training`, once with `parallel: {replicate: 1, shard: 4}`
(plain FSDP) and once with `{replicate: 2, shard: 2}` (HSDP). The recipe's worker loop is wrapped
(`counting_loop`): every rank gathers each rank's Ray node id, then replaces `torch.distributed`'s
`all_gather_single` and `reduce_scatter_single` (what FSDP2 in torch 2.13 calls), `all_reduce` (HSDP's gradient
all-reduce and the recipe's loss and token sums) and, in case anything calls them, `all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_gather` and `broadcast` with counters: calls and tensor bytes per process group,
split by step (inside `recipe.queue_step`) and everything else (start-up, export).

Bytes from calls, the ring model: an all-gather or reduce-scatter of S bytes (the whole gathered / reduced
tensor) over n ranks sends S·(n-1)/n from each rank, an all-reduce 2·S·(n-1)/n. Two conventions for "across
nodes", both applied alike to the counted trace and to the computed figure:
- per rank: the ring bytes of every collective whose group spans more than one node (the accounting of
  trainlift's estimate, `collective_bytes_per_step` / `replica_bytes_per_step`, over a per-GPU bus bandwidth);
- per node: the bytes that leave a node when each such ring visits a node's ranks one after the other
  (as NCCL builds its rings): only a rank whose ring successor sits on another node sends across.
The computed figure: P parameters, R of them in the root FSDP unit (which FSDP2 does not reshard after forward,
so its parameters are not gathered again in backward), b bytes per gathered parameter, g per reduced gradient;
a shard group of s ranks gathers b·(2P - R) and reduce-scatters g·P, a replicate group of r ranks all-reduces
the g·P/s gradient shard.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys
from pathlib import Path

import benchlib as bl

LLAMA_TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
MESHES = {"FSDP (1 × 4)": (1, 4), "HSDP (2 × 2)": (2, 2)}
KINDS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
         "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "broadcast": "broadcast"}
SIZE_ARG = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
            "all_gather": "tensor_list", "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
            "all_reduce": "tensor", "broadcast": "tensor"}
P5 = {"nodes": 4, "gpus_per_node": 8, "node_bytes_per_s": 3200e9 / 8}  # p5.48xlarge: 3,200 Gbps EFA per node
CONFIG_8B = bl.REPO / "examples" / "model-configs" / "llama-3.1-8b.json"


# ---- pure helpers: the ring model and where its bytes go ----

def ring_bytes(kind: str, size: float, n: int) -> float:
    """Bytes one rank sends in a ring collective of `size` bytes (whole tensor) over `n` ranks."""
    return (2.0 if kind == "all_reduce" else 1.0) * size * (n - 1) / n


def ring_exits(ranks: list[int], nodes: list) -> set[int]:
    """The ranks of a ring over `ranks` that visits each node's ranks in a row (nodes in rank order) whose
    successor sits on another node: the only ones that send across nodes."""
    order = list(dict.fromkeys(nodes))
    ring = sorted(ranks, key=lambda r: (order.index(nodes[r]), r))
    return {r for r, nxt in zip(ring, ring[1:] + ring[:1]) if nodes[r] != nodes[nxt]}


def group_key(kind: str, ranks) -> str:
    return f"{kind}|{','.join(str(r) for r in ranks)}"


def cross_node(step_by_rank: dict[int, dict], nodes: list) -> dict:
    """One step's traffic from each rank's counts ({group_key: [calls, bytes]}): the mean per rank of the ring
    bytes in node-spanning groups, by kind; the mean per node of the bytes its ring exits send across; the mean
    per rank within a node."""
    per_rank: dict[str, float] = {}
    per_node = intra = 0.0
    ranks_n, nodes_n = len(step_by_rank), len(set(nodes))
    for rank, counts in step_by_rank.items():
        for key, (_, size) in counts.items():
            kind, ranks = key.split("|")[0], [int(r) for r in key.split("|")[1].split(",")]
            sent = ring_bytes(kind, size, len(ranks))
            if len({nodes[r] for r in ranks}) == 1:
                intra += sent / ranks_n
                continue
            per_rank[kind] = per_rank.get(kind, 0.0) + sent / ranks_n
            if rank in ring_exits(ranks, nodes):
                per_node += sent / nodes_n
    return {"per_rank": per_rank, "cross_rank": sum(per_rank.values()), "per_node": per_node, "intra": intra}


def expected_step(params: int, root: int, replicate: int, shard: int, param_bytes: int, grad_bytes: int) -> dict:
    """What FSDP2 should issue in one step on each rank of the (replicate, shard) mesh (consecutive ranks shard,
    dim 0 replicates), as {rank: {group_key: [calls, bytes]}} (calls unknown: 0)."""
    grid = [[i * shard + j for j in range(shard)] for i in range(replicate)]
    steps = {}
    for i, row in enumerate(grid):
        for j, rank in enumerate(row):
            counts = {}
            if shard > 1:
                counts[group_key("all_gather", row)] = [0, param_bytes * (2 * params - root)]
                counts[group_key("reduce_scatter", row)] = [0, grad_bytes * params]
            if replicate > 1:
                counts[group_key("all_reduce", [r[j] for r in grid])] = [0, grad_bytes * params / shard]
            steps[rank] = counts
    return steps


def p5_figures(params: int, root: int, replicate: int, shard: int) -> dict:
    """Bytes across nodes per step on 4 × p5.48xlarge (bf16 gathers, fp32 gradient reduction) and their time at
    line rate: per GPU over its 1/8 of the node's EFA, per node over all of it."""
    per_node_gpus = P5["gpus_per_node"]
    nodes = [r // per_node_gpus for r in range(replicate * shard)]
    traffic = cross_node(expected_step(params, root, replicate, shard, 2, 4), nodes)
    gpu_rate = P5["node_bytes_per_s"] / per_node_gpus
    return {**traffic, "rank_s": traffic["cross_rank"] / gpu_rate,
            "node_s": traffic["per_node"] / P5["node_bytes_per_s"]}


# ---- on each Ray Train worker (travels by value with this script) ----

def counted(fn, name: str, current: list):
    """`fn` (a torch.distributed collective) adding its calls and tensor bytes to `current[0]` by group."""
    import inspect

    import torch.distributed as dist

    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments[SIZE_ARG[name]]
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        size = sum(t.numel() * t.element_size() for t in tensors)
        group = bound.arguments.get("group") or dist.group.WORLD
        entry = current[0].setdefault(group_key(KINDS[name], dist.get_process_group_ranks(group)), [0, 0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + size
        return fn(*args, **kwargs)

    wrapper.uncounted = fn
    return wrapper


def counting_loop(out_dir: str, config: dict) -> None:
    """The recipe's worker loop with torch.distributed's collectives counted; writes <out_dir>/rank<N>.json."""
    import ray
    import torch.distributed as dist

    from trainlift.train import recipe

    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    trace = {"rank": dist.get_rank(), "nodes": nodes, "steps": [], "other": {}}
    current = [trace["other"]]
    for name in KINDS:
        fn = getattr(dist, name)
        setattr(dist, name, counted(getattr(fn, "uncounted", fn), name, current))
    queue_step = getattr(recipe.queue_step, "uncounted", recipe.queue_step)

    def traced_step(*args, **kwargs):
        trace["steps"].append({})
        current[0] = trace["steps"][-1]
        try:
            return queue_step(*args, **kwargs)
        finally:
            current[0] = trace["other"]

    traced_step.uncounted = queue_step
    recipe.queue_step = traced_step
    try:
        recipe.train_loop_per_worker(config)
    finally:
        Path(out_dir, f"rank{trace['rank']}.json").write_text(json.dumps(trace))


# ---- the driver ----

def param_counts(config: dict) -> tuple[int, int]:
    """(all parameters, those in the root FSDP unit: neither in a decoder layer nor in an untied embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainlift.train.model.build import build_config, decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(config))
    units, embedding, head = [*decoder_layers(model)], model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:  # apply_fsdp: an untied embedding is its own unit
        units.append(embedding)
    inside = {id(p) for unit in units for p in unit.parameters()}
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if id(p) not in inside)


def two_raylets():
    nodes = runpy.run_path(str(bl.REPO / "tests" / "integration" / "ray_nodes.py"))
    return nodes["two_local_nodes"](cpus=2)


def run_mesh(address: str, name: str, replicate: int, shard: int, steps: int, work: Path) -> dict:
    from trainlift.config.job import validate_job_spec
    from trainlift.train.launch import run_training

    spec = validate_job_spec({
        "model": {"config": LLAMA_TINY, "tokenizer": str(bl.REPO / "examples" / "tiny" / "tokenizer")},
        "data": {"train": str(bl.REPO / "examples" / "data" / "tasks-train.jsonl"), "seq_len": 256},
        "train": {"steps": steps, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "scaling": {"workers": 4}, "parallel": {"replicate": replicate, "shard": shard},
        "checkpoint": {"every_steps": 0}, "run": {"name": name, "storage": str(work / "runs"), "max_failures": 0}})
    out = work / f"trace-{name}"
    out.mkdir()
    summary = run_training(spec, address=address, train_loop=functools.partial(counting_loop, str(out)))
    assert (summary["mesh"]["replicate"], summary["mesh"]["shard"]) == (replicate, shard), summary["mesh"]
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and "eval_loss" not in r]
    traces = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda t: t["rank"])
    nodes = traces[0]["nodes"]
    per_step = [cross_node({t["rank"]: t["steps"][i] for t in traces}, nodes) for i in range(len(traces[0]["steps"]))]
    calls = sum(c for c, _ in traces[0]["steps"][-1].values())
    return {"times": times, "steps": per_step, "nodes": nodes, "calls_per_step": calls}


def fmt(value: float, unit: float = 1e6) -> str:
    return f"{value / unit:,.3f}"


def tiny_tables(results: dict, params: int, root: int) -> tuple[str, str, dict]:
    rows, kinds, ratios = [], [], {}
    for label, (r, s) in MESHES.items():
        res = results[label]
        counted = res["steps"][-1]
        spread = max(abs(st["cross_rank"] - counted["cross_rank"]) for st in res["steps"])
        computed = cross_node(expected_step(params, root, r, s, 4, 4), res["nodes"])
        ratios[label] = (counted, computed)
        step = bl.median(res["times"][1:])
        rows.append([label, f"{step:.3f}", " ".join(f"{t:.2f}" for t in res["times"]), res["calls_per_step"],
                     fmt(counted["cross_rank"]), fmt(computed["cross_rank"]),
                     f"{counted['cross_rank'] / computed['cross_rank']:.6f}", fmt(counted["per_node"]),
                     fmt(computed["per_node"]), fmt(counted["intra"]), fmt(computed["intra"]), f"{spread:,.0f}"])
        for kind in sorted(set(counted["per_rank"]) | set(computed["per_rank"])):
            c, e = counted["per_rank"].get(kind, 0.0), computed["per_rank"].get(kind, 0.0)
            kinds.append([label, kind, fmt(c), fmt(e), f"{c - e:,.0f}"])
    main = bl.table(["mesh", "step s (median, steps 2+)", "step s (each)", "collective calls per step (rank 0)",
                     "across nodes per rank MB: counted", "computed", "counted / computed",
                     "leaving a node MB: counted", "computed", "within a node per rank MB: counted", "computed",
                     "counted spread over steps B"], rows)
    by_kind = bl.table(["mesh", "collective", "across nodes per rank MB: counted", "computed",
                        "counted − computed B"], kinds)
    return main, by_kind, ratios


def p5_section() -> str:
    from trainlift.estimate.memory import Workload
    from trainlift.estimate.shape import shape_of
    from trainlift.estimate.timing import collective_bytes_per_step, replica_bytes_per_step
    from trainlift.train.model.build import build_config

    config = json.loads(CONFIG_8B.read_text())
    params, root = param_counts(config)
    shape = shape_of(build_config(config))
    gpus = P5["nodes"] * P5["gpus_per_node"]
    rows, figures = [], {}
    for label, (r, s) in {f"FSDP (1 × {gpus})": (1, gpus), f"HSDP ({P5['nodes']} × {P5['gpus_per_node']})":
                          (P5["nodes"], P5["gpus_per_node"])}.items():
        f = figures[label] = p5_figures(params, root, r, s)
        w = Workload(micro_batch=1, seq_len=8192, grad_accum=1, activation_checkpointing=True, gpu=True, bf16=True,
                     workers=gpus, shard=0 if r == 1 else s)
        estimate = collective_bytes_per_step(shape, w) if r == 1 else replica_bytes_per_step(shape, w)
        rows.append([label, fmt(f["cross_rank"], 1e9), f"{f['rank_s']:.3f}", fmt(f["per_node"], 1e9),
                     f"{f['node_s']:.3f}", fmt(estimate, 1e9)])
    (fsdp, hsdp) = figures.values()
    return (f"**8B on {P5['nodes']} × p5.48xlarge** ({gpus} H100, 3,200 Gbps EFA per node = 400 GB/s per node, "
            f"50 GB/s per GPU), the same computation: Llama-3.1-8B (examples/model-configs/llama-3.1-8b.json), "
            f"P = {params / 1e9:.3f} B parameters, R = {root / 1e6:.0f} M in the root unit (untied LM head and final "
            f"norm); on GPU the recipe gathers bf16 parameters (b = 2) and reduces fp32 gradients (g = 4: "
            f"`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); one micro-batch per step (with "
            f"gradient accumulation, every micro-batch repeats the gathers and, on GPU, the gradient reduction).\n\n"
            f"- FSDP over {gpus}: every collective spans the nodes; per GPU "
            f"(b·(2P − R) + g·P)·{gpus - 1}/{gpus}.\n"
            f"- HSDP {P5['nodes']} × {P5['gpus_per_node']}: gathers and reduce-scatters stay on NVLink; across "
            f"nodes only the all-reduce of the gradient shard, per GPU 2·(g·P/{P5['gpus_per_node']})·"
            f"{P5['nodes'] - 1}/{P5['nodes']}.\n\n"
            + bl.table(["mesh", "across nodes per GPU GB/step", "s at 50 GB/s per GPU",
                        "leaving a node GB/step (node-ordered rings)", "s at 400 GB/s per node",
                        "the estimate's formula per GPU GB (timing.py)"], rows)
            + f"\n\nPer GPU, HSDP sends {hsdp['cross_rank'] / fsdp['cross_rank']:.3f}× FSDP's bytes across nodes "
              f"(FSDP's count assumes every GPU's ring traffic crosses the network). Per node, with rings that "
              f"visit a node's 8 GPUs in a row, the 32-GPU FSDP ring leaves each node once per collective, so a node "
              f"sends {fmt(fsdp['per_node'], 1e9)} GB against HSDP's {fmt(hsdp['per_node'], 1e9)} GB "
              f"({hsdp['per_node'] / fsdp['per_node']:.2f}×): at line rate {fsdp['node_s']:.3f} s against "
              f"{hsdp['node_s']:.3f} s of communication per step. HSDP's fp32 all-reduce (reduce-scatter + "
              f"all-gather of 4P bytes across 4 nodes) outweighs FSDP's fp32 reduce-scatter across nodes, and "
              f"it saves FSDP's two bf16 parameter gathers across nodes. The estimate's formulas count the "
              f"root unit's backward gather too (2·R·{gpus - 1}/{gpus} bytes more for FSDP).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)
    for key in ("OMP_NUM_THREADS", "RAY_ADDRESS"):
        os.environ.pop(key, None)
    work = bl.workdir("trainlift-bench-hsdp-")
    os.environ.update(RAY_AUTH_MODE="disabled", TRAINLIFT_HOME=str(work / "home"), TOKENIZERS_PARALLELISM="false")
    params, root = param_counts(LLAMA_TINY)
    results, loads = {}, []
    with two_raylets() as address:
        for label, (r, s) in MESHES.items():
            loads.append(bl.wait_for_quiet())
            results[label] = run_mesh(address, f"mesh-{r}x{s}", r, s, args.steps, work)
            print(label, json.dumps(results[label]["steps"][-1]), file=sys.stderr, flush=True)
    bl.record("19. HSDP against FSDP: bytes across nodes", loads, report(results, params, root, args.steps),
              key="hsdp_bytes")


def report(results: dict, params: int, root: int, steps: int) -> str:
    main_table, by_kind, ratios = tiny_tables(results, params, root)
    (fsdp_c, fsdp_e), (hsdp_c, hsdp_e) = ratios.values()
    fsdp_t, hsdp_t = (bl.median(results[label]["times"][1:]) for label in MESHES)
    nodes = results[next(iter(MESHES))]["nodes"]
    layout = ", ".join(f"rank {r} on node {list(dict.fromkeys(nodes)).index(n)}" for r, n in enumerate(nodes))
    return (f"Tiny Llama (hidden 256, 4 layers, vocab 2048, untied head, random init): P = {params:,} parameters "
            f"({params * 4 / 1e6:.2f} MB fp32), R = {root:,} in the root unit; seq_len 256, micro-batch 2, {steps} "
            f"steps, no checkpoint, 4 workers (1 CPU each, gloo) on 2 local raylets of 2 CPUs ({layout}). Counted: "
            f"the trace of the last step (every step counts the same bytes; spread below) with the ring model "
            f"applied; computed: b = g = 4 bytes and the mesh's groups. Step time: the recipe's `step_time_s`.\n\n"
            + main_table + "\n\n" + by_kind
            + f"\n\n**HSDP / FSDP**: step time {hsdp_t / fsdp_t:.2f}×; bytes across nodes per rank "
              f"{hsdp_c['cross_rank'] / fsdp_c['cross_rank']:.3f}× counted "
              f"({hsdp_e['cross_rank'] / fsdp_e['cross_rank']:.3f}× computed); bytes leaving a node "
              f"{hsdp_c['per_node'] / fsdp_c['per_node']:.3f}× counted "
              f"({hsdp_e['per_node'] / fsdp_e['per_node']:.3f}× computed). The counted bytes exceed the computed "
              f"ones by the recipe's two float64 all-reduces over all 4 workers per step (loss, token counts and "
              f"stop vote: 5 values, 2·40·3/4 = 60 B per rank); the gradient norm's all-reduce goes through "
              f"DTensor's functional collectives, which the wrapper does not see (one scalar). On one machine "
              f"the 'nodes' share loopback, so step times show the cost of the extra collectives' latency and CPU, "
              f"not of a network link; the bytes are what a real 2-node run sends.\n\n"
            + p5_section())


if __name__ == "__main__":
    main()
