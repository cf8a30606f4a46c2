"""`bench/critic_compare.py summary` on runs written here: the table's means, sample sds, token
totals and steady-state step times are the ones of the files (the GPU comparison is read from it)."""

from __future__ import annotations

import json

from repo_scripts import load_script


def _write_run(run_dir, start, end, steps, peak, explained=None):
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({"start": {"pass_at_1": start}, "end": {"pass_at_1": end}}))
    rows = [{"step": 0, "eval/pass_at_1": start}]
    for i, (seconds, tokens) in enumerate(steps, start=1):
        row = {"step": i, "time/step": seconds, "rollout/sampled_tokens": tokens, "reward/mean": 0.1 * i}
        if explained is not None:
            row["critic/explained_variance"] = explained
        rows.append(row)
    (run_dir / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run_dir / "memory.json").write_text(json.dumps({"peak_gib": peak, "kind": "device"}))


def test_the_summary_reads_every_seed_of_every_arm(tmp_path):
    bench = load_script("bench/critic_compare.py")
    _write_run(tmp_path / "grpo" / "seed0", 0.2, 0.8, [(9.0, 100), (1.0, 100), (3.0, 100)], 1.0)
    _write_run(tmp_path / "grpo" / "seed1", 0.4, 0.6, [(9.0, 50), (2.0, 50), (2.0, 50)], 3.0)
    _write_run(tmp_path / "ppo1" / "seed0", 0.2, 0.5, [(9.0, 10), (4.0, 10), (6.0, 10)], 2.0, explained=0.25)
    lines = bench.summary(tmp_path, ["grpo", "ppo1"], ["0", "1"])
    grpo, ppo1 = lines[2].split(" | "), lines[3].split(" | ")
    # pass@1 0.2/0.4 and 0.8/0.6: mean +- sample sd; tokens 300/150; median of steps 2..3: 2.0 both
    assert grpo[1:7] == ["2/2", "0.300 +- 0.141", "0.700 +- 0.141", "225 +- 106", "2.00 +- 0.00",
                         "2.00 +- 1.41 (device)"]
    assert grpo[7] == "- |"
    assert ppo1[1:8] == ["1/2", "0.200", "0.500", "30", "5.00", "2.00 (device)", "0.250 |"]
    bench.plot(tmp_path, ["grpo", "ppo1"], ["0", "1"], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
