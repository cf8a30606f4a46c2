"""Episodes with several actors (envs/multi_actor.py): each turn decoded by the acting policy's
engine, every token tagged with its actor, each actor's row masked to exactly its own tokens,
and what an actor sees appended through the chat template (template-exact).

Real pieces: a tiny Qwen3-format tokenizer, random tiny decoders behind the real Engine and
Driver on one CPU device (one per policy). The environment is scripted: its rules, not the
random models' text, decide who acts next.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from chat_formats import CORPUS, FORMATS, build_tokenizer
from tiny_decoder import tiny_agent_engine

from agentrl_jax.envs.base import ToolStats
from agentrl_jax.envs.multi_actor import OBSERVATION, ActorTurn, MultiActorEnvironment, MultiActorLoop, MultiActorResult
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.sampling import SamplingParams

PER_TURN, MAX_TOKENS = 5, 256
ASK = [{"role": "system", "content": "Propose."}, {"role": "user", "content": "What is 12*34?"}]
REVIEW_SYSTEM = "Review the proposal."


class Dialogue(MultiActorEnvironment):
    """proposer -> critic (sees the proposal) -> proposer (sees the critique) -> done."""

    actors = ("proposer", "critic")

    def __init__(self, shared_view: bool, fail_at: int = 0):
        self.shared_view, self.fail_at = shared_view, fail_at
        self.stop_strings = {}

    async def reset(self, task):
        self.said = []
        return ActorTurn("proposer", messages=list(ASK))

    async def step(self, actor, action_text):
        self.said.append((actor, action_text))
        if len(self.said) == self.fail_at:
            raise RuntimeError("the environment broke")
        if len(self.said) == 1:
            seen = ([{"role": "user", "content": "Critic, your review?"}] if self.shared_view else
                    [{"role": "system", "content": REVIEW_SYSTEM}, {"role": "user", "content": action_text}])
            return MultiActorResult(ActorTurn("critic", messages=seen))
        if len(self.said) == 2:
            return MultiActorResult(ActorTurn("proposer", messages=[{"role": "user", "content": "Critic: " + action_text}]))
        return MultiActorResult(None, done=True, rewards={"proposer": 1.0, "critic": 0.5}, correct=True,
                                finish_reason="answer", tool_stats={"proposer": ToolStats(calls=2, errors=1)})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tokenizer(FORMATS["qwen3"], tmp_path_factory.mktemp("tok"), texts=list(CORPUS), vocab_size=600)
    engines = [tiny_agent_engine(tok.vocab_size, slots=2, max_target_length=MAX_TOKENS, max_prefill_length=128,
                                 min_prefill_bucket=32) for _ in range(2)]
    return tok, engines


def play(setup, *, shared_view: bool, self_play: bool, group_id: int = 3, fail_at: int = 0, tokenizers=None):
    tok, engines = setup
    actor_policy = {"proposer": "a", "critic": "a" if self_play else "b"}
    if tokenizers:  # the critic's policy in a token space of its own, on an engine of its vocabulary
        critic_tok = tokenizers["b"]
        engines = [engines[0], tiny_agent_engine(critic_tok.vocab_size, slots=2, max_target_length=MAX_TOKENS,
                                                 max_prefill_length=128, min_prefill_bucket=32)]

    async def main():
        drivers = {name: Driver(engine, params, eos_token_ids=(tokenizers or {name: tok})[name].eos_token_ids)
                   for name, (engine, params) in zip("ab", engines)}
        for d in drivers.values():
            await d.__aenter__()
        try:
            await drivers["b"].update_params(engines[1][1], 7)  # the critic's engine holds version 7
            loop = MultiActorLoop(drivers, actor_policy, tokenizers or tok, max_new_tokens_per_turn=PER_TURN,
                                  max_total_tokens=MAX_TOKENS)
            episode = await loop.run_episode(Dialogue(shared_view, fail_at), {"question": "q", "id": 1},
                                             SamplingParams(temperature=1.0, seed=0), group_id=group_id)
            return episode, loop.env_errors
        finally:
            for d in drivers.values():
                await d.__aexit__(None, None, None)

    episode, env_errors = asyncio.run(main())
    assert env_errors == int(fail_at > 0)
    return episode


def runs(values) -> list[tuple[int, int, int]]:
    """(value, start, end) of the maximal constant runs of ``values``."""
    values = np.asarray(values)
    edges = [0, *np.flatnonzero(np.diff(values)) + 1, len(values)]
    return [(int(values[a]), a, b) for a, b in zip(edges[:-1], edges[1:])]


def test_own_views_each_actor_trains_exactly_its_own_tokens(setup):
    tok = setup[0]
    episode = play(setup, shared_view=False, self_play=False)
    proposer, critic = episode.views["proposer"], episode.views["critic"]
    assert [v for v, _, _ in runs(proposer.owners)] == [OBSERVATION, 0, OBSERVATION, 0]
    assert [v for v, _, _ in runs(critic.owners)] == [OBSERVATION, 1]
    # The critic's prompt is the proposal as text, rendered by the template.
    proposal = tok.decode(proposer.ids[runs(proposer.owners)[1][1]:runs(proposer.owners)[1][2]],
                          skip_special_tokens=True)
    assert critic.ids[:critic.prompt_length] == tok.apply_chat(
        [{"role": "system", "content": REVIEW_SYSTEM}, {"role": "user", "content": proposal}])
    # The critique reaches the proposer through the template after its closed turn.
    _, start, end = runs(proposer.owners)[2]
    critique = tok.decode(critic.ids[critic.prompt_length:], skip_special_tokens=True)
    assert proposer.ids[start:end] == tok.append_messages(
        proposer.ids[:start], [{"role": "user", "content": "Critic: " + critique}], close_turn=True)[1]
    for actor, index, version in (("proposer", 0, 0), ("critic", 1, 7)):
        t = episode.trajectories[actor]
        view = episode.views[actor]
        np.testing.assert_array_equal(t.loss_mask, np.asarray(view.owners) == index)
        sampled = t.loss_mask.astype(bool)
        assert np.all(t.params_versions[sampled] == version) and np.all(t.params_versions[~sampled] == -1)
        assert np.all(t.rollout_logprobs[sampled] < 0) and np.all(t.rollout_logprobs[~sampled] == 0)
        assert t.group_id == 3 * 2 + index and t.task_metadata["actor"] == actor
        assert t.reward_components["correct"] == 1.0
    assert (episode.trajectories["proposer"].reward, episode.trajectories["critic"].reward) == (1.0, 0.5)
    # Each actor's tool calls reach its own trajectory (the per-policy tools/* metrics); none for the critic.
    assert episode.trajectories["proposer"].tool_stats == ToolStats(calls=2, errors=1)
    assert episode.trajectories["critic"].tool_stats == ToolStats()


@pytest.mark.parametrize("self_play", [False, True])
def test_shared_view_one_transcript_masks_split_by_actor(setup, self_play):
    tok = setup[0]
    episode = play(setup, shared_view=True, self_play=self_play)
    [view] = episode.views.values()
    segments = runs(view.owners)
    assert [v for v, _, _ in segments] == [OBSERVATION, 0, OBSERVATION, 1, OBSERVATION, 0]
    rows = episode.trajectories
    np.testing.assert_array_equal(rows["proposer"].token_ids, rows["critic"].token_ids)
    both = rows["proposer"].loss_mask + rows["critic"].loss_mask
    np.testing.assert_array_equal(both, np.asarray(view.owners) != OBSERVATION)  # disjoint, covering
    np.testing.assert_array_equal(rows["critic"].loss_mask, np.asarray(view.owners) == 1)
    # Between actors: the template's glue after the closed turn, exactly as a full render appends it.
    texts = ["Critic, your review?", "Critic: " + tok.decode(view.ids[segments[3][1]:segments[3][2]],
                                                              skip_special_tokens=True)]
    for (_, start, end), text in zip([segments[2], segments[4]], texts):
        assert view.ids[start:end] == tok.append_messages(view.ids[:start], [{"role": "user", "content": text}],
                                                          close_turn=True)[1]
    critic_version = 0 if self_play else 7  # self-play: one policy, one engine, one session
    assert set(rows["critic"].params_versions[rows["critic"].loss_mask > 0]) == {critic_version}
    if self_play:
        assert len(view.read) == 1


def test_a_broken_environment_masks_its_episode_and_the_run_goes_on(setup):
    episode = play(setup, shared_view=False, self_play=False, fail_at=2)
    assert episode.result.finish_reason == "env_error" and episode.result.masked
    assert all(t.masked and t.reward == 0.0 for t in episode.trajectories.values())
    assert set(episode.trajectories) == {"proposer", "critic"}  # both acted before the failure


def test_policies_with_their_own_tokenizers_read_each_other_as_text(setup, tmp_path):
    """Per-policy tokenizers: each actor's view is in its policy's token space (another family's
    chat template and vocabulary here); what it reads of the other's turn is that turn's text."""
    tok = setup[0]
    critic_tok = build_tokenizer(FORMATS["llama3.1"], tmp_path, texts=list(CORPUS), vocab_size=500)
    assert critic_tok.hf.get_vocab() != tok.hf.get_vocab()
    tokenizers = {"a": tok, "b": critic_tok}
    episode = play(setup, shared_view=False, self_play=False, tokenizers=tokenizers)
    proposer, critic = episode.views["proposer"], episode.views["critic"]
    assert [v for v, _, _ in runs(critic.owners)] == [OBSERVATION, 1]
    assert max(critic.ids) < critic_tok.vocab_size
    proposal = tok.decode(proposer.ids[runs(proposer.owners)[1][1]:runs(proposer.owners)[1][2]],
                          skip_special_tokens=True)
    assert critic.ids[:critic.prompt_length] == critic_tok.apply_chat(  # the critic's template, its tokens
        [{"role": "system", "content": REVIEW_SYSTEM}, {"role": "user", "content": proposal}])
    _, start, end = runs(proposer.owners)[2]
    critique = critic_tok.decode(critic.ids[critic.prompt_length:], skip_special_tokens=True)
    assert proposer.ids[start:end] == tok.append_messages(
        proposer.ids[:start], [{"role": "user", "content": "Critic: " + critique}], close_turn=True)[1]
    np.testing.assert_array_equal(episode.trajectories["critic"].loss_mask, np.asarray(critic.owners) == 1)
    # One transcript for both needs one token space
    with pytest.raises(ValueError, match="has one view for all actors, but their policies have different tokenizers"):
        play(setup, shared_view=True, self_play=False, tokenizers=tokenizers)
