"""Agentic rollout throughput through the `Driver`, next to the same engine's raw decode.

Usage (GPU):
    python bench/rollout.py --size 1.7b --groups 8 --group-size 8 --turns 4 --turn-tokens 128
    python bench/rollout.py --size 1.7b --groups 8 --group-size 8 --turns 1 --turn-tokens 512
Quick check (CPU, < 1 min):
    python bench/rollout.py --tiny

Qwen3 shapes with random bf16 weights (no download; `bench/decode.py`'s table). The workload
is `--groups` GRPO groups of `--group-size` episodes, all in flight at once (one decode slot
each, or `--slots` slots: then groups wait and fill the slots others free, so the tail
where a few long episodes decode alone weighs less). Every episode of a group starts
from the group's `--prompt`-token prompt (the driver prefills it once and shares its
pages) and runs `--turns` turns in one session: a turn
samples a length drawn uniformly from turn_tokens x [1 - s, 1 + s], s = `--length-spread`
(default 0.5; random weights never stop by themselves, so `max_new_tokens` forces the ragged
lengths; 0 makes every turn the same length; the host knows such an end ahead and frees the
slot for the next dispatch), or with `--ends stop` samples until it draws one of a fixed set
of "stop" ids (a real turn's eos or stop string, which the host sees only when it reads the
token: the slot then decodes the rest of its dispatch and the next one for nothing), then the "tool"
answers after `--tool-latency` seconds with `--observation` random tokens, which the next
turn prefills into the session's pages. One untimed pass compiles the shapes it meets; two
timed passes use other seeds and the last one is reported (with how many shapes the timed
passes still had to compile).

`--lanes B` (fewer than the slots) decodes B sequences per step (`Engine(decode_batch=B)`):
the other slots hold admitted sequences ready, and a sequence that stops, at a stop id or its
length, hands its lane to one of them on the device at the next step.

Reported: sampled tokens / wall time of the timed pass, and the raw decode rate of the
same engine at the same concurrency (every lane's slot filled, a lane per slot, `steps_per_dispatch`-step
dispatches from a `--prompt`-token prompt for turns x turn_tokens steps, each dispatch queued before the
previous one is read; with `--lanes` an engine without lanes, so with the kernel's default chunking for
equal lengths), and their ratio; the mean context a sampled token attended over in the workload
(`mean_decode_context`: longer than the baseline's, `raw_mean_decode_context`, by the observations
and the ragged turns; `--matched-baseline` also runs the baseline from a prompt that much longer,
`ratio_context_matched`); plus preemptions, evictions and shared prefills. Where the ratio goes (`Driver.stats`
over the timed pass): `slot_occupancy` (lane-steps that advanced a sequence, of all
dispatched; free lanes at the end of the pass, when the longest episodes finish alone, and
lanes between turns lower it), `kept_token_fraction` (of those, tokens kept; the rest came after
a stop), their product `ratio_if_steps_ran_at_raw_speed` (the ceiling this workload
allows with this dispatch length), and `step_efficiency` = ratio / that ceiling (what
prefills, host work and longer contexts cost per dispatched step).

Diagnostics: `--warmup` calls `Driver.warmup()` first (every prefill shape and the decode
dispatch compiled, reported as `warmup_*`), and with `--no-untimed` skips the untimed pass,
so `shapes_compiled_in_timed_passes` shows what warm-up missed. `--call-times` adds a pass
after the timed ones in which every engine call is run to completion before the next
(`CallTimes`; slower, reported apart as `diag_*`): wall time per prefill call and per decode
dispatch, their share, prefill tokens real, laid out in rows (`diag_prefill_padded_tokens`:
the rows' R x C) and computed by the dense layers (`diag_prefill_computed_tokens`: N of a
compacted call, else R x C), compiles. `--no-compaction`: `Engine(prefill_compaction=False)`.
`--compiler-options`: `Engine(decode_compiler_options=)` for every engine of the run, the
baselines' included ('none': XLA's own GEMMs instead of the GPU default's cuBLAS ones).
`steady_*` is the decoded tokens/s over the part of the timed pass in which new episodes
still waited for a slot, `full_pool_*` over the part in which at least as many episodes
were unfinished as there are slots (the pool can be kept full, as with partial rollouts; no
ragged tail), next to the whole-pass number, which a synchronous RL step sees.

Other workloads: `--header N` starts every group's prompt with the same N tokens (a system
prompt or few-shot header; with `--prefix-cache` the driver keeps their pages and later
groups reuse them: `prefix_cache_hit_tokens`); `--max-length` and `--kv-fraction` size the
engine like a config (`rollout.max_sequence_length`, `rollout.kv_cache_memory_fraction`)
for a memory run, which reports the memory plan, the most KV tokens held and sequences
decoding at once (`peak_*`, sampled every 20 ms) and the preemptions; `--timed-passes 0
--no-raw` makes it one pass (compiles included) without the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


async def _rollout(driver, args, vocab: int, seed: int) -> dict:
    import numpy as np

    from agentrl_jax.rollout import SamplingParams

    rng = np.random.default_rng(seed)
    low, high = _turn_range(args)
    stops = _stop_ids(args, vocab)

    async def episode(prompt: list[int], index: int) -> int:
        session = driver.session()
        sampled, pending, context = 0, prompt, 0
        try:
            for _ in range(args.turns):
                length = high if stops else int(rng.integers(low, high + 1))
                completion = await driver.generate(
                    pending, SamplingParams(temperature=1.0, seed=seed * 100_003 + index), max_new_tokens=length,
                    session=session, stop_token_ids=stops,
                )
                n = len(completion.token_ids)
                context += len(pending)
                attended[0] += n * context + n * (n - 1) // 2  # the new tokens' contexts: context, ..., context + n - 1
                attended[1] += n
                context += n
                sampled += n
                await asyncio.sleep(args.tool_latency)
                pending = rng.integers(0, vocab, args.observation).tolist()
        finally:
            session.close()
            peak["unfinished"] -= 1
        return sampled

    header = np.random.default_rng(0).integers(0, vocab, args.header).tolist()  # the same in every pass
    prompts = [header + rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.groups)]
    peak = {"pages": 0, "slots": 0, "unfinished": args.groups * args.group_size}
    attended = [0, 0]  # sum over sampled tokens of the entries they attended over; sampled tokens
    sampling = asyncio.ensure_future(_sample_peaks(driver, peak))
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(episode(prompts[i // args.group_size], i)
                                    for i in range(args.groups * args.group_size)))
    seconds = time.perf_counter() - t0
    sampling.cancel()
    page_tokens = driver.engine.page_size
    return {"sampled_tokens": sum(counts), "seconds": seconds,
            "mean_decode_context": round(attended[0] / max(attended[1], 1)), "peak_kv_held_tokens": peak["pages"] * page_tokens,
            "peak_decoding_sequences": peak["slots"], **_steady(peak, "steady"), **_steady(peak, "full_pool")}


def _turn_range(args) -> tuple[int, int]:
    """The turn lengths' bounds: uniform in turn_tokens x [1 - spread, 1 + spread]; with ``--ends stop``,
    (1, the cap: `STOP_CAP` x turn_tokens)."""
    if args.ends == "stop":
        return 1, STOP_CAP * args.turn_tokens
    spread = round(args.turn_tokens * args.length_spread)
    return args.turn_tokens - spread, args.turn_tokens + spread


STOP_CAP = 3  # --ends stop: a turn that samples no stop id ends at this many times --turn-tokens


def _stop_ids(args, vocab: int) -> list[int]:
    """``--ends stop``: vocab / turn_tokens token ids drawn once (the same in every pass), so a turn of a
    random-weight model, whose next-token distribution is near uniform, samples one with probability
    ~1 / turn_tokens per step and its length is about geometric with mean ~turn_tokens (capped by
    `STOP_CAP`). Like eos or a stop string, the end is known only once the host reads the token. (With
    `--lanes` the engine checks them all on the device, `Engine(device_stop_ids=)`: a real request's
    few stop ids, eos and a tool call's end, take what a random model needs ~vocab / turn_tokens of.)"""
    import numpy as np

    if args.ends != "stop":
        return []
    count = max(vocab // args.turn_tokens, 1)
    return np.random.default_rng(12345).choice(vocab, count, replace=False).tolist()


async def _sample_peaks(driver, peak: dict) -> None:
    """Track the most KV pages held and sequences decoding at once, and two steady-state windows
    (sampled every 20 ms; `_steady`): from the first decoded token while new episodes still
    wait for a slot ("steady"), and while at least as many episodes are unfinished as there
    are slots ("full_pool": admission can keep every slot busy; for multi-turn episodes, which
    are all admitted early, the better measure)."""
    dispatcher = driver._dispatcher
    slots = driver.engine.decode_batch  # the decode lanes (the slots, unless --lanes is fewer)
    while True:
        peak["pages"] = max(peak["pages"], driver.pages_in_use())
        peak["slots"] = max(peak["slots"], len(driver._sched.slots))
        try:
            feeding = any(p.new_episode for p in list(driver._sched.waiting))
        except RuntimeError:  # the rollout thread changed the queue meanwhile: next sample
            feeding = True
        now, kept = time.perf_counter(), dispatcher.kept_tokens
        if kept > peak.setdefault("kept0", kept):
            for name, inside in (("steady", feeding), ("full_pool", peak["unfinished"] >= slots)):
                if inside:
                    peak.setdefault(name, [now, kept])
                    peak[name][2:] = [now, kept]
        await asyncio.sleep(0.02)


def _steady(peak: dict, name: str) -> dict:
    """Decoded tokens/s over the window ``name`` of `_sample_peaks` (the pool kept full but for
    turn gaps): what a trainer that keeps the pool full (partial rollouts, large steps) sees,
    without the ragged tail of a finite batch. Counts decoded tokens only (not the first token
    of each turn, which its prefill samples). None when the window is under 0.1 s."""
    window = peak.get(name)
    if window is None or len(window) < 4 or window[2] - window[0] < 0.1:
        return {f"{name}_tokens_per_s": None, f"{name}_window_s": None}
    return {f"{name}_tokens_per_s": round((window[3] - window[1]) / (window[2] - window[0])),
            f"{name}_window_s": round(window[2] - window[0], 2)}


class CallTimes:
    """Diagnostic: every prefill and decode call of the engine run to completion before the next
    (so the pass is slower than a timed one and is reported apart), with its wall time from call
    to result, and each prefill call's real and padded tokens; programs compiled in the pass."""

    def __init__(self, engine):
        import jax

        self.engine, self.jax = engine, jax
        self.calls = {"prefill": [], "decode": []}
        self.tokens = {"real": 0, "padded": 0, "computed": 0}
        self._prefill, self._generate = engine.prefill_insert, engine.generate
        self._compiled = len(engine._paged_prefill_fns) + len(engine._generate_fns)
        engine.prefill_insert, engine.generate = self.prefill_insert, self.generate

    def prefill_insert(self, params, state, rows, **kw):
        self.tokens["real"] += sum(len(r.tokens) for r in rows)
        padded, computed = _padded_tokens(self.engine, rows, kw.get("row_cap"))
        self.tokens["padded"] += padded
        self.tokens["computed"] += computed
        return self._timed("prefill", self._prefill, params, state, rows, **kw)

    def generate(self, params, state, **kw):
        return self._timed("decode", self._generate, params, state, **kw)

    def _timed(self, kind, fn, *args, **kw):
        t0 = time.perf_counter()
        out = self.jax.block_until_ready(fn(*args, **kw))
        self.calls[kind].append(time.perf_counter() - t0)
        return out

    def report(self, wall: float) -> dict:
        engine = self.engine
        del engine.prefill_insert, engine.generate  # the bound methods again
        pre, dec = self.calls["prefill"], self.calls["decode"]
        return {
            "diag_wall_s": round(wall, 2), "diag_prefill_calls": len(pre), "diag_prefill_s": round(sum(pre), 2),
            "diag_prefill_ms_mean": round(1e3 * sum(pre) / max(len(pre), 1), 2),
            "diag_decode_calls": len(dec), "diag_decode_s": round(sum(dec), 2),
            "diag_decode_ms_mean": round(1e3 * sum(dec) / max(len(dec), 1), 2),
            "diag_prefill_share": round(sum(pre) / max(sum(pre) + sum(dec), 1e-9), 3),
            "diag_prefill_real_tokens": self.tokens["real"], "diag_prefill_padded_tokens": self.tokens["padded"],
            "diag_prefill_computed_tokens": self.tokens["computed"],
            "diag_compiled": len(engine._paged_prefill_fns) + len(engine._generate_fns) - self._compiled,
        }


def _padded_tokens(engine, rows, row_cap) -> tuple[int, int]:
    """Tokens of the prefill call for ``rows`` (padding included): laid out in its rows, and computed
    by its dense layers (fewer when the call is compacted)."""
    if hasattr(engine, "prefill_shape"):
        shape = engine.prefill_shape(rows, row_cap)
        R, C = shape[:2]
        return R * C, shape.tokens if hasattr(shape, "tokens") else R * C  # (trees before compaction: a tuple)
    from agentrl_jax.rollout.state import prefill_bucket  # the layout of one row per sequence (older trees)

    most = max(sum(r.shard == d for r in rows) for d in range(engine.num_shards))
    per_shard = 1 << (2 * -(-max(most - 1, 0).bit_length() // 2))
    T = prefill_bucket(max(len(r.tokens) for r in rows), engine._min_bucket, engine.max_prefill_length)
    return (engine.num_shards * per_shard * T,) * 2


def _raw_steps(args) -> int:
    """The raw baseline's decode steps: turns x turn_tokens in whole dispatches, at least two."""
    return max(args.turns * args.turn_tokens // args.steps_per_dispatch, 2) * args.steps_per_dispatch


def _raw_decode(engine, params, args, vocab: int, trace_dir: str | None = None, extra_context: int = 0) -> float:
    """Tokens/s of `engine.generate` with every slot holding a `--prompt`-token prompt (the
    driver's decode loop without prefills, tools or stop checks). Each dispatch is queued
    before the previous one's results are read, as the driver does, so the device does not
    wait for the host between dispatches (reading every result before the next dispatch,
    as this loop once did, made the baseline a few percent slower).
    ``trace_dir``: the timed pass runs under `jax.profiler.trace` (the per-program device time
    is then written to trace_dir/programs.json). ``extra_context``: a prompt this many tokens
    longer (`--matched-baseline`: the workload's mean context)."""
    import contextlib

    import jax
    import numpy as np

    from agentrl_jax.rollout import SamplingParams

    tokens = np.random.default_rng(1).integers(0, vocab, args.header + args.prompt + extra_context).astype(np.int32)
    samples = args.group_size if args.raw_layout == "group" else 1
    prefix, _ = engine.prefill(params=params, padded_tokens=tokens, true_length=tokens.size,
                               sampler=SamplingParams(temperature=1.0, seed=0), num_samples=samples)
    dispatches = _raw_steps(args) // args.steps_per_dispatch
    for timed in (False, True):  # the first pass compiles
        state = engine.init_decode_state()
        state = _fill(engine, prefix, state, samples)
        jax.block_until_ready(state)
        traced = jax.profiler.trace(trace_dir) if timed and trace_dir else contextlib.nullcontext()
        with traced:
            t0, previous = time.perf_counter(), None
            for _ in range(dispatches):
                state, result = engine.generate(params, state, num_steps=args.steps_per_dispatch)
                result.copy_to_host_async()
                if previous is not None:
                    previous.convert_to_numpy()
                previous = result
            previous.convert_to_numpy()
            seconds = time.perf_counter() - t0
    if trace_dir:
        import timeline

        by_program = {}
        timeline.load(trace_dir, by_program)
        with open(os.path.join(trace_dir, "programs.json"), "w") as f:
            json.dump({"dispatches": dispatches, **timeline.programs(by_program)}, f, indent=1)
    return engine.decode_batch * dispatches * args.steps_per_dispatch / seconds


def _occupancy(before: dict, after: dict, lanes: int, steps: int) -> dict:
    """Where the reported pass's slot-steps went (`Driver.stats` counters, differenced over the pass)."""
    diff = {k: after[k] - before[k] for k in ("decode_dispatches", "live_slot_steps", "kept_tokens")}
    slot_steps = diff["decode_dispatches"] * steps * lanes
    occupancy = diff["live_slot_steps"] / max(slot_steps, 1)
    kept = diff["kept_tokens"] / max(diff["live_slot_steps"], 1)
    return {"decode_dispatches": diff["decode_dispatches"], "slot_occupancy": round(occupancy, 3),
            "kept_token_fraction": round(kept, 3), "kv_held_tokens_at_end": after.get("kv_held_tokens")}


def _host(before: dict, after: dict, seconds: float) -> dict:
    """Where the reported pass's host time went (`Driver.stats` counters, differenced): per tick,
    the engine thread's time and the share of it blocked on the device's results; and the
    pass's time outside ticks (the event loop: agents, tools, resolving futures)."""
    ticks = after["ticks"] - before["ticks"]
    tick_s = after["tick_seconds"] - before["tick_seconds"]
    wait_s = after["device_wait_seconds"] - before["device_wait_seconds"]
    busy_s = after["busy_seconds"] - before["busy_seconds"]
    return {"ticks": ticks, "tick_ms_mean": round(1e3 * tick_s / max(ticks, 1), 2),
            "tick_device_wait_share": round(wait_s / max(tick_s, 1e-9), 3),
            "outside_ticks_s": round(max(seconds - busy_s, 0.0), 2)}


async def _profiled(driver, args, vocab: int, seed: int) -> dict:
    """One pass under `jax.profiler.trace`, reduced by `timeline.summarize` (written to DIR/timeline.json)."""
    import jax

    trace_dir = os.path.join(args.profile, "trace")
    before = driver.stats()
    with jax.profiler.trace(trace_dir):
        result = await _rollout(driver, args, vocab, seed=seed)
    after = driver.stats()
    summary = _timeline(trace_dir, os.path.join(args.profile, "timeline.json"))
    return {"profile_wall_s": round(result["seconds"], 2),
            "profile_decode_dispatches": after["decode_dispatches"] - before["decode_dispatches"],
            **{f"profile_{k}": v for k, v in summary.items() if k not in ("largest_gaps", "device_ms_by_program")},
            "profile_device_ms_by_program": {k: v["ms"] for k, v in summary["device_ms_by_program"].items()}}


def _timeline(trace_dir: str, out: str) -> dict:
    import timeline

    by_program = {}
    summary = timeline.summarize(*timeline.load(trace_dir, by_program))
    summary["device_ms_by_program"] = timeline.programs(by_program)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _fill(engine, prefix, state, samples: int = 1):
    """As many slots as the engine has decode lanes hold the prompt (with decode lanes the other slots
    stay empty, so every lane decodes): each its own copy (``samples`` 1), or groups of ``samples`` slots
    sharing its full pages (`Engine.bulk_insert`, as a GRPO group's slots share them in the driver)."""
    for first in range(0, engine.decode_batch, samples):  # lanes: a multiple of the group size
        if samples == 1:
            state = engine.insert(prefix, state, first)
        else:
            state = engine.bulk_insert(prefix, state, list(range(first, first + samples)))
    return state


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--slots", type=int, default=0,
                        help="decode slots (default: one per episode; fewer: episodes wait and refill freed slots)")
    parser.add_argument("--lanes", type=int, default=0,
                        help="Engine(decode_batch=): sequences decoded per step (default: every slot); fewer: the "
                             "other slots wait ready and take the lane of a sequence that stops, on the device. The "
                             "raw baseline then decodes this many")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--length-spread", type=float, default=0.5,
                        help="turn lengths uniform in turn-tokens x [1 - s, 1 + s] (0: every turn the same length)")
    parser.add_argument("--ends", choices=["length", "stop"], default="length",
                        help="how a turn ends: at its drawn length (max_new_tokens, which the host knows ahead), or "
                             "at a sampled stop token (one of vocab / turn-tokens ids; known only when read, as eos or "
                             "a stop string), capped at %d x turn-tokens" % STOP_CAP)
    parser.add_argument("--observation", type=int, default=32)
    parser.add_argument("--tool-latency", type=float, default=0.0)
    parser.add_argument("--steps-per-dispatch", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--row-tokens", type=int, default=64, help="Engine(prefill_row_tokens=): prefill piece width")
    parser.add_argument("--kernel", default="",
                        help="override the Pallas decode kernel's settings, e.g. min_programs=1024 (as bench/decode.py)")
    parser.add_argument("--matched-baseline", action="store_true",
                        help="also the raw baseline from a prompt longer by the workload's mean context minus the "
                             "baseline's (raw_matched_decode_tokens_per_s, ratio_context_matched): the engine's own "
                             "loss apart from the workload attending over more entries")
    parser.add_argument("--kernel-programs", type=int, default=0,
                        help="Engine(decode_kernel_programs=N) for the rollout's engine (0: its default, 1024 with "
                             "--lanes, else 512); the raw baseline keeps its default")
    parser.add_argument("--compiler-options", default="",
                        help="Engine(decode_compiler_options=) for every engine of the run (bench/decode.py's "
                             "syntax: 'name=value,...', 'none' or 'default')")
    parser.add_argument("--no-compaction", action="store_true",
                        help="Engine(prefill_compaction=False): the prefill's dense layers run on every row's tokens")
    parser.add_argument("--header", type=int, default=0,
                        help="tokens of a header (system prompt / few-shot) shared by every group's prompt")
    parser.add_argument("--prefix-cache", action="store_true", help="Driver(prefix_cache=True)")
    parser.add_argument("--max-length", type=int, default=0,
                        help="the engine's max_target_length (default: the workload's longest sequence)")
    parser.add_argument("--kv-fraction", type=float, default=None, help="kv_cache_memory_fraction")
    parser.add_argument("--timed-passes", type=int, default=2,
                        help="passes after the untimed one (the last is reported); 0: report the untimed one")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw-decode baseline")
    parser.add_argument("--raw-layout", choices=["private", "group"], default="private",
                        help="the baseline's slots each hold their own copy of the prompt (default), or groups "
                             "of --group-size slots share its full pages as the driver's groups do")
    parser.add_argument("--warmup", action="store_true",
                        help="Driver.warmup() before the first pass (compiles every prefill shape; reported)")
    parser.add_argument("--no-untimed", action="store_true",
                        help="with --warmup: no untimed pass (the timed ones then show what warm-up left to compile)")
    parser.add_argument("--call-times", action="store_true",
                        help="one more pass after the timed ones, blocking on every engine call: device time per "
                             "call kind, prefill tokens real / padded, compiles (reported as diag_*)")
    parser.add_argument("--profile", metavar="DIR",
                        help="one more pass, traced with jax.profiler into DIR: the device's idle gaps and the host "
                             "phases they fell in (bench/timeline.py; reported as profile_*)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a < 1 min smoke run")
    parser.add_argument("--json", help="also write the result to this JSON file")
    args = parser.parse_args(argv)
    if not 0 <= args.length_spread < 1:
        parser.error(f"--length-spread={args.length_spread} must be in [0, 1)")
    if args.no_untimed and not (args.warmup and args.timed_passes > 0):
        parser.error("--no-untimed needs --warmup and --timed-passes >= 1")
    if args.tiny:
        args.size, args.groups, args.group_size, args.prompt, args.turns = "tiny", 2, 2, 16, 2
        args.turn_tokens, args.observation, args.steps_per_dispatch, args.page_size = 16, 4, 4, 8

    import jax
    from decode import compiler_options, parse_kernel, qwen3_model

    from agentrl_jax.rollout import Driver
    from agentrl_jax.rollout.jetstream import DensePrefixEngine  # the runs use JetStream's dense prefill too
    from agentrl_jax.sharding import make_mesh

    model, dtype = qwen3_model(args.size)
    vocab = model.config.vocab_size
    episodes = args.groups * args.group_size
    slots = args.slots or episodes
    if slots % args.group_size:
        parser.error(f"--slots={slots} must be a multiple of --group-size={args.group_size} (a group decodes at once)")
    prompt = args.header + args.prompt
    longest = prompt + args.turns * (_turn_range(args)[1] + args.observation + 1) + 1
    if args.max_length and args.max_length < longest:
        parser.error(f"--max-length={args.max_length} is shorter than the workload's longest sequence ({longest})")
    lanes = args.lanes or slots
    if not 1 <= lanes <= slots:
        parser.error(f"--lanes={lanes} must be in [1, --slots={slots}]")
    engine_kw = dict(mesh=make_mesh({"data": 1}, jax.devices()[:1]),
                     max_target_length=args.max_length or longest, max_prefill_length=max(min(prompt, 2048), 16),
                     cache_dtype=dtype, page_size=args.page_size, kv_cache_memory_fraction=args.kv_fraction,
                     prefill_row_tokens=args.row_tokens, decode_compiler_options=compiler_options(args.compiler_options),
                     decode_kernel=parse_kernel(args.kernel), **({"prefill_compaction": False} if args.no_compaction else {}))  # (older trees: no such argument)
    engine = DensePrefixEngine(model, max_concurrent_decodes=slots, decode_batch=lanes,
                    device_stop_ids=max(len(_stop_ids(args, vocab)), 1),
                    decode_kernel_programs=args.kernel_programs or None, **engine_kw)

    async def run():
        async with Driver(engine, model, steps_per_dispatch=args.steps_per_dispatch,
                          prefix_cache=args.prefix_cache) as driver:
            warmup = {}
            if args.warmup:
                warmup = {f"warmup_{k}": round(v, 1) if k == "seconds" else v for k, v in (await driver.warmup()).items()}
            before = driver.stats()
            shapes = len(engine._paged_prefill_fns) + len(engine._generate_fns)
            warm = {"seconds": 0.0} if args.no_untimed else await _rollout(driver, args, vocab, seed=1)
            if not args.no_untimed:
                shapes = len(engine._paged_prefill_fns) + len(engine._generate_fns)
            passes = [warm]
            for seed in range(2, 2 + args.timed_passes):
                before = driver.stats()
                passes.append(await _rollout(driver, args, vocab, seed=seed))
            after = driver.stats()
            timed_compiles = len(engine._paged_prefill_fns) + len(engine._generate_fns) - shapes
            if args.call_times:  # after the timed passes, so it does not change them
                times = CallTimes(engine)
                diag = await _rollout(driver, args, vocab, seed=2 + args.timed_passes)
                warmup.update(times.report(diag["seconds"]))
            if args.profile:  # last: tracing slows the host a little
                warmup.update(await _profiled(driver, args, vocab, seed=3 + args.timed_passes))
            counters = {**warmup, **{k: after.get(k, 0) - before.get(k, 0) for k in ("preemptions", "evictions", "shared_prefills", "split_groups")},
                        "shapes_compiled_in_timed_passes": timed_compiles, **_occupancy(before, after, lanes, args.steps_per_dispatch),
                        **_host(before, after, passes[-1]["seconds"]),
                        **{k: after[k] - before.get(k, 0) for k in ("prefix_cache_hits", "prefix_cache_hit_tokens")
                           if k in after}}
        return warm, passes, counters

    warm, passes, counters = asyncio.run(run())
    timed = passes[-1]
    # the baseline: every lane's slot filled, a lane per slot (the plain step), after the driver freed its pool
    raw_engine = engine if lanes == slots else DensePrefixEngine(model, max_concurrent_decodes=lanes, **engine_kw)
    raw = None if args.no_raw else _raw_decode(raw_engine, raw_engine.load_params(model), args, vocab,
                                               trace_dir=args.profile and os.path.join(args.profile, "raw_trace"))
    # what the lane step's gathers cost: the driver's engine decoding every lane, no slot waiting
    raw_lanes = None if args.no_raw or raw_engine is engine else _raw_decode(engine, engine.load_params(model),
                                                                               args, vocab)
    rate = timed["sampled_tokens"] / timed["seconds"]
    raw_context = args.header + args.prompt + _raw_steps(args) // 2  # the baseline's mean context
    matched = None
    if args.matched_baseline and not args.no_raw:  # the same baseline from a prompt as much longer as the workload attends
        extra = max(timed["mean_decode_context"] - raw_context, 0)
        # its own engine: the longer prompt is one prefill call, longer than the workload's prompts
        matched_engine = DensePrefixEngine(model, max_concurrent_decodes=lanes,
                                **{**engine_kw, "max_prefill_length": max(prompt + extra, 16)})
        matched = _raw_decode(matched_engine, matched_engine.load_params(model), args, vocab, extra_context=extra)
        matched_context = raw_context + extra
        del matched_engine
    # the ratio if every dispatched decode step ran at raw-decode speed: what the slot-steps were used for
    bound = counters["slot_occupancy"] * counters["kept_token_fraction"]
    row = {
        "device": jax.devices()[0].device_kind, "size": args.size, "episodes": episodes, "slots": slots, "lanes": lanes,
        "kernel": args.kernel or "default", "kernel_programs": engine.decode_kernel_programs,
        "decode_compiler_options": engine.decode_compiler_options,
        "turns": args.turns, "ends": args.ends, "length_spread": args.length_spread,
        "turn_tokens": args.turn_tokens, "tool_latency_s": args.tool_latency, "page_size": args.page_size, "row_tokens": engine.prefill_row_tokens,
        "rollout_tokens_per_s": round(rate), "raw_decode_tokens_per_s": raw and round(raw),
        "ratio": raw and round(rate / raw, 3),
        "raw_lane_step_tokens_per_s": raw_lanes and round(raw_lanes), "raw_layout": args.raw_layout, "ratio_if_steps_ran_at_raw_speed": round(bound, 3),
        "steady_tokens_per_s": timed["steady_tokens_per_s"], "steady_window_s": timed["steady_window_s"],
        "steady_ratio": raw and timed["steady_tokens_per_s"] and round(timed["steady_tokens_per_s"] / raw, 3),
        "full_pool_tokens_per_s": timed["full_pool_tokens_per_s"], "full_pool_window_s": timed["full_pool_window_s"],
        "full_pool_ratio": raw and timed["full_pool_tokens_per_s"] and round(timed["full_pool_tokens_per_s"] / raw, 3),
        "step_efficiency": raw and round(rate / raw / max(bound, 1e-9), 3),
        "header": args.header, "prefix_cache": args.prefix_cache, "max_target_length": engine.max_target_length,
        "warmup_s": round(warm["seconds"], 1), "timed_s": round(timed["seconds"], 2),
        "sampled_tokens": timed["sampled_tokens"], "mean_decode_context": timed["mean_decode_context"],
        "raw_mean_decode_context": raw_context,
        "raw_matched_decode_tokens_per_s": matched and round(matched),
        "raw_matched_mean_decode_context": matched and matched_context,
        "ratio_context_matched": matched and round(rate / matched, 3),
        "peak_kv_held_tokens": timed["peak_kv_held_tokens"],
        "peak_decoding_sequences": timed["peak_decoding_sequences"], **counters,
        "compiled_prefill_shapes": len(engine._paged_prefill_fns), "compiled_decode_shapes": len(engine._generate_fns),
        "memory_plan": engine.memory_plan.describe(),
    }
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
