"""Several trained policies in one multi-actor episode (docs/multi_policy.md)."""

from agentrl_jax.train.multi_policy.run import train_multi, train_multi_async

__all__ = ["train_multi", "train_multi_async"]
