"""The transport classifier on real NCCL_DEBUG=INFO text (sources in tests/fixtures/nccl_logs/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlift.doctor.nccl_log import classify_log_text, combine_transports

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "nccl_logs"


def verdict(name: str):
    return classify_log_text((LOGS / name).read_text(), source=name)


EXPECTED = [
    ("efa_gdrdma_p4d.log", "efa", True),
    ("efa_gdrdma_no_prefix.log", "efa", True),
    ("efa_no_gdr_p4d_nccl278.log", "efa", False),
    ("efa_no_gdr_mpirun_p3dn.log", "efa", False),
    ("efa_provider_pdsh.log", "efa", None),
    ("efa_p5en_newer_plugin.log", "efa", None),
    ("socket_after_plugin_failure.log", "socket", False),
    ("socket_mixed_ranks.log", "socket", False),
    ("socket_no_plugin.log", "socket", False),
    ("socket_ofi_tcp_provider.log", "socket", False),
    ("ib_gdrdma.log", "ib", True),
    ("ib_init_only.log", "ib", None),
    ("ib_nccl_plugin_lines.log", "ib", None),
]


@pytest.mark.parametrize("name,transport,gdrdma", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_real_logs(name, transport, gdrdma):
    v = verdict(name)
    assert (v.transport, v.gdrdma) == (transport, gdrdma)
    assert v.evidence, "a verdict quotes its evidence"
    assert all(line in (LOGS / name).read_text() for line in v.evidence), "evidence lines are quoted verbatim"


def test_every_fixture_is_covered_and_cited():
    readme = (LOGS / "README.md").read_text()
    names = {p.name for p in LOGS.glob("*.log")}
    assert names == {e[0] for e in EXPECTED}
    for name in names:
        assert name in readme
        assert (LOGS / name).read_text().startswith("# source: https://github.com/")


def test_gdrdma_evidence_is_the_channel_line():
    v = verdict("efa_gdrdma_p4d.log")
    assert v.evidence[0].endswith("via NET/AWS Libfabric/2/GDRDMA")


def test_socket_fallback_quotes_the_failed_plugin_and_the_socket_line():
    v = verdict("socket_after_plugin_failure.log")
    assert any("aws-ofi-nccl initialization failed" in line for line in v.evidence)
    stream = next(s for s in v.streams if s.pid == 84)
    assert stream.transport == "socket"
    assert any("NET/Socket : Using [0]eth0" in line for line in stream.evidence)


def test_streams_are_named_host_rank_when_the_lines_carry_a_rank():
    keys = {s.key: s.transport for s in verdict("efa_no_gdr_mpirun_p3dn.log").streams}
    assert keys == {"ip-172-32-38-1:7": "efa", "ip-172-32-34-121:15": "efa", "ip-172-32-45-165:23": "efa"}
    ranks = {s.key for s in verdict("efa_no_gdr_p4d_nccl278.log").streams}
    assert ranks == {"ip-172-31-6-104:9", "ip-172-31-13-103:0"}


def test_one_rank_on_sockets_makes_the_file_socket():
    v = verdict("socket_mixed_ranks.log")
    assert {s.key: s.transport for s in v.streams} == {"algo-1:pid17774": "socket", "algo-1:pid17780": "socket"}


def test_pdsh_prefix_and_timestamps_do_not_hide_the_host():
    hosts = {s.host for s in verdict("efa_provider_pdsh.log").streams}
    assert hosts == {"compute-st-p4d24xlarge-3", "compute-st-p4d24xlarge-12"}
    hosts = {s.host for s in verdict("socket_after_plugin_failure.log").streams}
    assert hosts == {"ip-10-36-29-253"}


def test_a_plugin_found_after_a_failed_default_load_is_still_efa():
    # NCCL first tries libnccl-net.so, then the named plugin; the later success wins.
    text = "\n".join([
        "node-1:100:100 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open shared object file",
        "node-1:100:100 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.20.0",
        "node-1:100:100 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 1 nics)",
        "node-1:100:100 [0] NCCL INFO Using network Libfabric",
        "[rank0]:node-1:100:120 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Libfabric/0",
    ])
    v = classify_log_text(text)
    assert (v.transport, v.gdrdma) == ("efa", False)
    assert v.streams[0].key == "node-1:0"


# The lines NCCL >= 2.23 writes when the AWS plugin is missing or fails (format strings of NVIDIA/nccl
# src/plugin/plugin_open.cc "%s/Plugin: Could not find:%s%s%s" and src/plugin/net.cc "Failed to initialize NET plugin
# %s", "Initialized NET plugin %s", "Assigned NET plugin %s to comm", WARN "Failed to initialize any NET plugin"),
# with the NCCL_NET_PLUGIN name the DLC sets.
PLUGIN_MISSING = "pod-a:41:41 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net-ofi.so"
PLUGIN_FAILED = "pod-a:41:41 [0] NCCL INFO Failed to initialize NET plugin Libfabric"
IB_FAILED = "pod-a:41:41 [0] NCCL INFO Failed to initialize NET plugin IB"
SOCKET_CHOSEN = ["pod-a:41:41 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0>",
                 "pod-a:41:41 [0] NCCL INFO Initialized NET plugin Socket",
                 "pod-a:41:41 [0] NCCL INFO Assigned NET plugin Socket to comm"]
NO_NETWORK = "pod-a:41:41 [0] transport/net.cc:349 NCCL WARN Failed to initialize any NET plugin"


def test_a_missing_aws_plugin_then_the_socket_plugin_is_socket_and_quotes_the_missing_plugin():
    v = classify_log_text("\n".join([PLUGIN_MISSING, IB_FAILED, *SOCKET_CHOSEN]))
    assert (v.transport, v.gdrdma) == ("socket", False)
    assert v.evidence[0] == PLUGIN_MISSING and SOCKET_CHOSEN[-1] in v.evidence


def test_no_network_plugin_at_all_is_none_with_the_cause():
    v = classify_log_text("\n".join([PLUGIN_MISSING, PLUGIN_FAILED, NO_NETWORK]))
    assert (v.transport, v.gdrdma) == ("none", False)
    assert v.evidence == [PLUGIN_MISSING, PLUGIN_FAILED, NO_NETWORK]
    assert combine_transports(["efa", "none", "socket"]) == "none"


def test_the_assigned_plugin_decides_without_a_using_network_line():
    lines = ["pod-b:7:7 [0] NCCL INFO Initialized NET plugin Libfabric",
             "pod-b:7:7 [0] NCCL INFO Assigned NET plugin Libfabric to comm"]
    assert classify_log_text("\n".join(lines)).transport == "efa"


def test_text_without_nccl_lines_is_unknown():
    v = classify_log_text("hello\nworld\n")
    assert (v.transport, v.gdrdma, v.evidence) == ("unknown", None, [])


def test_combine_reports_the_weakest_known_transport():
    assert combine_transports(["efa", "socket", "unknown"]) == "socket"
    assert combine_transports(["efa", "ib"]) == "ib"
    assert combine_transports(["efa", "unknown"]) == "efa"
    assert combine_transports(["unknown"]) == "unknown"
    assert combine_transports([]) == "unknown"
