"""The solver-checker episode (envs/solver_checker.py) with scripted turns: who acts next, the
critique's second try, the team and role rewards and the per-episode metrics. Real sandbox
pool and math verifier."""

from __future__ import annotations

import pytest

from agentrl_jax.envs.multi_actor import MultiActorResult
from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv
from agentrl_jax.envs.solver_checker import (
    CHECK_REQUEST,
    CHECKER,
    DEMO_CRITIQUE,
    SOLVER,
    SolverCheckerEnv,
    checker_demonstrations,
    parse_verdict,
)
from agentrl_jax.rewards import MathVerifier

TASK = {"question": "What is 12*34?", "answer": "408"}
PROGRAM = "<code>\n```python\nprint(12*34)\n```\n</code>"


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


def play_script(loop_thread, env, task, script):
    """Runs ``script`` ((actor, text) turns) on ``env``; the turns shown and the final result."""
    async def run():
        shown, result = [await env.reset(task)], None
        for actor, text in script:
            assert shown[-1].actor == actor, (shown[-1], actor)
            result = await env.step(actor, text)
            if result.done:
                break
            shown.append(result.next_turn)
        await env.close()
        return shown, result

    return loop_thread.run(run())


def play(loop_thread, pool, verifier, script, *, shared_view=False, retries=1):
    """Runs ``script`` ((actor, text) turns); returns the env, the turns shown, the final result."""
    env = SolverCheckerEnv(ReToolEnv(pool, verifier, ReToolConfig()), retries=retries, role_reward=1.0,
                           shared_view=shared_view)
    shown, result = play_script(loop_thread, env, TASK, script)
    return env, shown, result


def test_verdicts_parse_the_first_word_and_one_line():
    assert parse_verdict("REJECT: the product is 408, not 407\nmore") == (False, "the product is 408, not 407", True)
    assert parse_verdict("I ACCEPT this. REJECT later") == (True, "", True)
    assert parse_verdict("hmm") == (True, "", False)  # malformed: counts as accept, never right


def test_a_rejected_wrong_answer_gets_a_second_try_that_turns_it_right(loop_thread, pool, verifier):
    env, shown, result = play(loop_thread, pool, verifier, [
        (SOLVER, PROGRAM), (SOLVER, "So \\boxed{407}"), (CHECKER, "REJECT: recompute 12*34"),
        (SOLVER, "It is \\boxed{408}")])
    # the interpreter's output inline for the solver, then the checker's own prompt, then the critique
    assert shown[1].actor == SOLVER and "408" in shown[1].text
    assert shown[2].actor == CHECKER and shown[2].messages[0]["role"] == "system"
    assert "What is 12*34?" in shown[2].messages[1]["content"] and "\\boxed{407}" in shown[2].messages[1]["content"]
    assert shown[3].messages == [{"role": "user", "content": "A checker rejected your answer: recompute 12*34. "
                                                             "Try once more."}]
    assert result.done and result.correct
    assert result.rewards == {SOLVER: 1.0, CHECKER: 2.0}  # team 1; the checker was right to reject
    assert result.metrics["critique/wrong_first"] == 1.0 and result.metrics["critique/wrong_to_right"] == 1.0
    assert result.metrics["checker/accuracy"] == 1.0 and result.metrics["team/first_correct"] == 0.0
    assert result.tool_stats[SOLVER].calls == 1 and CHECKER not in result.tool_stats  # the solver's program


def test_without_the_team_reward_the_checker_earns_its_role_reward_alone(loop_thread, pool, verifier):
    env = SolverCheckerEnv(ReToolEnv(pool, verifier, ReToolConfig()), role_reward=1.0, checker_team_reward=False)
    _, result = play_script(loop_thread, env, TASK, [
        (SOLVER, "\\boxed{407}"), (CHECKER, "REJECT: recompute"), (SOLVER, "\\boxed{408}")])
    assert result.rewards == {SOLVER: 1.0, CHECKER: 1.0}  # the second try's team reward is the solver's alone


@pytest.mark.parametrize("shared_view", [False, True])
def test_rejecting_a_right_answer_costs_the_checker_and_the_team(loop_thread, pool, verifier, shared_view):
    _, shown, result = play(loop_thread, pool, verifier, [
        (SOLVER, "\\boxed{408}"), (CHECKER, "REJECT: no"), (SOLVER, "\\boxed{400}")], shared_view=shared_view)
    if shared_view:  # one transcript: the checker is asked in it
        assert shown[1].messages == [{"role": "user", "content": CHECK_REQUEST}]
    assert result.rewards == {SOLVER: 0.0, CHECKER: 0.0}
    assert result.metrics["team/first_correct"] == 1.0 and result.metrics["team/final_correct"] == 0.0
    assert result.metrics["checker/accuracy"] == 0.0 and result.metrics["critique/wrong_first"] == 0.0


def test_an_accept_or_no_tries_left_ends_at_the_first_answer(loop_thread, pool, verifier):
    _, _, accepted = play(loop_thread, pool, verifier, [(SOLVER, "\\boxed{408}"), (CHECKER, "ACCEPT")])
    assert accepted.rewards == {SOLVER: 1.0, CHECKER: 2.0} and accepted.metrics["checker/rejected"] == 0.0
    _, _, final = play(loop_thread, pool, verifier, [(SOLVER, "\\boxed{1}"), (CHECKER, "REJECT: wrong")], retries=0)
    assert isinstance(final, MultiActorResult) and final.done and final.rewards == {SOLVER: 0.0, CHECKER: 1.0}


def test_checker_demonstrations_teach_the_verdict_format_with_labels_independent_of_correctness():
    right = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 12*34?"},
             {"role": "assistant", "content": f"{PROGRAM}"}, {"role": "tool", "content": "408"},
             {"role": "assistant", "content": " so \\boxed{408}"}]
    wrong = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "I guess \\boxed{7}"}]
    solver, tasks = [right, wrong] * 300, [TASK] * 600
    demos = checker_demonstrations(solver, tasks, seed=0)
    whole = f"Problem: What is 12*34?\n\nSolution:\n{PROGRAM}408 so \\boxed{{408}}"
    shown = [d[1]["content"] for d in demos[0::2]]
    assert all(whole.startswith(text) and text.startswith("Problem: What is 12*34?") for text in shown)
    assert 0.4 < sum(text == whole for text in shown) / 300 < 0.65  # the rest cut short, as unfinished tries are
    verdicts = [parse_verdict(d[-1]["content"]) for d in demos]
    assert all(well_formed for _, _, well_formed in verdicts)  # the exact format the episode parses
    assert {d[-1]["content"] for d in demos} == {"ACCEPT", DEMO_CRITIQUE}
    accepted = [accepted for accepted, _, _ in verdicts]
    # About half accepted, on right and on wrong transcripts alike: the label says nothing of the answer.
    assert 0.42 < sum(accepted[0::2]) / 300 < 0.58 and 0.42 < sum(accepted[1::2]) / 300 < 0.58
    assert [d[-1] for d in checker_demonstrations(solver, tasks, seed=0)] == [d[-1] for d in demos]
    assert [d[-1] for d in checker_demonstrations(solver, tasks, seed=1)] != [d[-1] for d in demos]
    assert parse_verdict(DEMO_CRITIQUE)[:2] == (False, "the answer is wrong.")

    # Labeled: the same transcripts (the same cuts), each with its right verdict.
    labeled = checker_demonstrations(solver, tasks, seed=0, labeled=True)
    assert [d[1] for d in labeled] == [d[1] for d in demos]
    for demo in labeled:
        shown = demo[1]["content"]
        assert (demo[-1]["content"] == "ACCEPT") == shown.endswith("\\boxed{408}"), shown
    assert {d[-1]["content"] for d in labeled[1::2]} == {DEMO_CRITIQUE}  # the guess 7 is never right
    assert 0.45 < sum(d[-1]["content"] == "ACCEPT" for d in labeled[0::2]) / 300 < 0.65  # cut short: no answer
