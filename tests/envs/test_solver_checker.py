"""The solver-checker episode (envs/solver_checker.py) with scripted turns: who acts next, the
critique's second try, the team and role rewards and the per-episode metrics. Real sandbox
pool and math verifier."""

from __future__ import annotations

import numpy as np
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
    miscopy,
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


def short_solver(pool, verifier):
    """The arithmetic demo's short format: raw code in <code>, no system prompt."""
    return ReToolEnv(pool, verifier, ReToolConfig(fenced=False, system_prompt=None, max_observation_chars=64))


def test_a_checker_with_the_interpreter_runs_its_program_then_judges(loop_thread, pool, verifier):
    env = SolverCheckerEnv(short_solver(pool, verifier), checker_tool_calls=1)
    assert env.stop_strings[CHECKER] == ("\n", "</code>")  # a program in the short format is one line
    shown, result = play_script(loop_thread, env, TASK, [
        (SOLVER, "\\boxed{407}"), (CHECKER, "<code>print(12*34)</code>"), (CHECKER, "REJECT: it is 408"),
        (SOLVER, "\\boxed{408}")])
    assert "<code>" in shown[1].messages[0]["content"]  # its system prompt offers the interpreter
    # the checker's program ran in the real sandbox; its output comes back inline, in the checker's turn
    assert shown[2].actor == CHECKER and shown[2].messages is None and shown[2].text == "<interpreter>408</interpreter>"
    assert shown[3].actor == SOLVER and "it is 408" in shown[3].messages[0]["content"]
    assert result.rewards == {SOLVER: 1.0, CHECKER: 2.0} and result.metrics["checker/accuracy"] == 1.0
    assert result.tool_stats[CHECKER].calls == 1 and result.tool_stats[CHECKER].successful == 1
    assert result.tool_stats[SOLVER].calls == 0  # the solver's stats are its own


def test_the_checkers_programs_are_bounded_and_a_verdict_first_is_a_verdict(loop_thread, pool, verifier):
    # beyond its calls a program is read as the verdict: malformed, so it counts as accept and is never right
    env = SolverCheckerEnv(short_solver(pool, verifier), checker_tool_calls=1)
    shown, result = play_script(loop_thread, env, TASK, [
        (SOLVER, "\\boxed{407}"), (CHECKER, "<code>print(12*34</code>"), (CHECKER, "<code>print(1)</code>")])
    # a failing program is still its one call; its output is cut as the solver's are (64 characters here)
    assert "was never closed" in shown[2].text and "truncated" in shown[2].text
    assert result.done and result.metrics["checker/malformed"] == 1.0 and result.metrics["checker/accuracy"] == 0.0
    assert (result.tool_stats[CHECKER].calls, result.tool_stats[CHECKER].errors) == (1, 1)
    # an unclosed block spends a call too (no loop of corrections); ACCEPT before a block is the verdict
    env = SolverCheckerEnv(short_solver(pool, verifier), checker_tool_calls=2)
    shown, result = play_script(loop_thread, env, TASK, [
        (SOLVER, "\\boxed{408}"), (CHECKER, "<code>print(12*34)"), (CHECKER, "ACCEPT <code>print(1)</code>")])
    assert "was not closed" in shown[2].text and result.tool_stats[CHECKER].malformed == 1
    assert result.done and result.metrics["checker/accuracy"] == 1.0
    # without checker_tool_calls the checker only reads: a program is a malformed verdict, nothing runs
    env = SolverCheckerEnv(short_solver(pool, verifier))
    assert env.stop_strings[CHECKER] == ("\n",)
    _, result = play_script(loop_thread, env, TASK, [(SOLVER, "\\boxed{407}"), (CHECKER, "<code>print(1)</code>")])
    assert result.done and result.metrics["checker/malformed"] == 1.0 and CHECKER not in result.tool_stats
    # in the fenced format a program spans lines: only the close tag stops the checker's turn
    fenced = SolverCheckerEnv(ReToolEnv(pool, verifier, ReToolConfig()), checker_tool_calls=1)
    assert fenced.stop_strings[CHECKER] == ("</code>",)


def test_checker_demonstrations_with_the_interpreter_run_the_program_before_the_same_verdicts():
    wrong = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "\\boxed{407}"}]
    right = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "\\boxed{408}"}]
    turns = [{"role": "assistant", "content": "<code>print(12*34)</code>"},
             {"role": "interpreter", "content": "<interpreter>408</interpreter>"}]
    solver, tasks = [right, wrong] * 50, [TASK] * 100
    plain = checker_demonstrations(solver, tasks, seed=0, labeled=True)
    tools = checker_demonstrations(solver, tasks, seed=0, labeled=True, check_turns=lambda task: turns)
    for a, b in zip(plain, tools, strict=True):
        assert b[1] == a[1] and b[2:4] == turns and b[-1] == a[-1]  # the same transcript and verdict
        assert "<code>" in b[0]["content"] and "<code>" not in a[0]["content"]


def test_miscopied_demonstrations_change_one_digit_of_the_final_answer_and_are_labeled_wrong():
    rng = np.random.default_rng(0)
    for text in ["<code>print(12*34)</code><interpreter>408</interpreter>\\boxed{408}", "\\boxed{1} so \\boxed{4517277}"]:
        changed = miscopy(text, rng)
        head, answer = text.rsplit("{", 1)
        new_head, new_answer = changed.rsplit("{", 1)
        assert new_head == head and new_answer != answer and len(new_answer) == len(answer)
        assert sum(a != b for a, b in zip(answer, new_answer)) == 1 and not new_answer.startswith("0")
    assert miscopy("no answer", rng) == "no answer" and miscopy("\\boxed{x}", rng) == "\\boxed{x}"
    right = [{"role": "user", "content": "What is 12*34?"},
             {"role": "assistant", "content": "<code>print(12*34)</code>"},
             {"role": "interpreter", "content": "<interpreter>408</interpreter>"},
             {"role": "assistant", "content": "\\boxed{408}"}]
    plain = checker_demonstrations([right] * 400, [TASK] * 400, seed=0, labeled=True)
    demos = checker_demonstrations([right] * 400, [TASK] * 400, seed=0, labeled=True, miscopied=0.5)
    changed = [(a, b) for a, b in zip(plain, demos) if a != b]
    # Half miscopied, of which about half are shown whole (a transcript cut before its answer shows
    # no change); the others are as before: the same cuts, the same verdicts.
    assert 0.2 < len(changed) / 400 < 0.4
    whole = [(a, b) for a, b in changed if b[1]["content"].endswith("}")]
    assert len(whole) > 0.8 * len(changed)  # the rest cut inside the box: no answer either way
    for a, b in changed:
        assert b[-1]["content"] == DEMO_CRITIQUE and "<interpreter>408</interpreter>" in b[1]["content"]
    assert all(a[-1]["content"] == "ACCEPT" for a, _ in whole)  # right answers, miscopied: rejected
