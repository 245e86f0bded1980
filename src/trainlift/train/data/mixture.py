"""The example stream of one split: its sources' checked rows, drawn by weight when there are several.

Each draw picks source i with probability weight_i / Σ weights, from a random stream seeded by `train.seed` and
the sources' fingerprints, and takes that source's next row (every source is read in its own order). The draws
stop:
  - without a size (`data.mixture_size` unset): at the first draw of a source that has no rows left, so no row
    is drawn twice; a single source is read once through;
  - with a size: after that many examples; a source that runs out starts over from its first row.
`limit` (`data.eval_examples`) stops the stream earlier. So the mixed stream, the packed rows and the resume
cursor over them are a pure function of the spec and the data.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from typing import Any, Callable, Iterator, Sequence

from trainlift.errors import UsageError
from trainlift.train.data import formats, source as datasource


def checked_rows(source: datasource.SourceSpec) -> Iterator[tuple[str, dict]]:
    """(the source's format, row) for each row of `source`, renamed, checked and mapped to what the tokenizer
    reads (`formats.tokenized_as` of that format); errors name file:row. `auto` is settled by the first row."""
    fmt, columns, n = source.fmt, dict(source.columns), 0
    for where, row in datasource.rows_of(source):
        if not isinstance(row, dict):
            raise UsageError(f"{where}: a row must be an object with named columns (got {type(row).__name__})")
        row = datasource.rename(row, columns)
        if fmt == "auto":
            fmt = formats.detect(list(row), source.field)
        yield fmt, formats.mapped(row, fmt, where)
        n += 1
    if n == 0:
        raise UsageError(f"{source.field}: no examples in {source.location}")


def _started(rows: Iterator[Any]) -> Iterator[Any]:
    """`rows` with its first item read now: every source's format and first row are checked before the first draw,
    whichever sources the draws reach."""
    first = next(rows)
    return itertools.chain([first], rows)


def draw_seed(seed: int, fingerprints: Sequence[str]) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps([seed, list(fingerprints)]).encode()).digest()[:8], "big")


def draw(streams: Sequence[Callable[[], Iterator[Any]]], weights: Sequence[float], seed: int,
         size: int | None = None) -> Iterator[tuple[int, Any]]:
    """(source index, item) drawn by weight from `streams` (each called to start or restart a source), until a
    drawn source runs out (size None) or `size` items were drawn; see the module's docstring."""
    bounds = list(itertools.accumulate(weights))
    rng = random.Random(seed)
    started = [stream() for stream in streams]
    for _ in itertools.count() if size is None else range(size):
        i = min(bisect.bisect_right(bounds, rng.random() * bounds[-1]), len(bounds) - 1)
        item = next(started[i], StopIteration)
        if item is StopIteration and size is not None:
            started[i] = streams[i]()
            item = next(started[i], StopIteration)
        if item is StopIteration:
            return
        yield i, item


class Mixture:
    """The checked rows of a split's sources as one stream of (tokenized format, row); counts what it drew."""

    def __init__(self, sources: Sequence[datasource.SourceSpec], seed: int = 0, size: int | None = None,
                 limit: int | None = None):
        self.sources, self.seed, self.size, self.limit = tuple(sources), seed, size, limit
        self.drawn = [0] * len(self.sources)
        self.formats: list[str | None] = [s.fmt if s.fmt != "auto" else None for s in self.sources]

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        self.drawn = [0] * len(self.sources)
        fingerprints = [datasource.fingerprint(s.files()) for s in self.sources] if len(self.sources) > 1 else []
        streams = [lambda s=s: _started(checked_rows(s)) for s in self.sources]
        drawn = draw(streams, [s.weight for s in self.sources], draw_seed(self.seed, fingerprints), self.size)
        for i, (fmt, row) in itertools.islice(drawn, self.limit):
            self.drawn[i] += 1
            self.formats[i] = fmt
            yield formats.tokenized_as(fmt), row

    def composition(self) -> list[dict[str, Any]]:
        """Per source: what the spec says of it, its fingerprint, its share of the weights, the format its rows
        were read in and how many examples were drawn from it (after iterating)."""
        total = sum(s.weight for s in self.sources)
        return [{**s.describe(), "format": fmt or s.fmt, "fingerprint": datasource.fingerprint(s.files()),
                 "weight": s.weight / total, "drawn": n}
                for s, fmt, n in zip(self.sources, self.formats, self.drawn)]
