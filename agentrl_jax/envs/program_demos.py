"""Scripted-solver demonstrations in the ReTool layout, for the cold start of configs/retool_small.py.

The demonstrator solves a task of ``program_tasks`` in one of four styles, drawn
independently of the task (so the SFT policy inherits the mix everywhere, and RL has to
learn when a style pays off):

    tool     <code> the correct program </code>, the interpreter's output, \\boxed{output}
    memory   \\boxed{guess}: right when the answer has at most two digits, else one or two
             digits wrong (what a small model would guess)
    fix      <code> a program with a realistic bug </code>, the traceback, a one-line note on
             the error, <code> the correct program </code>, its output, \\boxed{output}
    give_up  the buggy program and its traceback, then \\boxed{guess} from memory

The bugs are those a person makes: ``import math`` left out (NameError), a misspelled
variable (NameError), an unclosed parenthesis (SyntaxError), a string concatenated with
the number (TypeError). Every program a demonstration shows is run in the real sandbox
pool and the demonstration carries exactly what the environment would answer: the same
``<interpreter>`` text, cut to the same ``max_observation_chars``. A correct program that
does not print the task's answer, or a buggy one that runs, is a generator bug and raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np

from agentrl_jax.envs.retool import ReToolConfig, initial_messages, interpreter_text, truncate_middle, wrap_interpreter

STYLES = ("tool", "memory", "fix", "give_up")
#: bug name -> (the note the demonstrator writes after reading the traceback, the error it raises)
BUGS = {
    "missing_import": ("I forgot to import math.", "NameError"),
    "typo": ("The variable name is misspelled.", "NameError"),
    "unclosed_paren": ("A parenthesis is not closed.", "SyntaxError"),
    "str_concat": ("Print the number itself, not text plus a number.", "TypeError"),
}
T = TypeVar("T")


def buggy_program(program: str, bug: str) -> str:
    """``program`` (``[import math]`` + ``answer = ...`` + ``print(answer)``) with ``bug`` put in."""
    if bug == "missing_import":
        if not program.startswith("import math\n"):
            raise ValueError("missing_import needs a program that imports math")
        return program.removeprefix("import math\n")
    if bug == "typo":
        return program.replace("print(answer)", "print(answr)")
    if bug == "unclosed_paren":
        return program.replace("print(answer)", "print(answer")
    if bug == "str_concat":
        return program.replace("print(answer)", 'print("The answer is " + answer)')
    raise ValueError(f"unknown bug {bug!r}; known: {', '.join(BUGS)}")


def code_action(program: str, config: ReToolConfig) -> str:
    """The policy's tool call for ``program`` in the environment's layout (fenced or raw)."""
    body = f"```python\n{program}\n```" if config.fenced else program
    return f"{config.open_tag}\n{body}\n{config.close_tag}"


def memory_guess(answer: int, rng: np.random.Generator, exact_up_to_digits: int = 2) -> int:
    """An answer from memory: exact up to ``exact_up_to_digits`` digits, else 1 or 2 digits changed."""
    digits = list(str(abs(answer)))
    if len(digits) <= exact_up_to_digits:
        return answer
    for index in rng.choice(len(digits), size=int(rng.integers(1, 3)), replace=False):
        choices = [d for d in "0123456789" if d != digits[index] and not (index == 0 and d == "0")]
        digits[index] = str(rng.choice(choices))
    return int("".join(digits)) * (-1 if answer < 0 else 1)


def draw_styles(count: int, fractions: dict[str, float], rng: np.random.Generator) -> list[str]:
    """``count`` styles drawn with ``fractions`` (style -> weight, normalized)."""
    unknown = sorted(set(fractions) - set(STYLES))
    if unknown or not fractions or min(fractions.values()) < 0 or sum(fractions.values()) <= 0:
        raise ValueError(f"style fractions must be non-negative weights over {STYLES}, got {fractions}")
    names = list(fractions)
    p = np.array([fractions[n] for n in names], dtype=np.float64)
    return [names[i] for i in rng.choice(len(names), size=count, p=p / p.sum())]


async def _observe(pool, program: str, config: ReToolConfig) -> tuple[str, bool]:
    result = await pool.run(program, timeout_s=config.tool_timeout_s)
    body = truncate_middle(interpreter_text(result), config.max_observation_chars)
    return wrap_interpreter(body, config.fenced), result.ok


async def demonstration(task: dict[str, Any], style: str, bug: str, pool, config: ReToolConfig,
                        rng: np.random.Generator) -> list[dict[str, str]]:
    """One conversation (system and user messages, then the turns) of ``style`` for ``task``.

    Raises:
      RuntimeError: the correct program does not print the answer, or the buggy one runs.
    """
    answer = int(task["answer"])
    turns: list[dict[str, str]] = []
    if style in ("fix", "give_up"):
        wrong = buggy_program(task["program"], bug)
        observation, ok = await _observe(pool, wrong, config)
        if ok or BUGS[bug][1] not in observation:
            raise RuntimeError(f"the {bug} bug did not raise {BUGS[bug][1]} for {task['question']!r}: {observation}")
        turns += [{"role": "assistant", "content": code_action(wrong, config)},
                  {"role": "interpreter", "content": observation}]
    if style in ("tool", "fix"):
        observation, ok = await _observe(pool, task["program"], config)
        printed = observation.split("<interpreter>")[-1].split("</interpreter>")[0].strip()
        if not ok or printed != str(answer):
            raise RuntimeError(f"the solver's program for {task['question']!r} printed {printed!r}, not {answer}")
        note = BUGS[bug][0] + "\n" if style == "fix" else ""
        turns += [{"role": "assistant", "content": note + code_action(task["program"], config)},
                  {"role": "interpreter", "content": observation},
                  {"role": "assistant", "content": f"\\boxed{{{printed}}}"}]
    elif style in ("memory", "give_up"):
        turns.append({"role": "assistant", "content": f"\\boxed{{{memory_guess(answer, rng)}}}"})
    else:
        raise ValueError(f"demonstration style must be one of {STYLES}, got {style!r}")
    return initial_messages(config, task) + turns


async def demonstrations(tasks: Sequence[dict[str, Any]], pool, config: ReToolConfig, *,
                         fractions: dict[str, float], seed: int) -> list[list[dict[str, str]]]:
    """A demonstration per task, styles drawn with ``fractions``, programs run in ``pool`` concurrently."""
    rng = np.random.default_rng([seed, 19])
    styles = draw_styles(len(tasks), fractions, rng)
    bugs = [[b for b in BUGS if b != "missing_import" or task["uses_math"]] for task in tasks]
    chosen = [options[int(rng.integers(len(options)))] for options in bugs]
    rngs = [np.random.default_rng([seed, 19, i]) for i in range(len(tasks))]
    return list(await asyncio.gather(*[demonstration(task, style, bug, pool, config, r)
                                       for task, style, bug, r in zip(tasks, styles, chosen, rngs)]))


def run_blocking(coroutine: Awaitable[T]) -> T:
    """Runs ``coroutine`` to completion on a fresh event loop in a worker thread, so callers that
    are themselves inside a running loop (the trainer's setup) can wait on it."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, coroutine).result()


__all__ = ["BUGS", "STYLES", "buggy_program", "code_action", "demonstration", "demonstrations", "draw_styles",
           "memory_guess", "run_blocking"]
