"""Decode throughput of Tunix's native sampler (google-tunix 0.1.7) at bench/decode.py's shapes.

Usage (GPU, with google-tunix and what it imports installed, e.g. from wheels with --no-deps):
    python bench/decode.py --sizes 1.7b --batches 64 --no-hf --json ours.json
    python bench/decode_tunix.py --size 1.7b --batch 64 --prompt 512 --gen 1024 --compare ours.json
Quick check (CPU, tiny shapes, < 1 min):
    python bench/decode_tunix.py --tiny

Its rows sit next to bench/decode.py's (`--compare`) for a same-card comparison. This runs
`tunix.generate.sampler.Sampler` (its own jitted prefill + `while_loop` decode over a
``[B, cache, KV, K]`` cache per layer) on `tunix.models.qwen3.model.Qwen3` with random
weights of bench/decode.py's Qwen3 shapes (bf16 on GPU), through its public ``__call__``:
every row the same length-`--prompt` prompt of random token ids, `--gen` new tokens. Decode
time = time(``gen`` tokens) - time(1 token), as bench/decode.py times HF `generate`, so the
prefill and the host-side work around it cancel. Each of the two calls is run once untimed
first (each output length is its own compiled shape), then `--trials` times (median).

Modes: ``sample`` = temperature 1, top_p 1.0 (Tunix then draws from the full distribution
without sorting) with log-probs returned, the work our engine does per token; ``greedy`` =
argmax without log-probs, Tunix's cheapest path.

Tunix needs a tokenizer; the prompts here are token ids already, so `IdTokenizer` maps
space-separated ids to ids and back (Tunix's TokenizerAdapter accepts any object with
encode/decode/bos_id/eos_id/pad_id).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode import FLOAT32_SIZES, QWEN3, _rates, hbm_bandwidth

PAD = 0  # Tunix masks pad ids out of the prompt: prompts draw ids from [1, vocab - 1)


class IdTokenizer:
    """Token ids as text ("17 4 99"): the prompts are random ids, there is no vocabulary to encode."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return PAD  # falsy: Tunix prepends no BOS

    def eos_id(self) -> int:
        return self.vocab - 1  # never in a prompt; a row that samples it is "done", the loop goes on for the others

    def pad_id(self) -> int:
        return PAD


def tunix_model(size: str):
    """A random-init Tunix Qwen3 of bench/decode.py's ``size`` shape and its dtype (bf16, float32 for tiny sizes)."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    vocab, d, f, layers, heads, kv, k, tie = QWEN3[size]
    dtype = jnp.float32 if size in FLOAT32_SIZES else jnp.bfloat16
    config = qwen3.ModelConfig(
        num_layers=layers, vocab_size=vocab, embed_dim=d, hidden_dim=f, num_heads=heads, head_dim=k,
        num_kv_heads=kv, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=tie, dtype=dtype, param_dtype=dtype,
    )
    return qwen3.Qwen3(config, rngs=nnx.Rngs(0)), dtype


def run(size: str, batch: int, prompt: int, gen: int, mode: str, trials: int, cache_size: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tunix
    from tunix.generate import sampler as sampler_lib

    model, dtype = tunix_model(size)
    vocab, _, _, layers, _, kv, k, _ = QWEN3[size]
    cache = sampler_lib.CacheConfig(cache_size=cache_size or prompt + gen, num_layers=layers, num_kv_heads=kv,
                                    head_dim=k)
    sampler = sampler_lib.Sampler(model, IdTokenizer(vocab), cache)
    ids = np.random.default_rng(0).integers(1, vocab - 1, prompt)
    prompts = [" ".join(map(str, ids))] * batch
    kwargs = {"temperature": 1.0, "top_p": 1.0, "return_logprobs": True, "seed": 0} if mode == "sample" else {}

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        out = sampler(prompts, max_generation_steps=n, max_prompt_length=prompt, **kwargs)
        seconds = time.perf_counter() - t0
        longest = max(len(t) for t in out.tokens)  # the loop runs until every row is done (or n tokens)
        if len(out.tokens) != batch or longest != n:
            raise RuntimeError(f"Tunix returned {len(out.tokens)} rows, the longest {longest} tokens; asked for "
                               f"{batch} x {n}")
        return seconds

    compile_s = timed(1) + timed(gen)  # one compile per output length
    first = statistics.median(timed(1) for _ in range(trials))
    total = statistics.median(timed(gen) for _ in range(trials))
    device = jax.devices()[0]
    impl = f"tunix {getattr(tunix, '__version__', '?')} Sampler ({mode})"
    if cache_size:
        impl += f" cache {cache_size}"
    row = {"impl": impl, "size": size, "batch": batch,
           "device": device.device_kind, "jax": jax.__version__, "prefill_ms": 1e3 * first,
           "first_calls_s": compile_s}
    row.update(_rates(size, batch, prompt, gen - 1, total - first, dtype_bytes=jnp.dtype(dtype).itemsize))
    return row


def table(rows: list[dict], ours: list[dict]) -> str:
    device = next((r["device"] for r in rows + ours if r.get("device") not in (None, "?")), "?")
    bandwidth = hbm_bandwidth(device)
    lines = [f"device: {device}", "", "| size | batch | impl | tokens/s | ms/step | GB/s | MBU | ours / this |",
             "|---|---|---|---|---|---|---|---|"]
    best = {}  # ours: the first row per shape (bench/decode.py's first --kernel setting, the defaults)
    for r in ours:
        if "error" not in r:
            best.setdefault((r["size"], r["batch"]), r)
    for r in ours + rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['batch']} | {r['impl']} | error: {r['error']} | | | | |")
            continue
        mbu = f"{100 * r['achieved_GBps'] * 1e9 / bandwidth:.0f}%" if bandwidth else "n/a"
        base = best.get((r["size"], r["batch"]))
        ratio = f"{base['tokens_per_s'] / r['tokens_per_s']:.2f}x" if base and r in rows else ""
        lines.append(f"| {r['size']} | {r['batch']} | {r['impl']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
                     f"{r['achieved_GBps']:.0f} | {mbu} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7b", choices=sorted(QWEN3))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=1024)
    parser.add_argument("--cache-size", type=int, default=0,
                        help="Tunix's CacheConfig.cache_size, the entries its sampler attends over every step: an RL "
                             "config's sequence budget (rollout.max_sequence_length); default --prompt + --gen, the "
                             "tightest fit (compare with bench/decode.py --max-length of the same value)")
    parser.add_argument("--modes", default="sample,greedy", help="comma-separated: sample, greedy")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--compare", help="bench/decode.py --json output of the same run: adds our rows and ratios")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a < 1 min smoke run")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.size, args.batch, args.prompt, args.gen, args.trials = "tiny", 2, 16, 8, 1
    modes = args.modes.split(",")
    if unknown := set(modes) - {"sample", "greedy"}:
        parser.error(f"--modes: unknown {sorted(unknown)}; known: sample, greedy")
    rows = []
    for mode in modes:
        try:
            rows.append(run(args.size, args.batch, args.prompt, args.gen, mode, args.trials, args.cache_size))
        except Exception as e:  # noqa: BLE001  (one mode failing must not hide the other)
            rows.append({"impl": f"tunix Sampler ({mode})", "size": args.size, "batch": args.batch,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    ours = []
    if args.compare:
        with open(args.compare) as f:
            ours = [r for r in json.load(f) if r.get("size") == args.size and r.get("batch") == args.batch]
    print(table(rows, ours))
    print(f"\ncommand: python bench/decode_tunix.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
