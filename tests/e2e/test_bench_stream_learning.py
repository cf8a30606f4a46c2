"""bench/stream_learning.py: every arm loads with both recipes (the stream colocated on one GPU with
the SmolLM2 tool recipe), and its summary / table from run directories written here."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script

from agentrl_jax.config import load_config

bench = load_script("bench/stream_learning.py")


@pytest.mark.parametrize("recipe", ["demo", "smollm2"])
def test_every_arm_loads_with_the_recipe(recipe, tmp_path):
    extra = [f"model.path={tmp_path / 'SmolLM2-135M-Instruct.Q4_1.gguf'}"] if recipe == "smollm2" else []
    bench.check_arms(bench.RECIPES[recipe], list(bench.ARMS), extra)
    stream = load_config(str(bench.ROOT / bench.RECIPES[recipe]), [*extra, *bench.ARMS["stream1"]])
    assert stream.async_rl.mode == "stream" and stream.async_rl.placement == "colocated"
    assert stream.mesh.fsdp == -1 and stream.mesh.data == stream.mesh.tensor == 1  # whatever devices there are: one
    assert bench.DEFAULT_ARMS[recipe][0] == bench.BASELINE


def test_an_arm_the_checkout_cannot_run_fails_before_anything_starts():
    with pytest.raises(SystemExit, match=r"arm 'stream1' .* cannot run with this checkout: async_rl.offload_optimizer"):
        bench.check_arms(bench.RECIPES["demo"], ["stream1"], ["async_rl.offload_optimizer=true"])


def _fake_run(run_dir, start, end, tool_use, curve, staleness=None):
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({
        "start": {"pass_at_1": start, "tool_use_rate": 0.5}, "end": {"pass_at_1": end, "tool_use_rate": tool_use},
        "rl_seconds": 100.0}))
    rows = [{"step": 0, "eval/pass_at_1": start}]
    for step, acc in enumerate(curve, 1):
        rows.append({"step": step, "reward/correct": acc, "loss": 0.1,
                     **({"stream/last_token_staleness_mean": staleness} if staleness is not None else {})})
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_summary_pairs_each_seed_with_the_synchronous_run(tmp_path):
    ends = {"sync": (0.50, 0.30, 0.80), "stream2": (0.46, 0.25, 0.78)}
    for arm, values in ends.items():
        for seed, end in enumerate(values):
            _fake_run(tmp_path / arm / f"seed{seed}", 0.2, end, 0.9 + seed / 100, [0.1, 0.2, 0.3],
                      staleness=1.9 if arm != "sync" else None)
    (tmp_path / "stream1" / "seed0").mkdir(parents=True)  # a run that did not finish: left out
    summary = bench.summarize(tmp_path, ["sync", "stream1", "stream2"], [0, 1, 2])
    assert list(summary["arms"]) == ["sync", "stream2"]
    paired = summary["arms"]["stream2"]["paired"]
    assert paired["diffs"] == pytest.approx([-0.04, -0.05, -0.02])
    assert paired["mean_sd"][0] == pytest.approx(-0.11 / 3) and paired["losses"] == 3 and paired["p"] == 0.25
    assert summary["arms"]["sync"]["end_tool_use_rate"][0] == pytest.approx(0.91)
    assert json.loads((tmp_path / "stream2" / "seed1.json").read_text())["steps"] == {
        "stream/last_token_staleness_mean": pytest.approx(1.9)}
    table = bench.table_markdown(summary)
    assert "| stream2 | 1 | 0.200 | 0.250 | 0.910 | -0.050 | 1.90 | 100 |" in table
    assert "-0.037 ± 0.015 (0/3 wins/losses, p 0.250)" in table
    bench.plot(summary, tmp_path / "learning.png")
    assert (tmp_path / "learning.png").stat().st_size > 0


def test_gpu_jobs_spread_over_cards_with_the_memory_split_per_card(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = [bench.child_env("smollm2", 6, None, slot % 2, 2) for slot in range(6)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"] * 3
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs} == {"0.3"}  # 3 runs per card
    one_card = bench.child_env("smollm2", 3, None, 0, 1)
    assert "CUDA_VISIBLE_DEVICES" not in one_card and one_card["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3"


def test_no_gpus_is_one_error_line(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--recipe", "smollm2", "--gpus", "0"])
    assert "--jobs (1) and --gpus (0) must be >= 1" in capsys.readouterr().err
