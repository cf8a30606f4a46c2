"""Scripted judge for the program tasks (``envs/program_tasks.py``): bridge thoughts in plain English.

The arithmetic oracle (``hindsight.ArithmeticOracleJudge``) writes terse, templated hints for a
model trained from scratch on that template. A pretrained instruct model was trained on
ordinary sentences, so this judge writes what a reviewer would say to it: first person, one
or two sentences, naming the one fix at the earliest point where the episode went wrong.
It reads the task (the solver's program), the episode's turns and the interpreter's
feedback, and names one failure kind:

    memory         no program: the answer was written from memory
    error          the last program raised (or never ran: an unclosed tag, a timeout)
    wrong_program  a program ran but did not print the answer
    not_copied     the interpreter printed the answer, the box says something else (or none)

A solved episode gets ``\\boxed{-1}``. The text goes through ``hindsight.parse_judge_output``
like a model judge's, so the hint limit and the leakage guard (a hint that states the gold
answer is dropped) apply unchanged; the wrong-program hint names the solver's expression,
never its value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from agentrl_jax.envs.base import Trajectory
from agentrl_jax.train.guidance.hindsight import Verdict, gold_answer, parse_judge_output

FAILURES = ("memory", "error", "wrong_program", "not_copied")
_INTERPRETER = re.compile(r"<interpreter>(.*?)</interpreter>", re.DOTALL)
_ERROR = re.compile(r"\b(\w+Error|Exception|TimeoutError)\b")
_MISSING = re.compile(r"NameError: name '(\w+)' is not defined")


def interpreter_outputs(trajectory: Trajectory) -> list[str]:
    """The body of every interpreter answer of the episode, in order (environment corrections included)."""
    bodies = []
    for turn in trajectory.turns:
        if turn.get("role") in ("tool", "interpreter"):
            found = _INTERPRETER.findall(turn["content"])
            bodies += [b.strip() for b in found] or [turn["content"].strip()]
    return bodies


def failure_kind(trajectory: Trajectory) -> str | None:
    """One of ``FAILURES`` for a failed episode, None for a solved one (module docstring)."""
    if trajectory.reward_components.get("correct", trajectory.reward > 0):
        return None
    assistant = " ".join(t["content"] for t in trajectory.turns if t.get("role") == "assistant")
    if "<code>" not in assistant:
        return "memory"
    outputs = interpreter_outputs(trajectory)
    answer = str(trajectory.task_metadata["answer"])
    if any(answer in line.split() for body in outputs for line in body.splitlines()):
        return "not_copied"
    if not outputs or _ERROR.search(outputs[-1]) or outputs[-1].startswith("Error:"):
        return "error"
    return "wrong_program"


def _error_fix(output: str) -> str:
    """The sentence about the error the last program raised."""
    missing = _MISSING.search(output)
    if missing and missing.group(1) == "math":
        return "My program failed because I forgot to import math."
    if missing:
        return f"My program failed because the name {missing.group(1)} is misspelled or not defined."
    if "SyntaxError" in output or "was not closed" in output:
        return "My program has a syntax error: a parenthesis or the code block is not closed."
    if "TypeError" in output:
        return "My program failed because I added text to a number; I should print the number itself."
    if "Timeout" in output:
        return "My program ran too long; I should compute it with a direct formula."
    found = _ERROR.search(output)
    return f"My program raised a {found.group(1)}; I should fix that line." if found else \
        "My program did not run; I should fix it."


def _expression(task: dict[str, Any]) -> str:
    """The solver's expression: the right-hand side of ``answer = ...`` in the task's program."""
    for line in str(task["program"]).splitlines():
        if line.startswith("answer = "):
            return line.removeprefix("answer = ")
    raise ValueError(f"program task without an 'answer = ...' line: {task.get('question')!r}")


def bridge_thought(task: dict[str, Any], kind: str, last_output: str = "") -> str:
    """The bridge thought for a failure of ``kind`` on ``task`` (``last_output``: the last interpreter answer)."""
    imports = "import math and " if task.get("uses_math") else ""
    if kind == "memory":
        return ("I cannot work this out reliably in my head. I should write a short Python program in "
                "<code> that computes it, run it, and copy the printed number into the box.")
    if kind == "error":
        return _error_fix(last_output) + " Then I should run it again and copy the printed number."
    if kind == "wrong_program":
        return (f"My program computes the wrong quantity. I should {imports}compute "
                f"answer = {_expression(task)}, print it, and copy the printed number.")
    if kind == "not_copied":
        return ("The interpreter already printed the right result. I should copy that number into "
                "\\boxed{} exactly, digit by digit.")
    raise ValueError(f"bridge_thought: kind must be one of {FAILURES}, got {kind!r}")


class ProgramOracleJudge:
    """Scripted judge of the program tasks: the judge text a perfect reviewer would write.

    Args:
      count_tokens: text -> tokens (the policy tokenizer's), for the hint limit.
      max_hint_tokens: longer hints are rejected as "too_long" (counted, not truncated).
    """

    def __init__(self, count_tokens: Callable[[str], int], *, max_hint_tokens: int = 64):
        self.count_tokens = count_tokens
        self.max_hint_tokens = max_hint_tokens

    def judge_text(self, trajectory: Trajectory) -> str:
        kind = failure_kind(trajectory)
        if kind is None:
            return "Score: 1\n\\boxed{-1}"
        outputs = interpreter_outputs(trajectory)
        hint = bridge_thought(trajectory.task_metadata, kind, outputs[-1] if outputs else "")
        return f"Score: 0\n\\boxed{{{hint}}}"

    async def __call__(self, trajectories: Sequence[Trajectory], policy: tuple[Any, int] = (None, 0)) -> list[Verdict]:
        return [parse_judge_output(self.judge_text(t), count_tokens=self.count_tokens,
                                   max_hint_tokens=self.max_hint_tokens, answer=gold_answer(t))
                for t in trajectories]


__all__ = ["FAILURES", "ProgramOracleJudge", "bridge_thought", "failure_kind", "interpreter_outputs"]
