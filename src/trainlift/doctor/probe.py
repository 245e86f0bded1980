"""Gather facts about this machine's training stack (the only impure part of doctor).

Everything here reads the machine: files, limits, environment, and a few
tools run through `trainlift.ops.run`. A missing tool or file becomes a fact
(`None`, `"absent"`, an empty list), never an exception.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import re
import resource
import socket
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from typing import Any

from trainlift.doctor.mlflow_probe import mlflow_access
from trainlift.doctor.storage_probe import storage_access
from trainlift.ops.run import run

# Where the aws-ofi-nccl plugin is installed: EFA installer >= 1.44, older
# installers, the DLAMI, and plain `make install` prefixes.
PLUGIN_DIRS = (
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib/aarch64-linux-gnu",
    "/opt/aws-ofi-nccl/lib",
    "/usr/local/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
)
FI_INFO_PATHS = ("fi_info", "/opt/amazon/efa/bin/fi_info")
EFA_PACKAGES_FILE = "/opt/amazon/efa_installed_packages"
ENV_PREFIXES = ("NCCL_", "FI_", "RDMAV_")
TOOL_TIMEOUT_S = 10.0


@dataclass
class Facts:
    """What one machine (or container) looks like. Plain data; JSON-friendly."""

    hostname: str = ""
    instance_type: str | None = None
    python: str = ""
    torch: str | None = None
    torch_cuda: str | None = None
    torch_cudnn: str | None = None
    torch_nccl: str | None = None
    ray: str | None = None
    transformers: str | None = None
    gpu_count: int = 0
    gpu_model: str | None = None
    attention: str | None = None  # the kernel model.attn_implementation auto runs on GPU 0, and why
    driver: str | None = None
    driver_cuda: str | None = None
    ofi_plugin: str | None = None
    ofi_plugin_candidates: list[str] = field(default_factory=list)
    ofi_plugin_on_ld_path: bool = False
    ofi_plugin_version: str | None = None
    ofi_plugin_missing_deps: list[str] = field(default_factory=list)
    libfabric: str | None = None
    efa_installer: str | None = None
    fi_info_efa: str = "absent"  # ok | no-efa | absent | timeout
    fi_info_detail: str = ""
    uverbs: list[str] = field(default_factory=list)
    memlock_bytes: int | None = None  # None means unlimited
    shm_bytes: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    mlflow: dict[str, Any] | None = None  # doctor.mlflow_probe.mlflow_access
    storage: dict[str, Any] | None = None  # doctor.storage_probe.storage_access: the run storage, as this node may use it
    job_packages: dict[str, str | None] = field(default_factory=dict)  # doctor.packages: name -> version, None: missing
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Facts":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def probe() -> Facts:
    """Look at this machine and return its facts."""
    facts = Facts(hostname=socket.gethostname(), python=platform.python_version())
    facts.instance_type = detect_instance_type()
    facts.ray = _dist_version("ray")
    facts.transformers = _dist_version("transformers")
    _torch_facts(facts)
    _gpu_facts(facts)
    _plugin_facts(facts)
    _libfabric_facts(facts)
    facts.uverbs = sorted(glob.glob("/dev/infiniband/uverbs*"))
    facts.memlock_bytes = _memlock()
    facts.shm_bytes = _fs_size("/dev/shm")
    facts.env = {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k == "LD_LIBRARY_PATH"
    }
    facts.mlflow = mlflow_access(os.environ)
    facts.storage = storage_access(os.environ)
    _job_package_facts(facts)
    return facts


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except (metadata.PackageNotFoundError, ValueError):  # ValueError: not a distribution name at all
        return None


def _job_package_facts(facts: Facts) -> None:
    """The installed release of each package TRAINLIFT_JOB_PACKAGES names (`doctor --job`)."""
    from trainlift.doctor.packages import from_env  # imported here: doctor.packages imports Facts from this module

    try:
        wanted = from_env(os.environ).packages
    except ValueError as exc:
        facts.notes.append(str(exc))
        return
    facts.job_packages = {p.name: installed_version(p.name, p.module) for p in wanted}


def installed_version(dist: str, module: str | None = None) -> str | None:
    """The installed release of distribution `dist`; None when it is missing, or when its `module` is not found
    (metadata left behind by a removed package, or a distribution hidden from this interpreter)."""
    version = _dist_version(dist)
    if version is None or module is None:
        return version
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception:  # a dotted name imports its parent package, which may fail in any way
        found = False
    return version if found else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def detect_instance_type() -> str | None:
    """The EC2 instance type from DMI (Nitro instances name it there); None elsewhere."""
    vendor = (_read("/sys/devices/virtual/dmi/id/sys_vendor") or "").strip()
    product = (_read("/sys/devices/virtual/dmi/id/product_name") or "").strip()
    if "Amazon" in vendor and re.fullmatch(r"[a-z0-9-]+\.[a-z0-9-]+", product):
        return product
    return None


def _torch_facts(facts: Facts) -> None:
    try:
        import torch
    except ImportError:
        facts.notes.append("torch: not installed")
        return
    facts.torch = torch.__version__
    facts.torch_cuda = torch.version.cuda
    try:
        cudnn = torch.backends.cudnn.version()
        facts.torch_cudnn = str(cudnn) if cudnn else None
    except Exception as exc:  # a CUDA build without the cuDNN library loadable
        facts.notes.append(f"torch cuDNN: {exc}")
    if torch.version.cuda:
        try:
            facts.torch_nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception as exc:
            facts.notes.append(f"torch NCCL: {exc}")
        try:
            facts.gpu_count = torch.cuda.device_count()
        except Exception as exc:
            facts.notes.append(f"torch.cuda.device_count: {exc}")
    if facts.gpu_count:
        _attention_fact(facts, torch)


def _attention_fact(facts: Facts, torch) -> None:
    from trainlift.train.model.kernels import attention_choice

    try:
        facts.attention = attention_choice("auto", torch.device("cuda", 0)).line()
    except Exception as exc:  # noqa: BLE001 - a GPU whose properties cannot be read is a note, not a crash
        facts.notes.append(f"attention kernel: {exc}")


def _gpu_facts(facts: Facts) -> None:
    query = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], TOOL_TIMEOUT_S)
    if query.absent:
        facts.notes.append("nvidia-smi: absent")
        return
    if not query.ok:
        facts.notes.append(f"nvidia-smi: exit {query.returncode}: {query.stderr.strip()[:200]}")
        return
    rows = [line.split(",") for line in query.stdout.splitlines() if line.strip()]
    if rows:
        facts.gpu_count = max(facts.gpu_count, len(rows))
        facts.gpu_model = rows[0][0].strip()
        facts.driver = rows[0][-1].strip()
    header = run(["nvidia-smi"], TOOL_TIMEOUT_S)
    match = re.search(r"CUDA Version:\s*(\d+\.\d+)", header.stdout)
    facts.driver_cuda = match.group(1) if match else None


def _plugin_facts(facts: Facts) -> None:
    ld_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    found: list[str] = []
    for directory in (*ld_dirs, *PLUGIN_DIRS):
        for path in sorted(glob.glob(os.path.join(directory, "libnccl-net*.so*"))):
            real = os.path.realpath(path)
            if path not in found and real not in (os.path.realpath(p) for p in found):
                found.append(path)
    facts.ofi_plugin_candidates = found
    chosen = _choose_plugin(found, os.environ.get("NCCL_NET_PLUGIN"))
    if chosen is None:
        return
    facts.ofi_plugin = chosen
    facts.ofi_plugin_on_ld_path = os.path.dirname(chosen) in ld_dirs or _in_ld_cache(chosen)
    facts.ofi_plugin_version = _plugin_version(chosen)
    ldd = run(["ldd", chosen], TOOL_TIMEOUT_S)
    if ldd.absent:
        facts.notes.append("ldd: absent")
    facts.ofi_plugin_missing_deps = re.findall(r"^\s*(\S+)\s+=>\s+not found", ldd.stdout, re.MULTILINE)


def _choose_plugin(found: list[str], net_plugin: str | None) -> str | None:
    """The library NCCL would load: NCCL_NET_PLUGIN=<x> means libnccl-net-<x>.so."""
    if net_plugin and os.path.sep in net_plugin:
        return net_plugin if os.path.exists(net_plugin) else None
    wanted = [f"libnccl-net-{net_plugin}.so"] if net_plugin else []
    wanted += ["libnccl-net.so", "libnccl-net-ofi.so"]
    for name in wanted:
        for path in found:
            if os.path.basename(path) == name:
                return path
    return found[0] if found else None


def _in_ld_cache(path: str) -> bool:
    cache = run(["ldconfig", "-p"], TOOL_TIMEOUT_S)
    return cache.ok and os.path.basename(path) in cache.stdout


_PLUGIN_VERSION = re.compile(rb"aws-ofi-nccl[ -]v?(\d+\.\d+\.\d+(?:-aws)?)")
_PACKAGE_PLUGIN_VERSION = re.compile(r"(?:aws-ofi-nccl|libnccl-ofi)[-_ ]v?(\d+\.\d+\.\d+)")


def _plugin_version(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            blob = fh.read(64 * 1024 * 1024)
    except OSError:
        blob = b""
    match = _PLUGIN_VERSION.search(blob)
    if match:
        return match.group(1).decode()
    packages = _read(EFA_PACKAGES_FILE) or ""
    match2 = _PACKAGE_PLUGIN_VERSION.search(packages)
    return match2.group(1) if match2 else None


def _libfabric_facts(facts: Facts) -> None:
    packages = _read(EFA_PACKAGES_FILE)
    if packages:
        match = re.search(r"EFA installer version:\s*(\S+)", packages)
        facts.efa_installer = match.group(1) if match else None
    fi_info, version = None, None
    for candidate in FI_INFO_PATHS:
        version = run([candidate, "--version"], TOOL_TIMEOUT_S)
        if not version.absent:
            fi_info = candidate
            break
    if fi_info is None or version is None:
        facts.notes.append("fi_info: absent")
        facts.fi_info_efa = "absent"
        if packages:
            match = re.search(r"libfabric1?-aws[-_](\d+\.\d+\.\d+\S*)", packages)
            facts.libfabric = match.group(1) if match else None
        return
    match = re.search(r"libfabric:\s*(\S+)", version.stdout)
    facts.libfabric = match.group(1) if match else None
    result = run([fi_info, "-p", "efa"], TOOL_TIMEOUT_S)
    if result.timed_out:
        facts.fi_info_efa, facts.fi_info_detail = "timeout", f"fi_info -p efa ran past {TOOL_TIMEOUT_S:.0f}s"
    elif result.ok and "efa" in result.stdout:
        facts.fi_info_efa, facts.fi_info_detail = "ok", _first_line(result.stdout)
    else:
        facts.fi_info_efa = "no-efa"
        facts.fi_info_detail = _first_line(result.stderr or result.stdout) or f"exit {result.returncode}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _memlock() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _fs_size(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def own_nccl_log(prefix: str | None) -> str:
    """This process's NCCL log, written to `NCCL_DEBUG_FILE=<prefix>.%h.%p.log`; the file is removed once read."""
    if not prefix:
        return ""
    text = []
    for path in glob.glob(f"{prefix}.*.{os.getpid()}.log"):
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text.append(fh.read())
            os.unlink(path)
        except OSError:
            continue
    return "".join(text)
