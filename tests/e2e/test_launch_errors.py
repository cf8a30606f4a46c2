"""Mistakes only the run can find print one ``config error:`` line through the real launcher.

A setting the config loader cannot check (what a data file holds, whether model.path is a
checkpoint, whether the mesh fits the devices) used to end in a traceback; the launcher
prints it as it prints a load-time mistake, naming the key, and exits with status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "data.prompts_per_step=2", "algorithm.group_size=4", "sft.steps=2",
    "sft.batch_size=4", "total_steps=1",
]


def _question_answer_files(tmp_path: Path) -> list[str]:
    """A user's question/answer dataset (GSM8K's field names), train and eval."""
    for split, numbers in (("train", range(8)), ("eval", range(8, 10))):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"Tom has {n} apples and buys 2. How many now?", "answer": f"#### {n + 2}"})
            + "\n" for n in numbers))
    return [f"data.train_path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}"]


def _launch(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py"]
    for item in [f"output_dir={tmp_path / 'run'}", *TINY, *overrides]:
        cmd += ["--set", item]
    # os.environ carries the 8 fake devices of tests/conftest.py
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)


def _arithmetic_on_question_answer_data(tmp_path):
    return _question_answer_files(tmp_path), (
        "config error: data.train_path: environment.name='arithmetic' writes its SFT demonstrations from the "
        "operands of its generated tasks (fields a, b, op, digits), but task 'train.jsonl:1' has ['answer', 'id', "
        "'question']; for question/answer data use --set environment.name=retool")


def _missing_data_path(tmp_path):
    return [f"data.train_path={tmp_path / 'missing.jsonl'}", f"data.eval_path={tmp_path / 'missing.jsonl'}"], (
        f"config error: data.train_path: data path '{tmp_path / 'missing.jsonl'}' matches no file")


def _model_path_without_config_json(tmp_path):
    (tmp_path / "not_a_checkpoint").mkdir()
    return [*_question_answer_files(tmp_path), "environment.name=retool", "sft.steps=0",
            f"model.path={tmp_path / 'not_a_checkpoint'}"], (
        f"config error: model.path: '{tmp_path / 'not_a_checkpoint'}' has no config.json")


def _mesh_that_does_not_divide_the_devices(tmp_path):
    """Reported before the data and the model are read: this data path and model.path are
    mistakes too, found only later."""
    (tmp_path / "not_a_checkpoint").mkdir()
    return ["mesh.data=3", f"data.train_path={tmp_path / 'missing.jsonl'}",
            f"data.eval_path={tmp_path / 'missing.jsonl'}", f"model.path={tmp_path / 'not_a_checkpoint'}"], (
        "config error: mesh: 8 devices are not divisible by the fixed axes {'data': 3, 'fsdp': -1, 'tensor': 1}")


@pytest.mark.parametrize("case", [_arithmetic_on_question_answer_data, _missing_data_path,
                                  _model_path_without_config_json, _mesh_that_does_not_divide_the_devices],
                         ids=lambda case: case.__name__.strip("_"))
def test_a_mistake_found_by_the_run_is_one_config_error_line(tmp_path, case):
    overrides, message = case(tmp_path)
    proc = _launch(tmp_path, overrides)
    assert proc.returncode == 2, f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(message), last_line


@pytest.mark.parametrize("flags, message", [
    (["--local-device-ids", "0,x", "--distributed"],
     "error: --local-device-ids '0,x': expected integers separated by commas"),
    (["--local-device-ids", "0,1"],
     "error: --local-device-ids applies to jax.distributed: pass --coordinator or --distributed too"),
])
def test_a_bad_local_device_list_is_one_error_line(flags, message):
    """Checked before jax.distributed starts, so it needs no coordinator."""
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == message, proc.stderr[-2000:]
