"""`bench/multi_policy_learning.py`'s reading of the runs: the sampled tokens so far at each
held-out evaluation (both policies' for the team), and the solo arm's pass@1 read at the team's
tokens, linear between its evaluations, flagged when its steps ran out first."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script


def write_metrics(run_dir, rows):
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_the_solo_arm_is_read_at_the_teams_sampled_tokens(tmp_path):
    bench = load_script("bench/multi_policy_learning.py")
    write_metrics(tmp_path / "team", [
        {"step": 0, "eval/team/final_correct": 0.1, "eval/team/first_correct": 0.1},
        {"step": 1, "solver/rollout/sampled_tokens": 100.0, "checker/rollout/sampled_tokens": 20.0,
         "checker/accuracy": 0.5, "checker/malformed": 0.0},
        {"step": 2, "solver/rollout/sampled_tokens": 100.0, "checker/rollout/sampled_tokens": 20.0,
         "checker/accuracy": 0.75, "checker/malformed": 0.0},
        {"step": 2, "eval/team/final_correct": 0.4, "eval/team/first_correct": 0.3}])
    write_metrics(tmp_path / "solo", [{"step": 0, "eval/pass_at_1": 0.1}]
                  + [{"step": i, "rollout/sampled_tokens": 80.0} for i in range(1, 5)]
                  + [{"step": 2, "eval/pass_at_1": 0.2}, {"step": 4, "eval/pass_at_1": 0.6}])
    team, solo = bench.read_run(tmp_path / "team", "team"), bench.read_run(tmp_path / "solo", "solo")
    assert team["sampled_tokens"] == 240.0 and [e["tokens"] for e in team["evals"]] == [0.0, 240.0]
    assert [r["checker/accuracy"] for r in team["train"]] == [0.5, 0.75]
    assert [(e["step"], e["tokens"]) for e in solo["evals"]] == [(0, 0.0), (2, 160.0), (4, 320.0)]
    after_sft = {"checker/accuracy": 0.5, "checker/malformed": 0.0}
    runs = {("team", 0): {**team, "after_sft": after_sft}, ("solo", 0): solo,
            ("team", 1): {**team, "after_sft": after_sft}, ("solo", 1): solo}
    summary = bench.summarize(runs, team_steps=2)
    first = summary["per_seed"][0]
    assert first["solo_at_team_tokens"] == pytest.approx(0.4)  # 240 tokens: halfway from 0.2 (160) to 0.6 (320)
    assert first["solo_at_team_steps"] == pytest.approx(0.2) and not first["solo_short_of_team_tokens"]
    assert (first["team_pass_at_1"], first["team_first_correct"]) == (0.4, 0.3)
    assert bench.pass_at(solo["evals"], "tokens", 400.0) == (0.6, True)  # past its last evaluation
    assert summary["stats"]["team_pass_at_1"] == {"mean": 0.4, "std": 0.0, "min": 0.4, "max": 0.4}
    assert "| solo: at the team's sampled tokens | 0.400 |" in bench.table(summary)
    lines = bench.per_seed_table(summary).splitlines()
    assert len({line.count("|") for line in lines}) == 1, lines  # a column per checker metric
    # Do both learn? Not known without the checker's balanced accuracy; known (and yes) with it.
    assert bench.both_learn(runs).splitlines()[2] == "| 0 | - | 0.100 -> 0.300 | no |"
    team["evals"][0]["checker/balanced_accuracy"], team["evals"][-1]["checker/balanced_accuracy"] = 0.6, 0.7
    both = bench.both_learn({("team", 0): team, ("solo", 0): solo}).splitlines()
    assert both[2] == "| 0 | 0.600 -> 0.700 | 0.100 -> 0.300 | yes |"
    assert both[-1] == "both policies improved in 1 of 1 seeds (held-out)"


@pytest.mark.parametrize("argv, message", [(["--solo-factor", "0.5"], "--solo-factor (0.5) must be >= 1"),
                                           (["--jobs", "0"], "--jobs (0) and --steps (16) must be >= 1")])
def test_a_bad_option_is_one_error_line(argv, message, capsys):
    bench = load_script("bench/multi_policy_learning.py")
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_the_checkers_verdicts_by_class_are_read_where_logged_and_derived_where_not(tmp_path, capsys):
    bench = load_script("bench/multi_policy_checker.py")
    # 10 first answers, 4 right (3 accepted) and 6 wrong (2 rejected): rejected 3 of 10
    old = {"team/first_correct": 0.4, "checker/balanced_accuracy": (0.75 + 2 / 6) / 2, "checker/rejected": 0.3}
    assert bench.verdict_rates(old) == pytest.approx((0.75, 2 / 6))
    assert bench.verdict_rates({**old, "checker/accepts_right": 1.0, "checker/rejects_wrong": 0.5}) == (1.0, 0.5)
    assert bench.verdict_rates({"team/first_correct": 0.4}) is None  # no class data: no point
    run = tmp_path / "run" / "team" / "seed0"
    write_metrics(run, [{"step": 0, **{f"eval/{k}": v for k, v in old.items()}},
                        {"step": 1, **old}, {"step": 2, "checker/accepts_right": 1.0, "checker/rejects_wrong": 0.5}])
    out = tmp_path / "plot.png"
    bench.main([str(tmp_path / "run"), "--labels", "both train", "--out", str(out)])
    assert "| both train | 0 | 0.75 (0) | 0.33 (0) |" in capsys.readouterr().out and out.stat().st_size > 0
    [seed] = bench.read_run(tmp_path / "run").values()
    assert [s for s, _, _ in seed["train"]] == [1, 2] and [s for s, _, _ in seed["eval"]] == [0]


def test_arms_run_apart_are_summarized_once_both_are_there(tmp_path, capsys):
    """``--arms team`` (e.g. a second config against the solo runs of a first): the team's records
    are written, the summary waits for the solo arm's runs, copied in; runs already done are never
    run again (no training here: every run has its results.json)."""
    bench = load_script("bench/multi_policy_learning.py")
    team_rows = [{"step": 0, "eval/team/final_correct": 0.1, "eval/team/first_correct": 0.1},
                 {"step": 1, "solver/rollout/sampled_tokens": 100.0, "checker/rollout/sampled_tokens": 20.0},
                 {"step": 1, "eval/team/final_correct": 0.4, "eval/team/first_correct": 0.3}]
    solo_rows = [{"step": 0, "eval/pass_at_1": 0.1}, {"step": 1, "rollout/sampled_tokens": 200.0},
                 {"step": 1, "eval/pass_at_1": 0.5}]
    start = {"start": {"team/final_correct": 0.1, "checker/accuracy": 0.5, "checker/malformed": 0.0}}
    argv = ["--seeds", "0", "--steps", "1", "--out", str(tmp_path)]
    write_metrics(tmp_path / "team" / "seed0", team_rows)
    (tmp_path / "team" / "seed0" / "results.json").write_text(json.dumps(start))
    bench.main(argv + ["--arms", "team"])
    assert "the summary needs solo seed 0 too" in capsys.readouterr().out
    assert (tmp_path / "team_seed0.json").exists() and not (tmp_path / "summary.json").exists()
    write_metrics(tmp_path / "solo" / "seed0", solo_rows)
    (tmp_path / "solo" / "seed0" / "results.json").write_text(json.dumps({"start": {"pass_at_1": 0.1}}))
    bench.main(argv)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["per_seed"][0]["solo_at_team_tokens"] == pytest.approx(0.1 + 0.4 * 120 / 200)
    assert (tmp_path / "learning.png").exists()


def test_a_variant_borrows_the_solo_runs_of_the_same_solo_config_only(tmp_path, capsys):
    bench = load_script("bench/multi_policy_learning.py")
    start = {"start": {"team/final_correct": 0.1, "checker/accuracy": 0.5, "checker/malformed": 0.0}}

    def fake_run(folder, arm):
        write_metrics(folder / arm / "seed0", [
            {"step": 0, "eval/team/final_correct": 0.1, "eval/team/first_correct": 0.1, "eval/pass_at_1": 0.1},
            {"step": 1, "solver/rollout/sampled_tokens": 100.0, "rollout/sampled_tokens": 200.0},
            {"step": 1, "eval/team/final_correct": 0.4, "eval/team/first_correct": 0.3, "eval/pass_at_1": 0.5}])
        (folder / arm / "seed0" / "results.json").write_text(json.dumps(start))

    base = tmp_path / "base"
    fake_run(base, "team"), fake_run(base, "solo")
    argv = ["--seeds", "0", "--steps", "1"]
    bench.main(argv + ["--out", str(base)])  # nothing runs (both are there); the records keep their Configs
    assert json.loads((base / "solo_seed0.json").read_text())["config"]["multi_policy"]["policies"] == []
    variant = tmp_path / "variant"  # another checker: the same solo arm
    fake_run(variant, "team")
    bench.main(argv + ["--out", str(variant), "--arms", "team", "--solo-from", str(base),
                       "--set", "multi_policy.checker_miscopied=0.5"])
    assert (variant / "summary.json").exists() and (variant / "solo" / "seed0" / "results.json").exists()
    other = tmp_path / "other"  # another solver: not the same solo arm
    fake_run(other, "team")
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--out", str(other), "--arms", "team", "--solo-from", str(base),
                           "--set", "optimizer.learning_rate=1e-3"])
    assert "its solo seed 0 trained another Config (sections ['optimizer'] differ" in str(e.value)
    assert not (other / "solo").exists()
    # a run done before counts only for the Config it trained: another --set into the same --out is an error
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--out", str(base), "--set", "optimizer.learning_rate=1e-3"])
    assert "its team seed 0 trained another Config (sections ['optimizer'] differ); use another --out" in str(e.value)
    with pytest.raises(SystemExit):  # a folder without solo runs
        bench.main(argv + ["--out", str(other), "--arms", "team", "--solo-from", str(tmp_path / "nowhere")])
    assert "--solo-from " + str(tmp_path / "nowhere") + ": no solo runs there" in capsys.readouterr().err
