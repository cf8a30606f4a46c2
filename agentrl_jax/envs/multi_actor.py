"""Episodes with several actors: the environment says who acts next and what it sees.

An actor is a role in the episode (a solver, a checker); each actor is played by a policy
(``actor_policy``), and one policy may play several actors (shared weights, roles by
prompt: self-play). The loop (``MultiActorLoop``) decodes each turn with the acting
policy's rollout driver:

    turn = await env.reset(task)                    # ActorTurn(actor, messages or text)
    while True:
        view = the actor's view (its own, or the one shared by all actors)
        append what the actor sees to the view       owner -1 (observation), loss_mask 0
        ids = driver[policy of actor].generate(view since this policy last read it)
        append ids to the view                       owner = the actor
        result = await env.step(actor, decode(ids))  # MultiActorResult
        if result.done: break                        # rewards per actor (team + role)
        turn = result.next_turn

A *view* is a token stream one or more actors read and write. By default every actor has
its own (``shared_view = False``): another actor's turn reaches it as text the environment
chose to show (a user message: loss_mask 0). With ``shared_view = True`` all actors write one
transcript. Either way every token of a view is tagged with the actor that sampled it
(``owners``; -1: prompt and observations), and each actor's training row is its view with
``loss_mask = (owners == actor)``: exactly its own sampled tokens, the other actors' turns
are observations for it. A view is in the token space of the policy whose actor it is, so
policies with different tokenizers each read and write their own views (a shared view needs
one tokenizer).

What an actor sees is appended as the agent loop appends observations: chat messages through
the template after the previous turn (``Tokenizer.append_messages``, closing the turn: the
ids equal a render of the whole conversation), or inline text as is (a tool's output inside
the actor's own turn). The first messages of a view are its prompt (``apply_chat``).
Token ids pass straight through: sampled ids enter the view as the engine produced them.

A view that would overflow the context ends the episode ("max_tokens"); the environment
scores it (``cut_short``) or, returning None, every row of the episode is masked. An
environment whose ``step`` raises ends its episode masked ("env_error", counted in
``env_errors``): a crash is never a training signal.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from agentrl_jax.envs.base import ToolStats, Trajectory
from agentrl_jax.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)
OBSERVATION = -1  # the owner of prompt and observation tokens


@dataclasses.dataclass
class ActorTurn:
    """Who acts next and what it sees first.

    actor: the acting actor's name (one of ``MultiActorEnvironment.actors``).
    messages: chat messages appended through the chat template (a view's first messages
      are its whole prompt); None: ``text`` instead.
    text: inline text appended as is (e.g. an interpreter's output inside the actor's turn).
    """

    actor: str
    messages: list[dict[str, Any]] | None = None
    text: str = ""

    def __post_init__(self):
        if self.messages is not None and self.text:
            raise ValueError("ActorTurn: give messages (through the chat template) or text (inline), not both")


@dataclasses.dataclass
class MultiActorResult:
    """The environment's answer to one turn.

    next_turn: who acts next and what it sees; None when ``done``.
    done: the episode is over.
    rewards: when done, each actor's reward (team reward plus its role reward).
    reward_components: when done, each actor's reward terms (logged as ``reward/<name>``).
    correct: when done, whether the team's final answer is correct (pass@1).
    finish_reason: when done, why (``envs.base.FINISH_REASONS`` or the environment's own).
    metrics: when done, per-episode numbers the trainer averages (e.g. checker accuracy).
    masked: the episode trains no token (cut short and not scored by the environment).
    tool_stats: when done, each actor's tool calls over the episode (its trajectory's, logged
      as ``<policy>/tools/*``); an actor left out made none.
    """

    next_turn: ActorTurn | None
    done: bool = False
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    reward_components: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    correct: bool | None = None
    finish_reason: str = ""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    masked: bool = False
    tool_stats: dict[str, ToolStats] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.done == (self.next_turn is not None):
            raise ValueError("MultiActorResult: a next_turn exactly when the episode is not done")


class MultiActorEnvironment(abc.ABC):
    """A task played by several actors. One instance runs one episode; make one per episode."""

    #: the actors' names, in a fixed order (an actor's index is its tag in ``owners``).
    actors: tuple[str, ...] = ()
    #: strings at which decoding stops, per actor (kept in the text).
    stop_strings: Mapping[str, tuple[str, ...]] = {}
    #: all actors write one transcript (else each actor has its own view).
    shared_view: bool = False

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> ActorTurn:
        """Starts an episode: the first actor and its prompt messages."""

    @abc.abstractmethod
    async def step(self, actor: str, action_text: str) -> MultiActorResult:
        """Consumes ``actor``'s turn (text up to and including a stop string) and answers."""

    def cut_short(self, finish_reason: str) -> MultiActorResult | None:
        """Scores an episode the context cut short; None: every row of it is masked."""
        del finish_reason
        return None

    async def close(self) -> None:
        """Releases per-episode resources. Safe to call twice."""


@dataclasses.dataclass
class View:
    """One token stream of an episode, with the actor that sampled each token."""

    ids: list[int] = dataclasses.field(default_factory=list)
    owners: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    prompt_length: int = 0
    read: dict[str, tuple[Any, int]] = dataclasses.field(default_factory=dict)  # policy -> (session, ids read)

    def observe(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.owners += [OBSERVATION] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def sample(self, completion: Any, owner: int) -> None:
        self.ids += completion.token_ids
        self.owners += [owner] * len(completion.token_ids)
        self.logprobs += list(completion.logprobs)
        self.versions += list(completion.params_versions)

    def row(self, owner: int) -> dict[str, np.ndarray]:
        """The view as ``owner``'s training row: loss_mask 1 exactly on its sampled tokens."""
        owners = np.asarray(self.owners, np.int32)
        mine = owners == owner
        return dict(prompt_token_ids=np.asarray(self.ids[:self.prompt_length], np.int32),
                    token_ids=np.asarray(self.ids, np.int32), loss_mask=mine.astype(np.int8),
                    rollout_logprobs=np.where(mine, np.asarray(self.logprobs, np.float32), 0.0).astype(np.float32),
                    params_versions=np.where(mine, np.asarray(self.versions, np.int32), -1).astype(np.int32))


@dataclasses.dataclass
class MultiActorEpisode:
    """A finished episode: its views, how it ended, and a Trajectory per actor that acted."""

    actors: tuple[str, ...]
    views: dict[str, View]
    result: MultiActorResult
    trajectories: dict[str, Trajectory]


class MultiActorLoop:
    """Runs ``MultiActorEnvironment`` episodes through one rollout driver per policy.

    Args:
      drivers: policy name -> ``rollout.driver.Driver`` (the policy's engine).
      actor_policy: actor name -> the policy that plays it.
      tokenizer: the tokenizer every policy shares, or one per policy (a mapping from the policy's
        name). A view is read and written with the tokenizer of the policy whose actor it is: each
        actor's own view in its policy's token space; a shared view needs one tokenizer for all.
      max_new_tokens_per_turn, max_total_tokens: as ``AgentLoop``'s, per view.
    """

    def __init__(self, drivers: Mapping[str, Any], actor_policy: Mapping[str, str], tokenizer: Any, *,
                 max_new_tokens_per_turn: int, max_total_tokens: int):
        unknown = sorted(set(actor_policy.values()) - set(drivers))
        if unknown:
            raise ValueError(f"MultiActorLoop: actors are played by policies without a driver: {unknown}")
        self.drivers, self.actor_policy = dict(drivers), dict(actor_policy)
        self.tokenizers = dict(tokenizer) if isinstance(tokenizer, Mapping) else {p: tokenizer for p in self.drivers}
        missing = sorted(set(self.drivers) - set(self.tokenizers))
        if missing:
            raise ValueError(f"MultiActorLoop: no tokenizer for the policies {missing}")
        self.max_new_tokens_per_turn, self.max_total_tokens = max_new_tokens_per_turn, max_total_tokens
        self.env_errors = 0

    def tokenizer(self, actor: str) -> Any:
        """The tokenizer of the policy that plays ``actor`` (its view's token space)."""
        return self.tokenizers[self.actor_policy[actor]]

    async def run_group(self, env_factory: Callable[[], MultiActorEnvironment], task: dict[str, Any],
                        num_samples: int, sampling: SamplingParams, *, group_id: int = 0) -> list[MultiActorEpisode]:
        """``num_samples`` episodes of one task, concurrently; seeds as ``AgentLoop.run_group``'s."""
        base = sampling.seed if sampling.seed is not None else 0
        return list(await asyncio.gather(*(
            self.run_episode(env_factory(), task, dataclasses.replace(sampling, seed=(base * 7919 + i) & 0x7FFFFFFF),
                             group_id=group_id) for i in range(num_samples))))

    async def run_episode(self, env: MultiActorEnvironment, task: dict[str, Any], sampling: SamplingParams, *,
                          group_id: int = 0) -> MultiActorEpisode:
        missing = sorted(set(env.actors) - set(self.actor_policy))
        if missing:
            raise ValueError(f"MultiActorLoop: no policy plays the actors {missing} of {type(env).__name__}")
        if env.shared_view and len({id(self.tokenizer(a)) for a in env.actors}) > 1:
            raise ValueError(f"MultiActorLoop: {type(env).__name__} has one view for all actors, but their policies "
                             "have different tokenizers (a shared view is one token space)")
        views: dict[str, View] = {}
        try:
            result = await self._play(env, task, sampling, views)
        finally:
            for view in views.values():
                for session, _ in view.read.values():
                    session.close()
            await env.close()
        return MultiActorEpisode(env.actors, views, result, self._trajectories(env, task, views, result, group_id))

    async def _play(self, env: MultiActorEnvironment, task: dict[str, Any], sampling: SamplingParams,
                    views: dict[str, View]) -> MultiActorResult:
        """The turns until the environment ends the episode or a view would overflow."""
        turn = await env.reset(task)
        while True:
            view = views.setdefault("shared" if env.shared_view else turn.actor, View())
            if not self._show(view, turn):
                return env.cut_short("context_overflow") or _masked("context_overflow")
            budget = min(self.max_new_tokens_per_turn, self.max_total_tokens - len(view.ids) - 1)
            if budget < 1:
                return env.cut_short("max_tokens") or _masked("max_tokens")
            policy, tok = self.actor_policy[turn.actor], self.tokenizer(turn.actor)
            driver = self.drivers[policy]
            session, read = view.read.get(policy) or (driver.session(), 0)
            completion = await driver.generate(view.ids[read:], sampling, stop_token_ids=tok.eos_token_ids,
                                               stop_strings=env.stop_strings.get(turn.actor, ()),
                                               max_new_tokens=budget, session=session)
            view.sample(completion, env.actors.index(turn.actor))
            view.read[policy] = (session, len(view.ids))
            try:
                result = await env.step(turn.actor, tok.decode(completion.token_ids, skip_special_tokens=True))
            except Exception as e:  # noqa: BLE001  (a broken env ends its episode, not the run)
                self.env_errors += 1
                logger.warning("environment step failed for task %r (episode masked): %r", task.get("id"), e)
                return _masked("env_error")
            if result.done:
                return result
            turn = result.next_turn

    def _show(self, view: View, turn: ActorTurn) -> bool:
        """Appends what ``turn.actor`` sees to ``view``; False when it would not fit the context."""
        tok = self.tokenizer(turn.actor)
        if turn.messages is None:
            ids = tok.encode(turn.text)
        elif not view.ids:
            ids = list(tok.apply_chat(turn.messages, add_generation_prompt=True))
        else:
            ids = tok.append_messages(view.ids, turn.messages, add_generation_prompt=True, close_turn=True)[1]
        if len(view.ids) + len(ids) + 1 >= self.max_total_tokens:
            return False
        view.observe(ids)
        if view.prompt_length == 0:
            view.prompt_length = len(view.ids)
        return True

    @staticmethod
    def _trajectories(env: MultiActorEnvironment, task: dict[str, Any], views: dict[str, View],
                      result: MultiActorResult, group_id: int) -> dict[str, Trajectory]:
        """One Trajectory per actor that sampled a token: its view, masked to its own tokens.

        Groups are per actor (``group_id * len(actors) + actor index``): an actor's advantages
        compare it with the same actor on the same task, never with another role.
        """
        out = {}
        for index, actor in enumerate(env.actors):
            view = views.get("shared" if env.shared_view else actor)
            if view is None or index not in view.owners:
                continue
            components = dict(result.reward_components.get(actor, {}))
            if result.correct is not None:
                components["correct"] = float(bool(result.correct))
            out[actor] = Trajectory(
                **view.row(index), reward=float(result.rewards.get(actor, 0.0)), reward_components=components,
                finish_reason=result.finish_reason or "done", group_id=group_id * len(env.actors) + index,
                task_metadata={**{k: v for k, v in task.items() if k != "question"}, "actor": actor},
                masked=result.masked, tool_stats=dataclasses.replace(result.tool_stats.get(actor, ToolStats())))
        return out


def _masked(reason: str) -> MultiActorResult:
    """The result of an episode cut short that the environment does not score: nothing trains."""
    return MultiActorResult(None, done=True, finish_reason=reason, masked=True)
