"""The step-0 diagnostic of docs/hybrid.md on the program tasks: does a pretrained teacher read the hint?

For held-out tasks of ``envs/program_tasks.py`` this builds failed episodes of the four kinds the
program oracle names (``train/guidance/program_oracle.py``), every program run in the real sandbox:

    memory         \\boxed{guess}                                   (a demonstration's memory answer)
    error          a realistic bug, its traceback, \\boxed{guess}   (a demonstration's give-up)
    wrong_program  the solver's program with one operand digit changed, its output boxed
    not_copied     the solver's program, its output, a box with one or two digits changed

and scores each episode's own tokens under three teacher contexts (hint appended to the user
message in the model's chat template, ``hybrid.hint_format``):

    student  log pi(y_t | prompt)
    hinted   log pi(y_t | prompt + the oracle's natural-language bridge thought)
    placebo  log pi(y_t | prompt + another task's bridge thought of the same kind and token length)

d = teacher - student per token: at the divergence token (the first token that differs from the
solver's correct episode), before it and after it, with the share of tokens where |d| < 0.25
(``bench/hint_diagnostic.py``'s statistics). Second, the correct episode itself (the solver's
program, its output, the copied answer) scored the same three ways: how many nats more likely the
hint makes a correct continuation, over the whole response and at the fork token.

    python bench/hint_diagnostic_programs.py --model runs/x/seed0/sft/export --tasks 48 --out diag.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hint_diagnostic import term_stats  # noqa: E402

from agentrl_jax.envs.base import Trajectory  # noqa: E402
from agentrl_jax.envs.program_demos import BUGS, code_action, demonstration, memory_guess  # noqa: E402
from agentrl_jax.envs.retool import ReToolConfig, interpreter_text, wrap_interpreter  # noqa: E402
from agentrl_jax.rewards.hints import hint_leaks_answer, placebo_hints  # noqa: E402
from agentrl_jax.train.guidance.distillation import teacher_context, teacher_logprobs  # noqa: E402
from agentrl_jax.train.guidance.program_oracle import FAILURES, bridge_thought  # noqa: E402
from agentrl_jax.train.sft import conversation_to_record  # noqa: E402

_LITERAL = re.compile(r"(?<![\w.])\d{2,}")
#: the student layout's width; the teacher's rows are padded to a multiple of --rows, so the jitted
#: forward compiles for few shapes
WIDTH = 768


async def _run(pool, program: str, config: ReToolConfig) -> tuple[str, bool]:
    result = await pool.run(program, timeout_s=config.tool_timeout_s)
    return interpreter_text(result), result.ok


async def failed_episode(task: dict, kind: str, pool, config: ReToolConfig, rng: np.random.Generator):
    """(messages of a failed episode of ``kind``, the last interpreter output), or None when the task
    cannot give one (an answer of two digits that a guess gets right, a changed operand that runs into
    the same answer)."""
    answer = int(task["answer"])
    bugs = [b for b in BUGS if b != "missing_import" or task["uses_math"]]
    if kind == "memory":
        messages = await demonstration(task, "memory", bugs[0], pool, config, rng)
        return (None, "") if messages[-1]["content"] == f"\\boxed{{{answer}}}" else (messages, "")
    if kind == "error":
        messages = await demonstration(task, "give_up", bugs[int(rng.integers(len(bugs)))], pool, config, rng)
        return messages, next(m["content"] for m in messages if m["role"] == "interpreter")
    correct = await demonstration(task, "tool", bugs[0], pool, config, rng)
    if kind == "not_copied":
        guess = memory_guess(answer, rng)
        if guess == answer:
            return None, ""
        return correct[:-1] + [{"role": "assistant", "content": f"\\boxed{{{guess}}}"}], correct[-2]["content"]
    if kind == "wrong_program":
        head, expression = task["program"].split("answer = ", 1)
        literals = list(_LITERAL.finditer(expression.split("\n")[0]))
        if not literals:
            return None, ""
        m = literals[int(rng.integers(len(literals)))]
        digits = list(m.group())
        i = int(rng.integers(1, len(digits)))
        digits[i] = str(rng.choice([d for d in "0123456789" if d != digits[i]]))
        program = head + "answer = " + expression[:m.start()] + "".join(digits) + expression[m.end():]
        output, ok = await _run(pool, program, config)
        if not ok or output.strip() == str(answer) or not output.strip():
            return None, ""
        observation = wrap_interpreter(output, config.fenced)
        return correct[:-3] + [{"role": "assistant", "content": code_action(program, config)},
                               {"role": "interpreter", "content": observation},
                               {"role": "assistant", "content": f"\\boxed{{{output.strip()}}}"}], observation
    raise ValueError(f"failed_episode: kind must be one of {FAILURES}, got {kind!r}")


def as_trajectory(tokenizer, messages: list[dict], task: dict) -> Trajectory:
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    record = conversation_to_record(tokenizer, messages)
    prompt = tokenizer.apply_chat(messages[:first], add_generation_prompt=True)
    n = len(record.token_ids)
    return Trajectory(prompt_token_ids=np.asarray(prompt, np.int32), token_ids=np.asarray(record.token_ids, np.int32),
                      loss_mask=np.asarray(record.loss_mask, np.int8), rollout_logprobs=np.zeros(n, np.float32),
                      params_versions=np.zeros(n, np.int32), turns=messages, reward=-1.0,
                      reward_components={"correct": 0.0}, task_metadata=task)


def _response_mask(trajectories: list[Trajectory], width: int) -> np.ndarray:
    mask = np.zeros((len(trajectories), width), np.float32)
    for i, t in enumerate(trajectories):
        mask[i, len(t.prompt_token_ids) - 1: len(t.token_ids) - 1] = t.loss_mask[len(t.prompt_token_ids):]
    return mask


def diagnose_kind(score, tokenizer, episodes: list[tuple], rng: np.random.Generator) -> dict:
    """episodes: (task, failed messages, correct messages, last interpreter output, kind), one kind."""
    tasks = [e[0] for e in episodes]
    failed = [as_trajectory(tokenizer, e[1], e[0]) for e in episodes]
    correct = [as_trajectory(tokenizer, e[2], e[0]) for e in episodes]
    diverge = [next(i for i in range(len(f.prompt_token_ids), len(f.token_ids))
                    if i >= len(c.token_ids) or f.token_ids[i] != c.token_ids[i]) for f, c in zip(failed, correct)]
    hints = [bridge_thought(t, e[4], e[3]) for t, e in zip(tasks, episodes)]
    leaked = [hint_leaks_answer(h, t["answer"]) for h, t in zip(hints, tasks)]
    lengths = [len(tokenizer.encode(h)) for h in hints]
    placebo, stats = placebo_hints(hints, lengths, [t["question"] for t in tasks], rng)
    keep = [i for i, p in enumerate(placebo) if p is not None and not leaked[i]]
    real = [i for i in range(len(tasks)) if not leaked[i]]
    out = {"episodes": len(tasks), "leaked": int(sum(leaked)), "example_hint": hints[0],
           "placebo_same_length": stats.same_length / max(stats.hinted, 1),
           "hint_tokens": float(np.mean(lengths))}
    for name, trajectories in (("failed", failed), ("correct", correct)):
        mask = _response_mask(trajectories, WIDTH)
        student = score(trajectories, [None] * len(tasks))
        hinted = score(trajectories, hints) - student
        shuffled = score(trajectories, [p if p is not None else h for p, h in zip(placebo, hints)]) - student
        if name == "failed":
            out["hinted"] = term_stats(hinted[real], mask[real], [diverge[i] for i in real])
            out["placebo"] = term_stats(shuffled[keep], mask[keep], [diverge[i] for i in keep])
            continue
        for label, d, rows in (("hinted", hinted, real), ("placebo", shuffled, keep)):
            total = (d * mask).sum(1)[rows]
            fork = [d[i, diverge[i] - 1] for i in rows]
            out[f"correct_{label}"] = {"total_nats": float(np.mean(total)), "per_token": float(
                np.sum((d * mask)[rows]) / max(np.sum(mask[rows]), 1)), "at_fork": float(np.mean(fork)),
                "more_likely": float(np.mean(total > 0))}
        out["correct_student_logp"] = float(np.mean((student * mask).sum(1)))
    return out


async def build_episodes(config, tasks: list[dict], seed: int) -> dict[str, list[tuple]]:
    from agentrl_jax.envs.sandbox import make_sandbox

    retool = ReToolConfig.from_config(config)
    out: dict[str, list[tuple]] = {k: [] for k in FAILURES}
    async with make_sandbox(config) as pool:
        for i, task in enumerate(tasks):
            for kind in FAILURES:
                rng = np.random.default_rng([seed, i, FAILURES.index(kind)])
                messages, last = await failed_episode(task, kind, pool, retool, rng)
                if messages is not None:
                    correct = await demonstration(task, "tool", "typo", pool, retool, np.random.default_rng(0))
                    out[kind].append((task, messages, correct, last, kind))
    return out


def load_scorer(model: str, config, rows: int):
    """(tokenizer, score(trajectories, hints) -> logp [B, WIDTH]) for an HF directory or a GGUF file."""
    import jax

    from agentrl_jax.models import split_params
    from agentrl_jax.models.gguf_cache import hf_directory
    from agentrl_jax.models.hf_io import load_hf_checkpoint
    from agentrl_jax.models.tokenizer import Tokenizer
    from agentrl_jax.train.step import forward_logprobs

    directory = str(hf_directory(model)) if model.endswith(".gguf") else model
    tokenizer = Tokenizer(directory)
    graphdef, params = split_params(load_hf_checkpoint(directory))
    forward = jax.jit(functools.partial(forward_logprobs, temperature=1.0), static_argnums=(0,))
    h = config.hybrid

    def score(trajectories, hint_list):
        contexts = [teacher_context(t, hint, tokenizer, placement=h.hint_placement, hint_format=h.hint_format)
                    for t, hint in zip(trajectories, hint_list)]
        if max(len(t.token_ids) for t in trajectories) > WIDTH:
            raise ValueError(f"an episode is longer than the diagnostic's {WIDTH} tokens")
        return teacher_logprobs(lambda arrays: forward(graphdef, params, arrays), trajectories, contexts,
                                (len(trajectories), WIDTH), row_multiple=rows)[0]

    return tokenizer, score


def table(results: dict[str, dict]) -> str:
    def pair(s: dict, key: str) -> str:
        return "-" if np.isnan(s[f"{key}_mean"]) else f"{s[f'{key}_mean']:+.2f}, {s[f'{key}_near_zero']:.2f}"

    lines = ["| failure | n | hint | d at divergence | d before (mean, near 0) | d after (mean, near 0) | "
             "correct episode: d total (nats) | d per token | d at fork | share more likely |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        for which in ("hinted", "placebo"):
            s, c = r[which], r[f"correct_{which}"]
            lines.append(f"| {kind} | {s['episodes']} | {which} | {s['at_divergence']:+.2f} | {pair(s, 'before')} | "
                         f"{pair(s, 'after')} | {c['total_nats']:+.2f} | {c['per_token']:+.3f} | {c['at_fork']:+.2f} | "
                         f"{c['more_likely']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF directory (the SFT export) or the GGUF file")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_hybrid.py"))
    parser.add_argument("--tasks", type=int, default=48, help="held-out tasks (each gives up to one episode per kind)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=64, help="teacher rows are padded to a multiple of this")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from agentrl_jax.config import apply_overrides, load_config

    config = apply_overrides(load_config(args.config), [f"seed={args.seed}", "environment.sandbox.workers=4"])
    tasks = config.environment.make_tasks(config, "eval")[: args.tasks]
    episodes = asyncio.run(build_episodes(config, tasks, args.seed))
    tokenizer, score = load_scorer(args.model, config, args.rows)
    rng = np.random.default_rng(args.seed)
    results = {kind: diagnose_kind(score, tokenizer, eps, rng) for kind, eps in episodes.items() if len(eps) >= 2}
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
