"""The generic agent loop: the rollout driver decodes, the environment answers.

One episode (ReTool layout: the whole response is one assistant turn in which tool
outputs appear inline):

    ids = chat_template(env.reset(task)) + generation prompt          loss_mask 0
    repeat:
        completion = await driver.generate(new ids, session=s, stop at env.stop_strings / eos)
        ids += completion.token_ids                                    loss_mask 1
        step = await env.step(decode(completion.token_ids))
        if step.done: break
        ids += tokenize(step.observation_text)                         loss_mask 0

Native chat layout (assistant -> tool messages -> assistant): the environment answers with
``StepResult.observation_messages`` instead of text, and the loop appends them with
``Tokenizer.append_messages``: the template's text after the assistant's end-of-turn token
(plus that token when the policy did not sample it), the messages with their role headers,
and the next assistant header, all with loss_mask 0. The prompt lists ``env.tools``.
The ids so built equal a render of the whole conversation by the chat template, except
where the template rewrites earlier turns (docs/chat_formats.md): the trajectory keeps the
tokens as sampled.

The environment answers through the typed episode contract (``envs.base.StepResult``):
``finish_reason``, ``correct``, ``reward_components`` and ``tool_stats`` are fields, and the
loop tells the environment the policy's token count in ``env.num_sampled_tokens`` before
each ``step``. ``StepResult.info`` is free-form and never read here.

Invariants (docs/architecture.md, "Invariants and where they are kept"): sampled ids enter
the trajectory exactly as the engine produced them, with the engine's logprobs and params
versions; observation text is tokenized once, when appended; nothing is detokenized and
tokenized again for training.
The driver session keeps the trajectory's KV cache between turns, so earlier turns are
never prefilled again.

How an episode ends (``envs.base.FINISH_REASONS``): the environment ends it (an answer,
no answer, max turns: graded by the environment), or the loop cuts it short before the
context (``max_total_tokens``) would overflow: ``max_tokens`` when the policy's own tokens
filled it, ``context_overflow`` when the prompt or an observation would not fit. A turn the
context cut off counts as graded only if the environment found a completed answer in it
(``finish_reason="answer"``); otherwise the episode is cut short too ("max_tokens"). A
cut-short episode is never graded as an answer; ``truncation`` decides what it trains:

- ``"mask"``: it trains no token and leaves its group's baseline (``Trajectory.masked``;
  DAPO's overlong filtering). Its reward is still the environment's score of an unanswered
  episode (``Environment.truncated_result``), for the logs only.
- ``"penalize"``: it trains with that score (a wrong answer, plus overlong shaping if the
  environment has it).

An environment that cannot score a cut-short episode (``truncated_result`` returns None)
gets it masked under either rule (logged once). An evaluation counts any of them as
incorrect (``reward_components["correct"] = 0``).

Failures: an environment whose ``step`` (or ``truncated_result``) raises ends its episode
with ``finish_reason="env_error"``, reward 0 and ``masked=True`` (logged and counted in
``env_errors``): a crash is never a training signal. A driver error propagates, because
it means the engine is unusable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agentrl_jax.envs.base import TRUNCATED_REASONS, Environment, StepResult, ToolStats, Trajectory
from agentrl_jax.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

TRUNCATION_RULES = ("mask", "penalize")


@dataclasses.dataclass
class _Tokens:
    """The trajectory's token streams as the episode grows them, position by position."""

    ids: list[int]
    mask: list[int]  # loss mask: 1 on the policy's sampled tokens
    logprobs: list[float]  # the engine's, on sampled tokens; 0 elsewhere
    versions: list[int]  # params version that sampled each token; -1 elsewhere

    @classmethod
    def of_prompt(cls, prompt: Sequence[int]) -> _Tokens:
        return cls(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))

    def add_sampled(self, completion: Any) -> None:
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += list(completion.logprobs)
        self.versions += list(completion.params_versions)

    def add_observation(self, observation: Sequence[int]) -> None:
        self.ids += observation
        self.mask += [0] * len(observation)
        self.logprobs += [0.0] * len(observation)
        self.versions += [-1] * len(observation)

    @property
    def num_sampled(self) -> int:
        return int(sum(self.mask))


@dataclasses.dataclass
class _Outcome:
    """How an episode ended and what it is worth."""

    finish: str
    reward: float = 0.0
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    tool_stats: ToolStats = dataclasses.field(default_factory=ToolStats)
    masked: bool = False


class AgentLoop:
    """Runs episodes of any ``Environment`` through a rollout ``Driver``.

    Args:
      driver: ``agentrl_jax.rollout.driver.Driver``.
      tokenizer: ``agentrl_jax.models.tokenizer.Tokenizer``.
      max_new_tokens_per_turn: decoding budget of one policy turn.
      max_total_tokens: the whole trajectory (prompt + turns + observations) must fit
        the engine's cache; the episode ends with "max_tokens" / "context_overflow"
        before it would not.
      truncation: "mask" or "penalize": what a cut-short episode trains (module docstring).

    Counters (cumulative over the loop's life): ``env_errors``, ``truncated``, ``masked``.
    """

    def __init__(self, driver: Any, tokenizer: Any, *, max_new_tokens_per_turn: int, max_total_tokens: int,
                 truncation: str = "mask"):
        if truncation not in TRUNCATION_RULES:
            raise ValueError(f"AgentLoop: truncation must be one of {TRUNCATION_RULES}, got {truncation!r}")
        self.driver = driver
        self.tokenizer = tokenizer
        self.max_new_tokens_per_turn = max_new_tokens_per_turn
        self.max_total_tokens = max_total_tokens
        self.truncation = truncation
        self.env_errors = 0
        self.truncated = 0
        self.masked = 0
        self._warned_unscored: set[str] = set()

    async def run_group(
        self,
        env_factory: Callable[[], Environment],
        task: dict[str, Any],
        num_samples: int,
        sampling: SamplingParams,
        *,
        group_id: int = 0,
    ) -> list[Trajectory]:
        """``num_samples`` episodes of one task, concurrently (a GRPO group)."""
        base_seed = sampling.seed if sampling.seed is not None else 0
        episodes = [
            self.run_episode(
                env_factory(),
                task,
                SamplingParams(
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    seed=(base_seed * 7919 + i) & 0x7FFFFFFF,
                ),
                group_id=group_id,
            )
            for i in range(num_samples)
        ]
        return list(await asyncio.gather(*episodes))

    async def run_episode(
        self, env: Environment, task: dict[str, Any], sampling: SamplingParams, *, group_id: int = 0
    ) -> Trajectory:
        """One episode of ``env`` on ``task``: the policy's turns and the environment's answers,
        then the grade (or the score of an episode cut short), as a Trajectory."""
        messages = await env.reset(task)
        prompt = list(self.tokenizer.apply_chat(messages, tools=env.tools, add_generation_prompt=True))
        tokens = _Tokens.of_prompt(prompt)
        turns: list[dict[str, str]] = list(messages)
        session = self.driver.session()
        try:
            outcome = await self._play(env, task, sampling, session, tokens, turns)
            if outcome.finish in TRUNCATED_REASONS:
                self._score_cut_short(env, task, outcome, tokens.num_sampled)
            if outcome.finish == "env_error":
                outcome.reward, outcome.components, outcome.masked = 0.0, {"correct": 0.0}, True
        finally:
            session.close()
            await env.close()
        self.masked += int(outcome.masked)
        self.truncated += int(outcome.finish in TRUNCATED_REASONS)
        return Trajectory(
            prompt_token_ids=np.asarray(prompt, np.int32),
            token_ids=np.asarray(tokens.ids, np.int32),
            loss_mask=np.asarray(tokens.mask, np.int8),
            rollout_logprobs=np.asarray(tokens.logprobs, np.float32),
            params_versions=np.asarray(tokens.versions, np.int32),
            turns=turns,
            tools=env.tools,
            reward=outcome.reward,
            reward_components=outcome.components,
            tool_stats=dataclasses.replace(outcome.tool_stats),
            finish_reason=outcome.finish,
            group_id=group_id,
            task_metadata={k: v for k, v in task.items() if k != "question"},
            masked=outcome.masked,
        )

    async def _play(self, env: Environment, task: dict[str, Any], sampling: SamplingParams, session: Any,
                    tokens: _Tokens, turns: list[dict[str, str]]) -> _Outcome:
        """The turns, appended to ``tokens`` and ``turns``, until the environment ends the
        episode (graded), it fails, or the context would overflow (cut short)."""
        tok = self.tokenizer
        tool_stats = ToolStats()
        pending: Sequence[int] = list(tokens.ids)
        while True:
            budget = min(self.max_new_tokens_per_turn, self.max_total_tokens - len(tokens.ids) - 1)
            if budget < 1:
                return _Outcome("max_tokens" if any(tokens.mask) else "context_overflow", tool_stats=tool_stats)
            completion = await self.driver.generate(
                pending,
                sampling,
                stop_token_ids=tok.eos_token_ids,
                stop_strings=env.stop_strings,
                max_new_tokens=budget,
                session=session,
            )
            tokens.add_sampled(completion)
            # Cut by the context (not by the per-turn budget): nothing more fits after this turn.
            context_full = completion.finish_reason == "capacity" or (
                completion.finish_reason == "length" and budget < self.max_new_tokens_per_turn)
            text = tok.decode(completion.token_ids, skip_special_tokens=True)
            turns.append({"role": "assistant", "content": text})
            env.num_sampled_tokens = tokens.num_sampled
            try:
                step = await env.step(text)
            except Exception as e:  # noqa: BLE001  (a broken env ends its episode, not the run)
                return _Outcome(self._env_error(task, "step", e), tool_stats=tool_stats)
            tool_stats = step.tool_stats or tool_stats
            # A turn the context cut off is graded only as an answer it completed before the cut.
            if step.done and (not context_full or step.finish_reason == "answer"):
                reward, components = self._graded(step)
                return _Outcome(step.finish_reason or "done", reward, components, tool_stats)
            if context_full or len(tokens.ids) + 1 >= self.max_total_tokens:
                return _Outcome("max_tokens", tool_stats=tool_stats)
            observation = self._observation_ids(tokens.ids, step, env.tools)
            turns += (step.observation_messages if step.observation_messages is not None
                      else [{"role": "tool", "content": step.observation_text}])
            if len(tokens.ids) + len(observation) + 1 >= self.max_total_tokens:
                return _Outcome("context_overflow", tool_stats=tool_stats)
            tokens.add_observation(observation)
            pending = observation

    def _score_cut_short(self, env: Environment, task: dict[str, Any], outcome: _Outcome, num_sampled: int) -> None:
        """Scores an episode the context cut short as the environment scores it unanswered, and
        decides whether it trains (``truncation``; module docstring); never graded correct."""
        env.num_sampled_tokens = num_sampled
        try:
            scored = env.truncated_result(outcome.finish, num_sampled)
        except Exception as e:  # noqa: BLE001
            outcome.finish, scored = self._env_error(task, "truncated_result", e), None
        if scored is not None:
            outcome.reward, outcome.components = self._graded(scored)
            outcome.tool_stats = scored.tool_stats or outcome.tool_stats
            outcome.masked = self.truncation == "mask"
        elif outcome.finish != "env_error":
            outcome.masked = True
            name = type(env).__name__
            if name not in self._warned_unscored:
                self._warned_unscored.add(name)
                logger.warning("%s.truncated_result returned None: episodes cut short by the context "
                               "are masked (they cannot be scored as a wrong answer)", name)
        outcome.components["correct"] = 0.0

    def _observation_ids(self, ids: list[int], step: StepResult, tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids that answer a turn: the observation text as is (inline layout), or the
        messages rendered by the chat template after the assistant's turn (native layout: the
        end-of-turn token if the policy did not sample one, the template's glue, the role
        headers, the contents and the next generation prompt)."""
        if step.observation_messages is None:
            return self.tokenizer.encode(step.observation_text)
        return self.tokenizer.append_messages(ids, step.observation_messages, tools=tools,
                                              add_generation_prompt=True, close_turn=True)[1]

    @staticmethod
    def _graded(step: StepResult) -> tuple[float, dict[str, float]]:
        """(reward, components with ``correct`` when graded) of a final StepResult."""
        components = {k: float(v) for k, v in step.reward_components.items()}
        if step.correct is not None:
            components["correct"] = float(bool(step.correct))
        return float(step.reward), components

    def _env_error(self, task: dict[str, Any], where: str, error: Exception) -> str:
        self.env_errors += 1
        logger.warning("environment %s failed for task %r (episode masked): %r", where,
                       task.get("id", task.get("question")), error)
        return "env_error"
