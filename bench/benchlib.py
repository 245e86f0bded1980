"""What every benchmark script shares: the machine line, waiting for a quiet machine, running the two
contenders (`trainlift train` and the torchrun loop), sampling worker memory, and recording results in
docs/BENCHMARKS.md: each benchmark rewrites its own section there, between `<!-- bench:KEY -->` and
`<!-- /bench:KEY -->`, and leaves every other section as it is."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_SPEC = "examples/tiny-local.yaml"
RESULTS = REPO / "docs" / "BENCHMARKS.md"
BIN = Path(sys.executable).parent


def ray_version() -> str:
    try:
        import ray
    except ImportError:
        return "Ray absent"
    return f"Ray {ray.__version__}"


def machine_line() -> str:
    import torch

    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return (f"{os.cpu_count()} cores ({cpu}), {mem_kib / 2**20:.0f} GiB memory, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {ray_version()}, {platform.system()} {platform.machine()}")


QUIET = {"max_load": 1.0, "record": True}


def add_common_args(parser) -> None:
    parser.add_argument("--no-record", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument("--max-load", type=float, default=1.0,
                        help="wait before each measured run until the 1-minute load average is below this")


def configure(args) -> None:
    QUIET.update(max_load=args.max_load, record=not args.no_record)


def load() -> tuple[float, float, float]:
    return os.getloadavg()


def wait_for_quiet(max_wait_s: float = 600.0) -> tuple[float, float, float]:
    """Sleep until the 1-minute load average is below the threshold (other work pollutes timings)."""
    threshold = QUIET["max_load"]
    deadline = time.monotonic() + max_wait_s
    while load()[0] >= threshold and time.monotonic() < deadline:
        print(f"waiting for a quiet machine: load {load()[0]:.2f}", file=sys.stderr, flush=True)
        time.sleep(15)
    if load()[0] >= threshold:
        print(f"load still {load()[0]:.2f} after {max_wait_s:.0f}s; measuring anyway", file=sys.stderr)
    return load()


def fmt_load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


MARKER_OPEN, MARKER_CLOSE = "<!-- bench:{key} -->", "<!-- /bench:{key} -->"
MARKER = re.compile(r"<!-- (/?)bench:([a-z0-9_]+) -->")


def replace_section(text: str, key: str, section: str) -> str:
    """`text` with what lies between the markers of `key` replaced by `section`, every byte outside them as it
    was; `section` appended inside a new marker pair when the document has none for `key`."""
    opening, closing = MARKER_OPEN.format(key=key), MARKER_CLOSE.format(key=key)
    if MARKER.search(section):
        raise ValueError(f"{key}: a section cannot hold benchmark markers itself")
    found = [(m.start(), m.group(1)) for m in MARKER.finditer(text) if m.group(2) == key]
    inner = "\n" + section.strip("\n") + "\n"
    if not found:
        return text.rstrip("\n") + "\n\n" + opening + inner + closing + "\n"
    if [slash for _, slash in found] != ["", "/"]:
        raise ValueError(f"{key}: expected one {opening} followed by one {closing}, found {len(found)} markers")
    start = found[0][0] + len(opening)
    return text[:start] + inner + text[found[1][0]:]


def record(title: str, loads: list, body: str, *, key: str, path: Path = RESULTS) -> None:
    """Print a result and write it into `path` (docs/BENCHMARKS.md) as the section of benchmark `key`: in place,
    between its `<!-- bench:KEY -->` markers, or appended with new markers where the file has none. No other
    section changes; `--no-record` leaves the file alone."""
    if not MARKER.fullmatch(MARKER_OPEN.format(key=key)):
        raise ValueError(f"benchmark key {key!r}: lower-case letters, digits and underscores only")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_text = "; ".join(fmt_load(v) for v in loads)
    section = (f"## {title}\n\n"
               f"- Command: `{command_line()}`\n"
               f"- Machine: {machine_line()}\n"
               f"- Date: {date}\n"
               f"- Load average (1/5/15 min) before each measured run: {load_text}\n\n"
               f"{body.strip()}\n")
    print(f"\n{section}")
    if not QUIET["record"]:
        return
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    new = replace_section(text, key, section)
    headings = [line for line in new.splitlines() if line == f"## {title}"]
    if len(headings) != 1:
        raise ValueError(f"{path}: heading '## {title}' would appear {len(headings)} times; "
                         f"put the existing section between {MARKER_OPEN.format(key=key)} markers")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def periods(times: list[float]) -> list[float]:
    """Gaps between consecutive step-end timestamps: the full cost of each step, loop overhead included."""
    return [b - a for a, b in zip(times, times[1:])]


def prebuilt_model(workdir: Path) -> str:
    """The demo model built once from its config, so no measured run pays for building it."""
    from trainlift.config.job import load_job_spec
    from trainlift.train.model.build import materialize

    spec = load_job_spec(REPO / DEMO_SPEC)
    path = workdir / "tiny-base"
    materialize(str(path), spec.model.config, str(REPO / spec.model.tokenizer), spec.train.seed)
    return str(path)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment both contenders run with: no thread settings or Ray address inherited from the shell."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def trainlift_train(spec_args: list[str], run_dir: Path, name: str, env: dict[str, str],
                    sample_memory: bool = False, timeout: float = 900) -> dict:
    """`trainlift train` as a user runs it; returns its summary, per-step metrics rows and worker peak RSS."""
    cmd = [str(BIN / "trainlift"), "train", DEMO_SPEC, "--run-dir", str(run_dir), "--set", f"run.name={name}",
           "--json", *spec_args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = RssSampler(proc.pid, lambda p, _root: " ".join(p.cmdline()).startswith("ray::RayTrainWorker"))
    if sample_memory:
        sampler.start()
    out, err = proc.communicate(timeout=timeout)
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"trainlift train failed ({proc.returncode}): {err[-3000:]}")
    summary = json.loads(out[out.index("\n{\n") + 1:] if not out.startswith("{") else out)
    rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r and "eval_loss" not in r]
    return {"t0": t0, "summary": summary, "steps": steps, "peak_rss_mib": sampler.peaks_mib(), "sampler": sampler,
            "stderr": err}


def torchrun_loop(spec_args: list[str], env: dict[str, str], steps: int, warmup: int,
                  sample_memory: bool = False, timeout: float = 900, workers: int = 2) -> dict:
    """bench/torchrun_fsdp.py under torchrun; returns its JSON result and worker peak RSS."""
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(workers), "bench/torchrun_fsdp.py", DEMO_SPEC,
           "--steps", str(steps), "--warmup", str(warmup), *spec_args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "BENCH_T0": repr(t0)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = RssSampler(proc.pid, lambda p, root: p.ppid() == root)
    if sample_memory:
        sampler.start()
    out, err = proc.communicate(timeout=timeout)
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {err[-3000:]}")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return {"t0": t0, "result": result, "peak_rss_mib": sampler.peaks_mib(), "sampler": sampler, "stderr": err}


class RssSampler:
    """Polls the descendants of `root`: the peak resident set (VmHWM) of those `select` picks, and every
    process's CPU time, so the CPU each one used over any window of the run can be computed afterwards."""

    def __init__(self, root: int, select, interval_s: float = 0.5):
        self.root, self.select, self.interval_s = root, select, interval_s
        self.peaks: dict[int, int] = {}
        self.snapshots: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            cpu = {}
            for proc in processes:
                try:
                    times = proc.cpu_times()
                    cpu[proc.pid] = (_label(proc), times.user + times.system)
                    if proc.pid != self.root and self.select(proc, self.root):
                        self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), _vm_hwm_kib(proc.pid))
                except (psutil.Error, OSError):
                    continue
            self.snapshots.append((time.time(), cpu))
            self._stop.wait(self.interval_s)

    def peaks_mib(self) -> list[float]:
        return sorted(round(kib / 1024, 1) for kib in self.peaks.values())

    def cpu_cores(self, start: float, end: float) -> dict[str, float]:
        """CPU used between `start` and `end` per kind of process, in cores (CPU-seconds per second)."""
        inside = [s for s in self.snapshots if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t1, first), (t2, last) = inside[0], inside[-1]
        used: dict[str, float] = {}
        for pid, (label, cpu) in last.items():
            if pid in first:
                used[label] = used.get(label, 0.0) + (cpu - first[pid][1]) / (t2 - t1)
        return used


def _label(proc) -> str:
    """`ray::TrainController`, `raylet`, `torchrun_fsdp.py`, ...: what a process is, without its pid."""
    cmd = proc.cmdline()
    if not cmd:
        return proc.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].split()[0]
    head = os.path.basename(cmd[0])
    if head.startswith("python"):
        rest = [a for a in cmd[1:] if a != "-u"]
        if rest[:1] == ["-m"]:
            return rest[1]
        return os.path.basename(rest[0]) if rest else head
    return head


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
