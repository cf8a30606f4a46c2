"""Evaluation metrics: pass@k with the unbiased estimator, avg@k, tool-use rates.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
with n samples of a task of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over tasks; computed as a numerically stable product. avg@k is the mean
correctness of the k samples.

Tool use, over all samples: ``tool_use_rate`` (a sample with at least one tool call),
``calls_per_episode`` (mean tool calls), ``tool_error_rate`` (a sample with at least one
failed call: a traceback, a non-zero exit, a timeout) and ``error_recovery_rate`` (of
those, the fraction still answered correctly; absent when no call failed).

Metric names spell "@" as "_at_" (`pass_at_1`, `avg_at_4`): "@" is not legal in a
tensorboard tag, and one name serves metrics.jsonl, tensorboard and results.json.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one task with ``num_correct`` of ``num_samples`` correct."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"need 0 <= num_correct <= num_samples, got {num_correct}, {num_samples}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"need 1 <= k <= num_samples ({num_samples}), got k={k}")
    if num_samples - num_correct < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i)
    i = np.arange(num_samples - num_correct + 1, num_samples + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def summarize(results: Mapping[str, Sequence[Mapping]], ks: Sequence[int] = (1,)) -> dict[str, float]:
    """Aggregate per-task sample results into evaluation metrics.

    Args:
      results: task id -> its samples, each a mapping with ``correct`` (bool) and
        optionally ``tool_calls`` and ``tool_errors`` (int, failed calls), ``num_sampled_tokens``
        (int), ``truncated`` and ``env_error`` (bool; such a sample should also have
        ``correct`` False).
      ks: the k values of pass@k (each <= the samples per task).

    Returns:
      ``pass_at_{k}`` per k, ``avg_at_{n}``, ``tool_use_rate`` (fraction of samples with a tool call),
      ``calls_per_episode``, ``mean_response_tokens``, ``num_tasks``; ``truncated_rate`` /
      ``env_error_rate`` when the samples carry those flags; ``tool_error_rate`` when they carry
      ``tool_errors``, and ``error_recovery_rate`` when some sample has a failed call.
    """
    if not results:
        raise ValueError("summarize: no results")
    out: dict[str, float] = {}
    n_per_task = {len(s) for s in results.values()}
    n = min(n_per_task)
    for k in ks:
        out[f"pass_at_{k}"] = float(
            np.mean([pass_at_k(len(s), sum(bool(x["correct"]) for x in s), k) for s in results.values()])
        )
    samples = [x for s in results.values() for x in s]
    out[f"avg_at_{n}"] = float(np.mean([bool(x["correct"]) for x in samples]))
    out["tool_use_rate"] = float(np.mean([x.get("tool_calls", 0) > 0 for x in samples]))
    out["calls_per_episode"] = float(np.mean([x.get("tool_calls", 0) for x in samples]))
    if any("tool_errors" in x for x in samples):
        failed = [x for x in samples if x.get("tool_errors", 0) > 0]
        out["tool_error_rate"] = len(failed) / len(samples)
        if failed:
            out["error_recovery_rate"] = float(np.mean([bool(x["correct"]) for x in failed]))
    out["mean_response_tokens"] = float(np.mean([x.get("num_sampled_tokens", 0) for x in samples]))
    out["num_tasks"] = float(len(results))
    for flag in ("truncated", "env_error"):
        if any(flag in x for x in samples):
            out[f"{flag}_rate"] = float(np.mean([bool(x.get(flag, False)) for x in samples]))
    return out


def results_table(rows: Mapping[str, Mapping[str, float]], keys: Sequence[str]) -> str:
    """A markdown table: one row per stage (e.g. "start", "end"), one column per metric."""
    lines = ["| stage | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values.get(k, float('nan')):.3f}" for k in keys) + " |")
    return "\n".join(lines)
