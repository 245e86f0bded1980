"""`model.attn_implementation: auto` picks a kernel the GPU can run, and says why.

No GPU here: each GPU is its recorded `torch.cuda.get_device_properties` (name, compute capability and opt-in
shared memory per block, as the CUDA C++ Programming Guide lists them for its compute capability); flash-attn's
presence is given, or an import made to fail as an ABI-broken build fails."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from trainlift.train.model.build import attention_implementation
from trainlift.train.model.kernels import choose, flash_attn_status

GPUS = {
    "NVIDIA L4": (8, 9, 101_376), "NVIDIA A10G": (8, 6, 101_376), "NVIDIA L40S": (8, 9, 101_376),
    "NVIDIA A100-SXM4-80GB": (8, 0, 166_912), "NVIDIA H100 80GB HBM3": (9, 0, 232_448),
    "NVIDIA H200": (9, 0, 232_448), "Tesla T4": (7, 5, 65_536),
}
# GPU -> (kernel with flash-attn loading, kernel without it)
EXPECTED = {
    "NVIDIA L4": ("flash_attention_2", "sdpa"), "NVIDIA A10G": ("flash_attention_2", "sdpa"),
    "NVIDIA L40S": ("flash_attention_2", "sdpa"), "NVIDIA A100-SXM4-80GB": ("flash_attention_2", "flex_attention"),
    "NVIDIA H100 80GB HBM3": ("flash_attention_2", "flex_attention"), "NVIDIA H200": ("flash_attention_2", "flex_attention"),
    "Tesla T4": ("sdpa", "sdpa"),
}


def props(name: str) -> SimpleNamespace:
    major, minor, shared = GPUS[name]
    return SimpleNamespace(name=name, major=major, minor=minor, shared_memory_per_block_optin=shared)


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_each_gpu_gets_the_kernel_it_can_run(gpu):
    with_flash, without = EXPECTED[gpu]
    assert choose("auto", props(gpu), (True, "")).kernel == with_flash
    assert choose("auto", props(gpu), (False, "flash-attn is not installed")).kernel == without


def test_the_reason_names_what_decided():
    assert choose("auto", props("NVIDIA L4"), (False, "flash-attn is not installed")).line() == (
        "sdpa (flash-attn is not installed; flex's backward needs 131,074 bytes of shared memory a block and NVIDIA L4 "
        "has 101,376 (pytorch#133254))")
    assert choose("auto", props("NVIDIA H200"), (False, "flash-attn is not installed")).reason == (
        "flash-attn is not installed; flex's backward fits NVIDIA H200's 232,448 bytes of shared memory a block")
    assert choose("auto", props("NVIDIA H100 80GB HBM3"), (True, "")).reason == (
        "flash-attn loads and NVIDIA H100 80GB HBM3 is sm_90")
    assert choose("auto", props("Tesla T4"), (True, "")).reason.startswith(
        "flash-attn 2 needs sm_80 or newer and Tesla T4 is sm_75; flex's backward needs")
    assert choose("eager", props("NVIDIA L4"), (True, "")).line() == "eager (model.attn_implementation)"
    assert choose("auto", None, (True, "")).kernel == "sdpa"


def test_a_flash_attn_built_for_another_torch_is_not_chosen(monkeypatch):
    find_spec, import_module = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else find_spec(name))
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: True)

    def broken(name):
        if name.startswith("flash_attn"):
            raise ImportError("flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: undefined symbol: "
                              "_ZN3c104cuda9SetDeviceEab")
        return import_module(name)

    monkeypatch.setattr(importlib, "import_module", broken)
    loads, why = flash_attn_status()
    assert not loads and why.startswith("flash-attn is installed but does not load (flash_attn_2_cuda")
    monkeypatch.setattr(importlib, "import_module", lambda name: object() if name.startswith("flash_attn")
                        else import_module(name))
    assert flash_attn_status() == (True, "")
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: False)
    assert flash_attn_status()[1].startswith("transformers does not accept this flash-attn")


def test_the_recipe_asks_the_same_choice():
    assert attention_implementation("auto", torch.device("cpu")) == "sdpa"
    assert attention_implementation("eager", torch.device("cuda")) == "eager"


def test_doctor_reports_the_kernel_and_why_on_a_gpu_node(monkeypatch):
    from rich.console import Console

    from trainlift.cli.doctor import _facts_table
    from trainlift.doctor.probe import Facts, _attention_fact

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else find_spec(name))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props("NVIDIA L4"))
    facts = Facts(hostname="ray-train-worker-0", gpu_count=4, gpu_model="NVIDIA L4")
    _attention_fact(facts, torch)
    assert facts.attention == ("sdpa (flash-attn is not installed; flex's backward needs 131,074 bytes of shared "
                               "memory a block and NVIDIA L4 has 101,376 (pytorch#133254))")
    console = Console(width=400, record=True)
    console.print(_facts_table(facts))
    text = console.export_text()
    assert "│ attention " in text and "sdpa (flash-attn is not installed" in text
