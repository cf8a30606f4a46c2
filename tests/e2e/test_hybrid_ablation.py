"""bench/hybrid_ablation.py (docs/hybrid.md): its statistics, its table from run directories, its
preflight, and (slow) the documented end-to-end check of 1 seed x 2 arms x 3 steps."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


ablation = load_script("bench/hybrid_ablation.py")


def test_steps_to_threshold_uses_the_trailing_window():
    assert ablation.steps_to_threshold([0.0, 0.9, 0.9, 0.0, 0.6], threshold=0.5, window=3) == 3
    assert ablation.steps_to_threshold([0.2, 0.4, 0.6, 0.6, 0.6], threshold=0.5, window=3) == 4
    assert ablation.steps_to_threshold([0.9, 0.9], threshold=0.5, window=3) is None  # not enough steps
    assert ablation.steps_to_threshold([0.1] * 30, threshold=0.5, window=3) is None


def test_sign_flip_p_against_brute_force_numpy():
    rng = np.random.default_rng(0)
    for n in (3, 5):
        d = rng.normal(0.05, 0.1, n)
        signs = np.array(list(itertools.product((1, -1), repeat=n)))
        want = np.mean(np.abs((signs * d).mean(axis=1)) >= abs(d.mean()) - 1e-12)
        assert ablation.sign_flip_p(list(d)) == pytest.approx(want)
    assert ablation.sign_flip_p([0.1, 0.2, 0.3, 0.1, 0.2]) == pytest.approx(2 / 32)  # all wins: the floor


def _fake_run(path: Path, start: float, end: float, curve: list[float], seconds: float = 10.0):
    (path / "metrics").mkdir(parents=True)
    rows = [{"step": 0, "eval/pass_at_1": start}]
    rows += [{"step": s, "reward/mean": c, "reward/correct": c, "rollout/all_equal_groups": 0.5}
             for s, c in enumerate(curve, 1)]
    (path / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (path / "results.json").write_text(json.dumps({"start": {"pass_at_1": start}, "end": {"pass_at_1": end},
                                                   "rl_seconds": seconds}))


def test_summary_table_and_plot_from_run_directories(tmp_path):
    finals = {"grpo": [0.2, 0.3, 0.1], "hybrid_lam0.3": [0.4, 0.3, 0.3]}
    for arm, values in finals.items():
        for seed, end in enumerate(values):
            curve = list(np.linspace(0.1, end + 0.3, 6))
            _fake_run(tmp_path / f"seed{seed}" / arm, 0.1, end, curve)
    summary = ablation.summarize(tmp_path, [0, 1, 2], ["grpo", "hybrid_lam0.3"])
    hybrid = summary["arms"]["hybrid_lam0.3"]
    assert hybrid["final_mean_sd"][0] == pytest.approx(np.mean(finals["hybrid_lam0.3"]))
    assert hybrid["final_mean_sd"][1] == pytest.approx(np.std(finals["hybrid_lam0.3"], ddof=1))
    diffs = np.subtract(finals["hybrid_lam0.3"], finals["grpo"])
    assert hybrid["paired"]["diff_mean_sd"][0] == pytest.approx(diffs.mean())
    assert (hybrid["paired"]["wins"], hybrid["paired"]["losses"]) == (2, 0)
    assert "paired" not in summary["arms"]["grpo"]
    table = ablation.table_markdown(summary)
    assert "| hybrid_lam0.3 | 3 | 0.100 | 0.333 ± 0.058 |" in table
    ablation.plot(summary, tmp_path / "ablation.png")
    assert (tmp_path / "ablation.png").stat().st_size > 10_000


def test_decision_rule_and_the_hint_content_comparison(tmp_path):
    assert ablation.decision({"diff_mean_sd": (0.01, 0.1), "wins": 4}, 5)
    assert not ablation.decision({"diff_mean_sd": (0.01, 0.1), "wins": 3}, 5)  # 4 of 5 wins needed
    assert not ablation.decision({"diff_mean_sd": (-0.01, 0.1), "wins": 4}, 5)
    assert not ablation.decision(None, 5)
    finals = {"grpo": [0.2, 0.2, 0.2, 0.2, 0.2], "hybrid_lam0.3": [0.3, 0.3, 0.3, 0.3, 0.1],
              "placebo": [0.1, 0.2, 0.2, 0.2, 0.2]}
    for arm, values in finals.items():
        for seed, end in enumerate(values):
            _fake_run(tmp_path / f"seed{seed}" / arm, 0.1, end, [0.1, 0.2, 0.3])
    summary = ablation.summarize(tmp_path, list(range(5)), list(finals))
    content = summary["content"]
    assert (content["wins"], content["losses"]) == (4, 1)
    assert content["diff_mean_sd"][0] == pytest.approx(np.mean(np.subtract(finals["hybrid_lam0.3"], finals["placebo"])))
    table = ablation.table_markdown(summary)
    assert "Decision (docs/hybrid.md): helps: hybrid_lam0.3; the hint content helps." in table


def test_steps_to_the_grpo_runs_final_training_accuracy(tmp_path):
    curves = {"grpo": [[0.2, 0.4, 0.6, 0.6, 0.6], [0.1, 0.1, 0.3, 0.5, 0.7]],
              "hybrid_lam0.3": [[0.6, 0.6, 0.6, 0.7, 0.7], [0.1, 0.1, 0.1, 0.1, 0.2]]}
    for arm, per_seed in curves.items():
        for seed, curve in enumerate(per_seed):
            _fake_run(tmp_path / f"seed{seed}" / arm, 0.1, 0.5, curve)
    summary = ablation.summarize(tmp_path, [0, 1], list(curves))
    # seed 0: GRPO's last trailing mean 0.6 (first reached at step 5); the hybrid is there at step 3.
    # seed 1: GRPO's 0.5 at step 5; the hybrid never gets there.
    assert summary["arms"]["hybrid_lam0.3"]["to_grpo_final"] == {0: 3, 1: None}
    assert summary["arms"]["hybrid_lam0.3"]["to_grpo_final_no_later"] == 1
    assert summary["arms"]["grpo"]["to_grpo_final"] == {0: 5, 1: 5}
    assert "| 3 - | 1/2 |" in ablation.table_markdown(summary)


def test_preflight_names_what_an_arm_lacks(monkeypatch):
    ablation.check_arms(["grpo", "hybrid_lam1", "opd_only"], ["total_steps=3"])
    ablation.check_arms(["grpo", "hybrid_lam0.1", "hybrid_lam0.3", "placebo", "policy_judge"],
                        ["model.path=model.gguf"], "configs/smollm2_hybrid.py")
    monkeypatch.setitem(ablation.ARMS, "bogus", ["hybrid.mode=hybrid", "hybrid.no_such_field=1"])
    with pytest.raises(SystemExit, match="arm 'bogus'.*no_such_field"):
        ablation.check_arms(["grpo", "bogus"], [])


class _Launches:
    """Stands in for the launch/tpu_pod.py processes (the slow test below runs real ones): it
    records each run and writes what a finished run leaves, an SFT its export."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, run_dir, overrides, log_times=None, config=None):
        self.calls.append((run_dir.parent.name + "/" + run_dir.name, overrides))
        if run_dir.name in self.fail:
            raise RuntimeError(f"{run_dir} failed")
        sft = run_dir.name == "sft"
        if sft:
            (run_dir / "export").mkdir(parents=True)
            (run_dir / "export" / "config.json").write_text("{}")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({"start": {}} if sft else {"start": {}, "end": {}}))


def test_ablation_runs_sfts_first_across_seeds_and_continues_a_partial_out(tmp_path, monkeypatch):
    launches = _Launches()
    monkeypatch.setattr(ablation, "_launch", launches)
    ablation.AblationRuns(tmp_path, ["total_steps=2"], 5, jobs=3, deadline=None).run([0, 1], ["grpo", "placebo"])
    names = [name for name, _ in launches.calls]
    assert sorted(names) == sorted(f"seed{s}/{r}" for s in (0, 1) for r in ("sft", "grpo", "placebo"))
    for seed in (0, 1):  # each seed's arms after its SFT, from its export
        assert names.index(f"seed{seed}/sft") < names.index(f"seed{seed}/grpo")
        grpo = dict(launches.calls)[f"seed{seed}/grpo"]
        assert f"model.path={tmp_path / f'seed{seed}' / 'sft' / 'export'}" in grpo and f"seed={seed}" in grpo
    assert "sft.steps=5" in dict(launches.calls)["seed0/sft"]
    # a second pass over the same OUT: everything is reused; a lost export reruns that SFT only
    launches.calls.clear()
    ablation.AblationRuns(tmp_path, ["total_steps=2"], 5, jobs=3, deadline=None).run([0, 1], ["grpo", "placebo"])
    assert launches.calls == []
    (tmp_path / "seed1" / "sft" / "export" / "config.json").unlink()
    (tmp_path / "seed1" / "sft" / "export").rmdir()
    (tmp_path / "seed1" / "placebo" / "results.json").unlink()
    ablation.AblationRuns(tmp_path, ["total_steps=2"], 5, jobs=3, deadline=None).run([0, 1], ["grpo", "placebo"])
    assert [name for name, _ in launches.calls] == ["seed1/sft", "seed1/placebo"]


def test_ablation_runs_report_failures_and_the_deadline(tmp_path, monkeypatch, capsys):
    launches = _Launches(fail={"grpo"})
    monkeypatch.setattr(ablation, "_launch", launches)
    runs = ablation.AblationRuns(tmp_path, [], None, jobs=2, deadline=None)
    runs.run([0], ["grpo", "placebo"])
    assert runs.failed == ["seed0/grpo"] and (tmp_path / "seed0" / "placebo" / "results.json").exists()
    assert "FAILED: seed0/grpo" in capsys.readouterr().out
    late = ablation.AblationRuns(tmp_path / "late", [], None, jobs=2, deadline=0.0)
    late.run([0, 1], ["grpo"])
    assert sorted(late.skipped) == ["seed0/grpo", "seed0/sft", "seed1/grpo", "seed1/sft"]


@pytest.mark.slow
def test_documented_end_to_end_check_runs(tmp_path):
    """docs/hybrid.md's check: 1 seed x 2 arms x 3 steps (about 10 minutes on 2 busy cores)."""
    out = tmp_path / "smoke"
    cmd = [sys.executable, "bench/hybrid_ablation.py", "--out", str(out), "--seeds", "0", "--arms", "grpo",
           "hybrid_lam0.3", "--steps", "3", "--sft-steps", "40", "--eval-tasks", "8"]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=3600)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"grpo", "hybrid_lam0.3"}
    hybrid = summary["arms"]["hybrid_lam0.3"]["runs"]["0"]
    assert len(hybrid["curve"]) == 3 and "judge/hint_fraction" in hybrid["step1"]
    assert (out / "ablation.png").exists() and "hybrid_lam0.3" in (out / "table.md").read_text()


# ------------------------------------------------------------------ bench/hint_diagnostic.py


def _diagnostic():
    return load_script("bench/hint_diagnostic.py")


def test_scripted_failures_diverge_where_the_mistake_is(tmp_path):
    from agentrl_jax.envs import make_tasks
    from agentrl_jax.models.tiny import train_tiny_tokenizer
    from agentrl_jax.models.tokenizer import Tokenizer

    diagnostic = _diagnostic()
    corpus = ["What is 123*456? <code>print(123*456)</code> <interpreter>56088</interpreter> \\boxed{56088}"] * 20
    tokenizer = Tokenizer(train_tiny_tokenizer(tmp_path / "tok", corpus, vocab_size=300, individual_digits=True))
    rng = np.random.default_rng(0)
    for task in make_tasks(10, 4, seed=0):
        for kind in ("memory", "wrong_code", "not_copied"):
            episode, j = diagnostic.scripted_episode(tokenizer, task, kind, rng)
            prompt = len(episode.prompt_token_ids)
            text_before = tokenizer.decode(episode.token_ids[prompt:j].tolist())
            wrong = tokenizer.decode(episode.token_ids[j:j + 1].tolist())
            assert episode.loss_mask[j] == 1  # the policy chose the wrong token
            if kind == "memory":
                assert j == prompt  # wrong from the first token: no tool call
            elif kind == "wrong_code":  # at a digit of the second operand
                assert text_before.startswith(f"<code>print({task['a']}{task['op']}") and wrong.isdigit()
                assert str(task["b"]).startswith(text_before.split(task["op"])[-1])
            else:  # at a digit of the boxed copy of the printed result
                assert f"<interpreter>{task['answer']}</interpreter>" in text_before and wrong.isdigit()
                assert task["answer"].startswith(text_before.split("\\boxed{")[-1])
    d = np.array([[0.0, -3.0, 0.1, -0.5], [0.2, 0.0, -2.0, 0.0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)
    stats = diagnostic.term_stats(d, mask, [2, 3])  # token j's logprob sits at index j - 1
    assert stats["at_divergence"] == pytest.approx(-2.5)
    assert stats["before_mean"] == pytest.approx(0.2 / 3) and stats["after_mean"] == pytest.approx(-0.2)
    assert stats["before_near_zero"] == pytest.approx(1.0) and stats["after_near_zero"] == pytest.approx(0.5)
