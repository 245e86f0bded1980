"""A DCP checkpoint's `.metadata` read as data, so that its bytes can neither run code nor change anything outside
the load.

DCP pickles its metadata objects. An unpickler that only limits which classes a pickle may name still hands the
pickle those classes: BUILD on a class sets its attributes for the whole process (`pathlib.PosixPath._str`, a
function's `cache`), and REDUCE calls the classes with whatever arguments the pickle chose. Here every class a
`.metadata` names is replaced, while it is unpickled, by a sealed stand-in that only records what the pickle gives
it (its arguments, its state); BUILD on the class itself is refused. Then trainlift builds DCP's metadata objects
from that record, each field checked for the plain data DCP writes there: a call with arguments DCP never passes,
a value of another type, a file over `MAX_BYTES` and bytes that are not exactly one pickle are refused.
"""

from __future__ import annotations

import io
import pickle
from pathlib import PurePosixPath
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

# A `.metadata` grows with tensors x ranks (one chunk and one storage entry each, about 200 bytes); this is far
# above a fine-tune's, and bounds the memory a crafted file can make the unpickler take.
MAX_BYTES = 128 << 20
_DCP = "torch.distributed.checkpoint.metadata"
DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}  # _MEM_FORMAT_ENCODING


class Refused(Exception):
    """The `.metadata` is not DCP metadata as DCP writes it; the message says why."""


class _Sealed(type):
    """The stand-ins' type: no pickle (nor anything else) can set or delete a stand-in class's attributes."""

    def __setattr__(cls, name, value):
        raise pickle.UnpicklingError(f"it sets {cls.global_name}.{name}")

    def __delattr__(cls, name):
        raise pickle.UnpicklingError(f"it deletes {cls.global_name}.{name}")


class _StateOfInstances:
    """`__setstate__` of the stand-ins. BUILD looks it up on what it builds: an instance records its state (once);
    the class itself, a global the pickle named, is refused."""

    def __get__(self, instance, owner):
        if instance is None:
            raise pickle.UnpicklingError(f"it sets attributes of {owner.global_name}")
        return instance.record_state


_NO_STATE = object()


class StandIn(metaclass=_Sealed):
    """One class a `.metadata` names. Calling it (REDUCE) or making an instance (NEWOBJ) records the arguments;
    BUILD records the state. Nothing else happens."""

    __slots__ = ("args", "state")
    global_name = "a stand-in"

    def __new__(cls, *args, **kwargs):
        if kwargs:
            raise pickle.UnpicklingError(f"it passes keyword arguments to {cls.global_name}")
        self = object.__new__(cls)
        self.args, self.state = args, _NO_STATE
        return self

    def __init__(self, *args, **kwargs):
        pass

    __setstate__ = _StateOfInstances()

    def record_state(self, state) -> None:
        if self.state is not _NO_STATE:
            raise pickle.UnpicklingError(f"it sets the state of a {self.global_name} twice")
        self.state = state


def _stand_in(module: str, name: str) -> type:
    return _Sealed(name, (StandIn,), {"__slots__": (), "global_name": f"{module}.{name}"})


_NAMES = [(_DCP, name) for name in ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
                                    "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                    "_MEM_FORMAT_ENCODING")] + [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # StorageMeta.checkpoint_id (3.13 moved the class)
    *(("torch", name) for name in DTYPES)]
STAND_INS = {key: _stand_in(*key) for key in _NAMES}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in STAND_INS:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}")
        return STAND_INS[(module, name)]


def parse(data: bytes) -> Metadata:
    """DCP's metadata from a `.metadata` file's bytes; Refused unless they are one pickle of DCP metadata alone."""
    if len(data) > MAX_BYTES:
        raise Refused(f"{len(data):,} bytes, over the {MAX_BYTES >> 20} MiB a .metadata may have")
    stream = io.BytesIO(data)
    try:
        recorded = _Unpickler(stream).load()
    except Exception as exc:  # noqa: BLE001 - whatever a crafted pickle raises is a refusal
        raise Refused(_first_line(exc)) from None
    if stream.tell() != len(data):
        raise Refused(f"{len(data) - stream.tell():,} bytes after the end of the pickle")
    try:
        metadata = _Builder().value(recorded)
    except (TypeError, ValueError, KeyError, RecursionError) as exc:
        raise Refused(_first_line(exc)) from None
    if not isinstance(metadata, Metadata):
        raise Refused(f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


_BUILDING = object()


class _Builder:
    """Real values from what the unpickler recorded: plain data as it is, a stand-in by its class's builder.
    Each recorded object is built once (a pickle may share one value many times), and one that contains itself is
    refused."""

    def __init__(self):
        self.built: dict[int, Any] = {}

    def value(self, recorded: Any) -> Any:
        key = id(recorded)
        if key in self.built:
            if self.built[key] is _BUILDING:
                raise Refused("a value that contains itself")
            return self.built[key]
        self.built[key] = _BUILDING
        self.built[key] = self._build(recorded)
        return self.built[key]

    def _build(self, recorded: Any) -> Any:
        kind = type(recorded)
        if recorded is None or kind in (bool, int, float, str, bytes):
            return recorded
        if kind in (list, tuple):
            return kind(self.value(item) for item in recorded)
        if kind is dict:
            return {self.value(k): self.value(v) for k, v in recorded.items()}
        if isinstance(recorded, StandIn):
            if kind.global_name not in BUILDERS:
                raise Refused(f"it calls {kind.global_name}")
            return BUILDERS[kind.global_name](self, recorded)
        if isinstance(recorded, _Sealed) and recorded.global_name.startswith("torch.") and \
                recorded.global_name[len("torch."):] in DTYPES:
            return DTYPES[recorded.global_name[len("torch."):]]
        raise Refused(f"it holds {getattr(recorded, 'global_name', kind.__name__)} as a value")

    def args(self, recorded: StandIn, count: int) -> list[Any]:
        """The arguments a stand-in was called with, built; refused unless there are `count` and no state."""
        if len(recorded.args) != count or recorded.state is not _NO_STATE:
            raise Refused(f"it makes a {recorded.global_name} as DCP does not")
        return [self.value(arg) for arg in recorded.args]

    def fields(self, recorded: StandIn, checks: dict[str, Callable[[Any], bool]],
               required: tuple[str, ...] = ()) -> dict[str, Any]:
        """A dataclass's fields from its state (a dict, set by BUILD), built and each checked; no arguments."""
        state = {} if recorded.state is _NO_STATE else recorded.state
        if recorded.args or type(state) is not dict or not set(state) <= set(checks) or \
                not set(required) <= set(state):
            raise Refused(f"it makes a {recorded.global_name} as DCP does not")
        fields = {name: self.value(value) for name, value in state.items()}
        wrong = next((name for name, value in fields.items() if not checks[name](value)), None)
        if wrong is not None:
            raise Refused(f"{recorded.global_name}.{wrong} is a {type(fields[wrong]).__name__}")
        return fields


def plain(value: Any, seen: set[int] | None = None) -> bool:
    """Numbers, strings, bytes, None and lists, tuples and dicts of them (the planner's data)."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or type(value) in (bool, int, float, str, bytes):
        return True
    seen.add(id(value))
    if type(value) in (list, tuple):
        return all(plain(item, seen) for item in value)
    return type(value) is dict and all(plain(k, seen) and plain(v, seen) for k, v in value.items())


def _is(*types: type) -> Callable[[Any], bool]:
    return lambda value: type(value) in types


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0


def _list_of(*types: type) -> Callable[[Any], bool]:
    return lambda value: type(value) is list and all(type(item) in types for item in value)


def _dict_of(keys: tuple[type, ...], values: tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda value: type(value) is dict and all(type(k) in keys and type(v) in values for k, v in value.items())


NONE = type(None)
SIZE = (torch.Size, NONE)


def _size(b: _Builder, r: StandIn) -> torch.Size:
    (dims,) = b.args(r, 1)
    if type(dims) is not tuple or not all(_whole(d) for d in dims):
        raise Refused("a torch.Size of other than whole numbers")
    return torch.Size(dims)


def _layout(b: _Builder, r: StandIn) -> torch.layout:
    (name,) = b.args(r, 1)
    if type(name) is not str or name not in LAYOUTS:
        raise Refused(f"{name!r} is not a torch layout")
    return LAYOUTS[name]


def _memory_format(b: _Builder, r: StandIn) -> torch.memory_format:
    (code,) = b.args(r, 1)
    if type(code) is not int or code not in MEMORY_FORMATS:
        raise Refused(f"{code!r} is not a memory format's code")
    return MEMORY_FORMATS[code]


def _posix_path(b: _Builder, r: StandIn) -> str:
    parts = b.args(r, len(r.args))
    if not all(type(part) is str for part in parts):
        raise Refused("a path of other than strings")
    return str(PurePosixPath(*parts))


def _tensor_properties(b: _Builder, r: StandIn) -> TensorProperties:
    state = None if r.state is _NO_STATE else b.value(r.state)
    kinds = (torch.dtype, torch.layout, bool, torch.memory_format, bool)
    if r.args or type(state) is not tuple or len(state) != 5 or not all(map(isinstance, state, kinds)):
        raise Refused(f"it makes a {r.global_name} as DCP does not")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    return TensorProperties(dtype=dtype, layout=layout, requires_grad=requires_grad, memory_format=memory_format,
                            pin_memory=pin_memory)


def _dataclass(cls: type, checks: dict[str, Callable[[Any], bool]], required: tuple[str, ...] = ()):
    return lambda b, r: cls(**b.fields(r, checks, required))


BUILDERS: dict[str, Callable[[_Builder, StandIn], Any]] = {
    "torch.Size": _size, "torch.serialization._get_layout": _layout, f"{_DCP}._MEM_FORMAT_ENCODING": _memory_format,
    "pathlib.PosixPath": _posix_path, "pathlib._local.PosixPath": _posix_path,
    f"{_DCP}.TensorProperties": _tensor_properties,
    f"{_DCP}.ChunkStorageMetadata": _dataclass(ChunkStorageMetadata, {"offsets": _is(torch.Size),
                                                                      "sizes": _is(torch.Size)},
                                               ("offsets", "sizes")),
    f"{_DCP}.TensorStorageMetadata": _dataclass(
        TensorStorageMetadata, {"properties": _is(TensorProperties), "size": _is(torch.Size),
                                "chunks": _list_of(ChunkStorageMetadata)}, ("properties", "size", "chunks")),
    f"{_DCP}.BytesStorageMetadata": _dataclass(BytesStorageMetadata, {}),
    f"{_DCP}.MetadataIndex": _dataclass(MetadataIndex, {"fqn": _is(str), "offset": _is(*SIZE), "index": _is(int, NONE)},
                                        ("fqn",)),
    "torch.distributed.checkpoint.filesystem._StorageInfo": _dataclass(
        _StorageInfo, {"relative_path": _is(str), "offset": _whole, "length": _whole,
                       "transform_descriptors": lambda v: v is None or _list_of(str)(v)},
        ("relative_path", "offset", "length")),
    f"{_DCP}.StorageMeta": _dataclass(StorageMeta, {"checkpoint_id": _is(str, NONE), "save_id": _is(str, NONE),
                                                    "load_id": _is(str, NONE), "modules": _list_of(str)}),
    f"{_DCP}.Metadata": _dataclass(
        Metadata, {"state_dict_metadata": _dict_of((str,), (TensorStorageMetadata, BytesStorageMetadata)),
                   "planner_data": plain, "storage_data": _dict_of((MetadataIndex,), (_StorageInfo,)),
                   "storage_meta": _is(StorageMeta, NONE), "version": _is(str, NONE)}, ("state_dict_metadata",)),
}
