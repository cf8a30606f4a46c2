"""The solver-checker team on the embedded demo's arithmetic tasks (configs/multi_policy_arith.py):
the team's solver plays the run's own environment (the arithmetic demo's short format), the
checker's format-only cold start is written from the arithmetic demonstrations and shows it the
text the episode will show it, and an episode decoded by two tiny policies' engines masks each
policy's row to exactly its own tokens. Real sandbox pool, math verifier, tokenizer, Engine
and Driver."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_solver_checker import play_script
from tiny_decoder import tiny_agent_engine

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.envs.arithmetic import ArithmeticEnv
from agentrl_jax.envs.multi_actor import OBSERVATION, MultiActorLoop
from agentrl_jax.envs.solver_checker import (
    CHECKER,
    DEMO_CRITIQUE,
    SOLVER,
    checker_prompt,
    first_answer_part,
    parse_verdict,
)
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rewards import MathVerifier
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.request import Completion
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.train.multi_policy.team import (
    demonstrations,
    scratch_corpus,
    team_env_factory,
)
from agentrl_jax.train.sft import conversation_to_record

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "multi_policy_arith.py")
MAX_TOKENS = 384
TASK = {"question": "What is 12*34?", "answer": "408"}


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG, ["environment.num_train_tasks=200"])


def test_the_team_solver_plays_the_runs_arithmetic_episode(loop_thread, pool, verifier, config):
    env = team_env_factory(config, pool, verifier, count_tokens=len)()
    assert isinstance(env.solver, ArithmeticEnv) and env.stop_strings[SOLVER] == ("</code>",)
    shown, result = play_script(loop_thread, env, TASK, [
        (SOLVER, "<code>print(12*34)</code>"), (SOLVER, "\\boxed{407}"), (CHECKER, "REJECT: copy it"),
        (SOLVER, "\\boxed{408}")])
    assert shown[0].messages == [{"role": "user", "content": "What is 12*34?"}]  # the demo's: no system prompt
    assert shown[1].text == "<interpreter>408</interpreter>"  # the short format's observation
    assert shown[2].messages == checker_prompt(
        "What is 12*34?", "<code>print(12*34)</code><interpreter>408</interpreter>\\boxed{407}")
    assert result.correct and result.rewards == {SOLVER: 1.0, CHECKER: 1.0}  # the recipe's checker: its role reward
    assert result.metrics["critique/wrong_to_right"] == 1.0


def test_a_solver_environment_the_checker_cannot_read_is_one_error_line(pool, verifier, config):
    native = dataclasses.replace(config, environment=dataclasses.replace(config.environment, layout="native"))
    with pytest.raises(ConfigError, match=r"ReTool-style solver .* layout 'native' plays NativeReToolEnv"):
        team_env_factory(native, pool, verifier, count_tokens=len)


def test_the_checkers_cold_start_from_arithmetic_demonstrations_shows_the_episodes_text(
        loop_thread, pool, verifier, config):
    tasks = config.environment.make_tasks(config, "train")
    demos = demonstrations(config, tasks)
    assert len(demos[SOLVER]) == len(demos[CHECKER]) == len(tasks)
    verdicts = [parse_verdict(d[-1]["content"]) for d in demos[CHECKER]]
    assert all(well_formed for _, _, well_formed in verdicts)
    assert 0.35 < np.mean([accepted for accepted, _, _ in verdicts]) < 0.65
    factory = team_env_factory(config, pool, verifier, count_tokens=len)
    for task, solver, checker in list(zip(tasks, demos[SOLVER], demos[CHECKER]))[:12]:
        # The demonstration's assistant turns played in the episode: the checker is then shown
        # its prompt over the whole transcript, of which its cold start saw this one or a cut.
        script = [(SOLVER, m["content"]) for m in solver if m["role"] == "assistant"]
        shown, _ = play_script(loop_thread, factory(), task, script)
        [whole] = [turn for turn in shown if turn.actor == CHECKER]
        assert checker[:-1][0] == whole.messages[0]
        assert whole.messages[1]["content"].startswith(checker[1]["content"])
        assert checker[1]["content"].startswith(f"Problem: {task['question']}\n\nSolution:\n")


def test_two_policies_decode_their_own_actors_and_train_exactly_their_own_tokens(
        loop_thread, pool, verifier, config, tmp_path):
    tasks = config.environment.make_tasks(config, "train")
    train_tiny_tokenizer(tmp_path, scratch_corpus(config, demonstrations(config, tasks), tasks), 384,
                         individual_digits=True)
    tok = Tokenizer(str(tmp_path))
    engines = [tiny_agent_engine(tok.vocab_size, slots=2, max_target_length=384, max_prefill_length=256,
                                 min_prefill_bucket=32, max_position_embeddings=512) for _ in range(2)]
    made = []

    def factory():
        made.append(team_env_factory(config, pool, verifier, count_tokens=lambda s: len(tok.encode(s)))())
        return made[-1]

    async def main():
        drivers = {name: Driver(engine, params, eos_token_ids=tok.eos_token_ids, tokenize=tok.encode,
                                detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
                   for name, (engine, params) in zip((SOLVER, CHECKER), engines)}
        for d in drivers.values():
            await d.__aenter__()
        try:
            await drivers[CHECKER].update_params(engines[1][1], 7)  # the checker's engine holds version 7
            loop = MultiActorLoop(drivers, {SOLVER: SOLVER, CHECKER: CHECKER}, tok, max_new_tokens_per_turn=32,
                                  max_total_tokens=384)
            return await loop.run_episode(factory(), TASK, SamplingParams(temperature=1.0, seed=0), group_id=2)
        finally:
            for d in drivers.values():
                await d.__aexit__(None, None, None)

    episode = loop_thread.run(main())
    solver_view, checker_view = episode.views[SOLVER], episode.views[CHECKER]
    question = [{"role": "user", "content": TASK["question"]}]  # the demo's short format: no system prompt
    assert solver_view.ids[:solver_view.prompt_length] == tok.apply_chat(question)
    assert checker_view.ids[:checker_view.prompt_length] == tok.apply_chat(
        checker_prompt(TASK["question"], made[0].solver.response))
    assert set(checker_view.owners) == {OBSERVATION, 1} and 0 in solver_view.owners and 1 not in solver_view.owners
    for actor, index, version in ((SOLVER, 0, 0), (CHECKER, 1, 7)):
        row = episode.trajectories[actor]
        np.testing.assert_array_equal(row.loss_mask, np.asarray(episode.views[actor].owners) == index)
        sampled = row.loss_mask.astype(bool)
        assert np.all(row.params_versions[sampled] == version) and np.all(row.params_versions[~sampled] == -1)
        assert row.group_id == 2 * 2 + index
    team = episode.result.metrics["team/final_correct"]
    assert episode.trajectories[SOLVER].reward == team
    assert episode.trajectories[CHECKER].reward == episode.result.metrics["checker/accuracy"]  # no team reward


class _Session:
    def close(self):
        pass


class ScriptedSampler:
    """A policy whose turns are given token ids: it stands in for the engine's sampling only
    (a random tiny model cannot be made to write a demonstration); the loop, the environment,
    the sandbox and the tokenizer are the real ones."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    def session(self):
        return _Session()

    async def generate(self, ids, sampling, *, stop_token_ids, stop_strings, max_new_tokens, session):
        out = self.turns.pop(0)
        assert len(out) <= max_new_tokens
        return Completion(out, [0.0] * len(out), [0.0] * len(out), "stop", [0] * len(out), len(ids))


def sampled_runs(ids, mask) -> list[list[int]]:
    """The maximal runs of loss-mask-1 tokens: the assistant's turns as the policy samples them."""
    runs, previous = [], 0
    for token, flag in zip(ids, mask):
        if flag and not previous:
            runs.append([])
        if flag:
            runs[-1].append(token)
        previous = flag
    return runs


def scripted_episode(loop_thread, factory, tok, task, turns: dict[str, list[list[int]]]):
    """One episode of ``factory``'s environment on ``task`` in which each actor writes the given
    turns (token ids); the episode and the samplers (each must have used all its turns)."""
    samplers = {actor: ScriptedSampler(actor_turns) for actor, actor_turns in turns.items()}
    loop = MultiActorLoop(samplers, {SOLVER: SOLVER, CHECKER: CHECKER}, tok, max_new_tokens_per_turn=32,
                          max_total_tokens=MAX_TOKENS)
    return loop_thread.run(loop.run_episode(factory(), task, SamplingParams(temperature=1.0, seed=0))), samplers


def test_the_solvers_second_try_demonstrations_are_the_rejected_episodes_tokens(loop_thread, pool, verifier, config,
                                                                                 tmp_path):
    tasks = config.environment.make_tasks(config, "train")
    demos = demonstrations(config, tasks)
    plain = config.environment.make_demonstrations(config, tasks)
    assert [first_answer_part(d) for d in demos[SOLVER]] == plain  # the first answers are the demo's own
    retried = [(task, d) for task, d in zip(tasks, demos[SOLVER]) if d != first_answer_part(d)]
    memory_wrong = [p for task, p in zip(tasks, plain) if len(p) == 2 and p[1]["content"] != f"\\boxed{{{task['answer']}}}"]
    assert len(retried) == len(memory_wrong) > 0  # solver_second_tries=1: every wrong answer goes on
    train_tiny_tokenizer(tmp_path, scratch_corpus(config, demos, tasks), MAX_TOKENS, individual_digits=True)
    tok = Tokenizer(str(tmp_path))
    factory = team_env_factory(config, pool, verifier, count_tokens=lambda s: len(tok.encode(s)))
    for task, demo in retried[:3]:
        record = conversation_to_record(tok, demo)
        episode, _ = scripted_episode(loop_thread, factory, tok, task, {
            SOLVER: sampled_runs(record.token_ids, record.loss_mask),
            CHECKER: [tok.encode(DEMO_CRITIQUE) + [tok.eos_token_ids[0]]]})
        # The solver's row in the rejected episode is its SFT record: the same ids (the prompt,
        # the wrong answer, the rejection note through the template, the interpreter's output,
        # the second try) and the same tokens trained.
        row = episode.trajectories[SOLVER]
        assert row.token_ids.tolist() == record.token_ids
        assert row.loss_mask.tolist() == record.loss_mask
        m = episode.result.metrics
        assert (m["team/first_correct"], m["checker/rejected"], m["critique/wrong_to_right"]) == (0.0, 1.0, 1.0)


def test_the_checkers_interpreter_demonstrations_are_the_episodes_tokens(loop_thread, pool, verifier, config,
                                                                          tmp_path):
    """With ``checker_tool_calls`` the checker's cold start (a program printing the task's result,
    its output, the labeled verdict) is, token for token, its row in an episode where it writes
    the same: the program runs in the real sandbox and its output is the demonstration's."""
    config = dataclasses.replace(config, multi_policy=dataclasses.replace(
        config.multi_policy, checker_tool_calls=1, checker_cold_start="labeled"))
    tasks = config.environment.make_tasks(config, "train")
    demos = demonstrations(config, tasks)
    plain = demonstrations(dataclasses.replace(config, multi_policy=dataclasses.replace(
        config.multi_policy, checker_tool_calls=0)), tasks)
    assert demos[SOLVER] == plain[SOLVER]  # the solver's are unchanged, the checker's verdicts too
    assert [d[-1] for d in demos[CHECKER]] == [d[-1] for d in plain[CHECKER]]
    train_tiny_tokenizer(tmp_path, scratch_corpus(config, demos, tasks), MAX_TOKENS, individual_digits=True)
    tok = Tokenizer(str(tmp_path))
    factory = team_env_factory(config, pool, verifier, count_tokens=lambda s: len(tok.encode(s)))
    whole = [(task, s, c) for task, s, c in zip(tasks, demos[SOLVER], demos[CHECKER])
             if c[1]["content"].endswith(first_answer_part(s)[-1]["content"])]  # shown the whole first answer
    picked = [w for verdict in ("ACCEPT", DEMO_CRITIQUE)
              for w in [w for w in whole if w[2][-1]["content"] == verdict][:3]]
    assert len(picked) == 6  # accepted episodes and rejected ones (the solver's second try follows)
    for task, solver_demo, checker_demo in picked:
        assert checker_demo[2]["content"] == f"<code>print({task['a']}{task['op']}{task['b']})</code>"
        solver_record = conversation_to_record(tok, solver_demo)  # with its second try after a rejection
        record = conversation_to_record(tok, checker_demo)
        episode, samplers = scripted_episode(loop_thread, factory, tok, task, {
            SOLVER: sampled_runs(solver_record.token_ids, solver_record.loss_mask),
            CHECKER: sampled_runs(record.token_ids, record.loss_mask)})
        row = episode.trajectories[CHECKER]
        assert row.token_ids.tolist() == record.token_ids
        assert row.loss_mask.tolist() == record.loss_mask
        assert episode.result.tool_stats[CHECKER].successful == 1 and episode.result.metrics["checker/accuracy"] == 1
        assert not samplers[SOLVER].turns and not samplers[CHECKER].turns
