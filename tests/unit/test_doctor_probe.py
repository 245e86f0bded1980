"""The probe on this machine (no GPU, no EFA) and on a real, deliberately broken plugin library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from trainlift.doctor.probe import Facts, _choose_plugin, probe
from trainlift.ops.run import run


def test_probe_reports_this_machine_and_its_absent_gpu_and_efa_stack():
    facts = probe()
    assert facts.python and facts.hostname
    assert facts.torch and facts.ray
    # Where the GPU or EFA stack is missing (as on the CI machines), that is a fact, not a crash.
    if shutil.which("nvidia-smi") is None:
        assert facts.driver is None and "nvidia-smi: absent" in facts.notes
        if facts.torch_cuda is None:
            assert facts.gpu_count == 0
    if shutil.which("fi_info") is None and not os.path.exists("/opt/amazon/efa/bin/fi_info"):
        assert facts.fi_info_efa == "absent" and "fi_info: absent" in facts.notes and facts.libfabric is None
    if not os.path.isdir("/dev/infiniband"):
        assert facts.uverbs == []
    assert facts.shm_bytes and facts.shm_bytes > 0
    assert all(k.startswith(("NCCL_", "FI_", "RDMAV_")) or k == "LD_LIBRARY_PATH" for k in facts.env)
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_probe_picks_up_nccl_and_libfabric_environment(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("UNRELATED", "x")
    env = probe().env
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["FI_PROVIDER"] == "efa" and "UNRELATED" not in env


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler to build a plugin library")
def test_probe_finds_a_plugin_reads_its_version_and_its_unresolved_dependency(tmp_path, monkeypatch):
    (tmp_path / "dep.c").write_text("int tl_dep(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text(
        'const char *banner = "NET/OFI Initializing aws-ofi-nccl 1.20.0-aws";\n'
        "int tl_dep(void);\nint probe_me(void) { return tl_dep(); }\n"
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libtldep.so", tmp_path / "dep.c"], check=True)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", tmp_path / "libnccl-net-ofi.so", tmp_path / "plugin.c",
         f"-L{tmp_path}", "-ltldep"],
        check=True,
    )
    (tmp_path / "libtldep.so").unlink()  # the classic silent-fallback cause: a dependency that is gone
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    facts = probe()
    assert facts.ofi_plugin == str(tmp_path / "libnccl-net-ofi.so")
    assert facts.ofi_plugin_on_ld_path
    assert facts.ofi_plugin_version == "1.20.0-aws"
    assert facts.ofi_plugin_missing_deps == ["libtldep.so"]


def test_nccl_net_plugin_names_the_library_nccl_loads():
    found = ["/a/libnccl-net.so", "/b/libnccl-net-ofi.so", "/c/libnccl-net-aws.so"]
    assert _choose_plugin(found, None) == "/a/libnccl-net.so"
    assert _choose_plugin(found, "ofi") == "/b/libnccl-net-ofi.so"
    assert _choose_plugin(found, "aws") == "/c/libnccl-net-aws.so"
    assert _choose_plugin([], "ofi") is None


def test_run_reports_a_missing_tool_as_a_fact():
    result = run(["definitely-not-a-tool-xyz", "--version"], timeout=5)
    assert result.absent and not result.ok and result.returncode is None


def test_run_captures_output_and_timeouts():
    assert run(["sh", "-c", "echo hi; exit 3"], timeout=5).stdout == "hi\n"
    assert run(["sh", "-c", "exit 3"], timeout=5).returncode == 3
    slow = run(["sleep", "5"], timeout=0.2)
    assert slow.timed_out and slow.returncode is None
