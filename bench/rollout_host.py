"""Host time per decode step of the rollout driver, on CPU with the tiny model.

Usage (run the same script against two checkouts to compare them on one machine):
    PYTHONPATH=/path/to/old python bench/rollout_host.py --json old.json
    PYTHONPATH=$PWD python bench/rollout_host.py --json new.json

What the accelerator never sees is the host's share of a tick: scheduling, page-table
updates, packing prefills, dispatching, and reading results (stop checks included). This
script runs `bench/rollout.py`'s workload (GRPO groups of multi-turn sessions, ragged
forced turn lengths) on the tiny Qwen3 shape, plus stop token ids and a stop string
(with a toy detokenizer whose text makes ~1 token in 26 a candidate), and splits each
tick's wall time into the time spent waiting for the device and the rest, the host
time. On CPU the "device" computes on the same cores as the host, so the two would slow
each other down and blur the split: here every prefill and decode call is run to
completion before the host goes on (timed as waiting; the driver's pipelining is off for
the measurement), so the host time is the host's own work. Other processes on the machine still stretch
wall-clock times, so the tick thread's CPU time (`time.thread_time`, which does not count
waiting or XLA's own threads) is reported too: `host_cpu_ms_per_decode_step` is the
steadier number. It reports host
milliseconds per dispatched decode step and per tick, and the tick count. It wraps
only calls that every version of the driver makes (`Engine.generate`,
`ResultTokens.convert_to_numpy`, the tick function), so it measures old and new code alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Clock:
    """Cumulative seconds and counts of the wrapped calls."""

    def __init__(self):
        self.tick_s = self.wait_s = self.cpu_s = 0.0
        self.ticks = self.dispatches = 0

    def wrap_tick(self, fn):
        def tick(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.tick_s += time.perf_counter() - t0
                self.cpu_s += time.thread_time() - c0
                self.ticks += 1
        return tick

    def wrap_wait(self, fn):
        import jax

        def convert(result):
            t0 = time.perf_counter()
            jax.block_until_ready(result)
            self.wait_s += time.perf_counter() - t0
            return fn(result)
        return convert

    def wrap_device_call(self, fn, count: bool):
        """``fn`` (a jitted engine call) run to completion, its device time counted as waiting."""
        import jax

        def call(*args, **kwargs):
            self.dispatches += count
            out = fn(*args, **kwargs)
            t0 = time.perf_counter()
            jax.block_until_ready(out)
            self.wait_s += time.perf_counter() - t0
            return out
        return call


def _instrument(driver, clock: _Clock) -> None:
    """Wrap the tick of this driver (its dispatcher's in newer versions) and the engine's generate."""
    owner = getattr(driver, "_dispatcher", None)
    if owner is not None:
        owner.tick = clock.wrap_tick(owner.tick)
    else:
        driver._tick = clock.wrap_tick(driver._tick)
    engine = driver.engine
    engine.generate = clock.wrap_device_call(engine.generate, count=True)
    engine.prefill_insert = clock.wrap_device_call(engine.prefill_insert, count=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--observation", type=int, default=8)
    parser.add_argument("--steps-per-dispatch", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", help="also write the result to this JSON file")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    import agentrl_jax
    from agentrl_jax.rollout import Driver, Engine, SamplingParams
    from agentrl_jax.rollout.result_tokens import ResultTokens
    from agentrl_jax.sharding import make_mesh

    from decode import qwen3_model

    model, dtype = qwen3_model("tiny")
    vocab = model.config.vocab_size
    slots = args.groups * args.group_size
    longest = args.prompt + args.turns * (3 * args.turn_tokens // 2 + args.observation + 1) + 1
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=slots,
                    max_target_length=longest, max_prefill_length=max(args.prompt, 16), cache_dtype=dtype,
                    page_size=args.page_size)
    clock = _Clock()
    ResultTokens.convert_to_numpy = clock.wrap_wait(ResultTokens.convert_to_numpy)
    detokenize = lambda ids: "".join(chr(97 + int(i) % 26) for i in ids)  # noqa: E731

    async def rollout(driver, seed: int) -> int:
        rng = np.random.default_rng(seed)
        low, high = args.turn_tokens // 2, 3 * args.turn_tokens // 2

        async def episode(prompt, index):
            session, sampled, pending = driver.session(), 0, prompt
            try:
                for _ in range(args.turns):
                    completion = await driver.generate(
                        pending, SamplingParams(temperature=1.0, seed=seed * 100_003 + index),
                        max_new_tokens=int(rng.integers(low, high + 1)), session=session,
                        stop_token_ids=(vocab + 1,), stop_strings=("zzzq",),
                    )
                    sampled += len(completion.token_ids)
                    pending = rng.integers(0, vocab, args.observation).tolist()
            finally:
                session.close()
            return sampled

        prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.groups)]
        counts = await asyncio.gather(*(episode(prompts[i // args.group_size], i) for i in range(slots)))
        return sum(counts)

    async def run():
        async with Driver(engine, model, steps_per_dispatch=args.steps_per_dispatch, detokenize=detokenize) as driver:
            await rollout(driver, seed=1)  # compiles
            _instrument(driver, clock)
            clock.__init__()
            t0 = time.perf_counter()
            sampled = await rollout(driver, seed=2)
            return sampled, time.perf_counter() - t0

    sampled, seconds = asyncio.run(run())
    host = clock.tick_s - clock.wait_s
    steps = clock.dispatches * args.steps_per_dispatch
    row = {
        "agentrl_jax": os.path.dirname(agentrl_jax.__file__), "episodes": slots, "turns": args.turns,
        "sampled_tokens": sampled, "wall_s": round(seconds, 3), "ticks": clock.ticks,
        "dispatches": clock.dispatches, "tick_s": round(clock.tick_s, 3), "device_wait_s": round(clock.wait_s, 3),
        "host_s": round(host, 3), "host_ms_per_tick": round(1e3 * host / max(clock.ticks, 1), 3),
        "host_ms_per_decode_step": round(1e3 * host / max(steps, 1), 4),
        "host_cpu_ms_per_decode_step": round(1e3 * clock.cpu_s / max(steps, 1), 4),
        "host_us_per_sampled_token": round(1e6 * host / max(sampled, 1), 2),
    }
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
