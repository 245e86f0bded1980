"""Data in the formats users have: JSONL, JSON, Parquet and CSV files, directories and globs of them, a column
mapping; bad rows named by file and row. Files are written with the real pyarrow writers."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError, UsageError
from trainlift.train.data import examples as data, source as datasource

REPO = Path(__file__).resolve().parents[2]
PAIRS = [{"prompt": f"add {i} {i + 1} =", "completion": f" {2 * i + 1}"} for i in range(30)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


def chat_rows(n):
    with open(REPO / "examples" / "data" / "tasks-train.jsonl") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_reads_the_same_rows_in_order(tmp_path, tokenizer):
    reference = data.prepare(str(write_jsonl(tmp_path / "ref.jsonl", PAIRS)), "prompt_completion", tokenizer, 32)
    renamed = [{"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(PAIRS)]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "pairs.parquet")
    pcsv.write_csv(pa.Table.from_pylist(renamed), tmp_path / "pairs.csv")
    (tmp_path / "pairs.json").write_text(json.dumps(PAIRS))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        write_jsonl(shards / f"part-{i}.jsonl", PAIRS[i * 10:(i + 1) * 10])
    (shards / "_SUCCESS").write_text("")  # a marker file other tools leave: not data
    mapping = {"prompt": "question", "completion": "answer"}
    for path, columns in ((tmp_path / "pairs.parquet", mapping), (tmp_path / "pairs.csv", mapping),
                          (tmp_path / "pairs.json", None), (shards, None), (shards / "part-*.jsonl", None)):
        packed = data.prepare(str(path), "prompt_completion", tokenizer, 32, columns=columns)
        assert packed.rows == reference.rows, path


def test_chat_rows_from_parquet_and_from_csv_json_cells(tmp_path, tokenizer):
    rows = chat_rows(12)
    reference = data.prepare(str(write_jsonl(tmp_path / "chat.jsonl", rows)), "messages", tokenizer, 64)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    pcsv.write_csv(pa.table({"messages": [json.dumps(r["messages"]) for r in rows]}), tmp_path / "chat.csv")
    for name in ("chat.parquet", "chat.csv"):
        assert data.prepare(str(tmp_path / name), "messages", tokenizer, 64).rows == reference.rows


def test_bad_parquet_row_is_named_by_file_and_row(tmp_path):
    table = pa.table({"prompt": ["a", "b", "c"], "completion": [" x", None, " z"]})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(UsageError, match=r"bad\.parquet:row 2: completion must be text \(got NoneType\)"):
        list(data.records(str(tmp_path / "bad.parquet"), "prompt_completion"))


def test_bad_csv_row_is_named_by_file_and_line(tmp_path):
    (tmp_path / "bad.csv").write_text('messages\n"[{""role"": ""user"", ""content"": ""x""}]"\n')
    with pytest.raises(UsageError, match=r"bad\.csv:2: no assistant message to learn from"):
        list(data.records(str(tmp_path / "bad.csv"), "messages"))
    (tmp_path / "broken.csv").write_text("messages\n[{oops\n")
    with pytest.raises(UsageError, match=r"broken\.csv:2: messages is not valid JSON"):
        list(data.records(str(tmp_path / "broken.csv"), "messages"))


def test_a_missing_parquet_column_fails_before_reading_with_the_fix(tmp_path):
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), tmp_path / "qa.parquet")
    files = datasource.resolve(str(tmp_path / "qa.parquet"))
    with pytest.raises(UsageError, match=r"qa\.parquet: no column prompt, completion .*columns: question, answer") as err:
        datasource.check_schema(files, "prompt_completion", {})
    assert "data.columns" in err.value.hint
    datasource.check_schema(files, "prompt_completion", {"prompt": "question", "completion": "answer"})


def test_paths_that_name_no_data_say_so(tmp_path):
    with pytest.raises(UsageError, match=r"data\.train: data file not found: .*nothing\.jsonl"):
        datasource.resolve(str(tmp_path / "nothing.jsonl"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match=r"data\.eval: no \.jsonl/\.json/\.parquet/\.csv files: "):
        datasource.resolve(str(tmp_path), "data.eval")


def test_column_mapping_keys_are_checked_in_the_spec():
    spec = {"model": {"path": "m"}, "data": {"train": "t.parquet", "columns": {"prompt": "question"}}}
    assert validate_job_spec(spec).data.columns == {"prompt": "question"}
    spec["data"]["columns"] = {"question": "prompt"}
    with pytest.raises(SpecError, match=r"data\.columns: unknown key question; the keys are messages, prompt"):
        validate_job_spec(spec)
