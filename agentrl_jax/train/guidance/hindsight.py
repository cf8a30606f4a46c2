"""PRM judge and hindsight bridge thoughts (the Retool-RL recipe of
"Agentic RL (Part III): Architecture Analysis of Verl and SkyRL to Retool-RL Case Practice",
sections 3-4).

After an episode ends, a judge sees the problem, the trajectory with its tool feedback and
the outcome, and answers in a fixed format:

    Score: <s in [0, 1]>            optional PRM score of the process
    \\boxed{-1}                      no intervention needed
    \\boxed{<bridge thought>}        the minimal corrective hint, e.g.
                                    "I should define x with symbols('x') before summing."

The last top-level ``\\boxed{}`` decides. Anything else is *malformed* (no hint); a hint
longer than ``max_hint_tokens`` tokens is *too_long* (no hint, not truncated: half a hint
would pollute the token-level supervision); a hint that states the task's gold answer is
*leaked* (no hint: ``rewards.hints.hint_leaks_answer``, the leakage guard). Every outcome
is counted (``judge_metrics``).

A judge is any object with ``async __call__(trajectories) -> list[Verdict]``:
- ``ModelJudge`` renders the template, decodes through the rollout ``Driver`` (optionally
  swapping in the judge's params for the call and restoring the policy's afterwards) and
  parses the text;
- ``ArithmeticOracleJudge`` is a scripted judge for the arithmetic demo: it writes the
  judge text a perfect PRM would write from the tool feedback, and the same parser reads it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from agentrl_jax.envs.arithmetic import bridge_thought
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.rewards.boxed import extract_boxed
from agentrl_jax.rewards.hints import hint_leaks_answer, placebo_hints
from agentrl_jax.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

JUDGE_TEMPLATE = """You are a process reward model reviewing one attempt at a problem.

Problem:
{problem}

Attempt (the model's turns, with the tool's feedback):
{trajectory}

Outcome: {outcome} (reward {reward}).

First write one line `Score: s` with s between 0 and 1: how sound the process was.
Then, if the attempt needs no correction, answer \\boxed{{-1}}. Otherwise answer \\boxed{{...}}
with one short bridge thought in the first person: the single, minimal, actionable fix at
the earliest point where the attempt went wrong (e.g. \\boxed{{I should define x with
symbols('x') before using it in the sum.}}). Do not solve the problem: never state the final
answer or any number equal to it; a hint that contains the answer is discarded."""

STATUSES = ("hint", "no_intervention", "malformed", "too_long", "leaked", "error")
NO_INTERVENTION = "-1"
_SCORE = re.compile(r"score\s*[:=]\s*([-+]?\d*\.?\d+)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The judge's answer for one trajectory.

    Attributes:
      status: one of STATUSES; only "hint" carries a hint.
      hint: the bridge thought (status "hint"), else None.
      score: the PRM score in [0, 1], or None when absent / out of range.
      hint_tokens: tokens of the hint (0 without one).
      raw: the judge's text, for logs.
    """

    status: str
    hint: str | None = None
    score: float | None = None
    hint_tokens: int = 0
    raw: str = ""


class Judge(Protocol):
    """Judges finished episodes. ``policy`` is the (params, version) the rollout driver holds
    for the policy: a judge that swaps its own params into the driver hands these back."""

    async def __call__(self, trajectories: Sequence[Trajectory], policy: tuple[Any, int]) -> list[Verdict]: ...


def parse_judge_output(text: str, *, count_tokens: Callable[[str], int], max_hint_tokens: int,
                       answer: str | None = None) -> Verdict:
    """Parse a judge's text (module docstring format) into a Verdict.

    Args:
      text: the judge's answer.
      count_tokens: text -> number of tokens (the policy tokenizer's).
      max_hint_tokens: hints with more tokens are rejected as "too_long".
      answer: the task's gold answer; a hint stating it is rejected as "leaked"
        (None: no gold known, no check).
    """
    score = None
    scores = _SCORE.findall(text)
    if scores:
        value = float(scores[-1])
        score = value if 0.0 <= value <= 1.0 else None
    boxed = extract_boxed(text)
    if boxed is None or not boxed.strip():
        return Verdict("malformed", score=score, raw=text)
    content = boxed.strip()
    if content == NO_INTERVENTION:
        return Verdict("no_intervention", score=score, raw=text)
    n = count_tokens(content)
    if n > max_hint_tokens:
        return Verdict("too_long", score=score, hint_tokens=n, raw=text)
    if answer is not None and hint_leaks_answer(content, answer):
        return Verdict("leaked", score=score, hint_tokens=n, raw=text)
    return Verdict("hint", hint=content, score=score, hint_tokens=n, raw=text)


def gold_answer(trajectory: Trajectory) -> str | None:
    """The task's gold answer for the leakage guard, or None when the task carries none."""
    answer = trajectory.task_metadata.get("answer")
    return None if answer is None else str(answer)


def render_trajectory(trajectory: Trajectory) -> str:
    """The episode after the prompt: assistant turns and tool feedback, labelled."""
    lines = []
    started = False
    for turn in trajectory.turns:
        role = turn.get("role")
        started = started or role == "assistant"
        if started:
            label = "Model" if role == "assistant" else "Tool"
            lines.append(f"[{label}] {turn['content']}")
    return "\n".join(lines) if lines else "(no response)"


def judge_prompt(template: str, trajectory: Trajectory) -> str:
    """Fill the judge template: {problem} {trajectory} {outcome} {reward} {reference_answer}."""
    users = [t["content"] for t in trajectory.turns if t.get("role") == "user"]
    correct = trajectory.reward_components.get("correct")
    if correct is None:
        outcome = f"finished ({trajectory.finish_reason or 'unknown'})"
    else:
        outcome = "correct" if correct else f"incorrect ({trajectory.finish_reason or 'unknown'})"
    return template.format(
        problem=users[0] if users else "",
        trajectory=render_trajectory(trajectory),
        outcome=outcome,
        reward=f"{trajectory.reward:g}",
        reference_answer=str(trajectory.task_metadata.get("answer", "")),
    )


class ModelJudge:
    """A model judge decoded through the rollout driver.

    Args:
      driver: the rollout ``Driver`` (its engine decodes the judge prompts).
      tokenizer: chat template for the judge prompt, token counts for the hint limit.
      template: the judge template (``JUDGE_TEMPLATE`` when empty).
      max_new_tokens, temperature: decoding of one judge answer.
      max_hint_tokens: the hint limit.
      params: the judge's params (reference / teacher), swapped into the driver for the
        call and replaced by the caller's ``policy`` afterwards; None: judge with whatever the
        driver holds (the current policy).
      calls: judge calls made already (a resumed run draws the seeds it would have).
      seed: base seed of the judge's sampling.
    """

    def __init__(self, driver: Any, tokenizer: Any, *, template: str = "", max_new_tokens: int = 256,
                 temperature: float = 0.0, max_hint_tokens: int = 64, params: Any = None,
                 seed: int = 0, calls: int = 0):
        self.driver = driver
        self.tokenizer = tokenizer
        self.template = template or JUDGE_TEMPLATE
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_hint_tokens = max_hint_tokens
        self.params = params
        self.seed = seed
        self.calls = calls

    async def _one(self, trajectory: Trajectory, seed: int) -> Verdict:
        messages = [{"role": "user", "content": judge_prompt(self.template, trajectory)}]
        ids = self.tokenizer.apply_chat(messages, add_generation_prompt=True)
        try:
            completion = await self.driver.generate(
                ids, SamplingParams(temperature=self.temperature, seed=seed),
                stop_token_ids=self.tokenizer.eos_token_ids, max_new_tokens=self.max_new_tokens,
            )
        except ValueError as e:  # the request alone cannot fit (prompt too long): no hint, counted
            logger.warning("judge request failed: %s", e)
            return Verdict("error", raw=str(e))
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return parse_judge_output(text, count_tokens=lambda s: len(self.tokenizer.encode(s)),
                                  max_hint_tokens=self.max_hint_tokens, answer=gold_answer(trajectory))

    async def __call__(self, trajectories: Sequence[Trajectory], policy: tuple[Any, int]) -> list[Verdict]:
        self.calls += 1
        base = (self.seed * 1_000_003 + self.calls * 7919) & 0x7FFFFFFF
        if self.params is not None:
            await self.driver.update_params(self.params, -1, drain=True)
        try:
            return list(await asyncio.gather(*[self._one(t, (base + i) & 0x7FFFFFFF)
                                               for i, t in enumerate(trajectories)]))
        finally:
            if self.params is not None:
                params, version = policy
                await self.driver.update_params(params, version, drain=True)


class ArithmeticOracleJudge:
    """Scripted judge of the arithmetic demo: the judge text a perfect PRM would write.

    It reads the task's operands and the tool feedback: a correct episode gets
    ``\\boxed{-1}``; an answer from memory gets "call the interpreter with the exact
    expression"; a wrong expression in the code gets the exact expression; a correct
    interpreter result that was not copied gets "copy it into the box" (the hints are
    ``envs.arithmetic.bridge_thought``'s, which the hint-following SFT data uses too).
    The text goes through ``parse_judge_output`` like a model's, with the same hint limit
    and leakage guard.
    """

    def __init__(self, count_tokens: Callable[[str], int], *, max_hint_tokens: int = 64):
        self.count_tokens = count_tokens
        self.max_hint_tokens = max_hint_tokens

    def judge_text(self, trajectory: Trajectory) -> str:
        meta = trajectory.task_metadata
        if trajectory.reward_components.get("correct", trajectory.reward > 0):
            return "Score: 1\n\\boxed{-1}"
        assistant = " ".join(t["content"] for t in trajectory.turns if t.get("role") == "assistant")
        feedback = " ".join(t["content"] for t in trajectory.turns if t.get("role") == "tool")
        if "<code>" not in assistant:
            mistake = "memory"
        elif str(meta["answer"]) in feedback:
            mistake = "not_copied"
        else:
            mistake = "wrong_code"
        return f"Score: 0\n\\boxed{{{bridge_thought(meta, mistake)}}}"

    async def __call__(self, trajectories: Sequence[Trajectory], policy: tuple[Any, int] = (None, 0)) -> list[Verdict]:
        return [parse_judge_output(self.judge_text(t), count_tokens=self.count_tokens,
                                   max_hint_tokens=self.max_hint_tokens, answer=gold_answer(t))
                for t in trajectories]


def judge_metrics(verdicts: Sequence[Verdict]) -> dict[str, float]:
    """Fractions per status, mean hint length, mean PRM score (over verdicts that have one)."""
    n = max(len(verdicts), 1)
    out = {f"judge/{s}": sum(v.status == s for v in verdicts) / n for s in STATUSES}
    out["judge/hint_fraction"] = out.pop("judge/hint")
    lengths = [v.hint_tokens for v in verdicts if v.status == "hint"]
    out["judge/hint_tokens"] = float(np.mean(lengths)) if lengths else 0.0
    scores = [v.score for v in verdicts if v.score is not None]
    if scores:
        out["judge/prm_score"] = float(np.mean(scores))
    return out


def apply_prm_reward(trajectories: Sequence[Trajectory], verdicts: Sequence[Verdict], weight: float) -> None:
    """reward += weight * score where the judge gave a score; the score is kept in reward_components."""
    for t, v in zip(trajectories, verdicts, strict=True):
        if v.score is not None:
            t.reward_components["prm_score"] = v.score
            t.reward = t.reward + weight * v.score


def is_failed(trajectory: Trajectory) -> bool:
    """The episode did not solve its task: ``correct`` when the environment reports it, else reward <= 0."""
    correct = trajectory.reward_components.get("correct")
    return not correct if correct is not None else trajectory.reward <= 0


def teacher_hints(trajectories: Sequence[Trajectory], verdicts: Sequence[Verdict], *,
                  only_failed: bool) -> tuple[list[str | None], dict[str, float]]:
    """The hints the teacher reads: the verdicts' hints, with ``only_failed`` none on solved episodes.

    A judge may also "correct" a solved episode; distilling toward a hint there pushes on a
    trajectory the outcome reward already calls right. Dropped hints are counted
    (``judge/dropped_on_solved``, a share of all episodes).
    """
    hints = [v.hint for v in verdicts]
    dropped = 0
    if only_failed:
        for i, t in enumerate(trajectories):
            if hints[i] is not None and not is_failed(t):
                hints[i] = None
                dropped += 1
    return hints, {"judge/dropped_on_solved": dropped / max(len(hints), 1)}


def placebo_for(trajectories: Sequence[Trajectory], hints: Sequence[str | None],
                count_tokens: Callable[[str], int], rng: np.random.Generator) -> tuple[list[str | None], dict[str, float]]:
    """Placebo hints (``rewards.hints.placebo_hints``): other tasks' hints of the same token length.

    Tasks are told apart by their prompt token ids. Metrics, as shares of the hinted
    episodes: ``placebo/same_length``, ``placebo/other_length``, ``placebo/unmatched``.
    """
    lengths = [count_tokens(h) if h is not None else 0 for h in hints]
    keys = [np.asarray(t.prompt_token_ids).tobytes() for t in trajectories]
    placebo, stats = placebo_hints(hints, lengths, keys, rng)
    n = max(stats.hinted, 1)
    return placebo, {"placebo/same_length": stats.same_length / n, "placebo/other_length": stats.other_length / n,
                     "placebo/unmatched": stats.unmatched / n}
