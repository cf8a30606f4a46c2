"""The held-out evaluation's sampling seeds: one random stream per task, the same at every evaluation.

Real pieces: a trained tiny tokenizer, a random tiny decoder, the real Engine, Driver and
agent loop on one CPU device, and ``evaluate`` itself; the environment only records the
policy's first turn and ends the episode.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from tiny_decoder import tiny_agent_engine

from agentrl_jax.config import Config, apply_overrides
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.envs.base import Environment, StepResult
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.train.rl.collect import evaluate

CORPUS = ["What is 12*34? <code>print(12*34)</code> <interpreter>408</interpreter> \\boxed{408}"] * 30
SAMPLES = 3


class Recording(Environment):
    """Ends every episode after the first turn, recording the policy's text per task id."""

    def __init__(self, record: dict[str, list[str]]):
        self.record, self.task_id = record, None

    async def reset(self, task):
        self.task_id = task["id"]
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        self.record[self.task_id].append(action_text)
        return StepResult("", 0.0, True, finish_reason="answer", correct=False)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    tokenizer = Tokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", CORPUS, vocab_size=320,
                                               individual_digits=True))
    engine, params = tiny_agent_engine(tokenizer.vocab_size, slots=8, max_target_length=128, max_prefill_length=64,
                                       min_prefill_bucket=16)
    return tokenizer, engine, params


def _evaluations(pieces, tasks, times: int) -> list[dict[str, list[str]]]:
    """``times`` evaluations of ``tasks`` with one driver; per evaluation the sorted texts per task id."""
    tokenizer, engine, params = pieces
    config = apply_overrides(Config(), [f"eval.samples_per_task={SAMPLES}", "eval.temperature=1.0",
                                        "eval.num_tasks=0"])

    async def main():
        out = []
        async with Driver(engine, params, eos_token_ids=tokenizer.eos_token_ids,
                          detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) as driver:
            loop = AgentLoop(driver, tokenizer, max_new_tokens_per_turn=12, max_total_tokens=96)
            for _ in range(times):
                record = defaultdict(list)
                await evaluate(config.eval, loop, lambda record=record: Recording(record), tasks, label="test")
                out.append({k: sorted(v) for k, v in record.items()})
        return out

    return asyncio.run(main())


def test_tasks_sample_independently_and_evaluations_repeat(pieces):
    # two held-out tasks with the same prompt: the old shared seed gave them identical samples
    tasks = [{"question": "What is 12*34?", "answer": "408", "id": "a"},
             {"question": "What is 12*34?", "answer": "408", "id": "b"}]
    first, second = _evaluations(pieces, tasks, times=2)
    assert len(first["a"]) == len(first["b"]) == SAMPLES
    assert first["a"] != first["b"]  # each task its own random stream
    assert first == second  # the start and end evaluations draw the same streams (paired)
