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

``ArithmeticEnvConfig`` is the environment's config section (``environment.name='arithmetic'``):
it generates the tasks and writes the SFT demonstrations (``arithmetic_demonstrations``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from agentrl_jax.config import (Config, ConfigError, EnvironmentConfig, config_field, register_environment,
                                require)
from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv, code_env_factory, initial_messages, wrap_interpreter
from agentrl_jax.envs.sandbox import SandboxPool
from agentrl_jax.rewards.shaping import RewardWeights
from agentrl_jax.rewards.verifier import MathVerifier

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


#: The fields of a generated task the demonstrations and the oracle judge's hints are written from.
TASK_FIELDS = ("a", "b", "op", "digits")


def arithmetic_demonstrations(config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
    """SFT conversations for the arithmetic demo: a mix of tool use and answers from memory.

    A ``demo_hint_fraction`` of demonstrations carry a bridge thought at the end of the
    user message (``hinted_demonstration``, in ``hybrid.hint_format``) and follow it; of
    the others, a ``demo_tool_fraction`` call the interpreter and copy its result and the
    rest answer directly, right on easy tasks and often wrong on long numbers. The style
    is drawn independently of the task, so the SFT policy calls the tool about as often
    as the demonstrator did, whatever the difficulty: RL has to learn when the tool pays
    off. The SFT stage itself is not weakened. With ``demo_hint_fraction=0`` the random
    stream, and so the data, is the same as before hints existed.

    Raises:
      ConfigError: a task without the operands of a generated one (``TASK_FIELDS``), e.g.
        a question/answer dataset in ``data.train_path``.
    """
    for task in tasks:
        missing = [key for key in TASK_FIELDS if key not in task]
        if missing:
            raise ConfigError(
                f"data.train_path: environment.name='arithmetic' writes its SFT demonstrations from the operands of "
                f"its generated tasks (fields {', '.join(TASK_FIELDS)}), but task {task.get('id', '')!r} has "
                f"{sorted(task)}; for question/answer data use --set environment.name=retool (with model.path), "
                "or leave data.train_path and data.eval_path empty to generate arithmetic tasks")
    rng = np.random.default_rng([config.seed, 7])
    env_cfg = ArithmeticEnv.config_from(config)
    hint_fraction = config.environment.demo_hint_fraction
    conversations = []
    for task in tasks:
        messages = initial_messages(env_cfg, task)
        if hint_fraction and rng.random() < hint_fraction:
            suffix, turns = hinted_demonstration(task, rng, fenced=env_cfg.fenced,
                                                 hint_format=config.hybrid.hint_format)
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + suffix}
        else:
            style = "tool" if rng.random() < config.environment.demo_tool_fraction else "memory"
            turns = demonstration(task, style, rng, fenced=env_cfg.fenced, layout=config.environment.layout)
        conversations.append(messages + turns)
    return conversations


@register_environment("arithmetic")
@dataclass(frozen=True)
class ArithmeticEnvConfig(EnvironmentConfig):
    """The CPU demo: multi-digit sums and products with a Python tool (this module)."""

    name: str = config_field("arithmetic", "Which environment runs the episodes.")
    min_digits: int = config_field(2, "arithmetic: smallest operand width of generated tasks.")
    max_digits: int = config_field(4, "arithmetic: largest operand width of generated tasks.")
    num_train_tasks: int = config_field(4000, "arithmetic: generated training tasks (when data.train_path is "
                                              "empty).")
    num_eval_tasks: int = config_field(200, "arithmetic: generated held-out tasks (when data.eval_path is empty).")
    demo_tool_fraction: float = config_field(0.5, "arithmetic SFT: fraction of the unhinted demonstrations that "
                                                  "call the tool.")
    demo_hint_fraction: float = config_field(
        0.0, "arithmetic SFT: fraction of demonstrations whose user message ends with a bridge thought (the oracle "
        "judge's hint in hybrid.hint_format) that the assistant follows (exact code, copied result); these teach "
        "the post-SFT policy, later the teacher, to read hints (docs/hybrid.md).")

    generates_tasks: ClassVar[bool] = True
    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def validate(self) -> None:
        super().validate()
        require(1 <= self.min_digits <= self.max_digits, "environment.min_digits/max_digits",
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        require(0 <= self.demo_tool_fraction <= 1, self._path("demo_tool_fraction"), "must be in [0, 1]")
        require(0 <= self.demo_hint_fraction <= 1, self._path("demo_hint_fraction"), "must be in [0, 1]")
        require(self.num_train_tasks >= 1, self._path("num_train_tasks"), "must be >= 1")
        require(self.num_eval_tasks >= 1, self._path("num_eval_tasks"), "must be >= 1")

    def validate_in(self, config: Config) -> None:
        super().validate_in(config)
        require(not self.demo_hint_fraction or config.hybrid.hint_placement == "user_message",
                self._path("demo_hint_fraction"),
                f"({self.demo_hint_fraction}) writes the hint into the user message, as the teacher reads it with "
                f"hybrid.hint_placement='user_message'; with {config.hybrid.hint_placement!r} the demonstrations "
                "would teach another context than the teacher sees (set hint_placement='user_message')")
        require(not self.demo_hint_fraction or self.layout == "inline", self._path("demo_hint_fraction"),
                "hint-following demonstrations are written in the inline layout only; "
                "set environment.layout='inline' or demo_hint_fraction=0")

    def make_tasks(self, config: Config, split: Literal["train", "eval"]) -> list[dict[str, Any]]:
        widths = range(self.min_digits, self.max_digits + 1)
        count = self.num_train_tasks if split == "train" else self.num_eval_tasks
        per = -(-count // len(widths))
        split_name = "train" if split == "train" else "held_out"
        return [t for d in widths for t in make_tasks(per, d, seed=config.seed, split=split_name)]

    def make_demonstrations(self, config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
        return arithmetic_demonstrations(config, tasks)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        return code_env_factory(self, ArithmeticEnv, ArithmeticEnv.config_from(config), pool, verifier, count_tokens)


__all__ = ["ArithmeticEnv", "ArithmeticEnvConfig", "MISTAKES", "OPERATORS", "TASK_FIELDS", "arithmetic_config",
           "arithmetic_demonstrations", "bridge_thought", "demonstration", "hinted_demonstration", "make_tasks"]
