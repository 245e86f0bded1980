"""Weighted mixtures of data sources: draws follow the weights, stop as documented, and are a pure function of the
spec and the data, so the packed rows (and the resume cursor over them) are the same at every build; the cache
key covers every source, weight and format, and the cache's manifest records the composition."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import validate_job_spec
from trainlift.train.data import cache as datacache, mixture, source as datasource

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


@pytest.fixture
def sources(tmp_path):
    """Two text sources of `n` rows each ("a 0", "a 1", ... and "b 0", ...), and a spec maker over them."""
    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    def make(n=3000, **data_section):
        a = write("a.jsonl", [{"text": f"a {i}"} for i in range(n)])
        b = write("b.jsonl", [{"text": f"b {i}"} for i in range(n)])
        section = {"train": [{"source": a, "weight": 0.7}, {"source": b, "weight": 0.3}], "seq_len": 32,
                   **data_section}
        return validate_job_spec({"model": {"path": "unused"}, "data": section, "train": {"seed": 3},
                                  "run": {"storage": str(tmp_path / "runs")}})

    make.write = write
    return make


def drawn_texts(spec):
    stream = datacache.splits(spec)["train"].mixture()
    return [row["text"] for _, row in stream], stream


def test_a_70_30_mixture_draws_within_3_percent_of_its_weights(sources):
    texts, stream = drawn_texts(sources(mixture_size=4000))
    assert len(texts) == 4000
    share = sum(t.startswith("a ") for t in texts) / len(texts)
    assert abs(share - 0.7) <= 0.03, share
    assert stream.drawn[0] + stream.drawn[1] == 4000 and stream.drawn[0] == round(share * 4000)


def test_without_a_size_the_draws_stop_at_the_first_source_that_runs_out(sources):
    texts, stream = drawn_texts(sources(n=1000))
    a_rows = [t for t in texts if t.startswith("a ")]
    assert a_rows == [f"a {i}" for i in range(1000)]  # every row of the source that ran out, once, in order
    b_rows = [t for t in texts if t.startswith("b ")]
    assert b_rows == [f"b {i}" for i in range(len(b_rows))] and stream.drawn == [1000, len(b_rows)]
    assert abs(len(a_rows) / len(texts) - 0.7) <= 0.03


def test_with_a_size_a_source_that_runs_out_starts_over(sources):
    texts, stream = drawn_texts(sources(n=50, mixture_size=500))
    assert len(texts) == 500
    a_rows = [t for t in texts if t.startswith("a ")]
    assert a_rows == [f"a {i % 50}" for i in range(len(a_rows))] and len(a_rows) > 100
    assert max(Counter(texts).values()) > 1


def test_each_source_reads_in_its_own_format_and_columns(sources, tmp_path):
    alpaca = sources.write("alpaca.jsonl", [{"task": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    chat = sources.write("chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}] * 40)
    spec = sources(train=[{"source": alpaca, "format": "alpaca", "columns": {"instruction": "task", "output": "answer"}},
                          {"source": chat}])
    stream = datacache.splits(spec)["train"].mixture()
    rows = list(stream)
    assert {fmt for fmt, _ in rows} == {"messages"} and stream.formats == ["alpaca", "messages"]
    assert {"role": "user", "content": "q0"} in next(r for _, r in rows if r["messages"][0]["content"] == "q0")["messages"]


def test_two_builds_of_one_spec_pack_identical_rows(sources, tokenizer, tmp_path):
    spec = sources(n=200)
    other = spec.model_copy(update={"run": spec.run.model_copy(update={"storage": str(tmp_path / "elsewhere")})})
    first, second = (datacache.prepare_splits(s, lambda: tokenizer) for s in (spec, other))
    assert first == second and first["train"]["built"]
    directories = [Path(datacache.root_of(s.run.storage)[1]) / first["train"]["key"] for s in (spec, other)]
    for name in ("rows-00000.npy", "meta-00000.npy"):
        assert np.array_equal(*(np.load(d / name) for d in directories))
    train, _ = datacache.load_splits(spec, lambda: tokenizer, rank=0, keys=first)
    assert len(train.rows) > 0


def test_the_manifest_records_the_composition(sources, tokenizer):
    spec = sources(n=200)
    keys = datacache.prepare_splits(spec, lambda: tokenizer)
    a, b = datacache.composition(spec, keys)["train"]
    assert (a["source"], a["weight"], a["format"], a["drawn"]) == (spec.data.train[0].source, 0.7, "text", 200)
    assert b["source"] == spec.data.train[1].source and b["weight"] == pytest.approx(0.3) and 0 < b["drawn"] < 200
    assert a["fingerprint"] != b["fingerprint"] and len(a["fingerprint"]) == 64


def test_the_cache_key_covers_every_source_weight_format_and_the_seed(sources, tmp_path):
    def key(spec):
        return datacache.cache_key(datacache.splits(spec)["train"], "tok")

    base = sources(n=20)
    entries = [e.model_dump() for e in base.data.train]
    other = sources.write("c.jsonl", [{"text": f"c {i}"} for i in range(20)])

    def changed(**data_section):
        return key(validate_job_spec({**base.model_dump(), "data": {**base.data.model_dump(), **data_section}}))

    assert changed() == key(base)
    assert changed(train=[{**entries[0], "weight": 0.6}, entries[1]]) != key(base)
    assert changed(train=[entries[0], {**entries[1], "source": other}]) != key(base)
    assert changed(train=[entries[0], {**entries[1], "format": "text"}]) != key(base)
    assert changed(mixture_size=30) != key(base)
    reseeded = base.model_copy(update={"train": base.train.model_copy(update={"seed": 4})})
    assert key(reseeded) != key(base)
    single = changed(train=[entries[0]])
    assert changed(train=[{**entries[0], "weight": 5}]) == single  # one source: its weight changes nothing
    assert key(reseeded.model_copy(update={"data": base.data.model_copy(update={"train": [base.data.train[0]]})})) == single


def test_draw_picks_by_weight_from_a_seeded_stream():
    streams = [lambda: iter(range(100)), lambda: iter(range(100, 200))]
    first = list(mixture.draw(streams, [1, 1], seed=7))
    assert first == list(mixture.draw(streams, [1, 1], seed=7))
    assert first != list(mixture.draw(streams, [1, 1], seed=8))
    assert max(Counter(i for i, _ in first).values()) == 100  # it stopped when one ran out
    assert [item for i, item in first if i == 1] == list(range(100, 100 + sum(i == 1 for i, _ in first)))


def test_the_data_fingerprint_of_a_plain_location_is_its_files_and_of_a_mixture_every_choice(sources):
    spec = sources(n=20)
    a, b = datacache.splits(spec)["train"].sources
    plain = datasource.specs_of(a.location)
    assert datasource.fingerprint_of(plain) == datasource.fingerprint(datasource.resolve(a.location))
    reweighted = datasource.SourceSpec(b.location, b.fmt, b.columns, weight=0.5, field=b.field)
    assert len({datasource.fingerprint_of(s) for s in ((a, b), (a, reweighted), (b, a))}) == 3


def test_a_mixture_spec_passes_the_drivers_checks_and_grants_s3_reads_per_source(sources, tiny_assets):
    """What reads data.train as a whole (the driver's preflight, the rendered S3 policy) takes every source."""
    from trainlift.render.s3_access import job_s3_uses
    from trainlift.train.run import preflight

    spec = sources(n=50)
    spec = validate_job_spec({**spec.model_dump(mode="json"), "model": {"path": str(tiny_assets / "model")}})
    checked = preflight.check(spec)
    assert [Path(s.source).is_absolute() for s in checked.data.train] == [True, True]
    remote = validate_job_spec({**spec.model_dump(mode="json"), "data": {
        "train": [{"source": "s3://b/data/a.jsonl", "weight": 0.5}, {"source": "s3://b/data/b/", "weight": 0.5}],
        "eval": "s3://b/data/eval.jsonl"}})
    assert [(u.field, u.uri) for u in job_s3_uses(remote) if not u.write] == [
        ("data.train[0]", "s3://b/data/a.jsonl"), ("data.train[1]", "s3://b/data/b/"), ("data.eval", "s3://b/data/eval.jsonl")]
