"""The rollout engine's layout of the decoder: weights one dict per layer, KV cache one buffer per layer.

- `DecodeParams`: the `Decoder`'s weights in an inference layout, one dict per layer (a
  tuple, so `decode.forward` unrolls the L layers in Python and each matmul reads its own
  buffer). Q, K and V are one matrix ``[D, KV, G + 2, K]`` (per kv head: its G query heads,
  its key, its value), gate and up one ``[D, 2, F]``; both keep whole heads / MLP columns on
  one tensor shard. `to_decode_params` converts, `decode_params_axes` names the axes.
- `LayerCache`: L separate k and v buffers ``[B, KV, S, K]``, donated through the engine's
  jitted calls and updated in place; or, with a page table, L pools of pages
  ``[N, KV, P, K]`` (the rollout engine's paged cache: row b's entry t lives at entry
  ``t % P`` of page ``page_table[b, t // P]``, `cache_attention.paged_xla_attend_and_write`).

Dimension letters: B batch, S cache length, N pages, P page size, D width, H heads, KV kv
heads, G query heads per kv head, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from agentrl_jax.models.config import DecoderConfig

LAYER_CACHE_AXES: tuple[str, ...] = ("slots", "kv_heads", "cache_sequence", "head_dim")


@struct.dataclass
class DecodeParams:
    """Decoder weights in the inference layout (see the module docstring).

    Attributes:
      embed: ``[V, D]`` token embedding.
      layers: L dicts of one layer's weights (`layer_axes` names them).
      final_norm: ``[D]``.
      lm_head: ``[D, V]``, or None with tied embeddings.
    """

    embed: jax.Array
    layers: tuple[dict[str, jax.Array], ...]
    final_norm: jax.Array
    lm_head: jax.Array | None = None

    def output_embedding(self) -> tuple[jax.Array, str]:
        """``(table, "vd")`` for tied embeddings, ``(kernel, "dv")`` for an lm_head."""
        if self.lm_head is None:
            return self.embed, "vd"
        return self.lm_head, "dv"


@struct.dataclass
class LayerCache:
    """Keys and values of every layer, one buffer per layer.

    Attributes:
      k: L arrays ``[B, KV, S, K]``, keys after RoPE.
      v: L arrays ``[B, KV, S, K]``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, config: DecoderConfig, batch: int, max_len: int, dtype) -> LayerCache:
        shape = cls.shape(config, batch, max_len)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))

    @staticmethod
    def shape(config: DecoderConfig, batch: int, max_len: int) -> tuple[int, int, int, int]:
        """``(B, KV, S, K)`` of one layer's buffer."""
        return (batch, config.num_kv_heads, max_len, config.head_dim)

    @classmethod
    def logical_axes(cls, config: DecoderConfig) -> LayerCache:
        axes = (LAYER_CACHE_AXES,) * config.num_layers
        return cls(k=axes, v=axes)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def map(self, fn) -> LayerCache:
        """Apply ``fn`` to every layer's k and v buffer."""
        return LayerCache(k=tuple(map(fn, self.k)), v=tuple(map(fn, self.v)))


def layer_axes(config: DecoderConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axes of one layer's inference weights (kv heads and MLP columns over tensor)."""
    axes = {
        "attn_norm": ("norm",),
        "wqkv": ("embed", "kv_heads", None, "head_dim"),
        "wo": ("kv_heads", None, "head_dim", "embed"),
        "mlp_norm": ("norm",),
        "w_gate_up": ("embed", None, "mlp"),
        "w_down": ("mlp", "embed"),
    }
    if config.attention_bias:
        axes["bqkv"] = ("kv_heads", None, "head_dim")
    if config.qk_norm:
        axes["q_norm"] = ("norm",)
        axes["k_norm"] = ("norm",)
    return axes


def decode_params_axes(config: DecoderConfig) -> DecodeParams:
    """Logical axes of every `DecodeParams` leaf (a `DecodeParams` of tuples)."""
    return DecodeParams(
        embed=("vocab", "embed"),
        layers=tuple(layer_axes(config) for _ in range(config.num_layers)),
        final_norm=("norm",),
        lm_head=None if config.tie_word_embeddings else ("embed", "vocab"),
    )


def to_decode_params(config: DecoderConfig, params: nnx.State) -> DecodeParams:
    """The inference layout of a `Decoder`'s params (``nnx.state(model, nnx.Param)``).

    Pure array code (reshape, concatenate, index): run it under ``jax.jit`` with the
    shardings of `decode_params_axes` as ``out_shardings``.
    """
    L, H, KV, K = config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim
    G = H // KV
    stacked = params["layers"]

    def value(x):
        return x[...] if isinstance(x, nnx.Variable) else x

    wq = value(stacked["wq"])
    D = wq.shape[1]
    # query head h = kv * G + g reads kv head kv (grouped-query attention)
    wqkv = jnp.concatenate(
        [wq.reshape(L, D, KV, G, K), value(stacked["wk"])[:, :, :, None], value(stacked["wv"])[:, :, :, None]],
        axis=3,
    )
    fused = {
        "attn_norm": value(stacked["attn_norm"]),
        "wqkv": wqkv,
        "wo": value(stacked["wo"]).reshape(L, KV, G, K, -1),
        "mlp_norm": value(stacked["mlp_norm"]),
        "w_gate_up": jnp.stack([value(stacked["w_gate"]), value(stacked["w_up"])], axis=2),
        "w_down": value(stacked["w_down"]),
    }
    if config.attention_bias:
        bq = value(stacked["bq"]).reshape(L, KV, G, K)
        fused["bqkv"] = jnp.concatenate([bq, value(stacked["bk"])[:, :, None], value(stacked["bv"])[:, :, None]], axis=2)
    if config.qk_norm:
        fused["q_norm"] = value(stacked["q_norm"])
        fused["k_norm"] = value(stacked["k_norm"])
    layers = tuple({name: w[i] for name, w in fused.items()} for i in range(L))
    return DecodeParams(
        embed=value(params["embed"]),
        layers=layers,
        final_norm=value(params["final_norm"]),
        lm_head=None if config.tie_word_embeddings else value(params["lm_head"]),
    )
