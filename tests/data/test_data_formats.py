"""Public dataset shapes: DAPO-Math-17k, AIME-style eval files, ReTool-SFT (raw and converted)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl_jax.data import (
    BadRowError,
    load_sft_records,
    load_task_records,
    parse_retool_sft_row,
    split_interpreter_blocks,
    strip_dapo_instruction,
)

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "Find $x$ if $2x = 10$.\n\nRemember to put your answer on its own line after \"Answer:\"."
)


def dapo_row(prompt=DAPO_PROMPT, truth="5", index="abc-1"):
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": prompt}], "ability": "MATH",
            "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


def test_dapo_math_parquet_nested_rows(tmp_path):
    rows = [dapo_row(), dapo_row(truth=None, index="abc-2"), dapo_row(prompt="Compute 3+4.", index="abc-3")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    records, stats = load_task_records(tmp_path / "dapo.parquet", format="dapo_math")
    assert [(r.prompt, r.answer, r.id) for r in records] == [
        ("Find $x$ if $2x = 10$.", "5", "abc-1"), ("Compute 3+4.", "5", "abc-3")]
    assert records[0].metadata == {"data_source": "math_dapo", "ability": "MATH"}
    assert stats.bad_by_reason == {"missing_field:reward_model.ground_truth": 1}
    kept, _ = load_task_records(tmp_path / "dapo.parquet", format="dapo_math", strip_instruction=False)
    assert kept[0].prompt == DAPO_PROMPT


def test_dapo_flattened_copy_and_strip_is_exact():
    assert strip_dapo_instruction(DAPO_PROMPT) == "Find $x$ if $2x = 10$."
    assert strip_dapo_instruction("No wrapper here.") == "No wrapper here."
    from agentrl_jax.data import parse_dapo_math_row
    record = parse_dapo_math_row({"prompt": DAPO_PROMPT, "label": "5"}, "f:1")
    assert (record.prompt, record.answer, record.id) == ("Find $x$ if $2x = 10$.", "5", "f:1")
    with pytest.raises(BadRowError, match="no user message"):
        parse_dapo_math_row({"prompt": [{"role": "system", "content": "x"}], "label": "1"}, "f:2")


def test_aime_variants(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"ID": "2024-I-1", "problem": "P1", "answer": 204, "year": 2024, "solution": "long"},
        {"question": "P2", "answer": "033"},
        {"prompt": "P3", "label": "7", "id": 3},
        {"problem": "P4", "answer": True},
        {"problem": "P5"},
    ]))
    records, stats = load_task_records(path, format="aime")
    assert [(r.prompt, r.answer, r.id) for r in records] == [
        ("P1", "204", "2024-I-1"), ("P2", "033", "aime.jsonl:2"), ("P3", "7", "3")]
    assert records[0].metadata == {"year": 2024, "solution": "long"}
    assert stats.bad_by_reason == {"wrong_type:answer": 1, "missing_field:answer": 1}


def test_task_rows_under_the_common_field_names(tmp_path):
    """GSM8K, MATH-style and seq2seq rows load with the default task format; the first name
    present wins, a GSM8K answer becomes its final answer, and a worked solution is no answer."""
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all: 48+24 = <<48+24=72>>72.\n#### 72"},
        {"question": "How many #### marks?", "answer": "#### 4"},
    ]))
    records, stats = load_task_records(tmp_path / "gsm8k.jsonl")
    assert [(r.prompt[:14], r.answer) for r in records] == [("Natalia sold 4", "72"), ("How many #### ", "4")]
    assert stats.rows_kept == 2
    pq.write_table(pa.Table.from_pylist([{"Problem": "Find x if 2x = 10.", "Final_Answer": "5", "level": 3}]),
                   tmp_path / "math.parquet")
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"input": "1+2", "target": 3},
        {"prompt": "P", "question": "Q", "answer": "keep the prompt"},
        {"problem": "MATH row", "solution": "so the answer is \\boxed{4}"},
        {"text": "no prompt", "answer": "1"},
    ]))
    records, stats = load_task_records([tmp_path / "math.parquet", tmp_path / "mixed.jsonl"])
    assert [(r.prompt, r.answer) for r in records] == [
        ("Find x if 2x = 10.", "5"), ("1+2", "3"), ("P", "keep the prompt")]
    assert stats.bad_by_reason == {"missing_field:answer": 1, "missing_field:prompt": 1}


RETOOL_PROMPT = ("Solve the following problem step by step. You now have the ability to selectively write "
                 "executable Python code ...\n\n*user question:*\nWhat is 17 * 23?\n\n"
                 "Remember to place the final answer in the last part using the format: \n<answer>\n"
                 "\\boxed{'The final answer goes here.'}\n</answer>")
RETOOL_RESPONSE = ("Let me compute it.\n<code>\n```python\nprint(17 * 23)\n```\n</code>\n"
                   "<interpreter>\n391\n</interpreter>\n\nCheck again.\n<code>\n```python\nprint(391 // 17)\n"
                   "```\n</code>\n<interpreter>\n23\n</interpreter>\n\n<answer>\n\\boxed{391}\n</answer>")


def test_retool_sft_raw_split_is_lossless(tmp_path):
    row = {"messages": [{"role": "user", "content": RETOOL_PROMPT},
                        {"role": "assistant", "content": RETOOL_RESPONSE}]}
    pq.write_table(pa.Table.from_pylist([row, {"messages": [{"role": "user", "content": "q"},
                                                            {"role": "assistant", "content": "<interpreter>x"}]}]),
                   tmp_path / "retool.parquet")
    records, stats = load_sft_records(tmp_path / "retool.parquet", format="retool_sft")
    assert stats.bad_by_reason == {"malformed:messages[1].content": 1}
    messages = records[0].messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert "".join(m.content for m in messages[1:]) == RETOOL_RESPONSE
    assert messages[2].content == "<interpreter>\n391\n</interpreter>"
    assert messages[1].content.endswith("</code>\n")
    assert messages[0].content == RETOOL_PROMPT
    short = parse_retool_sft_row(row, "x", question_only=True)
    assert short.messages[0].content == "What is 17 * 23?"


def test_retool_sft_converted_tool_calls():
    row = {"messages": [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "Let me compute it.",
         "tool_calls": [{"type": "function", "function": {"name": "code_interpreter",
                                                          "arguments": json.dumps({"code": "print(17 * 23)"})}}]},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": "\\boxed{391}"}]}
    record = parse_retool_sft_row(row, "x")
    assert [m.role for m in record.messages] == ["user", "assistant", "tool", "assistant"]
    assert record.messages[1].content == "Let me compute it.\n<code>\n```python\nprint(17 * 23)\n```\n</code>\n"
    assert record.messages[2].content == "<interpreter>\n391\n</interpreter>\n"
    bad = dict(row, messages=row["messages"][:1] + [dict(row["messages"][1], tool_calls=[{"function": {}}])])
    with pytest.raises(BadRowError, match=r"tool_calls\[0\]\.function\.arguments"):
        parse_retool_sft_row(bad, "x")


def test_split_interpreter_blocks_errors():
    with pytest.raises(BadRowError, match="without a matching"):
        split_interpreter_blocks("a </interpreter> b", "f")
    assert [m.role for m in split_interpreter_blocks("<interpreter>1</interpreter>tail", "f")] == ["tool", "assistant"]


def test_deduplicate_counts_repeats_across_files(tmp_path):
    rows = [dapo_row(index="a"), dapo_row(index="b"), dapo_row(prompt="Compute 3+4.", truth="7", index="c")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "1.parquet")  # a file of repeats only: not an error
    records, stats = load_task_records(tmp_path, format="dapo_math")  # deduplication is the default
    assert [r.id for r in records] == ["a", "c"]
    assert (stats.rows_read, stats.rows_kept, stats.rows_dropped, stats.rows_bad) == (4, 2, 2, 0)
    assert stats.dropped_by_reason == {"duplicate": 2}
    assert "skipped 2 (duplicate=2)" in stats.summary()
    all_records, _ = load_task_records(tmp_path, format="dapo_math", deduplicate=False)
    assert len(all_records) == 4
