"""ReTool and Search-R1 in the native chat layout: the same tasks and rewards as the inline
environments (envs/retool.py, envs/search.py), with the tools called through the model's
own tool-call format and answered in ``tool`` messages.

- ReTool: a ``python`` tool (the sandbox pool, one stateful session per episode); the final
  turn (no call) is graded on its last ``\\boxed{}`` with the math verifier, and shaped by
  the composite reward (format, tool, overlong terms) over the policy's text.
- Search-R1: a ``search`` tool (the retriever); the final turn's ``<answer>...</answer>`` is
  scored with the run's answer metric (EM by default), as in the inline layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from agentrl_jax.envs.retool import ReToolConfig
from agentrl_jax.envs.search import SearchConfig, golden_answers, parse_action, search_reward, well_formed
from agentrl_jax.envs.tools.builtin import python_tool, search_tool
from agentrl_jax.envs.tools.env import Grade, ToolCallingEnv, ToolEnvConfig
from agentrl_jax.envs.tools.registry import ToolRegistry
from agentrl_jax.rewards.boxed import find_boxed_spans
from agentrl_jax.rewards.shaping import composite_reward

NATIVE_RETOOL_SYSTEM_PROMPT = (
    "Solve the problem step by step. You can run Python with the python tool; print() the values you "
    "need. Put the final answer in \\boxed{}.")
NATIVE_SEARCH_PROMPT_TEMPLATE = (
    "Answer the question below. Think inside <think> and </think> whenever you get new information. If you "
    "are missing knowledge, call the search tool; you may search several times. When you need no more "
    "information, give only the final answer inside <answer> and </answer>, for example <answer> Paris "
    "</answer>. Question: {question}\n")


def tool_env_config(settings: ReToolConfig | SearchConfig, tool_format: str, system_prompt: str | None,
                    timeout_s: float) -> ToolEnvConfig:
    """The native environment's limits from the inline environment's settings."""
    max_calls = settings.max_tool_calls if isinstance(settings, ReToolConfig) else settings.max_searches
    return ToolEnvConfig(tool_format=tool_format, max_turns=settings.max_turns, max_tool_calls=max_calls,
                         max_observation_chars=settings.max_observation_chars,
                         max_observation_tokens=settings.max_observation_tokens, tool_timeout_s=timeout_s,
                         system_prompt=system_prompt)


class NativeReToolEnv(ToolCallingEnv):
    """ReTool's math tasks with a native ``python`` tool; tasks are {"question", "answer"}."""

    def __init__(self, pool: Any, verifier: Any, settings: ReToolConfig = ReToolConfig(), *,
                 tool_format: str = "hermes", count_tokens: Callable[[str], int] | None = None):
        system = settings.system_prompt
        if system is not None and "<code>" in system:  # the inline layout's default prompt
            system = NATIVE_RETOOL_SYSTEM_PROMPT
        super().__init__(lambda: ToolRegistry([python_tool(pool, stateful=settings.stateful,
                                                           timeout_s=settings.tool_timeout_s)]),
                         tool_env_config(settings, tool_format, system, settings.tool_timeout_s),
                         count_tokens=count_tokens)
        self.verifier, self.settings = verifier, settings

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        if "answer" not in task:
            raise KeyError("NativeReToolEnv task is missing field 'answer'")
        return await super().reset(task)

    async def grade(self, final_text: str) -> Grade:
        boxes = find_boxed_spans(final_text)
        answer = boxes[-1][2] if boxes else None
        verdict = await self.verifier.averify(answer, str(self.task["answer"]))
        return self._shaped(bool(verdict.correct), answer)

    def _shaped(self, correct: bool, answer: str | None) -> Grade:
        reward, components = composite_reward(
            correct, self.response, num_tokens=self.num_sampled_tokens,
            successful_tool_calls=self.tool_stats.successful, weights=self.settings.reward_weights)
        return Grade(reward, correct, components, answer)

    def unanswered_grade(self) -> Grade:
        return self._shaped(False, None)


class NativeSearchEnv(ToolCallingEnv):
    """Search-R1's question answering with a native ``search`` tool."""

    def __init__(self, retriever: Any, settings: SearchConfig = SearchConfig(), *, tool_format: str = "hermes",
                 count_tokens: Callable[[str], int] | None = None):
        super().__init__(lambda: ToolRegistry([search_tool(retriever, top_k=settings.top_k)]),
                         tool_env_config(settings, tool_format, settings.system_prompt, settings.search_timeout_s),
                         count_tokens=count_tokens)
        self.settings = settings
        if settings.prompt_template == SearchConfig().prompt_template:  # the inline layout's default prompt
            self.settings = dataclasses.replace(settings, prompt_template=NATIVE_SEARCH_PROMPT_TEMPLATE)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        question = str(task["question"]).strip()
        return system + [{"role": "user", "content": self.settings.prompt_template.format(question=question)}]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        self.answers = golden_answers(task)
        return await super().reset(task)

    async def grade(self, final_text: str) -> Grade:
        action = parse_action(final_text)
        answer = action.content if action.kind == "answer" else None
        reward, components = search_reward(answer, self.answers, formatted=well_formed(self.response),
                                           config=self.settings)
        return Grade(reward, components["em"] == 1.0, components, answer)

    def unanswered_grade(self) -> Grade:
        reward, components = search_reward(None, self.answers, formatted=False, config=self.settings)
        return Grade(reward, False, components)
