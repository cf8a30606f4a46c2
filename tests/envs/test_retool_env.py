"""ReTool env: every malformed action has a defined outcome; a scripted episode end to end."""

import numpy as np
import pytest

from agentrl_jax.envs import (ArithmeticEnv, ReToolConfig, ReToolEnv, ToolStats, Trajectory, arithmetic_config,
                              demonstration, make_tasks)
from agentrl_jax.rewards import MathVerifier, RewardWeights

TASK = {"question": "What is 2**10 + 1?", "answer": "1025"}


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


def code(body):
    return f"Let me compute.\n<code>\n```python\n{body}\n```\n</code>"


def episode(loop_thread, env, actions, task=TASK):
    async def play():
        await env.reset(task)
        steps = [await env.step(action) for action in actions]
        await env.close()
        return steps

    return loop_thread.run(play())


def test_scripted_multi_turn_episode(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(reward_weights=RewardWeights(format=0.1, tool=0.5)))
    assert env.stop_strings == ("</code>",)
    steps = episode(loop_thread, env, [code("x = 2**10\nprint(x)"), code("print(x + 1)"),
                                       "So the answer is \\boxed{1025}."])
    assert steps[0].observation_text == "\n<interpreter>\n1024\n</interpreter>\n" and not steps[0].done
    assert "1025" in steps[1].observation_text  # the session kept x
    final = steps[2]
    assert final.done and final.finish_reason == "answer" and final.correct
    assert final.reward_components == {"outcome": 1.0, "format": 1.0, "tool": 0.2}
    assert final.reward == pytest.approx(1.0 + 0.1 + 0.5 * 0.2)
    assert final.tool_stats == ToolStats(calls=2, errors=0, timeouts=0)


def test_wrong_answer_and_no_answer(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier)
    wrong = episode(loop_thread, env, ["\\boxed{1024}"])[0]
    assert wrong.done and not wrong.correct and wrong.reward == -1.0
    silent = episode(loop_thread, env, ["I give up."])[0]
    assert silent.done and silent.finish_reason == "no_answer" and silent.reward == -1.0


def test_unclosed_tag_gets_correction(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier)
    steps = episode(loop_thread, env, ["<code>\n```python\nprint(1)\n```", "\\boxed{1025}"])
    assert "not closed" in steps[0].observation_text and not steps[0].done
    assert "<interpreter>" in steps[0].observation_text and env.tool_stats.calls == 0
    assert steps[1].correct


def test_empty_code_block(loop_thread, pool, verifier):
    steps = episode(loop_thread, ReToolEnv(pool, verifier), ["<code>\n```python\n\n```\n</code>"])
    assert "empty code block" in steps[0].observation_text and not steps[0].done


def test_several_code_blocks_runs_first_only(loop_thread, pool, verifier):
    action = code("print('first')") + "\n" + code("print('second')")
    step = episode(loop_thread, ReToolEnv(pool, verifier), [action])[0]
    assert "first" in step.observation_text and "second" not in step.observation_text.split("Note")[0]
    assert "only the first code block" in step.observation_text


def test_text_after_answer_is_graded_without_format_credit(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(reward_weights=RewardWeights(format=0.5)))
    step = episode(loop_thread, env, ["\\boxed{1025} and some rambling afterwards"])[0]
    assert step.done and step.correct and step.reward_components["format"] == 0.0


def test_gigantic_output_is_truncated(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(max_observation_chars=300))
    step = episode(loop_thread, env, [code("print('z' * 10**6)")])[0]
    assert "truncated" in step.observation_text and len(step.observation_text) < 400


def test_token_limit_on_observation(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(max_observation_tokens=20), count_tokens=lambda s: len(s.split()))
    step = episode(loop_thread, env, [code("print(' '.join(str(i) for i in range(500)))")])[0]
    body = step.observation_text.split("<interpreter>")[1].split("</interpreter>")[0]
    assert len(body.split()) <= 20 + 8  # the truncation marker adds a few words


def test_timeout_and_error_are_reported_in_observation(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(tool_timeout_s=1.0))
    steps = episode(loop_thread, env, [code("while True:\n    pass"), code("1/0")])
    assert "TimeoutError" in steps[0].observation_text
    assert "ZeroDivisionError" in steps[1].observation_text
    assert env.tool_stats.timeouts == 1 and env.tool_stats.errors == 1


def test_tool_call_and_turn_limits(loop_thread, pool, verifier):
    env = ReToolEnv(pool, verifier, ReToolConfig(max_tool_calls=1, max_turns=3))
    steps = episode(loop_thread, env, [code("print(1)"), code("print(2)"), code("print(3)")])
    assert "limit reached" in steps[1].observation_text and env.tool_stats.calls == 1
    assert steps[2].done and steps[2].finish_reason == "max_turns" and steps[2].reward == -1.0


def test_zero_tool_calls_from_the_config_runs_no_code(loop_thread, pool, verifier):
    """`environment.max_tool_calls=0` reaches the environment (it used to become 1)."""
    from agentrl_jax.config import load_config

    config = ArithmeticEnv.config_from(load_config("configs/demo.py", ["environment.max_tool_calls=0"]))
    env = ReToolEnv(pool, verifier, config)
    steps = episode(loop_thread, env, [code("print(1)"), "\\boxed{2}"])
    assert "limit reached" in steps[0].observation_text and env.tool_stats.calls == 0
    assert steps[1].done


def test_reset_validates_task(loop_thread, pool, verifier):
    with pytest.raises(KeyError, match="answer"):
        loop_thread.run(ReToolEnv(pool, verifier).reset({"question": "q"}))


def test_trajectory_validates_shapes():
    ids = np.arange(6, dtype=np.int32)
    traj = Trajectory(ids[:2], ids, np.array([0, 0, 1, 1, 0, 1]), np.zeros(6, np.float32), np.full(6, 3))
    assert traj.num_sampled_tokens == 3
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(ids[:2], ids, np.ones(5), np.zeros(6), np.zeros(6))
    with pytest.raises(ValueError, match="prompt"):
        Trajectory(ids[:2], ids, np.ones(6), np.zeros(6), np.zeros(6))


def test_arithmetic_tasks_are_seeded_and_split():
    train = make_tasks(200, 3, seed=0)
    again = make_tasks(200, 3, seed=0)
    held_out = make_tasks(50, 3, seed=0, split="held_out")
    assert train == again
    assert not {t["question"] for t in train} & {t["question"] for t in held_out}
    for task in train[:20]:
        a, b = task["a"], task["b"]
        assert 100 <= a < 1000 and 100 <= b < 1000
        assert task["answer"] == str(a * b if task["op"] == "*" else a + b)
    with pytest.raises(ValueError, match="split"):
        make_tasks(1, 2, seed=0, split="test")


@pytest.mark.parametrize("fenced", [False, True])
def test_tool_demonstration_replays_exactly_in_env(loop_thread, pool, verifier, fenced):
    task = make_tasks(1, 5, seed=1, operators="*")[0]
    turns = demonstration(task, "tool", np.random.default_rng(0), fenced=fenced)
    assert [t["role"] for t in turns] == ["assistant", "interpreter", "assistant"]
    env = ArithmeticEnv(pool, verifier, arithmetic_config(fenced=fenced))
    steps = episode(loop_thread, env, [turns[0]["content"], turns[2]["content"]], task=task)
    assert steps[0].observation_text == turns[1]["content"]  # SFT text == what RL rollouts see
    assert steps[1].done and steps[1].reward == 1.0


def test_memory_demonstrations_are_right_when_easy_and_wrong_when_long():
    rng = np.random.default_rng(0)
    easy = make_tasks(50, 1, seed=2)
    hard = make_tasks(50, 6, seed=2)
    guesses = lambda tasks: [demonstration(t, "memory", rng)[0]["content"] for t in tasks]  # noqa: E731
    assert all(g == f"\\boxed{{{t['answer']}}}" for g, t in zip(guesses(easy), easy))
    wrong = sum(g != f"\\boxed{{{t['answer']}}}" for g, t in zip(guesses(hard), hard))
    assert wrong == len(hard)
