"""A solver and a checker on the ReTool tasks: two actors, one episode (``envs/multi_actor.py``).

    solver:  a ReTool episode (envs/retool.py, or a subclass: the arithmetic demo's
             envs/arithmetic.py): programs run in the sandbox, the
             interpreter's output appended inline, until a \\boxed{} answer
    checker: reads the problem and the solver's transcript, answers ACCEPT or
             "REJECT: <one-line critique>"; with ``checker_tool_calls`` it may first run
             programs in the solver's sandbox (``<code>`` in its own turn, the output
             appended inline as the solver's are) and then give its verdict
    solver:  after a rejection, sees the critique and gets one more try (``retries``)

Rewards: the team reward (both actors) is 1 for a correct final answer, else 0; the
checker's role reward adds ``role_reward`` for a right verdict on the first answer (accept
a correct one, reject a wrong one). A checker reply with neither word counts as ACCEPT
and is never right (``verdict/malformed``). Without ``checker_team_reward`` the checker's
reward is its role reward alone: with the team reward a rejection is a free second try, and
rejecting every answer pays whenever a second try is as likely right as a first one. The
trainer may reweigh the role reward over a step's episodes (``balanced_verdict_weights``:
``multi_policy.checker_reward``).

With ``shared_view`` both actors write one transcript: the checker's turn opens with a user
message asking for the verdict, the critique goes back to the solver as a user message
(self-play: one model, roles by prompt). Otherwise the checker's view is its own prompt:
the problem and the solver's transcript as text.

Per-episode metrics (averaged by the trainer): ``checker/accuracy``, ``checker/rejected``,
``team/first_correct``, ``team/final_correct``, and for the critique's effect
``critique/wrong_first`` (rejected a wrong first answer) and ``critique/wrong_to_right`` (that
rejection, then a correct second answer); their ratio is the critique-turns-wrong-right rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agentrl_jax.envs.base import StepResult
from agentrl_jax.envs.multi_actor import (
    ActorTurn,
    MultiActorEnvironment,
    MultiActorResult,
)
from agentrl_jax.envs.base import ToolStats
from agentrl_jax.envs.retool import ReToolEnv, interpreter_text, parse_code, record_call, wrap_interpreter
from agentrl_jax.rewards.boxed import extract_boxed, find_boxed_spans

SOLVER, CHECKER = "solver", "checker"
CHECKER_SYSTEM_PROMPT = ("You check a solution to a math problem. Reply ACCEPT if its final answer is right, "
                         "else REJECT: and one line saying what is wrong.")
CHECKER_TOOL_SYSTEM_PROMPT = CHECKER_SYSTEM_PROMPT + " You may run <code></code> first."
CHECK_REQUEST = "Checker: is the final answer above right? Reply ACCEPT, or REJECT: and one line saying why."
# Short: a scratch tokenizer trained on the solver's demonstrations spells English nearly byte by
# byte, and the verdict has to fit one turn (the demo's 32 new tokens).
DEMO_CRITIQUE = "REJECT: the answer is wrong."


def rejection_note(critique: str) -> str:
    """The user message the solver sees after a rejection (its second-try demonstrations use it too)."""
    return f"A checker rejected your answer: {critique.rstrip('.') or 'it is wrong'}. Try once more."


def checker_prompt(question: str, transcript: str, *, tools: bool = False) -> list[dict[str, str]]:
    """The checker's own view: the problem and the solver's transcript as text (``tools``: the
    system prompt says it may run code)."""
    return [{"role": "system", "content": CHECKER_TOOL_SYSTEM_PROMPT if tools else CHECKER_SYSTEM_PROMPT},
            {"role": "user", "content": f"Problem: {question}\n\nSolution:\n{transcript}"}]


def checker_demonstrations(solver_conversations: list[list[dict[str, str]]], tasks: list[dict[str, Any]], *,
                           seed: int, labeled: bool = False,
                           check_turns: Callable[[dict[str, Any]], list[dict[str, str]]] | None = None,
                           miscopied: float = 0.0) -> list[list[dict[str, str]]]:
    """The checker's SFT conversations, one per solver demonstration (``tasks[i]``'s): its own
    view of that transcript answered ``ACCEPT`` or ``DEMO_CRITIQUE``.

    Format-only (the default): each verdict with probability 1/2 from ``seed``, independently of
    whether the transcript's answer is right. The cold start teaches the verdict's format (one
    well-formed line that ``parse_verdict`` reads), never the judgment: after it the checker's
    accuracy is a coin flip and RL, through its role reward, has to teach it to read.

    ``labeled`` (``multi_policy.checker_cold_start='labeled'``): the right verdict, ACCEPT
    exactly when the shown transcript's boxed answer is the task's. The checker then arrives at
    RL already judging, from the scripted solver's mistakes (not the policy's): a comparison
    must not credit RL with the judgment it starts with.

    Half of the transcripts (also drawn from ``seed``) are cut at a random character: in RL the
    checker reads the solver policy's own transcripts, unfinished or garbled early on, and a
    verdict format learned only after finished scripted ones does not carry over to those. A cut
    transcript's answer is what is left of it (none, or a cut number: wrong).

    ``check_turns`` (``multi_policy.checker_tool_calls``): the turns the checker runs before each
    verdict, ``check_turns(task)`` (e.g. a program printing the task's result and the
    interpreter's output: an ``interpreter`` turn, loss mask 0), under the system prompt that
    offers the interpreter.

    ``miscopied`` (``multi_policy.checker_miscopied``): that share of the transcripts (drawn from
    ``seed`` apart from the rest) shows its final boxed answer with one digit changed
    (``miscopy``), the mistake a solver makes after the right program; labeled, they are wrong.
    The scripted solver's own mistakes (guesses from memory) can be told from the tool's right
    answers without reading a number, and a checker trained on those alone learns that shortcut;
    a miscopied answer looks like a right one but for the digits.
    """
    rng, miscopy_rng = np.random.default_rng(seed), np.random.default_rng([seed, 43])
    out = []
    for conversation, task in zip(solver_conversations, tasks, strict=True):
        first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        transcript = "".join(m["content"] for m in conversation[first:])
        if miscopied and miscopy_rng.random() < miscopied:
            transcript = miscopy(transcript, miscopy_rng)
        if rng.random() < 0.5:
            transcript = transcript[:int(rng.integers(0, len(transcript) + 1))]
        coin = rng.random() < 0.5  # drawn in both modes: the cuts are the same with and without labels
        accept = _is_answer(extract_boxed(transcript), task["answer"]) if labeled else coin
        checks = check_turns(task) if check_turns else []
        out.append(checker_prompt(str(task["question"]), transcript, tools=check_turns is not None) + checks
                   + [{"role": "assistant", "content": "ACCEPT" if accept else DEMO_CRITIQUE}])
    return out


def miscopy(transcript: str, rng: np.random.Generator) -> str:
    """``transcript`` with one digit of its last boxed answer changed (a leading digit never to 0);
    unchanged when that answer has no digit or there is none."""
    spans = find_boxed_spans(transcript)
    if not spans:
        return transcript
    start, end, content = spans[-1]
    digits = [i for i, c in enumerate(content) if c.isdigit()]
    if not digits:
        return transcript
    index = digits[int(rng.integers(len(digits)))]
    leading = index == 0 or not content[index - 1].isdigit()
    choices = [d for d in "0123456789" if d != content[index] and not (leading and d == "0" and len(digits) > 1)]
    changed = content[:index] + str(rng.choice(choices)) + content[index + 1:]
    at = transcript.rfind(content, start, end)  # the content closes its span
    return transcript[:at] + changed + transcript[at + len(content):]


def _is_answer(boxed: str | None, answer: Any) -> bool:
    """Whether a boxed answer (None: there was none) is ``answer``, as the demonstrations write both."""
    return boxed is not None and boxed.strip() == str(answer).strip()


def parse_verdict(text: str) -> tuple[bool, str, bool]:
    """(accepted, critique, well_formed) of a checker reply: the first of ACCEPT / REJECT wins."""
    upper = text.upper()
    accept, reject = upper.find("ACCEPT"), upper.find("REJECT")
    if reject >= 0 and (accept < 0 or reject < accept):
        critique = text[reject + len("REJECT"):].lstrip(" :").strip().splitlines()
        return False, (critique[0] if critique else "").strip(), True
    return True, "", accept >= 0


def first_answer_part(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """A solver demonstration up to its first answer: without a rejection note and second try."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    note = next((i for i in range(first, len(conversation)) if conversation[i]["role"] == "user"), len(conversation))
    return conversation[:note]


def with_second_tries(conversations: list[list[dict[str, str]]], tasks: list[dict[str, Any]],
                      retry_turns: Callable[[dict[str, Any]], list[dict[str, str]]], *, fraction: float,
                      seed: int) -> list[list[dict[str, str]]]:
    """The solver's demonstrations, of which a ``fraction`` (drawn from ``seed``) of those whose
    final boxed answer is wrong go on as a rejected team episode does: the note the episode
    appends after the checker's cold-start critique (``rejection_note``), then ``retry_turns(task)``
    (a second try, e.g. one that calls the interpreter and answers right).

    The others stay as they are (accepted episodes), and every demonstration's first-answer part
    (``first_answer_part``) is the input's: what the solver learns to answer first is unchanged.
    """
    note = {"role": "user", "content": rejection_note(parse_verdict(DEMO_CRITIQUE)[1])}
    rng = np.random.default_rng([seed, 41])
    out = []
    for conversation, task in zip(conversations, tasks, strict=True):
        answer = extract_boxed(conversation[-1]["content"]) if conversation[-1]["role"] == "assistant" else None
        wrong = answer is not None and not _is_answer(answer, task["answer"])
        out.append(conversation + [note, *retry_turns(task)] if wrong and rng.random() < fraction else conversation)
    return out


def balanced_verdict_weights(first_correct: Sequence[bool]) -> np.ndarray:
    """The checker's role-reward weight per episode (``multi_policy.checker_reward='balanced'``):
    1 / (K * the share of the episode's class) among the step's episodes, the classes being
    "the first answer is right" and "it is wrong" and K how many of them occur.

    The mean role reward over the step is then ``role_reward`` times the balanced accuracy (the
    mean over the classes of the fraction judged right): a constant verdict earns 1/K of the
    maximum whatever the share p of right first answers, where with unit weights accepting all
    earns p and rejecting all 1 - p (the team reward on top made rejecting all pay while p < 1/3).
    """
    right = np.asarray(first_correct, bool)
    if not right.size:
        return np.zeros(0)
    share = np.where(right, right.mean(), 1.0 - right.mean())
    return 1.0 / (len(np.unique(right)) * share)


class SolverCheckerEnv(MultiActorEnvironment):
    """The solver's ReTool episode, read and judged by a checker (module docstring)."""

    actors = (SOLVER, CHECKER)

    def __init__(self, solver: ReToolEnv, *, retries: int = 1, role_reward: float = 1.0, shared_view: bool = False,
                 checker_team_reward: bool = True, checker_tool_calls: int = 0):
        self.solver, self.retries, self.role_reward, self.shared_view = solver, retries, role_reward, shared_view
        self.checker_team_reward, self.checker_tool_calls = checker_team_reward, checker_tool_calls
        # The verdict is one line; a program in the fenced format spans lines, so there its close tag alone stops.
        line = () if checker_tool_calls and solver.config.fenced else ("\n",)
        self.stop_strings = {SOLVER: solver.stop_strings,
                             CHECKER: line + ((solver.config.close_tag,) if checker_tool_calls else ())}

    async def reset(self, task: dict[str, Any]) -> ActorTurn:
        self.task = task
        self.first: StepResult | None = None  # the solver's first graded answer
        self.verdict: tuple[bool, str, bool] | None = None
        self.tries = 0
        self.checker_stats = ToolStats()  # the checker's programs (``checker_tool_calls``)
        return ActorTurn(SOLVER, messages=await self.solver.reset(task))

    async def step(self, actor: str, action_text: str) -> MultiActorResult:
        if actor == CHECKER:
            return await self._check_code(action_text) or self._checked(action_text)
        step = await self.solver.step(action_text)
        if not step.done:
            return MultiActorResult(ActorTurn(SOLVER, text=step.observation_text))
        self.tries += 1
        if self.first is None:
            self.first = step
            return MultiActorResult(self._check_turn())
        return self._finish(step)

    def _check_turn(self) -> ActorTurn:
        if self.shared_view:
            return ActorTurn(CHECKER, messages=[{"role": "user", "content": CHECK_REQUEST}])
        return ActorTurn(CHECKER, messages=checker_prompt(str(self.task["question"]), self.solver.response,
                                                          tools=bool(self.checker_tool_calls)))

    async def _check_code(self, reply: str) -> MultiActorResult | None:
        """The checker's program, run in the solver's sandbox (a fresh namespace, the solver's
        time limit and observation size) with its output back inline in the checker's turn; None
        when ``reply`` is a verdict: no program before the first ACCEPT / REJECT, or the
        checker's ``checker_tool_calls`` are spent (the reply is then read as a verdict, so a
        program there is malformed)."""
        config = self.solver.config
        start = reply.find(config.open_tag)
        if start < 0 or self.checker_stats.calls >= self.checker_tool_calls or any(
                0 <= reply.upper().find(word) < start for word in ("ACCEPT", "REJECT")):
            return None
        code, problem = parse_code(reply, config)
        if code is None:  # a malformed block spends a call too, so the checker cannot loop
            self.checker_stats.calls += 1
            self.checker_stats.errors += 1
            self.checker_stats.malformed += 1
            body = problem
        else:
            result = await self.solver.pool.run(code, session=None, timeout_s=config.tool_timeout_s)
            record_call(self.checker_stats, result)
            body = interpreter_text(result) + (f"\n{problem}" if problem else "")
        return MultiActorResult(ActorTurn(CHECKER, text=wrap_interpreter(self.solver.limit_observation(body),
                                                                         config.fenced)))

    def _checked(self, reply: str) -> MultiActorResult:
        self.verdict = parse_verdict(reply)
        accepted, critique, _ = self.verdict
        if accepted or self.tries > self.retries:
            return self._finish(self.first)
        self.solver.turns = 0  # the new try has the solver's turn limit of its own
        return MultiActorResult(ActorTurn(SOLVER, messages=[{"role": "user", "content": rejection_note(critique)}]))

    def _finish(self, final: StepResult) -> MultiActorResult:
        """Team and role rewards, from the first answer, the verdict and the final answer."""
        first_correct, final_correct = bool(self.first.correct), bool(final.correct)
        accepted, _, well_formed = self.verdict or (True, "", False)
        right = well_formed and accepted == first_correct
        team = float(final_correct)
        wrong_first = float(not first_correct and not accepted)
        return MultiActorResult(
            None, done=True, correct=final_correct, finish_reason=final.finish_reason or "answer",
            rewards={SOLVER: team, CHECKER: team * self.checker_team_reward + self.role_reward * float(right)},
            reward_components={SOLVER: {"team": team}, CHECKER: {"team": team, "verdict": float(right)}},
            metrics={"checker/accuracy": float(right), "checker/rejected": float(not accepted),
                     "checker/malformed": float(not well_formed), "team/first_correct": float(first_correct),
                     "team/final_correct": team, "critique/wrong_first": wrong_first,
                     "critique/wrong_to_right": wrong_first * team},
            tool_stats={SOLVER: dataclasses.replace(self.solver.tool_stats),  # both tries'
                        **({CHECKER: dataclasses.replace(self.checker_stats)} if self.checker_stats.calls else {})})

    def cut_short(self, finish_reason: str) -> MultiActorResult:
        """A context overflow: the team's answer is wrong (a checker that never spoke is not right)."""
        wrong = StepResult("", 0.0, True, finish_reason=finish_reason, correct=False)
        self.first = self.first or wrong
        result = self._finish(wrong)
        result.finish_reason = finish_reason
        return result

    async def close(self) -> None:
        await self.solver.close()
