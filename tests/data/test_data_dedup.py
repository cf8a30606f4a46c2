"""Repeated rows, case-insensitive column names, and the skip counts in the run's metrics."""

import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.data import DataError, load_sft_records, load_task_records
from agentrl_jax.train import setup
from agentrl_jax.train.metrics import MetricsWriter, read_tensorboard


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dapo_row(question, truth, index):
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": question}],
            "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": {"index": index}}


def test_repeats_are_dropped_and_counted_by_default(tmp_path, caplog):
    # DAPO-Math-17k shape: every problem repeated; one repeat differs only in whitespace, one in the answer.
    rows = [dapo_row(f"Problem {i}.", str(i), f"id-{i}-{copy}") for copy in range(4) for i in range(3)]
    rows.append(dapo_row("Problem  1.\n", "1", "spaced"))
    rows.append(dapo_row("Problem 2.", "3", "conflict"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.data.readers"):
        records, stats = load_task_records(tmp_path / "dapo.parquet", format="dapo_math")
    assert [(r.prompt, r.answer, r.id) for r in records] == [
        ("Problem 0.", "0", "id-0-0"), ("Problem 1.", "1", "id-1-0"), ("Problem 2.", "2", "id-2-0")]
    assert (stats.rows_read, stats.rows_kept, stats.rows_bad) == (14, 3, 0)
    assert stats.dropped_by_reason == {"duplicate": 10, "conflicting_answer": 1}
    assert "dapo.parquet:14: dropped (conflicting_answer)" in caplog.text
    assert "dapo.parquet:3 but answer '3' instead of '2'" in caplog.text
    assert stats.as_metrics(prefix="data/train/") == {
        "data/train/rows_read": 14, "data/train/rows_kept": 3, "data/train/rows_skipped": 11,
        "data/train/skipped/duplicate": 10, "data/train/skipped/conflicting_answer": 1}
    everything, kept_all = load_task_records(tmp_path / "dapo.parquet", format="dapo_math", deduplicate=False)
    assert len(everything) == 14 and kept_all.rows_dropped == 0


def test_sft_duplicates_are_exact_conversations(tmp_path):
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    spaced = [{"role": "user", "content": "q "}, {"role": "assistant", "content": "a"}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": conversation}, {"messages": spaced},
                                                 {"messages": conversation}])
    records, stats = load_sft_records(path)
    assert len(records) == 2 and stats.dropped_by_reason == {"duplicate": 1}


def test_capitalized_column_names_load(tmp_path):
    # Maxwell-Jia/AIME_2024 spells its columns ID / Problem / Solution / Answer.
    aime = [{"ID": "2024-I-1", "Problem": "P1", "Solution": "long", "Answer": 204},
            {"ID": "2024-I-2", "Problem": "P2", "Solution": "s", "Answer": 25}]
    pq.write_table(pa.Table.from_pylist(aime), tmp_path / "aime.parquet")
    write_jsonl(tmp_path / "aime.jsonl", aime)
    for name in ("aime.parquet", "aime.jsonl"):
        records, stats = load_task_records(tmp_path / name, format="aime")
        assert [(r.prompt, r.answer, r.id) for r in records] == [("P1", "204", "2024-I-1"), ("P2", "25", "2024-I-2")]
        assert records[0].metadata == {"Solution": "long"} and stats.rows_bad == 0
    tasks, _ = load_task_records(write_jsonl(tmp_path / "t.jsonl", [{"Prompt": "q", "ANSWER": "1", "Id": 7}]))
    assert (tasks[0].prompt, tasks[0].answer, tasks[0].id) == ("q", "1", "7")
    nested = [{"Prompt": [{"Role": "user", "Content": "Find x."}], "Reward_Model": {"Ground_Truth": "5"},
               "Extra_Info": {"Index": "k"}, "Data_Source": "dapo"}]
    pq.write_table(pa.Table.from_pylist(nested), tmp_path / "dapo.parquet")
    dapo, _ = load_task_records(tmp_path / "dapo.parquet", format="dapo_math")
    assert (dapo[0].prompt, dapo[0].answer, dapo[0].id, dapo[0].metadata) == ("Find x.", "5", "k",
                                                                               {"data_source": "dapo"})
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"Messages": [{"Role": "user", "Content": "q"},
                                                            {"ROLE": "assistant", "content": "a"}]}])
    conversations, _ = load_sft_records(sft)
    assert [(m.role, m.content) for m in conversations[0].messages] == [("user", "q"), ("assistant", "a")]


def test_columns_that_differ_only_in_case_are_an_error_naming_them(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"Problem": "P", "Answer": "1", "answer": "2"}]), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: columns 'Answer' and 'answer' differ only in case"):
        load_task_records(tmp_path / "a.parquet", format="aime")
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"problem": "P1", "answer": "1"},
        {"problem": "P2", "Answer": "1", "answer": "2"},
        {"problem": "P3", "answer": "3", "reward_model": {"ground_truth": "3"}},
    ])
    records, stats = load_task_records(path, format="aime")
    assert [r.prompt for r in records] == ["P1", "P3"]
    assert stats.bad_by_reason == {"ambiguous_field:answer": 1}
    assert "keys 'Answer' and 'answer' differ only in case" in stats.examples[0]
    nested = write_jsonl(tmp_path / "n.jsonl", [
        {"prompt": "q", "reward_model": {"ground_truth": "1", "Ground_Truth": "2"}}])
    with pytest.raises(DataError, match=r"reward_model.ground_truth.*'Ground_Truth', 'ground_truth' differ only"):
        load_task_records(nested, format="dapo_math")


def test_metric_reasons_are_tensorboard_tag_safe():
    from agentrl_jax.data.readers import metric_reason

    assert metric_reason("missing_field:prompt") == "missing_field/prompt"
    assert metric_reason("wrong_type:<row>") == "wrong_type/row"
    assert metric_reason("empty:messages[1].content") == "empty/messages_1.content"
    assert metric_reason("unsupported_field:messages[0].tool_calls") == "unsupported_field/messages_0.tool_calls"


def _task_config(tmp_path, *overrides):
    train = [dapo_row(f"Q{i}", str(i), f"t{i}") for i in range(6)] * 3  # 6 problems, each 3 times
    train.append(dapo_row("AIME problem 1", "7", "leak"))                # an eval problem in the train set
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    write_jsonl(tmp_path / "eval.jsonl", [{"ID": 1, "Problem": "AIME  problem 1", "Answer": 7},
                                          {"ID": 2, "Problem": "AIME problem 2", "Answer": 8},
                                          {"ID": 3, "Problem": "AIME problem 2", "Answer": 8},
                                          {"ID": 4, "Problem": "", "Answer": 1}])
    return load_config("retool", ["model.path=m", f"data.train_path={tmp_path / 'train.parquet'}",
                                  f"data.eval_path={tmp_path / 'eval.jsonl'}", *overrides])


def test_task_counts_reach_metrics_jsonl_and_tensorboard(tmp_path):
    train, held_out, stats = setup.load_task_data(_task_config(tmp_path))
    assert [t["question"] for t in train] == [f"Q{i}" for i in range(6)]
    assert [t["question"] for t in held_out] == ["AIME  problem 1", "AIME problem 2"]
    console = io.StringIO()
    with MetricsWriter(tmp_path / "metrics", total_steps=10, console=console) as writer:
        writer.write(0, setup.data_metrics(stats), timed=False)
        writer.write(1, {"loss": 1.0})
        # a record written before the steps run prints no progress line and is not a step for the ETA
        assert console.getvalue() == "step 1/10 (10%) | - s/step | eta ? | loss 1\n"
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["step"] == 0
    expected = {"data/train/rows_read": 19, "data/train/rows_kept": 6, "data/train/rows_skipped": 13,
                "data/train/skipped/duplicate": 12, "data/train/skipped/eval_overlap": 1,
                "data/eval/rows_read": 4, "data/eval/rows_kept": 2, "data/eval/rows_skipped": 2,
                "data/eval/skipped/duplicate": 1, "data/eval/skipped/empty/problem": 1}
    assert {k: v for k, v in rows[0].items() if k.startswith("data/")} == expected
    tensorboard = read_tensorboard(tmp_path / "metrics")
    assert {k: v for k, v in tensorboard.items() if k.startswith("data/")} == {
        k: [(0, float(v))] for k, v in expected.items()}


def test_eval_overlap_can_be_kept_and_deduplication_turned_off(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.train.setup"):
        train, held_out, stats = setup.load_task_data(
            _task_config(tmp_path, "data.drop_eval_overlap=false", "data.deduplicate=false"))
    assert len(train) == 19 and len(held_out) == 3
    assert stats["train"].rows_dropped == 0 and stats["eval"].rows_bad == 1
    assert setup.data_metrics(stats)["data/train/flagged/eval_overlap"] == 1
    assert stats["train"].summary() == "kept 19/19 rows; skipped 0; kept but flagged: eval_overlap=1"
    assert "1 training tasks have the prompt of an eval task" in caplog.text and "contaminated" in caplog.text
    eval_only = tmp_path / "only"
    eval_only.mkdir()
    write_jsonl(eval_only / "t.jsonl", [{"problem": "P", "answer": "1"}])
    config = load_config("retool", ["model.path=m", "data.format=aime", f"data.train_path={eval_only / 't.jsonl'}",
                                    f"data.eval_path={eval_only / 't.jsonl'}"])
    with pytest.raises(ConfigError, match="every training task also appears in data.eval_path"):
        setup.load_task_data(config)
