"""Which transport did NCCL use? Classify NCCL_DEBUG=INFO text (pure).

Lines are grouped into streams, one per process (`host:pid:tid [dev]` prefix),
named `host:rank` once a rank is known (an `mpirun --tag-output` prefix, a
torchrun `[rankN]:` prefix, or NCCL's own `comm 0x.. rank N nranks M` line).
Each stream's verdict rests on, in order of strength:

1. channel lines `via NET/<network>/<dev>[/GDRDMA]` (what was connected),
2. `Using network <name>` (what NCCL chose),
   (NCCL >= 2.23 also logs `Initialized NET plugin <name>` and `Assigned NET plugin <name> to comm`),
3. inference from init lines: a selected OFI provider, a failed plugin,
   `NET/IB : Using [...]`, `NET/Socket : Using [...]`.

`Failed to initialize any NET plugin` with nothing chosen means NCCL had no network at all (it stops with
ncclInvalidUsage, e.g. when NCCL_NET names a plugin that is not installed): transport `none`.

The libfabric network with a provider other than efa (tcp, sockets) counts
as socket. A file mixing streams reports the weakest: one rank on sockets
makes the job a socket job.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

# What a job's NCCL must log for `classify_log_text` to see its transport.
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
TRANSPORTS = ("efa", "ib", "socket", "none", "unknown")
_WEAKEST_FIRST = ("none", "socket", "ib", "efa")
MAX_EVIDENCE = 8

_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?")
_PREFIX = re.compile(r"(?P<host>[A-Za-z0-9][\w.\-]*):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] ")
_LAUNCHER_RANK = re.compile(r"^\s*(?:\[\d+,(?P<mpi>\d+)\]<std(?:out|err)>:|\[(?:rank|default)(?P<tr>\d+)\]:|\[(?P<tag>\d+)\]\s)")
_COMM_RANK = re.compile(r"\bcomm 0x[0-9a-fA-F]+ rank (\d+) n[Rr]anks")
_CHANNEL = re.compile(r"via NET/(?P<net>[^/\s][^/]*)/\d+(?:\(\d+\))?(?P<gdr>/GDRDMA)?")
_USING_NETWORK = re.compile(r"Using (?:internal )?[Nn]etwork (?P<net>[A-Za-z][\w ]*?)\s*$"
                            r"|(?:Initialized|Assigned) NET plugin (?P<plugin>[A-Za-z][\w ]*?)(?: to comm)?\s*$")
_PROVIDER = re.compile(r"Selected [Pp]rovider is (?P<prov>[\w;\-]+)")
_PLUGIN_FAILED = re.compile(
    r"aws-ofi-nccl initialization failed|Initializing plugin failed|Could(?:n't| not) find any optimal provider"
    r"|OFI plugin initNet\(\) failed"
    # NCCL >= 2.23 (src/plugin/plugin_open.cc, net.cc): the AWS plugin is missing, or loaded but failed
    r"|NET/Plugin: Could not find:.*libnccl-net-(?:ofi|aws)|Failed to initialize NET plugin (?:AWS )?(?:Libfabric|OFI)"
)
_NO_NETWORK = re.compile(r"Failed to initialize any NET plugin")
_IB_USING = re.compile(r"NET/IB\s*:\s*Using \[")
_SOCKET_USING = re.compile(r"NET/Socket\s*:\s*Using \[")
_GDR_HINT = re.compile(r"GPU Direct RDMA (?P<on>Enabled|Disabled)|use ring PXN \d+ GDR (?P<flag>[01])|(?P<off>GDR disabled)")


@dataclass
class StreamVerdict:
    key: str
    host: str | None
    pid: int | None
    rank: int | None
    transport: str
    gdrdma: bool | None
    evidence: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LogVerdict:
    transport: str
    gdrdma: bool | None
    evidence: list[str]
    streams: list[StreamVerdict] = field(default_factory=list)
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "transport": self.transport, "gdrdma": self.gdrdma,
            "evidence": self.evidence, "streams": [s.to_dict() for s in self.streams],
        }


@dataclass
class _Stream:
    host: str | None = None
    pid: int | None = None
    rank: int | None = None
    channels: list[tuple[str, bool, str]] = field(default_factory=list)
    using: list[tuple[str, str]] = field(default_factory=list)
    providers: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    no_network: list[str] = field(default_factory=list)
    ib: list[str] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    gdr_hints: list[tuple[bool, str]] = field(default_factory=list)


def classify_log_text(text: str, source: str | None = None) -> LogVerdict:
    """Classify one log's text: overall verdict plus one verdict per process stream."""
    streams: dict[tuple[str | None, int | None], _Stream] = {}
    for raw in text.splitlines():
        line = _TIMESTAMP.sub("", raw).strip()
        if not line or ("NCCL" not in line and "NET/" not in line):
            continue
        prefix = _PREFIX.search(line)
        host, pid = (prefix.group("host"), int(prefix.group("pid"))) if prefix else (None, None)
        stream = streams.setdefault((host, pid), _Stream(host, pid))
        _collect(stream, line, raw.strip())
    verdicts = [_decide(s) for s in streams.values()]
    verdicts = [v for v in verdicts if v.transport != "unknown" or v.evidence] or verdicts
    return _combine(verdicts, source)


def combine_transports(transports: Iterable[str]) -> str:
    """The weakest known transport among several; unknown when none is known."""
    known = set(transports) - {"unknown"}
    return next((t for t in _WEAKEST_FIRST if t in known), "unknown")


def _collect(s: _Stream, line: str, raw: str) -> None:
    launcher = _LAUNCHER_RANK.search(line)
    if launcher and s.rank is None:
        s.rank = int(next(g for g in launcher.groups() if g is not None))
    comm = _COMM_RANK.search(line)
    if comm and s.rank is None:
        s.rank = int(comm.group(1))
    if m := _CHANNEL.search(line):
        s.channels.append((m.group("net").strip(), bool(m.group("gdr")), raw))
    elif m := _USING_NETWORK.search(line):
        s.using.append((m.group("net") or m.group("plugin"), raw))
    if m := _PROVIDER.search(line):
        s.providers.append((m.group("prov"), raw))
    if _PLUGIN_FAILED.search(line):
        s.failures.append(raw)
    if _NO_NETWORK.search(line):
        s.no_network.append(raw)
    if _IB_USING.search(line):
        s.ib.append(raw)
    if _SOCKET_USING.search(line):
        s.sockets.append(raw)
    if m := _GDR_HINT.search(line):
        on = m.group("on") == "Enabled" if m.group("on") else m.group("flag") == "1"
        s.gdr_hints.append((on and not m.group("off"), raw))


def _decide(s: _Stream) -> StreamVerdict:
    evidence: list[str] = []
    if s.channels:
        net = s.channels[-1][0]
        evidence += _firsts([c[2] for c in s.channels], 2)
        net_channels = [c for c in s.channels if _net_kind(c[0]) != "socket"]
        gdr: bool | None = any(c[1] for c in net_channels) if net_channels else None
    elif s.using:
        net = s.using[-1][0]
        evidence.append(s.using[-1][1])
        gdr = s.gdr_hints[-1][0] if s.gdr_hints else None
    else:
        net = None if s.no_network else _infer(s)
        gdr = s.gdr_hints[-1][0] if s.gdr_hints else None
    kind = _net_kind(net) if net else "unknown"
    if net is None and s.no_network:
        return _verdict(s, "none", False, s.failures[:2] + s.no_network[:1])
    provider = s.providers[-1][0] if s.providers else None
    if kind == "ofi":
        if provider:
            evidence.insert(0, s.providers[-1][1])
        kind = "socket" if provider and provider.split(";")[0] not in ("efa", "efa-direct") else "efa"
    if kind == "socket":
        gdr = False
        evidence = s.failures[:2] + s.sockets[:1] + evidence
    elif kind == "ib" and s.ib:
        evidence.insert(0, s.ib[0])
    if gdr is not None and not s.channels and s.gdr_hints:
        evidence.append(s.gdr_hints[-1][1])
    return _verdict(s, kind, gdr, evidence)


def _verdict(s: _Stream, kind: str, gdr: bool | None, evidence: list[str]) -> StreamVerdict:
    key = f"{s.host}:{s.rank if s.rank is not None else f'pid{s.pid}'}" if s.host else "-"
    return StreamVerdict(key, s.host, s.pid, s.rank, kind, gdr, _firsts(evidence, MAX_EVIDENCE))


def _infer(s: _Stream) -> str | None:
    if s.ib:
        return "IB"
    if s.providers and not s.failures:
        return "Libfabric"
    if s.sockets or s.failures:
        return "Socket"
    return None


def _net_kind(net: str) -> str:
    name = net.lower()
    if "libfabric" in name or "ofi" in name:
        return "ofi"
    if name.startswith("ib"):
        return "ib"
    if name.startswith("socket"):
        return "socket"
    return "unknown"


def _combine(streams: list[StreamVerdict], source: str | None) -> LogVerdict:
    transport = combine_transports(s.transport for s in streams)
    known = [s for s in streams if s.transport != "unknown"]
    flags = [s.gdrdma for s in known if s.gdrdma is not None]
    gdr = all(flags) if flags else None
    decisive = [s for s in known if s.transport == transport] + [s for s in known if s.transport != transport]
    evidence = _firsts([line for s in decisive for line in s.evidence], MAX_EVIDENCE)
    ordered = sorted(streams, key=lambda s: (s.host or "", s.rank if s.rank is not None else -1, s.pid or 0))
    return LogVerdict(transport, gdr, evidence, ordered, source)


def _firsts(lines: list[str], limit: int) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line not in out:
            out.append(line)
        if len(out) == limit:
            break
    return out


def nccl_log_env(prefix: str) -> dict[str, str]:
    """NCCL_DEBUG_ENV with each process's log at `<prefix>.<host>.<pid>.log` (read back by `probe.own_nccl_log`)."""
    return {**NCCL_DEBUG_ENV, "NCCL_DEBUG_FILE": f"{prefix}.%h.%p.log"}
