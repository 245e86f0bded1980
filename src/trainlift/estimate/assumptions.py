"""The estimate's assumptions (catalog/estimate.yaml), each with its source text."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

import yaml


class Figure(NamedTuple):
    value: float
    source: str
    label: str = ""


@lru_cache(maxsize=1)
def assumptions() -> dict[str, Any]:
    data = yaml.safe_load(resources.files("trainlift.catalog").joinpath("estimate.yaml").read_text())
    data["plain_mlp_model_types"] = frozenset(data["plain_mlp_model_types"]["models"])
    return data


def figure(section: str, *keys: str) -> Figure | None:
    """One figure with its source text (a key of `sources`, or the text itself); None where there is none."""
    data = assumptions()
    entry = data[section]
    for key in keys:
        entry = (entry or {}).get(key)
    if entry is None:
        return None
    source = data["sources"].get(entry["source"], entry["source"])
    return Figure(float(entry["value"]), " ".join(source.split()), entry.get("label", ""))


def hfu(gpu_model: str | None) -> tuple[Figure, bool]:
    """The hardware FLOP utilisation to assume for a GPU model and whether it was measured."""
    measured = figure("hfu", "measured", gpu_model or "")
    return (measured, True) if measured else (figure("hfu", "assumed"), False)


def compiled(hfu: Figure) -> Figure:
    """The assumed HFU of a run with train.compile: scaled by what compiling gave in the published run it comes
    from."""
    factor = figure("compile", "throughput_factor")
    return Figure(hfu.value * factor.value, f"{hfu.source}; {factor.source}", f"{hfu.label}, {factor.label}")
