"""What a tool-use recipe cost a chat model: its greedy answers to general prompts, and its KL to the base.

For each trained HF directory (the runs' ``export/``), on a fixed set of general chat prompts
(no tools, no math): the greedy answer of the base model and of the trained one, through the
project's own engine, and the per-token KL(trained || base) over the full vocabulary at every
position of the trained model's answer (teacher-forced, both models' float32 logits), its mean
and max over the answer's tokens. A model whose chat is intact keeps a small KL on its own
answers; one that now writes ``<code>`` for a greeting does not.

    python bench/chat_drift.py --base BASE_DIR --trained runs/s/seed0/export runs/s/seed1/export \\
        --out chat_drift.json [--markdown chat_drift.md] [--max-new-tokens 96]

BASE_DIR is the HF directory the runs started from (a ``.gguf`` path is converted first, as
``model.path`` is). Runs on CPU in float32 or on one accelerator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = (
    "Hi! How are you today?",
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Give me three tips for sleeping better.",
    "Explain what photosynthesis is in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and French.",
    "Suggest a name for a friendly orange cat.",
    "Why is the sky blue?",
    "Write one sentence encouraging a friend before an exam.",
)


def load(path: str):
    """(model, graphdef, params) in float32 on the first device."""
    from agentrl_jax.models import load_hf_checkpoint, split_params
    from agentrl_jax.sharding import make_mesh

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    model = load_hf_checkpoint(path, dtype=jnp.float32, mesh=mesh)
    return model, *split_params(model), mesh


async def greedy(engine, params, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from agentrl_jax.rollout import Driver, SamplingParams

    async with Driver(engine, params, eos_token_ids=tokenizer.eos_token_ids, steps_per_dispatch=8) as driver:
        completions = await asyncio.gather(*[driver.generate(p, SamplingParams(temperature=0.0),
                                                             max_new_tokens=max_new_tokens) for p in prompts])
    return [list(c.token_ids) for c in completions]


def make_log_softmax(graphdef):
    """A jitted ``(params, ids [B, T], lengths [B]) -> [B, T, V]`` float32 next-token log-probabilities
    of right-padded rows (one compile for every model of the same architecture and row shape)."""
    from flax import nnx

    from agentrl_jax.models.logits import output_logits

    @jax.jit
    def log_softmax(params, ids, lengths):
        model = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        hidden = model(ids, positions, lengths=lengths)
        table, layout = model.output_embedding()
        logits = output_logits(hidden.reshape(-1, hidden.shape[-1]), table, layout)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(*ids.shape, -1)

    return log_softmax


def kl_on_answers(log_softmax, trained_params, base_params, prompts, answers) -> list[tuple[float, float]]:
    """Per row: (mean, max) over the answer's positions of KL(trained || base) on the full vocabulary."""
    rows = [p + a for p, a in zip(prompts, answers)]
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    p = np.asarray(log_softmax(trained_params, jnp.asarray(ids), lengths))
    q = np.asarray(log_softmax(base_params, jnp.asarray(ids), lengths))
    out = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        if not answer:
            out.append((0.0, 0.0))
            continue
        first = len(prompt) - 1  # the position whose next token is the answer's first
        pi, qi = p[i, first:first + len(answer)], q[i, first:first + len(answer)]
        per_token = np.sum(np.exp(pi) * (pi - qi), axis=-1)
        out.append((float(per_token.mean()), float(per_token.max())))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="HF directory (or .gguf file) of the base model")
    parser.add_argument("--trained", nargs="+", required=True, help="HF directories of trained policies")
    parser.add_argument("--out", required=True, help="JSON file for the answers and KLs")
    parser.add_argument("--markdown", help="also write a markdown table here")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    from agentrl_jax.models import Tokenizer
    from agentrl_jax.models.gguf_cache import hf_directory
    from agentrl_jax.rollout import Engine

    base_path = hf_directory(args.base)  # a .gguf file: its cached conversion, as model.path uses it
    base, graphdef, base_params, mesh = load(base_path)
    tokenizer = Tokenizer(base_path)
    prompts = [tokenizer.apply_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    longest = max(len(p) for p in prompts)
    # One engine and one compiled forward serve every model: they share the architecture.
    engine = Engine(base, mesh=mesh, max_concurrent_decodes=len(prompts), max_target_length=longest + args.max_new_tokens,
                    max_prefill_length=longest, cache_dtype=None)
    log_softmax = make_log_softmax(graphdef)
    base_answers = asyncio.run(greedy(engine, base_params, tokenizer, prompts, args.max_new_tokens))
    report = {"base": base_path, "prompts": list(PROMPTS), "max_new_tokens": args.max_new_tokens,
              "device": jax.devices()[0].device_kind,
              "base_answers": [tokenizer.decode(a, skip_special_tokens=True) for a in base_answers], "trained": []}
    for path in args.trained:
        _, _, params, _ = load(path)
        answers = asyncio.run(greedy(engine, params, tokenizer, prompts, args.max_new_tokens))
        kls = kl_on_answers(log_softmax, params, base_params, prompts, answers)
        kls_base_text = kl_on_answers(log_softmax, params, base_params, prompts, base_answers)
        report["trained"].append({
            "path": path,
            "answers": [tokenizer.decode(a, skip_special_tokens=True) for a in answers],
            "kl_mean_on_own_answer": [k[0] for k in kls],
            "kl_max_on_own_answer": [k[1] for k in kls],
            "kl_mean_on_base_answer": [k[0] for k in kls_base_text],
            "same_answer_as_base": [a == b for a, b in zip(answers, base_answers)],
            "writes_code": ["<code>" in tokenizer.decode(a) for a in answers],
        })
        del params
    Path(args.out).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    """A table per prompt (mean KL per trained model) and the answers, base first."""
    runs = report["trained"]
    head = "| prompt | " + " | ".join(f"KL run {i}" for i in range(len(runs))) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for j, prompt in enumerate(report["prompts"]):
        lines.append(f"| {prompt} | " + " | ".join(f"{r['kl_mean_on_own_answer'][j]:.3f}" for r in runs) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{np.mean(r['kl_mean_on_own_answer']):.3f}**" for r in runs) + " |")
    lines += ["", "KL(trained || base) per token, mean over the trained model's greedy answer (nats).", ""]
    for j, prompt in enumerate(report["prompts"]):
        lines.append(f"**{prompt}**")
        lines.append(f"- base: {report['base_answers'][j]!r}")
        for i, r in enumerate(runs):
            lines.append(f"- run {i}: {r['answers'][j]!r}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
