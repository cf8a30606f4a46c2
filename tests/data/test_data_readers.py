"""Reading task / SFT files: bad rows are counted, logged with file:line, never fatal."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl_jax.data import DataError, load_sft_records, load_task_records


def write_jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_task_jsonl_counts_and_reports_each_bad_row(tmp_path, caplog):
    path = write_jsonl(tmp_path / "tasks.jsonl", [
        {"prompt": "1+1?", "answer": "2", "id": "a", "metadata": {"level": 1}},
        {"prompt": "2+2?"},                                   # line 2: missing answer
        {"prompt": 7, "answer": "7"},                         # line 3: wrong type
        {"prompt": "   ", "answer": "0"},                     # line 4: empty prompt
        '{"prompt": "broken", ',                              # line 5: unparsable
        "",                                                   # blank: not a row
        {"prompt": "3*3?", "answer": 9},                      # line 7: int answer is fine
        [1, 2],                                               # line 8: not an object
    ])
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.data.readers"):
        records, stats = load_task_records(path)
    assert [(r.prompt, r.answer, r.id) for r in records] == [("1+1?", "2", "a"), ("3*3?", "9", "tasks.jsonl:7")]
    assert records[0].metadata == {"level": 1}
    assert stats.rows_read == 7 and stats.rows_kept == 2 and stats.rows_bad == 5
    assert stats.bad_by_reason == {"missing_field:answer": 1, "wrong_type:prompt": 1, "empty:prompt": 1,
                                   "unparsable_json": 1, "wrong_type:<row>": 1}
    text = caplog.text
    for line in (2, 3, 4, 5, 8):
        assert f"tasks.jsonl:{line}" in text
    assert '{"prompt": "broken", ' in text  # the raw line is shown verbatim
    assert "kept 2/7 rows" in text
    metrics = stats.as_metrics()
    assert metrics["data/rows_skipped"] == 5 and metrics["data/skipped/empty/prompt"] == 1
    assert metrics["data/skipped/wrong_type/row"] == 1 and metrics["data/skipped/unparsable_json"] == 1


def test_only_first_examples_logged_verbatim_but_all_counted(tmp_path, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ok", "answer": "1"}] + [{"answer": "1"}] * 20)
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.data.readers"):
        _, stats = load_task_records(path, max_examples=3)
    assert stats.bad_by_reason["missing_field:prompt"] == 20
    assert sum("skipped bad row" in r.message for r in caplog.records) == 3


def test_file_with_only_bad_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"title": "x"}, "not json"])
    with pytest.raises(DataError, match=r"bad.jsonl: no usable rows out of 2.*missing_field:prompt"):
        load_task_records(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_task_records(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="matches no file"):
        load_task_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="known formats"):
        load_task_records(tmp_path / "bad.jsonl", format="nope")


def test_parquet_directory_and_glob(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i), "metadata": None} for i in range(5)]
    rows[3]["prompt"] = ""
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "part-0.parquet")
    write_jsonl(tmp_path / "part-1.jsonl", [{"prompt": "q9", "answer": "9"}])
    records, stats = load_task_records(tmp_path)
    assert [r.prompt for r in records] == ["q0", "q1", "q2", "q4", "q9"]
    assert records[0].id == "part-0.parquet:1"
    assert stats.bad_by_reason == {"empty:prompt": 1}
    records_glob, _ = load_task_records(str(tmp_path / "*.parquet"))
    assert len(records_glob) == 4


def test_sft_chat_validation(tmp_path):
    good = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "<code>1</code>"}, {"role": "tool", "content": ""},
                         {"role": "assistant", "content": "done"}], "id": 3}
    path = write_jsonl(tmp_path / "sft.jsonl", [
        good,
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"messages": "hello"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                          "tool_calls": [{"x": 1}]}]},
    ])
    records, stats = load_sft_records(path)
    assert len(records) == 1 and records[0].id == "3"
    assert [m.role for m in records[0].messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert stats.bad_by_reason == {"bad_role:messages[0].role": 1, "no_assistant:messages": 1,
                                   "empty:messages[1].content": 1, "wrong_type:messages": 1,
                                   "unsupported_field:messages[1].tool_calls": 1}
