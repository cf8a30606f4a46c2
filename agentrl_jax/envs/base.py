"""Environment API and the Trajectory record the trainer consumes (docs/architecture.md).

The agent loop (envs/agent_loop.py) drives an `Environment`:

    observation = await env.reset(task)          # initial messages for the chat template
    while not done:
        action_text = decode until one of env.stop_strings
        env.num_sampled_tokens = policy tokens so far
        step = await env.step(action_text)       # StepResult(observation_text, reward, done, ...)
        append tokenize(step.observation_text) with loss_mask 0

and fills a `Trajectory`. Token ids are never re-tokenized for training: the loop
appends the sampled ids and the observation ids as they were produced.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

#: Every way an episode of the built-in environments and the agent loop ends.
#:   answer            the policy gave a final answer; the environment graded it.
#:   no_answer         the policy stopped without an answer or a tool call (graded as wrong).
#:   max_turns         environment.max_turns actions without an answer (graded as wrong).
#:   max_tokens        the policy's own tokens filled the context (rollout.max_sequence_length)
#:                     before an answer: ended by the agent loop, ungraded (truncated).
#:   context_overflow  the prompt or an observation would not fit the context: ended by the
#:                     agent loop, ungraded (truncated).
#:   env_error         the environment raised; the episode never trains.
#: The built-in environments do not end an episode at max_tool_calls: a call beyond it is
#: answered with a request for the final answer. A custom environment may add reasons of
#: its own (counted under their names).
FINISH_REASONS = ("answer", "no_answer", "max_turns", "max_tokens", "context_overflow", "env_error")
#: Finish reasons of episodes cut short by the agent loop before the environment graded them.
TRUNCATED_REASONS = frozenset({"max_tokens", "context_overflow"})


@dataclasses.dataclass
class ToolStats:
    calls: int = 0
    errors: int = 0  # non-zero exit or sandbox failure, or a malformed call
    timeouts: int = 0
    malformed: int = 0  # of the errors: calls that could not run (bad JSON, unknown tool, wrong arguments)

    @property
    def successful(self) -> int:
        return self.calls - self.errors - self.timeouts


#: Fields of the episode contract: StepResult carries them typed, never in ``info``.
_CONTRACT_FIELDS = ("finish_reason", "correct", "reward_components", "tool_stats")


@dataclasses.dataclass
class StepResult:
    """What the environment answers to one policy action: the episode contract.

    The agent loop reads the typed fields below and nothing else; a minimal environment
    returns ``StepResult(observation_text, reward, done)``.

    observation_text: text to append after the action (tool output, correction), "" if none.
    reward: the final reward when ``done``, else 0.0.
    done: the episode is over (answer given or a limit reached).
    info: free-form details for tests and debugging (the answer, the query, the ExecResult);
      the agent loop reads none of it.
    finish_reason: when ``done``, why: one of ``FINISH_REASONS`` ("answer", "no_answer",
      "max_turns") or the environment's own name; "" is recorded as "done".
    correct: when ``done``, whether the answer was graded correct (pass@k, the judge); None:
      not graded (evaluation then counts ``reward > 0`` as correct).
    reward_components: when ``done``, the terms of ``reward`` (e.g. outcome, format, tool),
      logged as ``reward/<name>``.
    tool_stats: the episode's tool calls so far; the loop keeps the latest one given.
    observation_messages: native chat layout: the messages that answer the turn (e.g. one
      ``{"role": "tool", "content": ...}`` per call). The loop closes the assistant's turn and
      appends them through the chat template (role headers, end-of-turn tokens: loss_mask 0)
      instead of ``observation_text``, which must then be "".
    """

    observation_text: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str = ""
    correct: bool | None = None
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    tool_stats: ToolStats | None = None
    observation_messages: list[dict[str, Any]] | None = None

    def __post_init__(self):
        misplaced = [k for k in _CONTRACT_FIELDS if k in self.info]
        if misplaced:
            raise TypeError(f"StepResult.info holds {misplaced}, which the agent loop does not read there: pass "
                            f"them as fields, e.g. StepResult(text, reward, done, {misplaced[0]}=...)")
        if self.tool_stats is not None and not isinstance(self.tool_stats, ToolStats):
            raise TypeError(f"StepResult.tool_stats must be a ToolStats, got {type(self.tool_stats).__name__}")
        if self.observation_messages is not None and self.observation_text:
            raise ValueError("StepResult: give observation_text (inline layout) or observation_messages (native "
                             "chat layout), not both")


class Environment(abc.ABC):
    """A multi-turn task. One instance runs one episode at a time; make one per trajectory."""

    #: strings at which the rollout driver stops decoding and calls `step` (kept in the text).
    stop_strings: tuple[str, ...] = ()
    #: Native chat layout: JSON-schema tool descriptions the chat template shows the model
    #: (``Tokenizer.apply_chat(tools=...)``); None: the prompt lists no tools.
    tools: list[dict[str, Any]] | None = None
    #: The policy's sampled tokens so far in this episode (all turns), set by the agent loop
    #: before each ``step``: what length-based shaping (DAPO's overlong term) scores.
    num_sampled_tokens: int = 0

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        """Starts an episode for `task`; returns the initial chat messages (role/content dicts)."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Consumes one policy turn (text up to and including a stop string) and answers."""

    async def close(self) -> None:
        """Releases per-episode resources (e.g. a sandbox session). Safe to call twice."""

    def truncated_result(self, finish_reason: str, num_sampled_tokens: int) -> StepResult | None:
        """Scores an episode the agent loop cut short (``finish_reason`` in TRUNCATED_REASONS).

        The episode never answered, so an environment scores it as it scores an unanswered
        episode (a wrong answer, with its own outcome scheme and shaping, e.g. DAPO's overlong
        term); the trainer uses that score under ``algorithm.truncated_episodes='penalize'``
        and logs it under 'mask'. Called after the last ``step`` and before ``close``.

        Returns:
          A done StepResult (reward, correct, reward_components, tool_stats), or None: this
          environment cannot score one (the default), and the episode is masked (counted).
        """
        del finish_reason, num_sampled_tokens
        return None


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
    #: Native chat layout: the tool schemas the prompt was rendered with (a re-render of the
    #: prompt, e.g. the hindsight teacher's, must list them too); None: no tools listed.
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    tool_stats: ToolStats = dataclasses.field(default_factory=ToolStats)
    finish_reason: str = ""  # one of FINISH_REASONS, or a custom environment's own
    group_id: int = -1
    task_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The episode trains no token and leaves its group's baseline: a truncated episode under
    #: algorithm.truncated_episodes='mask' (DAPO's overlong filtering), or an environment error.
    masked: bool = False

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
    def truncated(self) -> bool:
        """Cut short by the agent loop (token budget or context) before the environment graded it."""
        return self.finish_reason in TRUNCATED_REASONS

    @property
    def num_sampled_tokens(self) -> int:
        return int(np.sum(self.loss_mask))
