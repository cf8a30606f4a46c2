"""Where the PPO ratio's "old" logprobs come from (``async_rl.old_logprobs``;
"Missing Old Logits in Asynchronous Agentic RL", arXiv:2605.12070).

The decoupled objective splits a sampled token's ratio pi/mu into old/mu (the discrepancy,
corrected by TIS/MIS/icepop) and pi/old (clipped by PPO). In a synchronous run "old" is
the policy that sampled the batch. With asynchronous rollouts the batch was sampled by
earlier versions, possibly several within one trajectory (partial rollouts), and the
trainer has to choose an "old":

- ``recompute``: the params being trained, before this step's update. Cheap (one forward,
  as in a synchronous run); old/mu then also carries the staleness, which the correction
  truncates or masks.
- ``snapshot``: exact old logits. The params of every version still referenced by queued
  data are kept (``max_staleness + 1`` copies on the training mesh) and each token's old
  logprob comes from the version that sampled it: one forward per distinct version, over
  the rows that hold it.
- ``ewma``: the PPO-EWMA proximal policy (Hilton et al. 2022): an exponential moving
  average of the params after every step, reset every ``ewma_reset_every`` steps or when
  the correction keeps fewer than ``ewma_min_kept`` of the loss tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import AsyncConfig
from agentrl_jax.losses.corrections import ewma_update
from agentrl_jax.train.multihost import to_host

logger = logging.getLogger(__name__)

# fn(params, forward_inputs, micro_rows) -> [R, T] logprobs (device or numpy)
LogprobFn = Callable[[Any, dict[str, np.ndarray], int], Any]


def copy_params(params: Any) -> Any:
    """Fresh buffers with the same values and shardings (the update step donates its inputs)."""
    return jax.tree.map(jnp.copy, params)


def _float32_copy(params: Any) -> Any:
    """A float32 copy in fresh buffers (``astype`` to the same dtype would alias the trainer's
    params, which the update step donates)."""
    return jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)


class OldPolicy:
    """The "old" policy of the PPO ratio, by mode.

    Args:
      config: the ``async_rl`` section (mode, staleness bound, EWMA settings).
      max_staleness: versions a trained token may lag (0 in a synchronous run).
    """

    def __init__(self, config: AsyncConfig, max_staleness: int):
        self.mode = config.old_logprobs
        self.config = config
        self.max_staleness = max_staleness
        self.snapshots: dict[int, Any] = {}
        self.ewma_params: Any = None
        self.ewma_resets = 0
        self._ewma_fn = jax.jit(ewma_update, static_argnames=("reset_every",), donate_argnums=(0,))

    # ---------------------------------------------------------------- bookkeeping

    def on_version(self, version: int, params: Any) -> None:
        """``params`` became ``version`` (pushed to the engine). Snapshot mode keeps a copy while
        later batches may still hold tokens of it, and drops versions no batch can reference."""
        if self.mode != "snapshot":
            return
        if self.max_staleness > 0:
            self.snapshots[version] = copy_params(params)
        for v in [v for v in self.snapshots if v < version - self.max_staleness]:
            del self.snapshots[v]

    def after_update(self, params: Any, step: int, kept_fraction: float | None) -> dict[str, float]:
        """EWMA mode: fold the updated params into the proximal policy (or reset it)."""
        if self.mode != "ewma":
            return {}
        if self.ewma_params is None:
            self.ewma_params = _float32_copy(params)
            self.ewma_resets += 1
            return {"old_policy/ewma_reset": 1.0}
        reset = (kept_fraction is not None and self.config.ewma_min_kept > 0
                 and kept_fraction < self.config.ewma_min_kept)
        if reset:
            logger.info("ewma: the correction kept %.3f < %.3f of the tokens; resetting the proximal policy",
                        kept_fraction, self.config.ewma_min_kept)
        periodic = self.config.ewma_reset_every > 0 and (step + 1) % self.config.ewma_reset_every == 0
        self.ewma_resets += int(reset or periodic)
        self.ewma_params = self._ewma_fn(self.ewma_params, params, self.config.ewma_decay, step + 1,
                                         reset_every=self.config.ewma_reset_every, reset=reset)
        return {"old_policy/ewma_reset": float(reset or periodic)}

    # ---------------------------------------------------------------- logprobs

    def from_update(self, *, epochs: int, minibatches: int, needs_old_before_update: bool,
                    token_versions: np.ndarray, loss_mask: np.ndarray, version: int) -> bool:
        """Whether the update may take ``old = sg(logp)`` from its own forward (no old pass).

        Exact when the old policy is the params being trained (``recompute``), every loss
        token was sampled by them (on-policy), and they do not move before the only update
        of the step (one epoch, one minibatch). ``needs_old_before_update``: something other
        than the update reads the old logprobs first (the OPD / hybrid teacher advantages).
        """
        sampled = loss_mask > 0
        return (self.mode == "recompute" and epochs == 1 and minibatches == 1 and not needs_old_before_update
                and bool(sampled.any()) and bool((token_versions[sampled] == version).all()))

    def logprobs(self, logprob_fn: LogprobFn, params: Any, version: int, inputs: dict[str, np.ndarray],
                 token_versions: np.ndarray, loss_mask: np.ndarray, micro_rows: int) -> Any:
        """Old logprobs [R, T] of ``inputs['targets']``: what ``logprob_fn`` returns (kept on device)
        for 'recompute' and 'ewma'; numpy for 'snapshot' (composed per version on the host).

        Args:
          logprob_fn: ``(params, inputs, micro_rows) -> [R, T]`` tempered logprobs.
          params, version: the params being trained and their version.
          inputs: forward inputs ([R, T] numpy arrays).
          token_versions: [R, T] version that sampled each target (-1 off the loss tokens).
          loss_mask: [R, T].
        """
        if self.mode == "recompute":
            return logprob_fn(params, inputs, micro_rows)
        if self.mode == "ewma":
            if self.ewma_params is None:  # first step: the proximal policy starts at the params
                self.ewma_params = _float32_copy(params)
            return logprob_fn(self.ewma_params, inputs, micro_rows)
        return self._snapshot_logprobs(logprob_fn, params, version, inputs, token_versions, loss_mask, micro_rows)

    def _params_of(self, v: int, params: Any, version: int) -> Any:
        if v == version:
            return params
        if v not in self.snapshots:
            raise RuntimeError(
                f"old_logprobs='snapshot': tokens of params version {v} but no snapshot of it (kept: "
                f"{sorted(self.snapshots)}, training version {version}, max_staleness {self.max_staleness})")
        return self.snapshots[v]

    def _snapshot_logprobs(self, logprob_fn, params, version, inputs, token_versions, loss_mask, micro_rows):
        sampled = loss_mask > 0
        out = np.zeros(token_versions.shape, np.float32)
        rows_total = token_versions.shape[0]
        versions = sorted(set(token_versions[sampled].tolist())) or [version]
        for v in versions:
            rows = np.nonzero((sampled & (token_versions == v)).any(axis=1))[0] if sampled.any() else \
                np.arange(rows_total)
            # Pad the row set to a multiple of micro_rows (repeating a row) so shapes stay compiled.
            padded = np.concatenate([rows, np.full((-len(rows)) % micro_rows, rows[0])])
            lp = to_host(logprob_fn(self._params_of(v, params, version), {k: x[padded] for k, x in inputs.items()},
                                    micro_rows))[: len(rows)]
            take = token_versions[rows] == v
            if v == versions[0]:
                take |= ~sampled[rows]  # positions off the loss get the first forward's values
            out[rows] = np.where(take, lp, out[rows])
        return out


def staleness_stats(token_versions: np.ndarray, loss_mask: np.ndarray, version: int,
                    num_trajectories: int) -> tuple[dict[str, float], np.ndarray]:
    """Staleness of a batch trained at ``version``: metrics and the per-token values.

    Token staleness = version - the version that sampled it; a trajectory's is its oldest
    token's. ``mixed_version_fraction`` counts trajectories whose tokens come from more than
    one version (continued across a weight update: partial rollouts).
    """
    sampled = loss_mask[:num_trajectories] > 0
    versions = token_versions[:num_trajectories]
    tokens = (version - versions)[sampled]
    per_traj = [version - int(versions[r][sampled[r]].min()) for r in range(num_trajectories) if sampled[r].any()]
    mixed = [len(set(versions[r][sampled[r]].tolist())) > 1 for r in range(num_trajectories) if sampled[r].any()]
    if not len(tokens):
        return {}, tokens
    stats = {
        "async/token_staleness_mean": float(tokens.mean()),
        "async/token_staleness_max": float(tokens.max()),
        "async/stale_token_fraction": float((tokens > 0).mean()),
        "async/trajectory_staleness_mean": float(np.mean(per_traj)),
        "async/trajectory_staleness_max": float(np.max(per_traj)),
        "async/mixed_version_fraction": float(np.mean(mixed)),
    }
    for s in range(int(tokens.max()) + 1):
        stats[f"async/token_staleness_{s}"] = float((tokens == s).mean())
    return stats, tokens
