"""Problem families and scripted-solver demonstrations of configs/retool_small.py.

Every generated answer is checked by running the solver's program in the real sandbox;
the held-out splits are disjoint from training; every demonstration replays through the
real ReTool environment turn for turn (same observations, the reward it claims).
"""

import asyncio
import re

import numpy as np
import pytest

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.envs import ReToolConfig, ReToolEnv
from agentrl_jax.envs.program_demos import BUGS, STYLES, buggy_program, demonstrations, draw_styles, memory_guess
from agentrl_jax.envs.program_tasks import FAMILIES, make_tasks
from agentrl_jax.rewards import MathVerifier

TRAIN, HELD_OUT = make_tasks(400, 120, seed=3)


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


def run_all(loop_thread, pool, programs):
    async def go():
        return await asyncio.gather(*[pool.run(p, timeout_s=2.0) for p in programs])

    return loop_thread.run(go())


def test_every_answer_is_what_the_solvers_program_prints(loop_thread, pool):
    tasks = TRAIN + HELD_OUT
    results = run_all(loop_thread, pool, [t["program"] for t in tasks])
    wrong = [(t["question"], t["answer"], r.stdout, r.stderr) for t, r in zip(tasks, results)
             if not r.ok or r.stdout.strip() != t["answer"]]
    assert not wrong, wrong[:3]
    assert {(t["family"], t["split"]) for t in tasks} >= {(f, "train") for f in FAMILIES}


def test_held_out_splits_are_disjoint_from_training():
    train_questions = {t["question"] for t in TRAIN}
    assert not train_questions & {t["question"] for t in HELD_OUT}
    assert len(train_questions) == len(TRAIN)
    combos = {(t["family"], t["variant"]) for t in HELD_OUT if t["split"] == "held_out_combo"}
    assert combos == {(f, v) for f, spec in FAMILIES.items() for v in spec.held_out_variants}
    assert not combos & {(t["family"], t["variant"]) for t in TRAIN}
    ranged = {(t["family"], t["variant"]) for t in HELD_OUT if t["split"] == "held_out_range"}
    assert ranged <= {(t["family"], t["variant"]) for t in TRAIN}
    assert {t["split"] for t in HELD_OUT} == {"held_out_range", "held_out_combo"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_held_out_ranges_lie_above_every_training_value(family):
    """Per variant, the banded parameter of every held_out_range task exceeds every training task's."""
    held_out_variants = {t["variant"] for t in HELD_OUT if t["family"] == family and t["split"] == "held_out_range"}
    assert held_out_variants
    for variant in held_out_variants:
        train = [t["param"] for t in TRAIN if (t["family"], t["variant"]) == (family, variant)]
        held_out = [t["param"] for t in HELD_OUT
                    if (t["family"], t["variant"], t["split"]) == (family, variant, "held_out_range")]
        assert train and min(held_out) > max(train), (family, variant, max(train), min(held_out))


def test_tasks_are_deterministic_and_validated():
    assert make_tasks(50, 10, seed=3) == make_tasks(50, 10, seed=3)
    assert make_tasks(50, 10, seed=3)[0] != make_tasks(50, 10, seed=4)[0]
    with pytest.raises(ValueError, match="unknown problem families"):
        make_tasks(5, 5, seed=0, families=("bignum", "calculus"))
    with pytest.raises(ConfigError, match="environment.families"):
        load_config("configs/retool_small_cpu.py", ["environment.families=[\"calculus\"]"])
    with pytest.raises(ConfigError, match="environment.demo_styles"):
        load_config("configs/retool_small_cpu.py", ["environment.demo_styles=[1.0, -0.5, 0.0, 0.0]"])


def test_bugs_raise_the_error_they_claim(loop_thread, pool):
    task = next(t for t in TRAIN if t["uses_math"])
    programs = [buggy_program(task["program"], bug) for bug in BUGS]
    for bug, result in zip(BUGS, run_all(loop_thread, pool, programs)):
        assert not result.ok and BUGS[bug][1] in result.stderr, (bug, result)
    plain = next(t for t in TRAIN if not t["uses_math"])
    with pytest.raises(ValueError, match="imports math"):
        buggy_program(plain["program"], "missing_import")


def test_memory_guess_and_style_mix():
    rng = np.random.default_rng(0)
    assert memory_guess(42, rng) == 42 and memory_guess(-7, rng) == -7
    guesses = [memory_guess(123456, rng) for _ in range(50)]
    assert all(g != 123456 and len(str(g)) == 6 for g in guesses)
    assert all(sum(a != b for a, b in zip(str(g), "123456")) in (1, 2) for g in guesses)
    styles = draw_styles(4000, {"tool": 0.5, "memory": 0.3, "fix": 0.2}, rng)
    counts = {s: styles.count(s) / 4000 for s in STYLES}
    assert counts["give_up"] == 0 and abs(counts["tool"] - 0.5) < 0.03 and abs(counts["fix"] - 0.2) < 0.03
    with pytest.raises(ValueError, match="style fractions"):
        draw_styles(3, {"tool": 1.0, "guess": 1.0}, rng)


def test_demonstrations_replay_through_the_real_environment(loop_thread, pool, verifier):
    """The SFT layout is the RL layout: feeding a demonstration's assistant turns to ReToolEnv
    gives back its interpreter turns exactly, and the reward the style implies."""
    config = ReToolConfig(max_turns=4, max_tool_calls=3, tool_timeout_s=2.0)
    tasks = TRAIN[:40]
    convs = loop_thread.run(demonstrations(tasks, pool, config, fractions=dict.fromkeys(STYLES, 1.0), seed=1))
    seen = set()

    async def replay(task, conv):
        env = ReToolEnv(pool, verifier, config)
        assert await env.reset(task) == conv[:2]
        turns, steps = conv[2:], []
        for i, turn in enumerate(turns):
            if turn["role"] == "assistant":
                steps.append(await env.step(turn["content"]))
                if i + 1 < len(turns):
                    assert steps[-1].observation_text == turns[i + 1]["content"]
        await env.close()
        return steps

    for task, conv in zip(tasks, convs):
        steps = loop_thread.run(replay(task, conv))
        final = steps[-1]
        calls = sum(m["role"] == "interpreter" for m in conv)
        assert final.done and final.finish_reason == "answer" and final.tool_stats.calls == calls
        boxed = re.search(r"\\boxed\{(-?\d+)\}", conv[-1]["content"]).group(1)
        if final.tool_stats.successful:  # tool or fix: the program's output, graded correct
            assert final.correct and final.reward == 1.0 and boxed == task["answer"]
            seen.add("fix" if final.tool_stats.errors else "tool")
        else:  # memory or give_up: right exactly when the answer has at most two digits
            assert final.correct == (len(task["answer"].lstrip("-")) <= 2) == (boxed == task["answer"])
            seen.add("give_up" if final.tool_stats.errors else "memory")
    assert seen == set(STYLES)
