"""The teacher's signal in one RL step: which params teach, which hints they read,
and the shaped OPD / hybrid advantages with their diagnostics.

``Teacher`` is the teacher role (``hybrid.teacher``): frozen params (the reference or a
checkpoint), the current policy (self-distillation with the hint, as SDPO / OPSD), or a
lagged copy of the policy (snapshots every k steps, or an EMA). ``teacher_signal`` is
what the ``score`` stage runs: the judge's hints (only on failed episodes with
``hybrid.hint_only_failed``; another task's with ``hybrid.placebo``), the teacher's
logprobs under [prompt + hint + response], lambda of the step (``hybrid.lam_schedule``),
the centered / clipped term (``losses/opd.py``), and the step-0 diagnostic metrics, with
an optional placebo pass (``hybrid.placebo_diagnostic_every``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.envs.base import Trajectory
from agentrl_jax.losses import opd_lambda, opd_term_diagnostics, shaped_opd_term
from agentrl_jax.train.guidance.hindsight import Verdict, placebo_for, teacher_hints
from agentrl_jax.train.guidance.teacher import hindsight_contexts, teacher_advantages, teacher_logprobs

TEACHERS = ("reference", "checkpoint", "policy", "lagged")
#: the checkpoint item that holds a lagged teacher's params
CHECKPOINT_TREE = "teacher"
logger = logging.getLogger(__name__)


def _owned_copy(params: Any) -> Any:
    """A copy that owns its buffers: the donating update deletes the policy's own."""
    return jax.tree.map(jnp.copy, params)


class Teacher:
    """The teacher role: its graph definition, and where its params come from.

    - "reference" / "checkpoint": frozen params, given once (the seed's recipe);
    - "policy": the params being trained, before this step's update: d = log pi(y | x,
      hint) - log pi(y | x) measures the hint alone;
    - "lagged": a copy of the policy that follows it slowly: a snapshot every
      ``lag_steps`` updates, or with ``ema_decay`` an EMA of the params (theta_T <- decay
      * theta_T + (1 - decay) * theta after every update), starting at the starting policy.

    ``params_for(policy_params)`` in the score stage, ``observe(new_params, updates)`` after
    each update. The lagged params are the one teacher state that is not in the config or the
    train state: ``checkpoint_trees()`` goes into every checkpoint, ``restore`` reads it back
    on resume, so a resumed run's teacher is the snapshot / EMA the run had, not the resumed
    policy.
    """

    def __init__(self, graphdef: Any, kind: str, *, frozen: Any = None, initial: Any = None, lag_steps: int = 0,
                 ema_decay: float = 0.0):
        if kind not in TEACHERS:
            raise ValueError(f"Teacher: kind must be one of {TEACHERS}, got {kind!r}")
        if kind in ("reference", "checkpoint") and frozen is None:
            raise ValueError(f"Teacher: teacher {kind!r} needs its frozen params")
        if kind == "lagged" and (initial is None or (lag_steps < 1) == (not 0.0 < ema_decay < 1.0)):
            raise ValueError("Teacher: 'lagged' needs the initial params and exactly one of lag_steps >= 1 "
                             f"or 0 < ema_decay < 1 (got lag_steps={lag_steps}, ema_decay={ema_decay})")
        self.graphdef, self.kind, self.lag_steps, self.ema_decay = graphdef, kind, lag_steps, ema_decay
        self._frozen = frozen
        self._lagged = _owned_copy(initial) if kind == "lagged" else None

    @property
    def params(self) -> Any:
        """The teacher's own params (frozen or lagged); the "policy" teacher has none."""
        if self.kind == "policy":
            raise AttributeError("Teacher 'policy' has no params of its own: use params_for(policy_params)")
        return self._lagged if self.kind == "lagged" else self._frozen

    def params_for(self, policy_params: Any) -> Any:
        """The teacher's params this step, given the policy's (before the update)."""
        return policy_params if self.kind == "policy" else self.params

    def checkpoint_trees(self) -> dict[str, Any]:
        """What a checkpoint must hold to restore this teacher (``Checkpointer.save(trees=...)``):
        a lagged teacher's params; nothing for the others (frozen or the policy itself)."""
        return {CHECKPOINT_TREE: self._lagged} if self.kind == "lagged" else {}

    def restore(self, checkpointer: Any, step: int) -> bool:
        """A lagged teacher's params from the checkpoint of ``step`` (into its current params'
        shardings); False when there is nothing to restore, or a checkpoint written before the
        teacher was saved (the teacher then stays at the resumed policy, logged)."""
        if self.kind != "lagged":
            return False
        restored = checkpointer.restore_tree(step, CHECKPOINT_TREE, self._lagged)
        if restored is None:
            logger.warning("the checkpoint of step %d holds no lagged teacher (written by an older version): "
                           "the teacher restarts at the resumed policy", step)
            return False
        self._lagged = restored
        return True

    def observe(self, policy_params: Any, updates: int) -> None:
        """After the ``updates``-th update (1-based): move a lagged teacher toward ``policy_params``."""
        if self.kind != "lagged":
            return
        if self.ema_decay:
            decay = self.ema_decay
            self._lagged = jax.tree.map(lambda t, p: (decay * t + (1.0 - decay) * p).astype(t.dtype),
                                        self._lagged, policy_params)
        elif updates % self.lag_steps == 0:
            self._lagged = _owned_copy(policy_params)


def teacher_signal(
    hybrid: Any,
    trajectories: Sequence[Trajectory],
    verdicts: Sequence[Verdict] | None,
    batch: Any,
    old_logprobs: np.ndarray,
    *,
    step: int,
    seed: int,
    tokenizer: Any,
    logprob_fn: Callable[[dict[str, Any]], np.ndarray],
    row_multiple: int,
) -> tuple[np.ndarray, dict[str, float]]:
    """Advantages [R, T] with the teacher's signal for one step, and its metrics.

    Args:
      hybrid: the ``hybrid`` config section.
      trajectories: the step's episodes; row i of ``batch`` is trajectory i.
      verdicts: the judge's, one per trajectory, or None (no judge).
      batch: the step's TrainBatch (``advantages``, ``loss_mask``, ``shape``).
      old_logprobs: [R, T] the policy's logprobs before the update.
      step: the 0-based RL step (lambda schedule, placebo draw).
      seed: the run's seed (placebo draw).
      tokenizer: builds the teacher contexts.
      logprob_fn: teacher inputs [R', T'] -> host logprobs, with this step's teacher params.
      row_multiple: teacher rows are rounded up to this (few compiled shapes).
    """
    h = hybrid
    metrics: dict[str, float] = {}
    hints = None
    if verdicts is not None:
        hints, metrics = teacher_hints(trajectories, verdicts, only_failed=h.hint_only_failed)
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    rng = np.random.default_rng([seed, step, 16])
    if h.placebo and hints is not None:
        hints, placebo_metrics = placebo_for(trajectories, hints, count, rng)
        metrics.update(placebo_metrics)

    def score(hint_list):
        contexts = hindsight_contexts(trajectories, hint_list, tokenizer, mode=h.mode,
                                      placement=h.hint_placement, hint_format=h.hint_format)
        return teacher_logprobs(logprob_fn, trajectories, contexts, batch.shape, row_multiple=row_multiple,
                                pad_token_id=tokenizer.pad_token_id)

    teacher_logp, has_teacher = score(hints)
    lam = float(opd_lambda(step, lam=h.lam, schedule=h.lam_schedule, warmup_steps=h.lam_warmup_steps,
                           decay_steps=h.lam_decay_steps, final_lam=h.lam_final))
    adv, shaped_metrics = teacher_advantages(h.mode, batch.advantages, teacher_logp, old_logprobs, batch.loss_mask,
                                             has_teacher, lam=lam, center=h.center, clip=h.clip)
    metrics.update(shaped_metrics)
    metrics["opd/lambda"] = lam
    metrics["opd/teacher_fraction"] = float(has_teacher[: len(trajectories)].mean())
    # the diagnostic looks at the hinted trajectories (every taught one without a judge)
    rows = has_teacher if hints is None else _rows([h_ is not None for h_ in hints], batch.shape[0])
    metrics.update(term_diagnostics(teacher_logp, old_logprobs, batch.loss_mask, rows, prefix="opd/"))
    if h.placebo_diagnostic_every and hints is not None and step % h.placebo_diagnostic_every == 0:
        placebo, _ = placebo_for(trajectories, hints, count, rng)
        placebo_logp, _ = score(placebo)
        placebo_rows = _rows([p is not None for p in placebo], batch.shape[0])
        metrics.update(term_diagnostics(placebo_logp, old_logprobs, batch.loss_mask, placebo_rows,
                                        prefix="opd/placebo_"))
    return adv, metrics


def _rows(flags: Sequence[bool], rows: int) -> np.ndarray:
    out = np.zeros(rows, bool)
    out[: len(flags)] = flags
    return out


def term_diagnostics(teacher_logp: np.ndarray, old_logprobs: np.ndarray, loss_mask: np.ndarray, rows: np.ndarray,
                     *, prefix: str) -> dict[str, float]:
    """``losses.opd_term_diagnostics`` of the raw d = tea - old on ``rows``: ``{prefix}min_token``
    (mean over those trajectories of their most negative token's d) and ``{prefix}near_zero_fraction``."""
    args = [jnp.asarray(x, jnp.float32) for x in (teacher_logp, old_logprobs, loss_mask)]
    raw = shaped_opd_term(*args, jnp.asarray(rows))
    diagnostics = opd_term_diagnostics(raw, args[2], jnp.asarray(rows))
    return {f"{prefix}min_token": float(diagnostics["min_token"]),
            f"{prefix}near_zero_fraction": float(diagnostics["near_zero_fraction"])}
