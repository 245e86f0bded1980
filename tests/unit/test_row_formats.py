"""Row formats: alpaca and sharegpt rows become exactly the messages they mean, before tokenization; `auto` picks
the one format a source's first row fits (after data.columns) and refuses, in one line, rows that fit none or
several; preference rows pass through unchanged."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trainlift.config.job import validate_job_spec
from trainlift.errors import UsageError
from trainlift.train.data import examples as data, formats, source as datasource

REPO = Path(__file__).resolve().parents[2]
NEEDS = ("messages needs messages; alpaca needs instruction, output; sharegpt needs conversations; "
         "prompt_completion needs prompt, completion; text needs text; preference needs prompt, chosen, rejected")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def test_alpaca_rows_become_a_user_turn_and_the_answer(tmp_path):
    rows = [{"instruction": "reverse", "input": "abc", "output": "cba"},
            {"instruction": "say hi", "input": "", "output": "hi"},
            {"instruction": "say hi", "output": "hi"},
            {"instruction": "sort", "input": None, "output": "1 2", "system": "be brief"}]
    assert list(data.records(write_jsonl(tmp_path / "a.jsonl", rows), "alpaca")) == [
        {"messages": [user("reverse\n\nabc"), assistant("cba")]},
        {"messages": [user("say hi"), assistant("hi")]},
        {"messages": [user("say hi"), assistant("hi")]},
        {"messages": [system("be brief"), user("sort"), assistant("1 2")]},
    ]


def test_sharegpt_speakers_map_to_roles(tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"},
                               {"from": "gpt", "value": "a1"}, {"from": "user", "value": "q2"},
                               {"from": "chatgpt", "value": "a2"}, {"from": "bing", "value": "a3"},
                               {"from": "assistant", "value": "a4"}]},
            {"system": "top", "conversations": [{"from": "human", "value": "weather?"},
                                                {"from": "function_call", "value": '{"name": "weather"}'},
                                                {"from": "observation", "value": "sunny"},
                                                {"from": "tool", "value": "warm"},
                                                {"from": "gpt", "value": "sunny and warm"}]},
            {"conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    assert list(data.records(write_jsonl(tmp_path / "s.jsonl", rows), "sharegpt")) == [
        {"messages": [system("s"), user("q1"), assistant("a1"), user("q2"), assistant("a2"), assistant("a3"),
                      assistant("a4")]},
        {"messages": [system("top"), user("weather?"), assistant('{"name": "weather"}'),
                      {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
                      assistant("sunny and warm")]},
        {"messages": [user("x"), assistant("y")]},
    ]


def test_a_sharegpt_speaker_it_does_not_know_is_named_with_the_known_ones(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "q"},
                                                                 {"from": "narrator", "value": "meanwhile"}]}])
    with pytest.raises(UsageError) as err:
        list(data.records(path, "sharegpt"))
    assert err.value.one_line() == (
        f"{path}:1: conversations[1].from is 'narrator'; the speakers are human, user, gpt, assistant, chatgpt, bing, "
        "function_call, system, tool, observation")


def test_bad_alpaca_and_sharegpt_rows_are_named_by_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": "y"}, {"instruction": "x"}])
    with pytest.raises(UsageError, match=r"a\.jsonl:2: missing output for data\.format=alpaca$"):
        list(data.records(path, "alpaca"))
    path = write_jsonl(tmp_path / "b.jsonl", [{"instruction": 3, "output": "y"}])
    with pytest.raises(UsageError, match=r"b\.jsonl:1: instruction must be text \(got int\)"):
        list(data.records(path, "alpaca"))
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "human", "value": "only a question"}]}])
    with pytest.raises(UsageError, match=r"c\.jsonl:1: no assistant message to learn from"):
        list(data.records(path, "sharegpt"))


def test_an_alpaca_row_tokenizes_as_the_chat_it_means(tmp_path, tokenizer):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "reverse", "input": "abc", "output": "cba"}])
    chat = write_jsonl(tmp_path / "m.jsonl", [{"messages": [user("reverse\n\nabc"), assistant("cba")]}])
    assert data.prepare(alpaca, "alpaca", tokenizer, 32).rows == data.prepare(chat, "messages", tokenizer, 32).rows


@pytest.mark.parametrize("fmt, row, columns", [
    ("messages", {"messages": [user("q"), assistant("a")], "id": 1}, {}),
    ("alpaca", {"instruction": "q", "input": "", "output": "a"}, {}),
    ("alpaca", {"task": "q", "answer": "a"}, {"instruction": "task", "output": "answer"}),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, {}),
    ("prompt_completion", {"prompt": "q", "completion": "a"}, {}),
    ("text", {"text": "hello", "source": "web"}, {}),
    ("preference", {"prompt": "q", "chosen": "good", "rejected": "bad"}, {}),
])
def test_auto_picks_the_one_format_the_first_row_fits(tmp_path, fmt, row, columns):
    path = write_jsonl(tmp_path / "rows.jsonl", [row])
    source = datasource.SourceSpec(path, "auto", tuple(columns.items()))
    mixture = data.Mixture([source])
    list(mixture)
    assert mixture.formats == [fmt]
    assert list(data.records(path, "auto", columns)) == list(data.records(path, fmt, columns))


def test_preference_rows_pass_through_unchanged(tmp_path):
    rows = [{"prompt": "q", "chosen": [assistant("good")], "rejected": "bad", "id": 7}]
    assert list(data.records(write_jsonl(tmp_path / "p.jsonl", rows), "preference")) == rows


def test_rows_that_fit_no_format_are_refused_with_every_formats_keys(tmp_path):
    path = write_jsonl(tmp_path / "ab.jsonl", [{"a": 1, "b": 2}])
    with pytest.raises(UsageError) as err:
        list(data.records(path))
    assert err.value.one_line() == f"data.train: cannot tell the row format from the columns a, b ({NEEDS}): set data.format"


def test_rows_that_fit_two_formats_are_refused_naming_both(tmp_path):
    path = write_jsonl(tmp_path / "alpaca-with-text.jsonl", [{"instruction": "q", "input": "", "output": "a",
                                                              "text": "q a"}])
    with pytest.raises(UsageError) as err:
        list(data.records(path, field="data.eval"))
    assert err.value.one_line() == ("data.eval: cannot tell the row format from the columns instruction, input, output, "
                                    f"text (alpaca and text both fit; {NEEDS}): set data.format")
    assert list(data.records(path, "alpaca")) == [{"messages": [user("q"), assistant("a")]}]


def test_a_list_entry_that_fits_no_format_names_its_own_field(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "x"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"a": 1}])
    with pytest.raises(UsageError, match=r"^data\.train\[1\]: cannot tell .*: set data\.train\[1\]\.format$"):
        list(data.records([good, bad]))


def test_parquet_columns_settle_auto_before_any_row_is_read(tmp_path):
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "qa.parquet")
    files = datasource.resolve(str(tmp_path / "qa.parquet"))
    with pytest.raises(UsageError, match=r"data\.train: cannot tell the row format from the columns question, answer"):
        datasource.check_schema(files, "auto", {})
    datasource.check_schema(files, "auto", {"instruction": "question", "output": "answer"})
    with pytest.raises(UsageError, match=r"qa\.parquet: no column output for data\.format=alpaca"):
        datasource.check_schema(files, "alpaca", {"instruction": "question"})


def test_the_spec_takes_the_formats_and_their_columns():
    spec = validate_job_spec({"model": {"path": "m"}, "data": {
        "train": "t.jsonl", "format": "sharegpt", "columns": {"conversations": "turns", "system": "persona"}}})
    assert spec.data.format == "sharegpt" and spec.data.columns == {"conversations": "turns", "system": "persona"}
    assert validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"}}).data.format == "auto"
    assert set(formats.COLUMN_KEYS) == {k for keys in formats.FORMAT_KEYS.values() for k in keys} | {"input", "system"}
