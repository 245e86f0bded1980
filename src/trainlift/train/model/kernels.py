"""Which attention kernel `model.attn_implementation: auto` runs on a device, and why. Every kernel here keeps
packed examples apart; auto avoids a dense [batch, 1, seq, seq] mask where that mask costs, within what the GPU,
the model and the compute dtype can run:

- flash-attn's variable-length kernel, when flash-attn passes transformers' own availability check, its CUDA
  extension imports (one built for another torch fails here, with an undefined symbol, not at the first forward),
  the GPU is sm_80 or newer (flash-attn 2 has no kernels for older parts) and the run computes in bf16 (flash-attn
  takes fp16 and bf16 only);
- else flex attention's block mask, where its backward fits the GPU's shared memory: at head_dim 128 it asks for
  about 131 KB a block (pytorch#133254), more than sm_86/sm_89 parts (A10G, L4, L40S: 101,376 bytes) give;
- else sdpa with the dense mask. On a CPU, sdpa: its mask is small at CPU sizes, and flex compiles for half a
  minute;
- eager, for a model that declares none of the above (Gemma 2: its attention soft-capping has no sdpa path).

Which kernels a model runs is its class's own declaration, transformers' `_supports_flash_attn`,
`_supports_flex_attn` and `_supports_sdpa` flags (eager always runs). An explicit choice the model or the dtype
cannot run is refused in one line that names the kernels that would (`check_choice`): on the driver before Ray
starts, with the flags read from transformers' source without importing it (`declared_kernels`), and on a worker
from the class itself.

Shared memory a block (opt-in) by compute capability, from the CUDA C++ Programming Guide's table of technical
specifications: sm_75 65,536 bytes; sm_80 166,912; sm_86 and sm_89 101,376; sm_90 232,448.
Pure apart from `attention_choice`, which reads the device and imports flash-attn, and `declared_kernels`, which
reads transformers' source files; no transformers model import.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from trainlift.errors import UsageError

log = logging.getLogger(__name__)

FLEX_BACKWARD_SHARED_BYTES = 131_074
FLASH_ATTN_MIN_CAPABILITY = (8, 0)
KERNELS = ("flash_attention_2", "flex_attention", "sdpa", "eager")  # the order auto prefers them in on a GPU
SUPPORT_FLAGS = {"flash_attention_2": "_supports_flash_attn", "flex_attention": "_supports_flex_attn",
                 "sdpa": "_supports_sdpa"}
HALF_PRECISION_ONLY = frozenset({"flash_attention_2"})


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    reason: str

    def line(self) -> str:
        return f"{self.kernel} ({self.reason})"


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a model class declares (eager always), and whether the run computes in bf16. The default: a
    model that declares every kernel."""

    name: str = "the model"
    declared: frozenset[str] = frozenset(KERNELS)
    half_precision: bool = True

    def refusal(self, kernel: str) -> str | None:
        """Why this model and dtype cannot run `kernel`; None where they can."""
        if kernel not in self.declared:
            return f"{self.name} does not support {kernel}"
        if kernel in HALF_PRECISION_ONLY and not self.half_precision:
            return f"{kernel} runs in fp16 or bf16 only and model.dtype is fp32"
        return None

    def usable(self) -> list[str]:
        return [kernel for kernel in KERNELS if self.refusal(kernel) is None]


def of_flags(name: str, flags: Mapping[str, Any], half_precision: bool = True) -> ModelKernels:
    """A class's kernels from its flag values. An absent flag is transformers' default (False); one that is not a
    plain False (a property) counts as declared: the class decides when it loads."""
    declared = {kernel for kernel, flag in SUPPORT_FLAGS.items() if flags.get(flag, False) is not False}
    return ModelKernels(name, frozenset(declared | {"eager"}), half_precision)


def check_choice(choice: str, model: ModelKernels) -> None:
    """Refuse an explicit `choice` the model or the dtype cannot run, naming the kernels that would."""
    why = None if choice == "auto" else model.refusal(choice)
    if why is not None:
        raise UsageError(f"model.attn_implementation: {why}; kernels that would work: {', '.join(model.usable())}",
                         hint="set model.attn_implementation to one of them, or to auto")


def choose(choice: str, props: Any | None, flash_attn: tuple[bool, str],
           model: ModelKernels = ModelKernels()) -> KernelChoice:
    """The kernel for `choice` on a GPU with CUDA device properties `props` (None: a CPU), given whether flash-attn
    loads here and, when not, why, and what the model and dtype allow."""
    if choice != "auto":
        check_choice(choice, model)
        return KernelChoice(choice, "model.attn_implementation")
    if props is None:
        no_sdpa = model.refusal("sdpa")
        return KernelChoice("eager", f"a CPU, and {no_sdpa}") if no_sdpa else KernelChoice(
            "sdpa", "a CPU: the dense mask is small at CPU sizes")
    return _gpu_choice(props, flash_attn, model)


def _gpu_choice(props: Any, flash_attn: tuple[bool, str], model: ModelKernels) -> KernelChoice:
    name = props.name
    no_flash = _flash_refusal(props, flash_attn, model)
    if no_flash is None:
        return KernelChoice("flash_attention_2", f"flash-attn loads and {name} is sm_{props.major}{props.minor}")
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    no_flex = model.refusal("flex_attention")
    if no_flex is None and shared >= FLEX_BACKWARD_SHARED_BYTES:
        return KernelChoice("flex_attention", f"{no_flash}; flex's backward fits {name}'s {shared:,} bytes of "
                                              "shared memory a block")
    no_flex = no_flex or (f"flex's backward needs {FLEX_BACKWARD_SHARED_BYTES:,} bytes of shared memory a block "
                          f"and {name} has {shared:,} (pytorch#133254)")
    no_sdpa = model.refusal("sdpa")
    if no_sdpa is None:
        return KernelChoice("sdpa", f"{no_flash}; {no_flex}")
    return KernelChoice("eager", f"{no_flash}; {no_flex}; {no_sdpa}")


def _flash_refusal(props: Any, flash_attn: tuple[bool, str], model: ModelKernels) -> str | None:
    loads, why_not = flash_attn
    if (refused := model.refusal("flash_attention_2")) is not None:
        return refused
    if not loads:
        return why_not
    if (props.major, props.minor) < FLASH_ATTN_MIN_CAPABILITY:
        return f"flash-attn 2 needs sm_80 or newer and {props.name} is sm_{props.major}{props.minor}"
    return None


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


def attention_choice(choice: str, device, model: ModelKernels = ModelKernels()) -> KernelChoice:
    """`choose` for a torch device: its properties read and flash-attn tried only where auto needs them."""
    if choice != "auto" or device.type != "cuda":
        return choose(choice, None, (False, ""), model)
    import torch

    return choose(choice, torch.cuda.get_device_properties(device), flash_attn_status(), model)


def check_spec_choice(choice: str, dtype: str, fields: Mapping[str, Any]) -> None:
    """The driver's check of an explicit `model.attn_implementation` against the model of `fields` (its
    config.json, as written) and `model.dtype`, before Ray starts. A model whose class the source does not show
    is checked against the dtype alone; the workers check it again against the class itself."""
    if choice == "auto":
        return
    half_precision = dtype != "fp32"
    model = declared_kernels(str(fields.get("model_type", "")), half_precision)
    check_choice(choice, model or ModelKernels(half_precision=half_precision))


def declared_kernels(model_type: str, half_precision: bool = True) -> ModelKernels | None:
    """The kernels transformers' causal LM class for `model_type` declares, read from its source without importing
    it: the class's flags, else its bases' (those defined in its own modeling file or imported from another
    model's), else transformers' default, False. None where the source does not say."""
    root = _transformers_dir()
    if root is None:
        return None
    name = _source_mapping(root / "models" / "auto" / "modeling_auto.py",
                           "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES").get(model_type)
    module = _source_mapping(root / "models" / "auto" / "auto_mappings.py",
                             "SPECIAL_MODEL_TYPE_TO_MODULE_NAME").get(model_type, model_type.replace("-", "_"))
    if not isinstance(name, str):
        return None
    own = sorted((root / "models" / str(module)).glob("modeling_*.py"))
    for path in own + [p for p in _modeling_files(root) if p not in own]:  # some types reuse another's class
        flags = _class_flags(path, name) if f"class {name}(" in _text(path) else None
        if flags is not None:
            return of_flags(name, flags, half_precision)
    return None


@functools.cache
def _modeling_files(root: Path) -> list[Path]:
    return sorted(root.glob("models/*/modeling_*.py"))


def _transformers_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return ""


@functools.cache
def _parsed(path: Path) -> ast.Module | None:
    try:
        return ast.parse(_text(path))
    except (SyntaxError, ValueError):
        return None


@functools.cache
def _source_mapping(path: Path, variable: str) -> dict[str, Any]:
    """The pairs of `variable = OrderedDict([(key, value), ...])` at the top of a source file; empty where the
    file says it otherwise."""
    for node in getattr(_parsed(path), "body", []):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == variable for t in node.targets):
            try:
                return dict(ast.literal_eval(node.value.args[0]))
            except (ValueError, AttributeError, IndexError, TypeError):
                return {}
    return {}


def _class_flags(path: Path, name: str) -> dict[str, Any] | None:
    """The support flags class `name` of the file at `path` ends up with, or None where the class is not there or
    a base it inherits from cannot be found."""
    tree = _parsed(path)
    cls = next((n for n in getattr(tree, "body", []) if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return None
    flags: dict[str, Any] = {}
    for base in reversed(cls.bases):  # the first base that sets a flag wins, as in the class's MRO
        where = _base_file(tree, path, getattr(base, "id", ""))
        inherited = {} if where is None else _class_flags(where, base.id)
        if inherited is None:
            return None
        flags.update(inherited)
    flags.update(_own_flags(cls))
    return flags


def _own_flags(cls: ast.ClassDef) -> dict[str, Any]:
    """The flags a class body sets: a constant's value; anything else (a property, an expression) as declared."""
    own: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if getattr(target, "id", None) in SUPPORT_FLAGS.values():
                    own[target.id] = node.value.value if isinstance(node.value, ast.Constant) else True
        elif isinstance(node, ast.FunctionDef) and node.name in SUPPORT_FLAGS.values():
            own[node.name] = True
    return own


def _base_file(tree: ast.Module, path: Path, base: str) -> Path | None:
    """Where a base class of a modeling file is defined: the file itself, or the modeling file of another model it
    is imported from; None for a base that sets no flags (PreTrainedModel: all False, GenerationMixin, ...)."""
    if any(isinstance(n, ast.ClassDef) and n.name == base for n in tree.body):
        return path
    for node in tree.body:
        if (isinstance(node, ast.ImportFrom) and node.level and any(a.name == base for a in node.names)
                and (node.module or "").rsplit(".", 1)[-1].startswith("modeling_")
                and node.module != "modeling_utils"):
            folder = path.parent
            for _ in range(node.level - 1):
                folder = folder.parent
            return folder.joinpath(*node.module.split(".")).with_suffix(".py")
    return None
