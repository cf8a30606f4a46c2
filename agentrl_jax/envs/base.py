"""Environment API and the Trajectory record the trainer consumes (DESIGN.md sections 1 and 5).

The agent loop (envs/agent_loop.py) drives an `Environment`:

    observation = await env.reset(task)          # initial messages for the chat template
    while not done:
        action_text = decode until one of env.stop_strings
        step = await env.step(action_text)       # StepResult(observation_text, reward, done, info)
        append tokenize(step.observation_text) with loss_mask 0

and fills a `Trajectory`. Token ids are never re-tokenized for training: the loop
appends the sampled ids and the observation ids as they were produced.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class StepResult:
    """What the environment answers to one policy action.

    observation_text: text to append after the action (tool output, correction), "" if none.
    reward: the final reward when `done`, else 0.0 (shaping goes in `info["reward_components"]`).
    done: the episode is over (answer given or a limit reached).
    info: e.g. {"finish_reason": "answer", "reward_components": {...}, "tool": ExecResult}.
    """

    observation_text: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ToolStats:
    calls: int = 0
    errors: int = 0  # non-zero exit or sandbox failure
    timeouts: int = 0

    @property
    def successful(self) -> int:
        return self.calls - self.errors - self.timeouts


class Environment(abc.ABC):
    """A multi-turn task. One instance runs one episode at a time; make one per trajectory."""

    #: strings at which the rollout driver stops decoding and calls `step` (kept in the text).
    stop_strings: tuple[str, ...] = ()

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        """Starts an episode for `task`; returns the initial chat messages (role/content dicts)."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Consumes one policy turn (text up to and including a stop string) and answers."""

    async def close(self) -> None:
        """Releases per-episode resources (e.g. a sandbox session). Safe to call twice."""


@dataclasses.dataclass
class Trajectory:
    """One finished episode, as the trainer consumes it.

    Per-token arrays all have length T = len(token_ids) (prompt included):
      token_ids         int32 [T]   prompt + sampled + observation tokens, as produced.
      loss_mask         int8  [T]   1 exactly on tokens the policy sampled.
      rollout_logprobs  float32 [T] engine logprob of each sampled token, 0 elsewhere.
      params_versions   int32 [T]   params version that sampled each token, -1 elsewhere.
    """

    prompt_token_ids: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    params_versions: np.ndarray
    turns: list[dict[str, str]] = dataclasses.field(default_factory=list)  # role/content, for logs
    reward: float = 0.0
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    tool_stats: ToolStats = dataclasses.field(default_factory=ToolStats)
    finish_reason: str = ""  # "answer" | "max_turns" | "max_tool_calls" | "max_tokens" | "error"
    group_id: int = -1
    task_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        length = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "params_versions"):
            if len(getattr(self, name)) != length:
                raise ValueError(f"Trajectory.{name} has length {len(getattr(self, name))}, token_ids has {length}")
        if len(self.prompt_token_ids) > length or not np.array_equal(
                self.token_ids[:len(self.prompt_token_ids)], self.prompt_token_ids):
            raise ValueError("Trajectory.token_ids must start with prompt_token_ids")
        if np.any(np.asarray(self.loss_mask)[:len(self.prompt_token_ids)]):
            raise ValueError("Trajectory.loss_mask must be 0 on the prompt")

    @property
    def num_sampled_tokens(self) -> int:
        return int(np.sum(self.loss_mask))
