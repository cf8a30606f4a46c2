"""The program-task oracle judge (train/guidance/program_oracle.py) on episodes whose programs ran in
the real sandbox: the failure kind it names, the natural-language hint it writes, and the leakage guard."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentrl_jax.envs import ReToolConfig
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.envs.program_demos import code_action, demonstration
from agentrl_jax.envs.program_tasks import make_tasks
from agentrl_jax.envs.retool import interpreter_text, wrap_interpreter
from agentrl_jax.train.guidance.program_oracle import ProgramOracleJudge, bridge_thought, failure_kind

CONFIG = ReToolConfig()


def _episode(task: dict, messages: list[dict], correct: bool) -> Trajectory:
    """An episode as the agent loop records it: the interpreter's answers under role 'tool'."""
    turns = [{"role": "tool" if m["role"] == "interpreter" else m["role"], "content": m["content"]} for m in messages]
    n = 4
    return Trajectory(prompt_token_ids=np.zeros(2, np.int32), token_ids=np.zeros(n, np.int32),
                      loss_mask=np.array([0, 0, 1, 1], np.int8), rollout_logprobs=np.zeros(n, np.float32),
                      params_versions=np.zeros(n, np.int32), turns=turns, reward=1.0 if correct else -1.0,
                      reward_components={"correct": float(correct)}, task_metadata=task)


@pytest.fixture(scope="module")
def tasks():
    train, _ = make_tasks(200, 16, seed=3)
    by_math = {t["uses_math"]: t for t in train if len(t["answer"]) >= 4}
    return by_math[True], by_math[False]


def _judge(episodes):
    judge = ProgramOracleJudge(lambda s: len(s.split()), max_hint_tokens=64)
    return asyncio.run(judge(episodes))


def test_each_failure_kind_gets_its_hint(loop_thread, pool, tasks):
    math_task, plain_task = tasks
    rng = np.random.default_rng(0)
    run = loop_thread.run
    tool = run(demonstration(plain_task, "tool", "typo", pool, CONFIG, rng))
    memory = run(demonstration(plain_task, "memory", "typo", pool, CONFIG, rng))
    missing_import = run(demonstration(math_task, "give_up", "missing_import", pool, CONFIG, rng))
    unclosed = run(demonstration(plain_task, "give_up", "unclosed_paren", pool, CONFIG, rng))
    not_copied = tool[:-1] + [{"role": "assistant", "content": "\\boxed{12}"}]
    wrong = plain_task["program"].replace("answer = ", "answer = 1 + ")
    output = interpreter_text(run(pool.run(wrong, timeout_s=2.0)))
    wrong_program = tool[:-3] + [{"role": "assistant", "content": code_action(wrong, CONFIG)},
                                 {"role": "interpreter", "content": wrap_interpreter(output, True)},
                                 {"role": "assistant", "content": f"\\boxed{{{output}}}"}]
    cases = [(tool, True, None), (memory, False, "memory"), (missing_import, False, "error"),
             (unclosed, False, "error"), (not_copied, False, "not_copied"), (wrong_program, False, "wrong_program")]
    episodes = [_episode(math_task if m is missing_import else plain_task, m, ok) for m, ok, _ in cases]
    assert [failure_kind(e) for e in episodes] == [kind for _, _, kind in cases]
    verdicts = _judge(episodes)
    assert verdicts[0].status == "no_intervention"
    assert all(v.status == "hint" for v in verdicts[1:]), [v.status for v in verdicts]
    hints = [v.hint for v in verdicts]
    assert "Python program" in hints[1]
    assert "forgot to import math" in hints[2]
    assert "not closed" in hints[3]
    assert "copy that number" in hints[4]
    expression = plain_task["program"].split("answer = ")[1].split("\n")[0]
    assert f"answer = {expression}" in hints[5]
    for hint, task in zip(hints[1:], [plain_task, math_task, plain_task, plain_task, plain_task]):
        assert task["answer"] not in hint


def test_a_hint_that_states_the_answer_is_dropped(tasks):
    _, task = tasks
    leaky = dict(task, program=f"answer = {task['answer']}\nprint(answer)")  # the expression is the answer itself
    episode = _episode(leaky, [{"role": "user", "content": task["question"]},
                               {"role": "assistant", "content": "<code>\n```python\nprint(1)\n```\n</code>"},
                               {"role": "tool", "content": wrap_interpreter("1", True)},
                               {"role": "assistant", "content": "\\boxed{1}"}], False)
    assert failure_kind(episode) == "wrong_program"
    assert _judge([episode])[0].status == "leaked"


def test_bridge_thought_refuses_an_unknown_kind(tasks):
    with pytest.raises(ValueError, match="kind must be one of"):
        bridge_thought(tasks[0], "bogus")


def test_the_diagnostics_scripted_failures_are_the_kinds_the_oracle_names(loop_thread, pool):
    """bench/hint_diagnostic_programs.py builds one failed episode per kind from real sandbox runs; the
    oracle must name each as the kind it was built as, or the diagnostic would score the wrong hint."""
    from repo_scripts import load_script

    diagnostic = load_script("bench/hint_diagnostic_programs.py")
    _, held_out = make_tasks(50, 12, seed=1)
    built = 0
    for i, task in enumerate(held_out):
        for kind in diagnostic.FAILURES:
            rng = np.random.default_rng([i, diagnostic.FAILURES.index(kind)])
            messages, last = loop_thread.run(diagnostic.failed_episode(task, kind, pool, CONFIG, rng))
            if messages is None:
                continue
            built += 1
            episode = _episode(task, messages, False)
            assert failure_kind(episode) == kind, (kind, messages[-3:])
            assert bridge_thought(task, kind, last) == ProgramOracleJudge(len).judge_text(episode).split(
                "\\boxed{", 1)[1][:-1]
    assert built >= 3 * len(held_out)
