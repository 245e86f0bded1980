"""Which attention kernel `model.attn_implementation: auto` runs on a device, and why. Every kernel here keeps
packed examples apart; auto avoids a dense [batch, 1, seq, seq] mask where that mask costs, within what the GPU can
run:

- flash-attn's variable-length kernel, when flash-attn passes transformers' own availability check, its CUDA
  extension imports (one built for another torch fails here, with an undefined symbol, not at the first forward)
  and the GPU is sm_80 or newer (flash-attn 2 has no kernels for older parts);
- else flex attention's block mask, where its backward fits the GPU's shared memory: at head_dim 128 it asks for
  about 131 KB a block (pytorch#133254), more than sm_86/sm_89 parts (A10G, L4, L40S: 101,376 bytes) give;
- else sdpa with the dense mask. On a CPU, sdpa: its mask is small at CPU sizes, and flex compiles for half a
  minute.

Shared memory a block (opt-in) by compute capability, from the CUDA C++ Programming Guide's table of technical
specifications: sm_75 65,536 bytes; sm_80 166,912; sm_86 and sm_89 101,376; sm_90 232,448.
Pure apart from `attention_choice`, which reads the device and imports flash-attn; no transformers model import.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

FLEX_BACKWARD_SHARED_BYTES = 131_074
FLASH_ATTN_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    reason: str

    def line(self) -> str:
        return f"{self.kernel} ({self.reason})"


def choose(choice: str, props: Any | None, flash_attn: tuple[bool, str]) -> KernelChoice:
    """The kernel for `choice` on a GPU with CUDA device properties `props` (None: a CPU), given whether flash-attn
    loads here and, when not, why."""
    if choice != "auto":
        return KernelChoice(choice, "model.attn_implementation")
    if props is None:
        return KernelChoice("sdpa", "a CPU: the dense mask is small at CPU sizes")
    name, capability = props.name, (props.major, props.minor)
    loads, why_not = flash_attn
    if loads and capability < FLASH_ATTN_MIN_CAPABILITY:
        loads, why_not = False, f"flash-attn 2 needs sm_80 or newer and {name} is sm_{props.major}{props.minor}"
    if loads:
        return KernelChoice("flash_attention_2", f"flash-attn loads and {name} is sm_{props.major}{props.minor}")
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    if shared >= FLEX_BACKWARD_SHARED_BYTES:
        return KernelChoice("flex_attention", f"{why_not}; flex's backward fits {name}'s {shared:,} bytes of shared "
                                              "memory a block")
    return KernelChoice("sdpa", f"{why_not}; flex's backward needs {FLEX_BACKWARD_SHARED_BYTES:,} bytes of shared "
                                f"memory a block and {name} has {shared:,} (pytorch#133254)")


def flash_attn_status() -> tuple[bool, str]:
    """(whether flash-attn can run here, why not): installed, accepted by transformers' availability check, and its
    CUDA extension importable."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed"
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        is_flash_attn_2_available = None
    if is_flash_attn_2_available is not None and not is_flash_attn_2_available():
        return False, "transformers does not accept this flash-attn (its version, or torch's CUDA)"
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, OSError, RuntimeError) as exc:
        log.warning("flash-attn is installed but does not load (%s); using another attention kernel", exc)
        return False, f"flash-attn is installed but does not load ({str(exc).splitlines()[0]})"
    return True, ""


def attention_choice(choice: str, device) -> KernelChoice:
    """`choose` for a torch device: its properties read and flash-attn tried only where auto needs them."""
    if choice != "auto" or device.type != "cuda":
        return choose(choice, None, (False, ""))
    import torch

    return choose(choice, torch.cuda.get_device_properties(device), flash_attn_status())
