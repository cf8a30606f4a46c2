"""The agent loop's episode endings (docs/troubleshooting.md): every way an episode
ends, how a cut-short or crashed one is scored and whether it trains.

Real pieces: a trained tiny tokenizer, a random tiny decoder, the real Engine and Driver on
one CPU device, the ReTool environment's own scoring. Only the environments' *actions* are
scripted (a random model would rarely produce the case under test).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from tiny_decoder import tiny_agent_engine

from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.envs.base import Environment, StepResult
from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rewards.shaping import RewardWeights
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.sampling import SamplingParams

TASK = {"question": "What is 12*34?", "answer": "408", "id": "t0"}
CORPUS = ["What is 12*34? <code>print(12*34)</code> <interpreter>408</interpreter> \\boxed{408}"] * 30
PER_TURN = 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", CORPUS, vocab_size=320,
                                individual_digits=True)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return tiny_agent_engine(tokenizer.vocab_size, slots=4, max_target_length=128, max_prefill_length=64,
                             min_prefill_bucket=16)


def run(engine, tokenizer, env, *, max_total_tokens, truncation="mask", seed=0):
    """One episode of ``env``; returns (trajectory, loop)."""
    eng, params = engine

    async def main():
        async with Driver(eng, params, eos_token_ids=tokenizer.eos_token_ids,
                          detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) as driver:
            loop = AgentLoop(driver, tokenizer, max_new_tokens_per_turn=PER_TURN,
                             max_total_tokens=max_total_tokens, truncation=truncation)
            return await loop.run_episode(env, TASK, SamplingParams(temperature=1.0, seed=seed)), loop

    return asyncio.run(main())


def prompt_length(tokenizer, env) -> int:
    return len(tokenizer.apply_chat(asyncio.run(env.reset(TASK)), add_generation_prompt=True))


class NeverAnswers(ReToolEnv):
    """ReTool's own scoring, but every action gets an observation: the policy never answers,
    the environment never ends the episode (its turn limit is out of reach)."""

    def __init__(self, observation: str = "", scheme: str = "pm1", **weights):
        config = ReToolConfig(max_turns=100, fenced=False, system_prompt=None, stateful=False,
                              reward_weights=RewardWeights(outcome_scheme=scheme, **weights))
        super().__init__(pool=None, verifier=None, config=config)
        self.observation = observation

    async def step(self, action_text: str) -> StepResult:
        self.turns += 1
        self.response += action_text
        return StepResult(self.observation, 0.0, False, {})


class Scripted(Environment):
    """Answers turn by turn from ``script``: "observe", "no_answer", "answer" or "raise"; cannot
    score a cut-short episode (``truncated_result`` is the base class's None)."""

    def __init__(self, *script: str):
        self.script = list(script)

    async def reset(self, task):
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        action = self.script.pop(0) if self.script else "observe"
        if action == "raise":
            raise RuntimeError("scripted environment failure")
        if action == "answer":
            return StepResult("", 1.0, True, finish_reason="answer", correct=True)
        if action == "no_answer":
            return StepResult("", -1.0, True, finish_reason="no_answer", correct=False)
        return StepResult("ok", 0.0, False, {})


@pytest.mark.parametrize("scheme, rule, reward, masked", [
    ("pm1", "mask", -1.0, True),        # logged as the wrong answer it is, trains nothing
    ("pm1", "penalize", -1.0, False),   # trains as a wrong answer (it used to train as 0 > -1)
    ("binary", "penalize", 0.0, False),
])
def test_running_out_of_context_is_scored_as_a_wrong_answer(engine, tokenizer, scheme, rule, reward, masked):
    env = NeverAnswers(scheme=scheme)
    t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 3 * PER_TURN,
                  truncation=rule)
    assert t.finish_reason == "max_tokens" and t.truncated
    assert t.masked == masked and t.reward == reward
    assert t.reward_components["correct"] == 0.0 and t.reward_components["outcome"] == reward
    assert t.num_sampled_tokens > PER_TURN  # several turns ran before the context was full
    assert (loop.truncated, loop.masked, loop.env_errors) == (1, int(masked), 0)


def test_penalize_adds_the_overlong_shaping(engine, tokenizer):
    # L_max = 8, buffer 4: a response of more than 8 sampled tokens gets the full -1 (DAPO eq. 13).
    env = NeverAnswers(scheme="pm1", overlong=1.0, max_tokens=8, overlong_cache_tokens=4)
    t, _ = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 3 * PER_TURN,
               truncation="penalize")
    assert t.finish_reason == "max_tokens" and t.num_sampled_tokens > 8
    assert t.reward == -2.0 and t.reward_components["overlong"] == -1.0 and not t.masked


def test_an_observation_that_does_not_fit_ends_with_context_overflow(engine, tokenizer):
    env = NeverAnswers(observation="interpreter output " * 40)
    t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 3 * PER_TURN)
    assert t.finish_reason == "context_overflow" and t.truncated and t.masked and t.reward == -1.0
    assert t.turns[-1]["role"] == "tool" and t.num_sampled_tokens <= PER_TURN  # after the first turn
    # the observation was never appended: the trajectory ends with the policy's tokens
    assert t.loss_mask[-1] == 1


def test_a_prompt_that_does_not_fit_ends_before_sampling(engine, tokenizer):
    env = NeverAnswers()
    t, _ = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env))
    assert t.finish_reason == "context_overflow" and t.num_sampled_tokens == 0 and t.masked


def test_a_turn_cut_by_the_context_is_not_graded_as_no_answer(engine, tokenizer):
    # Room for 3 tokens only: the first turn is cut by the context, and the environment's
    # "no answer" verdict on the cut text does not stand: the episode is truncated.
    env = Scripted("no_answer")
    t, _ = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 4, truncation="penalize")
    assert t.num_sampled_tokens == 3
    assert t.finish_reason == "max_tokens"
    # Scripted cannot score it: masked under either rule
    assert t.masked and t.reward == 0.0 and t.reward_components == {"correct": 0.0}


@pytest.mark.parametrize("rule", ["mask", "penalize"])
def test_an_environment_error_is_masked_and_counted(engine, tokenizer, rule, caplog):
    env = Scripted("observe", "raise")
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.envs.agent_loop"):
        t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 4 * PER_TURN,
                      truncation=rule)
    assert t.finish_reason == "env_error" and t.masked and not t.truncated
    assert t.reward == 0.0 and t.reward_components == {"correct": 0.0}
    assert loop.env_errors == 1 and loop.masked == 1 and loop.truncated == 0
    assert "scripted environment failure" in caplog.text


def test_an_environment_that_cannot_score_a_truncation_gets_it_masked(engine, tokenizer, caplog):
    env = Scripted()
    with caplog.at_level(logging.WARNING, logger="agentrl_jax.envs.agent_loop"):
        t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 2 * PER_TURN,
                      truncation="penalize")
    assert t.truncated and t.masked and loop.masked == 1
    assert "Scripted.truncated_result returned None" in caplog.text


def test_an_answer_is_graded_and_trains(engine, tokenizer):
    env = Scripted("observe", "answer")
    t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 4 * PER_TURN)
    assert t.finish_reason == "answer" and not t.truncated and not t.masked
    assert t.reward == 1.0 and t.reward_components["correct"] == 1.0
    assert (loop.truncated, loop.masked, loop.env_errors) == (0, 0, 0)
    assert np.sum(t.loss_mask) == t.num_sampled_tokens > 0


def test_truncation_rule_is_checked():
    with pytest.raises(ValueError, match="truncation must be one of"):
        AgentLoop(None, None, max_new_tokens_per_turn=1, max_total_tokens=8, truncation="drop")


class ObservesUntilTurnLimit(ReToolEnv):
    """ReTool's own observation path and scoring: every action is answered through ``_observe``,
    which ends the episode at ``max_turns`` (as a tool call or a correction does)."""

    def __init__(self, **weights):
        config = ReToolConfig(max_turns=3, fenced=False, system_prompt=None, stateful=False,
                              reward_weights=RewardWeights(outcome_scheme="pm1", **weights))
        super().__init__(pool=None, verifier=None, config=config)

    async def step(self, action_text: str) -> StepResult:
        self.turns += 1
        self.response += action_text
        return self._observe("ok", {})


def test_an_episode_ended_by_the_turn_limit_gets_the_overlong_shaping(engine, tokenizer):
    # It used to be scored with 0 sampled tokens (only a graded answer was told the count),
    # so a long episode that hit max_turns escaped DAPO's overlong penalty.
    env = ObservesUntilTurnLimit(overlong=1.0, max_tokens=8, overlong_cache_tokens=4)
    t, _ = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 6 * PER_TURN)
    assert t.finish_reason == "max_turns" and t.num_sampled_tokens > 8
    assert t.reward_components["overlong"] == -1.0 and t.reward == -2.0


class Minimal(Environment):
    """The least an environment writes: StepResult(observation_text, reward, done)."""

    async def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        return StepResult("ok", 0.0, False) if self.turn == 1 else StepResult("", 0.5, True)


def test_a_minimal_environment_needs_no_contract_fields(engine, tokenizer):
    env = Minimal()
    t, loop = run(engine, tokenizer, env, max_total_tokens=prompt_length(tokenizer, env) + 4 * PER_TURN)
    assert t.finish_reason == "done" and t.reward == 0.5 and t.reward_components == {}
    assert t.tool_stats.calls == 0 and not t.masked and loop.env_errors == 0


def test_contract_fields_in_info_are_refused():
    with pytest.raises(TypeError, match=r"StepResult.info holds \['correct'\].*correct=\.\.\."):
        StepResult("", 1.0, True, {"correct": True})
    with pytest.raises(TypeError, match="tool_stats must be a ToolStats"):
        StepResult("", 1.0, True, tool_stats={"calls": 1})
