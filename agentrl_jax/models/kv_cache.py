"""The key/value cache of the decoder: one ``[L, B, S, KV, K]`` buffer for keys and one for values.

The decoder writes row b's T new tokens at cache positions ``[cache_index[b],
cache_index[b] + T)`` and lets query t attend to entries ``j <= cache_index[b] + t``. The
same call therefore prefills (index 0), extends an existing prefix for a new turn (index =
its length) and decodes (T = 1). The cache does not store lengths: the caller (the rollout
engine) owns them.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.sharding import DEFAULT_RULES, Rules, logical_sharding

KV_CACHE_AXES: tuple[str, ...] = ("layers", "slots", "cache_sequence", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
      k: ``[L, B, S, KV, K]`` keys after RoPE.
      v: ``[L, B, S, KV, K]`` values.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, config: DecoderConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
        """A zero cache for ``batch`` rows of ``max_len`` tokens."""
        shape = cls.shape(config, batch, max_len)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @staticmethod
    def shape(config: DecoderConfig, batch: int, max_len: int) -> tuple[int, ...]:
        """``(L, B, S, KV, K)``."""
        return (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)

    @staticmethod
    def logical_axes() -> KVCache:
        """The logical axes of k and v, as a ``KVCache`` of tuples."""
        return KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES)

    @classmethod
    def shardings(
        cls,
        config: DecoderConfig,
        batch: int,
        max_len: int,
        mesh: Mesh,
        rules: Rules = DEFAULT_RULES,
    ) -> KVCache:
        """``NamedSharding`` of k and v on ``mesh`` (non-divisible dims are replicated)."""
        sharding: NamedSharding = logical_sharding(
            KV_CACHE_AXES, mesh, rules, shape=cls.shape(config, batch, max_len)
        )
        return KVCache(k=sharding, v=sharding)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]
