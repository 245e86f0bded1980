"""Judge facts: pure functions from `Facts` (and the known-good data) to findings."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Callable, Iterable

import yaml

from trainlift.doctor.probe import Facts

SEVERITIES = ("error", "warning", "ok")
FABRICS = ("efa", "socket", "any")
GiB = 1024**3


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str  # error | warning | ok
    message: str
    fix: str = ""
    node: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def known_good() -> dict[str, Any]:
    text = resources.files("trainlift.doctor").joinpath("known_good.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def version_tuple(text: str | None) -> tuple[int, ...]:
    """Leading numeric components: '2.13.0+cpu' -> (2, 13, 0), '1.22.0amzn4.0' -> (1, 22, 0)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", (text or "").strip())
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def _older(have: str | None, need: str) -> bool:
    return bool(version_tuple(have)) and version_tuple(have) < version_tuple(need)


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 1024**2:.0f} MiB"


# --- single-machine rules: each returns a Finding, or None when it does not apply


def efa_device(f: Facts, expect: str, kg: dict) -> Finding | None:
    if f.uverbs:
        return Finding("efa_device", "ok", f"EFA device visible ({len(f.uverbs)} uverbs)")
    if expect == "efa":
        return Finding(
            "efa_device", "error", "EFA expected but no EFA device (/dev/infiniband/uverbs*) in the container",
            "request vpc.amazonaws.com/efa in the pod resources (EFA device plugin) on an EFA-capable instance",
        )
    return None


def fi_info_efa(f: Facts, expect: str, kg: dict) -> Finding | None:
    if f.fi_info_efa == "ok":
        return Finding("fi_info_efa", "ok", "fi_info -p efa lists the EFA provider")
    if expect != "efa":
        return None
    if f.fi_info_efa == "absent":
        return Finding(
            "fi_info_efa", "error", "fi_info not found: libfabric from the EFA installer is missing",
            "use an image with the EFA installer (e.g. the Ray Train DLC) or install it with --skip-kmod",
        )
    return Finding(
        "fi_info_efa", "error", f"fi_info -p efa finds no EFA provider ({f.fi_info_detail or f.fi_info_efa})",
        "-61 (No data available) means no EFA device in the container: check the EFA resource and /dev/infiniband",
    )


def ofi_plugin(f: Facts, expect: str, kg: dict) -> Finding | None:
    if f.ofi_plugin is None:
        if expect != "efa":
            return None
        return Finding(
            "ofi_plugin", "error", "EFA expected but no aws-ofi-nccl plugin (libnccl-net*.so) found",
            "install the EFA installer >= 1.44 (ships /opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so)",
        )
    label = f"{f.ofi_plugin} ({f.ofi_plugin_version or 'version unknown'})"
    if not f.ofi_plugin_on_ld_path:
        directory = f.ofi_plugin.rsplit("/", 1)[0]
        return Finding(
            "ofi_plugin", "error" if expect == "efa" else "warning",
            f"plugin {label} is neither on LD_LIBRARY_PATH nor in the ld cache: NCCL will not load it",
            f"add {directory} to LD_LIBRARY_PATH",
        )
    return Finding("ofi_plugin", "ok", f"aws-ofi-nccl plugin {label}")


def ofi_plugin_deps(f: Facts, expect: str, kg: dict) -> Finding | None:
    if f.ofi_plugin is None:
        return None
    if f.ofi_plugin_missing_deps:
        return Finding(
            "ofi_plugin_deps", "error",
            f"plugin has unresolved dependencies: {', '.join(f.ofi_plugin_missing_deps)} (NCCL would fall back)",
            "add /opt/amazon/efa/lib (libfabric) and the CUDA libraries to LD_LIBRARY_PATH",
        )
    return Finding("ofi_plugin_deps", "ok", "plugin dependencies resolve (ldd)")


def nccl_net(f: Facts, expect: str, kg: dict) -> Finding | None:
    value = f.env.get("NCCL_NET")
    names = kg["ofi_plugin"]["network_names"]
    pin_hint = f"set NCCL_NET='{names[0]}' (older plugins: '{names[1]}') so a failed plugin is an error"
    if expect == "efa":
        if value is None:
            return Finding(
                "nccl_net", "warning",
                "NCCL_NET unset while EFA is expected: a failed plugin would silently fall back to sockets", pin_hint,
            )
        if value not in names:
            return Finding("nccl_net", "error", f"NCCL_NET={value} steers NCCL away from EFA", pin_hint)
        return Finding("nccl_net", "ok", f"NCCL_NET={value} pins the EFA plugin")
    if expect == "socket" and value in names:
        return Finding(
            "nccl_net", "warning", f"NCCL_NET={value} pins the EFA plugin although sockets are expected",
            "unset NCCL_NET or set NCCL_NET=Socket",
        )
    return None


def fi_provider(f: Facts, expect: str, kg: dict) -> Finding | None:
    value = f.env.get("FI_PROVIDER")
    if expect != "efa" or value is None:
        return None
    if value != "efa":
        return Finding(
            "fi_provider", "error", f"FI_PROVIDER={value} keeps libfabric off the EFA provider",
            "unset FI_PROVIDER or set FI_PROVIDER=efa",
        )
    return Finding("fi_provider", "ok", "FI_PROVIDER=efa")


def shm(f: Facts, expect: str, kg: dict) -> Finding | None:
    need = int(kg["shm"]["min_bytes"])
    fix = "mount an emptyDir with medium: Memory at /dev/shm (Kubernetes) or run with --shm-size=1g"
    if f.shm_bytes is None:
        return Finding("shm", "warning", "/dev/shm is missing", fix)
    if f.shm_bytes < need:
        severity = "error" if f.gpu_count > 1 else "warning"
        return Finding(
            "shm", severity, f"/dev/shm is {_size(f.shm_bytes)} (< {_size(need)}): NCCL's shared-memory transport can fail",
            fix,
        )
    return Finding("shm", "ok", f"/dev/shm is {_size(f.shm_bytes)}")


def memlock(f: Facts, expect: str, kg: dict) -> Finding | None:
    if f.memlock_bytes is None:
        return Finding("memlock", "ok", "memlock unlimited")
    if expect == "any" and not f.uverbs and f.fi_info_efa != "ok":
        return Finding("memlock", "ok", f"memlock limited to {_size(f.memlock_bytes)}; only EFA needs it unlimited, "
                       "and this machine has no EFA device")
    severity = {"efa": "error", "any": "warning"}.get(expect, "ok")
    return Finding(
        "memlock", severity, f"memlock limited to {_size(f.memlock_bytes)}; EFA needs it unlimited",
        "grant IPC_LOCK / run with --ulimit memlock=-1 (EKS nodes with EFA set this for pods)",
    )


def cuda_driver(f: Facts, expect: str, kg: dict) -> Finding | None:
    if not f.torch_cuda:
        if f.gpu_count:
            return Finding(
                "cuda_driver", "error", f"{f.gpu_count} GPU(s) present but torch {f.torch} is a CPU build",
                "install a CUDA build of torch",
            )
        return None
    if f.driver is None:
        return Finding("cuda_driver", "ok", f"torch built for CUDA {f.torch_cuda}; no NVIDIA driver on this node")
    major = str(version_tuple(f.torch_cuda)[0])
    need = kg["cuda_driver_min"]["by_cuda_major"].get(major)
    too_new = f.driver_cuda and version_tuple(f.driver_cuda)[:1] < version_tuple(f.torch_cuda)[:1]
    if too_new or (need and _older(f.driver, need)):
        return Finding(
            "cuda_driver", "error",
            f"torch's CUDA {f.torch_cuda} is newer than driver {f.driver} supports (CUDA {f.driver_cuda or '?'})",
            f"use a driver >= {need or '?'} or a torch build for CUDA {f.driver_cuda or 'the driver'}",
        )
    return Finding("cuda_driver", "ok", f"driver {f.driver} supports torch's CUDA {f.torch_cuda}")


def nccl_version(f: Facts, expect: str, kg: dict) -> Finding | None:
    need = kg["ofi_plugin"]["min_nccl"]
    if f.torch_nccl is None:
        if f.gpu_count:
            return Finding("nccl_version", "warning", "GPUs present but torch reports no NCCL", "install a CUDA build of torch")
        return None
    if f.ofi_plugin and _older(f.torch_nccl, need):
        return Finding(
            "nccl_version", "error", f"NCCL {f.torch_nccl} is older than aws-ofi-nccl supports (>= {need})",
            "use a torch build with a newer NCCL (or the DLC image)",
        )
    return Finding("nccl_version", "ok", f"NCCL {f.torch_nccl}")


def libfabric_version(f: Facts, expect: str, kg: dict) -> Finding | None:
    cfg = kg["ofi_plugin"]
    if not (f.ofi_plugin_version and f.libfabric):
        return None
    if not _older(f.ofi_plugin_version, cfg["min_libfabric_from_plugin"]) and _older(f.libfabric, cfg["min_libfabric"]):
        return Finding(
            "libfabric_version", "warning",
            f"libfabric {f.libfabric} is older than aws-ofi-nccl {f.ofi_plugin_version} needs (>= {cfg['min_libfabric']})",
            "install the EFA installer that shipped this plugin",
        )
    return Finding("libfabric_version", "ok", f"libfabric {f.libfabric} with aws-ofi-nccl {f.ofi_plugin_version}")


def legacy_env(f: Facts, expect: str, kg: dict) -> Finding | None:
    cfg = kg["ofi_plugin"]
    harmful = [k for k in cfg["harmful_env"] if k in f.env]
    legacy = [k for k in cfg["legacy_env"] if k in f.env]
    if harmful:
        return Finding(
            "legacy_env", "warning", f"{', '.join(harmful)} set; aws-ofi-nccl docs say it should not be", "unset it",
        )
    if legacy:
        return Finding(
            "legacy_env", "warning", f"{', '.join(legacy)} set; only needed with old plugin/libfabric releases",
            "drop it unless the plugin is older than the EFA installer's",
        )
    return Finding("legacy_env", "ok", "no legacy NCCL/libfabric settings")


def mlflow_access(f: Facts, expect: str, kg: dict) -> Finding | None:
    m = f.mlflow
    if m is None:
        return None
    fix = ("name a Kubernetes Secret holding MLFLOW_TRACKING_TOKEN (or _USERNAME and _PASSWORD) in run.mlflow_secret "
           "and list it in the cluster spec's secrets; locally, export them")
    if m["error"]:
        return Finding("mlflow_access", "warning", f"MLflow at {m['uri']} does not answer: {m['error']}",
                       "check the URI and that this machine can reach it")
    if m["status"] in (401, 403) and not m["credentials"]:
        return Finding("mlflow_access", "error", f"MLflow at {m['uri']} needs credentials (HTTP {m['status']}) and "
                       "this machine has none", fix)
    if m["status"] in (401, 403):
        return Finding("mlflow_access", "error", f"MLflow at {m['uri']} refuses the credentials in "
                       f"{', '.join(m['credentials'])} (HTTP {m['status']})", "check the Secret's values")
    if m["status"] != 200:
        return Finding("mlflow_access", "warning", f"MLflow at {m['uri']} answers HTTP {m['status']}",
                       "is it an MLflow tracking server?")
    return Finding("mlflow_access", "ok", f"MLflow at {m['uri']} answers"
                   + (f" with {', '.join(m['credentials'])}" if m["credentials"] else ""))


def known_stack(f: Facts, expect: str, kg: dict) -> Finding | None:
    if not (f.ofi_plugin or f.efa_installer):
        return None
    best, best_diff = None, None
    for stack in kg["stacks"]:
        diff = [
            f"{key} {getattr(f, key) or '-'} vs {want}"
            for key, want in stack.items()
            if key not in ("name", "source") and not _prefix_match(getattr(f, key, None), str(want))
        ]
        if not diff:
            return Finding("known_stack", "ok", f"matches the known-good stack '{stack['name']}'")
        if best_diff is None or len(diff) < len(best_diff):
            best, best_diff = stack, diff
    assert best is not None and best_diff is not None
    return Finding(
        "known_stack", "warning", "this EFA stack is not a known-good combination",
        f"closest is '{best['name']}'; differs in {'; '.join(best_diff)}",
    )


def _prefix_match(have: str | None, want: str) -> bool:
    have_v, want_v = version_tuple(have), version_tuple(want)
    return bool(have_v) and have_v[: len(want_v)] == want_v


STACK_RULES: tuple[Callable[[Facts, str, dict], Finding | None], ...] = (
    efa_device, fi_info_efa, ofi_plugin, ofi_plugin_deps, nccl_net, fi_provider,
    shm, memlock, cuda_driver, nccl_version, libfabric_version, legacy_env, known_stack, mlflow_access,
)


# What only a node that runs NCCL needs: a head without GPUs in a GPU cluster is not judged on them.
FABRIC_RULES = frozenset({efa_device, fi_info_efa, ofi_plugin, ofi_plugin_deps, nccl_net, fi_provider, memlock, legacy_env})


def stack_rules(facts: Facts, expect: str = "any", kg: dict | None = None, node: str | None = None,
                trains: bool = True) -> list[Finding]:
    """Every single-machine rule that applies to `facts`; without `trains`, none of the fabric rules."""
    if expect not in FABRICS:
        raise ValueError(f"expect must be one of {FABRICS}, not {expect!r}")
    kg = kg or known_good()
    found = (rule(facts, expect, kg) for rule in STACK_RULES if trains or rule not in FABRIC_RULES)
    return [Finding(x.rule, x.severity, x.message, x.fix, node) for x in found if x is not None]


# --- across nodes

CROSS_NODE_FACTS = (
    "ray", "python", "torch", "torch_cuda", "torch_nccl", "ofi_plugin_version", "libfabric", "transformers",
)


def version_facts(facts: Facts) -> dict[str, Any]:
    return {key: getattr(facts, key) for key in CROSS_NODE_FACTS}


def fabric_env(facts: Facts) -> dict[str, Any]:
    return {f"env.{k}": v for k, v in facts.env.items() if k.startswith(("NCCL_", "FI_"))}


def comparable(facts: Facts) -> dict[str, Any]:
    """The facts every node must share with the head, flattened (env keys as `env.NAME`)."""
    return {**version_facts(facts), **fabric_env(facts)}


def differences(nodes: list[tuple[str, Facts]], values_of: Callable[[Facts], dict[str, Any]] = comparable
                ) -> dict[str, dict[str, Any]]:
    """{fact: {node: value}} for every compared fact whose value is not the same on all nodes."""
    table = [(name, values_of(f)) for name, f in nodes]
    keys = sorted({k for _, values in table for k in values})
    out = {}
    for key in keys:
        row = {name: values.get(key) for name, values in table}
        if len({repr(v) for v in row.values()}) > 1:
            out[key] = row
    return out


def _mismatches(nodes: list[tuple[str, Facts]], values_of: Callable[[Facts], dict[str, Any]], label: str) -> list[Finding]:
    reference = nodes[0][0]
    findings = []
    for key, row in differences(nodes, values_of).items():
        want = row[reference]
        for name, have in row.items():
            if name != reference and have != want:
                findings.append(Finding(
                    "node_mismatch", "error", f"{key}={_show(have)} on {name} differs from {label} ({_show(want)})",
                    "run every node from the same image with the same env (RayCluster spec / runtime_env env_vars)",
                    node=name,
                ))
    return findings


def cross_node_rules(nodes: list[tuple[str, Facts]], trainers: set[str] | None = None) -> list[Finding]:
    """Every node must agree with the head (the first entry) on versions; the nodes that train (`trainers`,
    default all) must agree with the first of them on their NCCL/FI settings."""
    if len(nodes) < 2:
        return []
    training = [(name, f) for name, f in nodes if trainers is None or name in trainers]
    label = "the head" if training and training[0][0] == nodes[0][0] else f"the first worker {training[0][0]}" if training else ""
    findings = _mismatches(nodes, version_facts, "the head")
    if len(training) > 1:
        findings += _mismatches(training, fabric_env, label)
    if not findings:
        findings.append(Finding("node_mismatch", "ok", f"{len(nodes)} nodes agree on versions and NCCL/FI environment"))
    return findings


def training_nodes(nodes: list[tuple[str, Facts, bool]]) -> set[str]:
    """The nodes that run training workers: every node, except a head without GPUs in a cluster that has GPU
    nodes (the rendered RayCluster's head: num-gpus 0, no EFA, none of the workers' NCCL/FI env)."""
    gpu_cluster = any(f.gpu_count for _, f, _ in nodes)
    return {name for name, f, is_head in nodes if not (is_head and gpu_cluster and not f.gpu_count)}


def judge_nodes(nodes: list[tuple[str, Facts, bool]], expect: str = "any") -> list[Finding]:
    """(name, facts, is_head) per node, head first: each node by its role, then across nodes."""
    trainers = training_nodes(nodes)
    findings = [x for name, f, _ in nodes for x in stack_rules(f, expect, node=name, trains=name in trainers)]
    return findings + cross_node_rules([(name, f) for name, f, _ in nodes], trainers)


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda x: (SEVERITIES.index(x.severity), x.node or "", x.rule))


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(x.severity == "error" for x in findings)
