"""The admission rule of the RL loop, with a scripted collect and the real StepAdmission."""

from __future__ import annotations

import asyncio

import pytest

from agentrl_jax.train.rl.admission import StepAdmission


class Prompts:
    """A prompt iterator with a position (what a checkpoint stores)."""

    def __init__(self):
        self.drawn = 0

    def __next__(self):
        self.drawn += 1
        return [f"prompt {self.drawn - 1}"]

    def get_state(self):
        return {"drawn": self.drawn}


def _run(max_staleness: int, start_step: int = 0, total_steps: int = 5):
    """Runs the loop's protocol (await batch j, train, finish j); records when each collect
    started relative to the steps finished."""
    events: list[tuple[str, int]] = []
    data = Prompts()

    async def collect(step, tasks):
        events.append(("collect", step))
        assert tasks == [f"prompt {step - start_step}"]  # each step draws its own prompts, in order
        await asyncio.sleep(0.01)
        return [step], {}

    async def main():
        states = {}
        async with StepAdmission(collect, data, start_step, total_steps, max_staleness) as admission:
            for step in range(start_step, total_steps):
                trajectories, _, seconds = await admission.batch(step)
                assert trajectories == [step] and seconds > 0
                await asyncio.sleep(0.02)  # the update
                states[step] = admission.data_state(step + 1)
                events.append(("finish", step))
                await admission.finish(step)
        return states

    return events, asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_collect_starts_only_after_step_j_minus_1_minus_staleness_finished(max_staleness):
    events, _ = _run(max_staleness)
    finished = set()
    for kind, step in events:
        if kind == "finish":
            finished.add(step)
        elif step - 1 - max_staleness >= 0:
            assert step - 1 - max_staleness in finished, (step, events)
    # the bound is reached, not only kept: with staleness k, step k's collect starts before step 0 finished
    first_finish = events.index(("finish", 0))
    assert sum(kind == "collect" for kind, _ in events[:first_finish]) == 1 + max_staleness


def test_synchronous_schedule_alternates_and_checkpoints_the_next_prompts_position():
    events, states = _run(0, start_step=2, total_steps=5)
    assert events == [("collect", 2), ("finish", 2), ("collect", 3), ("finish", 3), ("collect", 4), ("finish", 4)]
    # finished step j: the position before step j + 1's prompts, drawn or not
    assert states == {2: {"drawn": 1}, 3: {"drawn": 2}, 4: {"drawn": 3}}


def test_with_steps_in_flight_a_checkpoint_records_the_position_before_untrained_prompts():
    _, states = _run(2)
    assert states[0] == {"drawn": 1}  # steps 1 and 2 were drawn already; a resume draws them again


def test_a_failing_collect_reaches_the_loop():
    async def collect(step, tasks):
        raise ValueError("sandbox down")

    async def main():
        async with StepAdmission(collect, Prompts(), 0, 3, 0) as admission:
            await admission.batch(0)

    with pytest.raises(ValueError, match="sandbox down"):
        asyncio.run(main())
