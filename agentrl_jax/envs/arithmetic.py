"""Arithmetic environment for the CPU demo: a tiny model learns to call the interpreter.

Tasks are multi-digit sums and products ("difficulty" = digits per operand). A model of
a few million parameters cannot multiply 5-digit numbers in its head, but it can learn
to copy them into code and the printed result into the answer.

Short format (default, `fenced=False`), one line per turn, no system prompt:

    user:        What is 4821*937?
    assistant:   <code>print(4821*937)</code>
    interpreter: <interpreter>4517277</interpreter>
    assistant:   \\boxed{4517277}

`fenced=True` gives the full ReTool format. Held-out tasks are disjoint from training
tasks by construction (a hash of the operands decides the split).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv, wrap_interpreter
from agentrl_jax.envs.sandbox import SandboxPool
from agentrl_jax.rewards.shaping import RewardWeights
from agentrl_jax.rewards.verifier import MathVerifier

if TYPE_CHECKING:
    from agentrl_jax.config import Config

OPERATORS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def arithmetic_config(fenced: bool = False, **overrides) -> ReToolConfig:
    """ReTool limits suited to the demo: few turns, short observations, binary outcome."""
    defaults = dict(max_turns=3, max_tool_calls=2, max_observation_chars=64, tool_timeout_s=2.0, stateful=False,
                    fenced=fenced, system_prompt=None, reward_weights=RewardWeights(outcome_scheme="binary"))
    return ReToolConfig(**{**defaults, **overrides})


class ArithmeticEnv(ReToolEnv):
    """`ReToolEnv` with the demo's short format; tasks come from `make_tasks`."""

    def __init__(self, pool: SandboxPool, verifier: MathVerifier, config: ReToolConfig | None = None,
                 count_tokens=None):
        super().__init__(pool, verifier, config or arithmetic_config(), count_tokens=count_tokens)

    @staticmethod
    def config_from(config: Config) -> ReToolConfig:
        """The settings of a run's ``environment`` section over the demo's (short format, no
        system prompt: ``environment.system_prompt`` does not apply)."""
        return ReToolConfig.from_config(config, base=arithmetic_config())


def _is_held_out(a: int, b: int, op: str, held_out_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < held_out_fraction


def make_tasks(num_tasks: int, digits: int, *, seed: int, split: str = "train", operators: str = "*+",
               held_out_fraction: float = 0.1) -> list[dict[str, Any]]:
    """`num_tasks` problems with `digits`-digit operands; train and held_out never overlap."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if digits < 1 or not set(operators) <= set(OPERATORS):
        raise ValueError(f"digits must be >= 1 and operators within {sorted(OPERATORS)}, got {digits}, {operators!r}")
    rng = np.random.default_rng([seed, digits])
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
    tasks, attempts = [], 0
    while len(tasks) < num_tasks:
        attempts += 1
        if attempts > 100 * num_tasks + 1000:
            raise ValueError(f"cannot draw {num_tasks} {split} tasks with {digits} digits")
        a, b = (int(x) for x in rng.integers(low, high, size=2))
        op = operators[int(rng.integers(len(operators)))]
        if _is_held_out(a, b, op, held_out_fraction) != (split == "held_out"):
            continue
        answer = OPERATORS[op](a, b)
        tasks.append({"question": f"What is {a}{op}{b}?", "answer": str(answer), "a": a, "b": b, "op": op,
                      "digits": digits, "split": split})
    return tasks


def _corrupt(number: int, rng: np.random.Generator, num_digits_changed: int) -> int:
    digits = list(str(number))
    for index in rng.choice(len(digits), size=min(num_digits_changed, len(digits)), replace=False):
        choices = [d for d in "0123456789" if d != digits[index] and not (index == 0 and d == "0")]
        digits[index] = str(rng.choice(choices))
    return int("".join(digits))


def demonstration(task: dict[str, Any], style: str, rng: np.random.Generator, *, fenced: bool = False,
                  memory_exact_up_to_digits: int = 2, layout: str = "inline") -> list[dict[str, Any]]:
    """An SFT demonstration as turns; only `assistant` turns are trained on (loss_mask 1).

    style "tool": code, the interpreter's exact output, then the copied boxed answer.
    style "memory": a direct boxed guess, right for tasks up to `memory_exact_up_to_digits`
    digits and corrupted in one or two digits above it (what a tiny model would guess).
    layout "native": the tool turn is an assistant message with a ``python`` tool call and the
    output a ``tool`` message, for the chat template to render (envs/tools/).
    """
    answer = int(task["answer"])
    expression = f"{task['a']}{task['op']}{task['b']}"
    if layout not in ("inline", "native"):
        raise ValueError(f"demonstration layout must be 'inline' or 'native', got {layout!r}")
    if style == "tool" and layout == "native":
        call = {"type": "function", "function": {"name": "python", "arguments": {"code": f"print({expression})"}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "python", "content": str(answer)},
                {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]
    if style == "tool":
        code = f"```python\nprint({expression})\n```" if fenced else f"print({expression})"
        code_turn = f"<code>\n{code}\n</code>" if fenced else f"<code>{code}</code>"
        return [{"role": "assistant", "content": code_turn},
                {"role": "interpreter", "content": wrap_interpreter(str(answer), fenced)},
                {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]
    if style == "memory":
        guess = answer
        if task["digits"] > memory_exact_up_to_digits:
            guess = _corrupt(answer, rng, int(rng.integers(1, 3)))
        return [{"role": "assistant", "content": f"\\boxed{{{guess}}}"}]
    raise ValueError(f"demonstration style must be 'tool' or 'memory', got {style!r}")


#: The mistakes a failed arithmetic episode can make, each with its bridge thought.
MISTAKES = ("memory", "wrong_code", "not_copied")


def bridge_thought(task: dict[str, Any], mistake: str) -> str:
    """The hint a perfect judge writes for a failed episode of ``task`` (the Retool-RL
    case study's format: one short first-person, actionable fix). None of them states the answer, so the
    leakage guard (``rewards.hints``) lets them through.

    mistake "memory": answered without the tool; "wrong_code": printed another
    expression; "not_copied": the interpreter printed the result but the box holds another number.
    """
    expression = f"{task['a']}{task['op']}{task['b']}"
    if mistake == "memory":
        return f"I should call the interpreter: <code>print({expression})</code>"
    if mistake == "wrong_code":
        return f"I should print exactly {expression}: <code>print({expression})</code>"
    if mistake == "not_copied":
        return "I should copy the number the interpreter printed into the box, digit by digit."
    raise ValueError(f"bridge_thought: mistake must be one of {MISTAKES}, got {mistake!r}")


def hinted_demonstration(task: dict[str, Any], rng: np.random.Generator, *, fenced: bool = False,
                         hint_format: str = "\nHint: {hint}") -> tuple[str, list[dict[str, str]]]:
    """A hint-following SFT demonstration: (text appended to the user message, turns).

    The hint is the bridge thought of a mistake drawn uniformly from ``MISTAKES``, in the
    teacher's ``hint_format`` (placement ``user_message``); the assistant follows it: it
    calls the interpreter with the exact expression and copies the printed result. Trained
    on these, the post-SFT policy can read a hint when it later serves as the teacher.
    """
    mistake = MISTAKES[int(rng.integers(len(MISTAKES)))]
    return hint_format.format(hint=bridge_thought(task, mistake)), demonstration(task, "tool", rng, fenced=fenced)


__all__ = ["ArithmeticEnv", "MISTAKES", "arithmetic_config", "bridge_thought", "demonstration",
           "hinted_demonstration", "make_tasks", "OPERATORS"]
