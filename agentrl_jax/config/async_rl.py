"""The async_rl section: asynchronous rollouts, the staleness bound, the stream, the old-logit source
(docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl_jax.config.core import _f, _require, _Section


@dataclass(frozen=True)
class AsyncConfig(_Section):
    """Asynchronous rollouts with bounded staleness (arXiv:2605.12070, arXiv:2605.15565; docs/async.md).

    Off (the default): each step rolls out, then trains, then syncs the weights. On: rollouts
    of later steps run while the trainer updates (a producer/consumer pipeline); a batch
    trained at params version k holds only tokens sampled by versions >= k - max_staleness,
    enforced by admission (a step's rollouts start only once version >= step - max_staleness;
    finished work is never discarded). In-flight trajectories continue on new weights
    (partial rollouts) with per-token versions. ``mode='stream'``: groups start one by one
    whenever one finishes, and each step trains the next finished groups; a group starts only
    if its first token's version is within max_staleness of the version that will train it.
    """

    enabled: bool = _f(False, "Overlap rollouts of later steps with training (async RL).")
    mode: Literal["step", "stream"] = _f(
        "step", "step: a step's rollouts start as a batch once the bound admits the step; stream: groups start one "
                "by one whenever one finishes, and each step trains the next finished groups (docs/async.md).")
    stream_max_groups: int = _f(0, "mode='stream': groups in flight at most (0: sized from the measured tool "
                                   "share of an episode's time, the decode lanes and the KV pool).")
    max_staleness: int = _f(1, "Versions a trained token may lag the params being updated (0: on-policy; "
                               "the async pipeline then reproduces the synchronous run).")
    placement: Literal["colocated", "disaggregated"] = _f(
        "colocated", "colocated: rollout and training share every device (time-shared); disaggregated: the "
        "devices split into a rollout mesh and a training mesh, weights move by device_put.")
    rollout_devices: int = _f(0, "disaggregated: devices given to the rollout engine (0: half of them); "
                                 "the training mesh (mesh.*) gets the rest.")
    old_logprobs: Literal["recompute", "snapshot", "ewma"] = _f(
        "recompute", "The 'old' policy of the PPO ratio: recompute (the params being trained, before the "
        "update), snapshot (exact: the params of the version that sampled each token, kept while queued "
        "data references them), ewma (PPO-EWMA proximal policy: an EWMA of the params).")
    ewma_decay: float = _f(0.5, "old_logprobs='ewma': theta_ewma <- decay * theta_ewma + (1 - decay) * theta "
                                "after every step.")
    ewma_reset_every: int = _f(0, "old_logprobs='ewma': reset the EWMA to the params every N steps (0: never).")
    ewma_min_kept: float = _f(0.0, "old_logprobs='ewma': reset when the off-policy correction keeps less than "
                                   "this share of the loss tokens (arXiv:2605.12070's automatic reset; 0: off).")
    offload_optimizer: bool = _f(False, "Synchronous colocated runs: keep the optimizer state in host memory "
                                        "during rollouts (moved back for the update).")
    release_kv_cache: bool = _f(True, "Synchronous runs: free the rollout KV cache after each rollout so the "
                                      "update has the memory (it is re-created for the next rollout).")

    def validate(self) -> None:
        _require(self.max_staleness >= 0, self._path("max_staleness"), "must be >= 0")
        _require(self.mode == "step" or self.enabled, self._path("mode"),
                 "'stream' needs async_rl.enabled=true (a synchronous run has nothing to stream)")
        _require(self.stream_max_groups >= 0, self._path("stream_max_groups"), "must be >= 0 (0: sized automatically)")
        _require(self.rollout_devices >= 0, self._path("rollout_devices"), "must be >= 0 (0: half)")
        _require(0.0 <= self.ewma_decay < 1.0, self._path("ewma_decay"), f"must be in [0, 1), got {self.ewma_decay}")
        _require(self.ewma_reset_every >= 0, self._path("ewma_reset_every"), "must be >= 0 (0: never)")
        _require(0.0 <= self.ewma_min_kept <= 1.0, self._path("ewma_min_kept"), "must be in [0, 1]")
        _require(self.placement == "colocated" or self.enabled, self._path("placement"),
                 "'disaggregated' needs async_rl.enabled=true (a synchronous step would leave one half idle)")
        _require(not (self.offload_optimizer and self.enabled), self._path("offload_optimizer"),
                 "applies to synchronous runs only (async rollouts run while the optimizer works)")
