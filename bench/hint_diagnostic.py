"""The step-0 diagnostic of docs/hybrid.md on scripted failures: does the teacher read the hint?

At step 0 the reference, the current policy and a lagged policy are the same params, so
one forward per context tells how every teacher choice starts. For held-out arithmetic
tasks this builds failed episodes of the three kinds the oracle judge names (an answer
from memory, a wrong expression in the code, an interpreter result not copied), each with
the token where it leaves the correct path (the first token that differs from the
hint-following demonstration), and scores the episode's own tokens three ways:

    student  log pi(y_t | prompt)
    hinted   log pi(y_t | prompt + the oracle's bridge thought for this failure)
    placebo  log pi(y_t | prompt + another task's bridge thought of the same token length)

and reports d = teacher - student per kind: at the divergence token, on the tokens before
it (which the hint does not concern: they agree with the correct path), on those after
it, and the share of tokens with |d| < 0.25. A teacher that reads the hint gives a clearly
negative d at the divergence token and d near zero before it; the placebo gives d near
zero everywhere. (docs/hybrid.md reports the numbers for the ablation's SFT policy.)

    python bench/hint_diagnostic.py --model runs/hybrid_ablation/seed0/sft/export --out diag.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl_jax.envs.arithmetic import MISTAKES, OPERATORS, bridge_thought, demonstration  # noqa: E402
from agentrl_jax.envs.base import Trajectory  # noqa: E402
from agentrl_jax.envs.retool import wrap_interpreter  # noqa: E402
from agentrl_jax.rewards.hints import placebo_hints  # noqa: E402
from agentrl_jax.train.sft import conversation_to_record  # noqa: E402
from agentrl_jax.train.guidance.distillation import teacher_context, teacher_logprobs  # noqa: E402

NEAR_ZERO = 0.25


def _change_digit(number: int, rng: np.random.Generator) -> int:
    digits = list(str(number))
    index = int(rng.integers(len(digits)))
    digits[index] = str(rng.choice([d for d in "0123456789" if d != digits[index] and not (index == 0 and d == "0")]))
    return int("".join(digits))


def failed_turns(task: dict, kind: str, rng: np.random.Generator) -> list[dict[str, str]]:
    """The assistant / interpreter turns of a failed episode of ``kind`` (``MISTAKES``)."""
    answer = int(task["answer"])
    if kind == "memory":
        return [{"role": "assistant", "content": f"\\boxed{{{_change_digit(answer, rng)}}}"}]
    if kind == "wrong_code":
        b = _change_digit(int(task["b"]), rng)
        result = OPERATORS[task["op"]](int(task["a"]), b)
        return [{"role": "assistant", "content": f"<code>print({task['a']}{task['op']}{b})</code>"},
                {"role": "interpreter", "content": wrap_interpreter(str(result), False)},
                {"role": "assistant", "content": f"\\boxed{{{result}}}"}]
    if kind == "not_copied":
        correct = demonstration(task, "tool", rng)
        return correct[:2] + [{"role": "assistant", "content": f"\\boxed{{{_change_digit(answer, rng)}}}"}]
    raise ValueError(f"failed_turns: kind must be one of {MISTAKES}, got {kind!r}")


def scripted_episode(tokenizer, task: dict, kind: str, rng: np.random.Generator) -> tuple[Trajectory, int]:
    """(the failed episode as a Trajectory, index of its first token off the correct path)."""
    user = [{"role": "user", "content": task["question"]}]
    failed = conversation_to_record(tokenizer, user + failed_turns(task, kind, rng))
    right = conversation_to_record(tokenizer, user + demonstration(task, "tool", rng))
    prompt = tokenizer.apply_chat(user, add_generation_prompt=True)
    ids, good = list(failed.token_ids), list(right.token_ids)
    diverge = next(i for i in range(len(prompt), len(ids)) if i >= len(good) or ids[i] != good[i])
    n = len(ids)
    trajectory = Trajectory(
        prompt_token_ids=np.asarray(prompt, np.int32), token_ids=np.asarray(ids, np.int32),
        loss_mask=np.asarray(failed.loss_mask, np.int8), rollout_logprobs=np.zeros(n, np.float32),
        params_versions=np.zeros(n, np.int32), turns=user, reward=0.0, reward_components={"correct": 0.0},
        task_metadata=task)
    return trajectory, diverge


def term_stats(d: np.ndarray, mask: np.ndarray, diverge: list[int]) -> dict[str, float]:
    """d at the divergence token (student index j - 1 holds token j), before and after it."""
    at, before, after = [], [], []
    for row, j in enumerate(diverge):
        idx = np.nonzero(mask[row] > 0)[0]
        at.append(d[row, j - 1])
        before += list(d[row, idx[idx < j - 1]])
        after += list(d[row, idx[idx > j - 1]])
    near = lambda xs: float(np.mean(np.abs(xs) < NEAR_ZERO)) if xs else float("nan")  # noqa: E731
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    return {"at_divergence": mean(at), "before_mean": mean(before), "before_near_zero": near(before),
            "after_mean": mean(after), "after_near_zero": near(after), "episodes": len(diverge)}


def diagnose(model_dir: str, hint_format: str, tasks: list[dict], seed: int = 0) -> dict[str, dict]:
    """Per kind, the stats of d under the real hint and under the placebo (module docstring)."""
    import jax

    from agentrl_jax.models import split_params
    from agentrl_jax.models.hf_io import load_hf_checkpoint
    from agentrl_jax.models.tokenizer import Tokenizer
    from agentrl_jax.train.step import forward_logprobs

    tokenizer = Tokenizer(model_dir)
    graphdef, params = split_params(load_hf_checkpoint(model_dir))
    forward = jax.jit(functools.partial(forward_logprobs, temperature=1.0), static_argnums=(0,))
    logprob_fn = lambda arrays: forward(graphdef, params, arrays)  # noqa: E731
    rng = np.random.default_rng(seed)
    out = {}
    for kind in MISTAKES:
        episodes = [scripted_episode(tokenizer, t, kind, rng) for t in tasks]
        trajectories, diverge = [e[0] for e in episodes], [e[1] for e in episodes]
        hints = [bridge_thought(t, kind) for t in tasks]
        placebo, stats = placebo_hints(hints, [len(tokenizer.encode(h)) for h in hints],
                                       [t["question"] for t in tasks], rng)
        width = max(len(t.token_ids) for t in trajectories) + 64

        def score(hint_list):
            contexts = [teacher_context(t, h, tokenizer, placement="user_message", hint_format=hint_format)
                        for t, h in zip(trajectories, hint_list)]
            return teacher_logprobs(logprob_fn, trajectories, contexts, (len(trajectories), width))[0]

        student = score([None] * len(trajectories))
        mask = np.zeros((len(trajectories), width), np.float32)
        for i, t in enumerate(trajectories):
            mask[i, len(t.prompt_token_ids) - 1: len(t.token_ids) - 1] = t.loss_mask[len(t.prompt_token_ids):]
        keep = [i for i, p in enumerate(placebo) if p is not None]
        out[kind] = {"hinted": term_stats(score(hints) - student, mask, diverge),
                     "placebo": term_stats((score(placebo) - student)[keep], mask[keep], [diverge[i] for i in keep]),
                     "placebo_same_length": stats.same_length / max(stats.hinted, 1)}
    return out


def table(results: dict[str, dict]) -> str:
    def pair(mean: float, near: float) -> str:
        return "-" if np.isnan(mean) else f"{mean:+.2f}, {near:.2f}"

    lines = ["| failure | hint | d at the divergence token | d before (mean, share near 0) | "
             "d after (mean, share near 0) |", "|---|---|---|---|---|"]
    for kind, r in results.items():
        for which in ("hinted", "placebo"):
            s = r[which]
            lines.append(f"| {kind} | {which} | {s['at_divergence']:+.2f} | {pair(s['before_mean'], s['before_near_zero'])}"
                         f" | {pair(s['after_mean'], s['after_near_zero'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF export of the SFT policy (with its tokenizer)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "hybrid_ablation.py"))
    parser.add_argument("--tasks", type=int, default=60, help="held-out tasks per failure kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from agentrl_jax.config import apply_overrides, load_config

    config = apply_overrides(load_config(args.config), [f"seed={args.seed}"])
    held_out = config.environment.make_tasks(config, "eval")  # ordered by operand width: take every k-th
    tasks = held_out[:: max(1, len(held_out) // args.tasks)][: args.tasks]
    results = diagnose(args.model, config.hybrid.hint_format, tasks, seed=args.seed)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
