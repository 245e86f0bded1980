"""The job spec's data section: where the rows come from (files, datasets saved or on the hub, or a weighted mixture
of them), how they read and how long a packed row is."""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from trainlift.config.section import Section as _Section

DATA_KEYS = ("messages", "prompt", "completion", "text", "instruction", "input", "output", "system", "conversations",
             "chosen", "rejected")
DataFormat = Literal["auto", "messages", "alpaca", "sharegpt", "prompt_completion", "text", "preference"]
HUB_DATASET = re.compile(r"hf://datasets/(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")
_SHAPES = ("location", "source", "mix")  # how a data.train/data.eval value is written; never in an error's path


def _known_column_keys(value: dict[str, str] | None) -> dict[str, str] | None:
    unknown = sorted(set(value or {}) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"unknown key {', '.join(unknown)}; the keys are {', '.join(DATA_KEYS)}")
    return value


def _data_location(value: str) -> str:
    if value.startswith("hf://") and not HUB_DATASET.fullmatch(value):
        raise ValueError("not a hub dataset id: write hf://datasets/<org>/<name> (config, split and revision go "
                         "beside it, as {source: hf://datasets/<org>/<name>, split: train})")
    return value


class DataSource(_Section):
    """One source of data.train or data.eval, with what chooses within it and how its rows read."""

    source: str = Field(description="What data.train takes as a plain string: a .jsonl/.json/.parquet/.csv file, a "
                        "directory or glob of them (local or s3://); a directory saved by datasets' save_to_disk; "
                        "a local directory in the hub's layout (data/train-00000-of-00001.parquet, or a README.md "
                        "with configs); or a hub dataset, hf://datasets/<org>/<name>, fetched once per node into "
                        "<staging dir>/datasets (TRAINLIFT_DATASET_CACHE names the directory itself).")
    config: str | None = Field(None, description="The dataset's configuration (datasets' `name`), for a hub "
                               "dataset or a hub-layout directory with several.")
    split: str | None = Field(None, description="The split to read (e.g. train); needed when the dataset has "
                              "several. A local directory given a config or split is read as the hub lays it out.")
    revision: str | None = Field(None, pattern=r"^[0-9a-f]{40}$", description="The hub commit (40 hex digits) of "
                                 "an hf://datasets/ source, fetched on every node; it alone keys the data cache. "
                                 "Unset: the main branch when the node first fetches it, keyed by the files' hash.")
    weight: float = Field(1.0, gt=0, description="In a list: this source's share of the draws, relative to the "
                          "others' (0.7 and 0.3, or 7 and 3).")
    format: DataFormat | None = Field(None, description="This source's row format; default: data.format.")
    columns: dict[str, str] | None = Field(None, description="This source's column mapping; default: data.columns.")

    _known_keys = field_validator("columns")(_known_column_keys)
    _location = field_validator("source")(_data_location)

    @model_validator(mode="after")
    def _revision_of_a_hub_dataset(self) -> "DataSource":
        if self.revision is not None and not self.source.startswith("hf://"):
            raise ValueError(f"revision pins a hub dataset's commit; {self.source} is not hf://datasets/<org>/<name>")
        return self


def _shape(value: Any) -> str:
    return "mix" if isinstance(value, list) else "source" if isinstance(value, (dict, DataSource)) else "location"


_Entry = Annotated[Union[Annotated[str, Tag("location")], Annotated[DataSource, Tag("source")]],
                   Discriminator(_shape)]
DataValue = Annotated[Union[Annotated[str, Tag("location")], Annotated[DataSource, Tag("source")],
                            Annotated[list[_Entry], Field(min_length=1), Tag("mix")]], Discriminator(_shape)]


class DataSection(_Section):
    train: DataValue = Field(description="A location (what data.train.source takes), a mapping {source, config, "
                             "split, revision, format, columns}, or a list of them to mix, each with a weight: "
                             "[{source: a.jsonl, weight: 0.7}, {source: hf://datasets/org/name, split: train, "
                             "weight: 0.3}]. A mixture draws each example from a source chosen by weight, seeded by "
                             "train.seed and the sources' content, and stops as data.mixture_size says.")
    eval: DataValue | None = Field(None, description="Like data.train; a mixture of it stops at its first "
                                   "source that runs out, or at data.eval_examples.")
    format: DataFormat = Field("auto", description="messages {messages: [{role, content}]}; alpaca {instruction, "
                               "input?, output, system?}; sharegpt {conversations: [{from: human|gpt|system|tool|"
                               "function_call|observation, value}], system?}; prompt_completion {prompt, "
                               "completion}; text {text}; preference {prompt, chosen, rejected} (for "
                               "train.objective: dpo). auto: the one format whose keys a source's first row has "
                               "(after data.columns).")
    columns: dict[str, str] = Field(
        default_factory=dict, description="The data's column for each key the format reads, e.g. "
        "{prompt: question, completion: answer} or {instruction: task, output: answer}.")
    mixture_size: int | None = Field(None, ge=1, description="Examples drawn from a data.train list; a source that "
                                     "runs out starts over from its first row. Unset: the draws stop at the first "
                                     "draw of a source with no rows left, so no row repeats.")
    seq_len: int = Field(512, gt=8)
    eval_examples: int = Field(256, ge=1, description="At most this many eval examples are scored.")

    _known_keys = field_validator("columns")(_known_column_keys)

    @field_validator("train", "eval")
    @classmethod
    def _locations(cls, value: Any) -> Any:
        for entry in value if isinstance(value, list) else [value]:
            if isinstance(entry, str):
                _data_location(entry)
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _paths_without_shapes(cls, raw: Any, handler) -> "DataSection":
        """Errors name data.train[1].weight, not the union member the value was read as."""
        try:
            return handler(raw)
        except ValidationError as exc:
            errors = [InitErrorDetails(type=e["type"], loc=_unshaped(e["loc"]), input=e["input"], ctx=e.get("ctx", {}))
                      for e in exc.errors()]
            raise ValidationError.from_exception_data(exc.title, errors) from None

    def locations(self) -> list[tuple[str, str]]:
        """(field, location) of every source: data.train, data.train[1], data.eval, ..."""
        out = []
        for name in ("train", "eval"):
            value = getattr(self, name)
            for i, entry in enumerate(value if isinstance(value, list) else [] if value is None else [value]):
                field = f"data.{name}[{i}]" if isinstance(value, list) else f"data.{name}"
                out.append((field, entry if isinstance(entry, str) else entry.source))
        return out

    def with_locations(self, change: Callable[[str], str]) -> "DataSection":
        """A copy with every source's location passed through `change` (e.g. made absolute)."""
        def moved(value: Any) -> Any:
            if isinstance(value, list):
                return [moved(entry) for entry in value]
            if isinstance(value, DataSource):
                return value.model_copy(update={"source": change(value.source)})
            return change(value) if isinstance(value, str) else value

        return self.model_copy(update={"train": moved(self.train), "eval": moved(self.eval)})


def _unshaped(loc: tuple) -> tuple:
    return tuple(part for i, part in enumerate(loc)
                 if not (part in _SHAPES and i and (loc[i - 1] in ("train", "eval") or isinstance(loc[i - 1], int))))
