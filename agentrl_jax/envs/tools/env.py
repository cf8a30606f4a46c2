"""A generic tool-calling environment in the native chat layout.

The episode is a chat: the model's turn ends with its end-of-turn token; if the turn holds
tool calls (Hermes/Qwen ``<tool_call>`` blocks or a Llama 3.x JSON call), they are checked
and run, concurrently, and each answer comes back as a ``tool`` message, which the agent
loop appends through the chat template; a turn without calls is the final answer, graded.

What happens to each kind of turn (never an exception):

- calls that parse, name a registered tool and fit its schema: run concurrently (each with
  ``tool_timeout_s``); the result (or the tool's failure or timeout) is its tool message.
- a malformed call (``bad_json``, ``unknown_tool``, ``bad_arguments``): not run; its tool
  message says what was wrong and how to write a call; counted in ``tool_stats.malformed``
  (and ``errors``) and per kind in ``malformed_counts``.
- calls beyond ``max_calls_per_turn`` in one turn, or beyond ``max_tool_calls`` in the
  episode: not run; their tool message asks for fewer calls / the final answer.
- no call: the final answer, graded by :meth:`ToolCallingEnv.grade` (episode done; "no_answer"
  when the grader finds no answer in it, e.g. no ``\\boxed{}``).
- ``max_turns`` turns without a final answer: done ("max_turns"), graded as no answer.
- cut short by the agent loop: ``truncated_result`` grades it as no answer.

Subclasses set the task's grading (``grade``, ``initial_messages``); ``envs/tools/tasks.py``
has the ReTool and Search-R1 ones.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from agentrl_jax.envs.base import Environment, StepResult, ToolStats
from agentrl_jax.envs.retool import truncate_middle
from agentrl_jax.envs.tools.parsers import MalformedCall, ToolCall, parser_for
from agentrl_jax.envs.tools.registry import ToolRegistry, ToolResult

CALL_HELP = {
    "hermes": 'Write a call as <tool_call>\n{"name": <tool>, "arguments": {...}}\n</tool_call>.',
    "llama3": 'Write a call as {"name": <tool>, "parameters": {...}}.',
}


@dataclasses.dataclass(frozen=True)
class ToolEnvConfig:
    tool_format: Literal["hermes", "llama3"] = "hermes"
    max_turns: int = 8  # assistant turns per episode
    max_tool_calls: int = 8  # calls run per episode
    max_calls_per_turn: int = 4
    max_observation_chars: int = 2048  # of one tool message
    max_observation_tokens: int | None = None  # enforced when the env has a `count_tokens`
    tool_timeout_s: float = 10.0
    system_prompt: str | None = None

    def __post_init__(self):
        parser_for(self.tool_format)
        for name in ("max_turns", "max_calls_per_turn", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToolEnvConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tool_calls < 0:
            raise ValueError(f"ToolEnvConfig.max_tool_calls must be >= 0, got {self.max_tool_calls}")


@dataclasses.dataclass(frozen=True)
class Grade:
    """The grading of a final answer: reward, whether it is correct, the reward's terms."""

    reward: float
    correct: bool
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    answer: str | None = None


class ToolCallingEnv(Environment):
    """Native tool calling over a :class:`ToolRegistry`; tasks are ``{"question": ..., ...}``.

    Args:
      make_registry: builds the tools of one episode (called at every reset, so per-episode
        state such as a sandbox session is fresh).
      config: limits and the tool-call format.
      grader: ``(final_text, task) -> Grade`` (may be async); subclasses override ``grade``
        instead. None: exact match of the final text with ``task["answer"]``.
      count_tokens: the policy tokenizer's token count, for ``max_observation_tokens``.
    """

    stop_strings = ()  # a native turn ends at the model's end-of-turn token

    def __init__(self, make_registry: Callable[[], ToolRegistry], config: ToolEnvConfig = ToolEnvConfig(), *,
                 grader: Callable[[str, dict[str, Any]], Any] | None = None,
                 count_tokens: Callable[[str], int] | None = None):
        self.make_registry, self.config, self.grader, self.count_tokens = make_registry, config, grader, count_tokens
        self.parse = parser_for(config.tool_format)
        self.registry: ToolRegistry | None = None  # built at reset: tools hold per-episode state
        # The schemas are known before the first episode (SFT prompts list them too); building
        # a registry allocates nothing until a tool runs.
        self.tools = make_registry().schemas()
        self.task: dict[str, Any] | None = None

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return system + [{"role": "user", "content": str(task["question"])}]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        if "question" not in task:
            raise KeyError(f"{type(self).__name__} task is missing field 'question'")
        await self.close()
        self.registry = self.make_registry()
        self.tools = self.registry.schemas()
        self.task = task
        self.turns = 0
        self.num_sampled_tokens = 0
        self.tool_stats = ToolStats()
        self.malformed_counts: collections.Counter[str] = collections.Counter()
        self.response = ""
        self.messages: list[dict[str, Any]] = []
        return self.initial_messages(task)

    async def step(self, action_text: str) -> StepResult:
        """One assistant turn -> tool messages or the final grade; see the module docstring."""
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset")
        self.turns += 1
        self.response += action_text
        parsed = self.parse(action_text)
        self.messages.append(parsed.assistant_message())
        if not parsed.calls:
            return await self._finish(parsed.content, "answer")
        checked = [self.registry.check(call) for call in parsed.calls]
        results = await asyncio.gather(*(self._answer(i, call) for i, call in enumerate(checked)))
        messages = [{"role": "tool", "name": call.name or "error", "content": self._limit(result.text)}
                    for call, result in zip(checked, results)]
        self.messages += messages
        info = {"calls": [c.name for c in checked],
                "malformed": [c.kind for c in checked if isinstance(c, MalformedCall)]}
        if self.turns >= self.config.max_turns:
            return await self._finish(None, "max_turns", info)
        return StepResult("", 0.0, False, info, tool_stats=dataclasses.replace(self.tool_stats),
                          observation_messages=messages)

    async def _answer(self, index: int, call: ToolCall | MalformedCall) -> ToolResult:
        """The result of the index-th (checked) call of a turn; counts it."""
        self.tool_stats.calls += 1
        if isinstance(call, MalformedCall):
            self.tool_stats.errors += 1
            self.tool_stats.malformed += 1
            self.malformed_counts[call.kind] += 1
            help_text = CALL_HELP[self.config.tool_format] if call.kind == "bad_json" else ""
            return ToolResult(f"Error: {call.reason}. {help_text}".strip(), ok=False)
        if index >= self.config.max_calls_per_turn or self.tool_stats.calls > self.config.max_tool_calls:
            self.tool_stats.calls -= 1  # not run: not a call
            limit = (f"at most {self.config.max_calls_per_turn} calls per turn" if index >= self.config.max_calls_per_turn
                     else f"the tool call limit ({self.config.max_tool_calls}) is reached; give your final answer")
            return ToolResult(f"Not run: {limit}.", ok=False)
        result = await self.registry.run(call, timeout_s=self.config.tool_timeout_s)
        self.tool_stats.timeouts += int(result.timed_out)
        self.tool_stats.errors += int(not result.ok and not result.timed_out)
        return result

    def _limit(self, text: str) -> str:
        text = truncate_middle(text, self.config.max_observation_chars)
        limit = self.config.max_observation_tokens
        if self.count_tokens is not None and limit is not None:
            while self.count_tokens(text) > limit and len(text) > 64:
                text = truncate_middle(text, int(len(text) * 0.8))
        return text

    async def grade(self, final_text: str) -> Grade:
        """Grades the final turn's text (the content outside any call)."""
        if self.grader is not None:
            grade = self.grader(final_text, self.task)
            return await grade if asyncio.iscoroutine(grade) else grade
        correct = final_text.strip() == str(self.task.get("answer", "")).strip()
        return Grade(float(correct), correct, {"outcome": float(correct)}, final_text)

    async def _finish(self, final_text: str | None, finish_reason: str, info: dict[str, Any] | None = None
                      ) -> StepResult:
        """The final StepResult; ``final_text`` None: the episode ended without an answer."""
        grade = self.unanswered_grade() if final_text is None else await self.grade(final_text)
        if finish_reason == "answer" and grade.answer is None:  # a final turn the grader found no answer in
            finish_reason = "no_answer"
        info = dict(info or {}, answer=grade.answer, malformed_counts=dict(self.malformed_counts),
                    messages=list(self.messages))
        return StepResult("", grade.reward, True, info, finish_reason=finish_reason, correct=grade.correct,
                          reward_components=dict(grade.components), tool_stats=dataclasses.replace(self.tool_stats))

    def truncated_result(self, finish_reason: str, num_sampled_tokens: int) -> StepResult:
        """A cut-short episode scores as an unanswered one (graded synchronously: no verifier call)."""
        self.num_sampled_tokens = num_sampled_tokens
        grade = self.unanswered_grade()
        return StepResult("", grade.reward, True, {"answer": None}, finish_reason=finish_reason, correct=False,
                          reward_components=dict(grade.components), tool_stats=dataclasses.replace(self.tool_stats))

    def unanswered_grade(self) -> Grade:
        """The grade of an episode without an answer (no verifier needed)."""
        return Grade(0.0, False, {"outcome": 0.0})

    async def close(self) -> None:
        registry, self.__dict__["registry"] = getattr(self, "registry", None), None
        if registry is not None:
            await registry.close()

