"""The decoder family (Llama 3, Qwen2/2.5, Qwen3 dense) as one Flax NNX module.

The L layers' weights are stored stacked with a leading ``layers`` dimension (``wq`` is
``[L, D, H, K]``; `params` names them) and run with ``jax.lax.scan``, so compile time does
not grow with depth. Every ``nnx.Param`` carries ``logical_axes`` metadata (one name per
dimension) that `params.param_logical_axes` collects and :mod:`agentrl_jax.sharding` maps
onto the mesh. The metadata key is our own (not flax's ``out_sharding``), so NNX never tries
to shard eagerly: sharding is applied by whoever materializes the arrays
(``hf_io.load_hf_checkpoint``, ``jax.device_put`` with `params.param_shardings`).

The trainer uses the functional form: ``graphdef, params = split_params(model)``, then
``apply(graphdef, params, input_ids, positions, ...)`` inside ``jax.jit``. The rollout engine
runs the same weights through `models.decode` (an inference layout and a KV cache), whose
`_decoder_block` reads step for step beside this one.

Dimension letters: B batch, T tokens, D width, H heads, KV kv heads, K head dim, F MLP
width, V vocab, L layers.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.layers import (
    LowRank,
    apply_rope,
    attention,
    packed_attention,
    packed_causal_mask,
    project,
    rms_norm,
    rope_frequencies,
    swiglu,
)
from agentrl_jax.models.params import init_values, layer_param_specs, param_specs
from agentrl_jax.models.remat import REMAT_POLICIES, remat_layer
from agentrl_jax.models.splash import splash_packed_attention
from agentrl_jax.sharding import DEFAULT_RULES, MESH_AXES, Rules, logical_to_spec

ATTENTION_IMPLS = ("xla", "cudnn", "splash", None)
LM_HEAD_DTYPES = ("param", "compute")


class DecoderLayers(nnx.Module):
    """The stacked weights of all L layers (each attribute is ``[L, ...]``)."""

    def __init__(self, config: DecoderConfig, values: dict[str, nnx.Param]):
        for name in layer_param_specs(config):
            setattr(self, name, values[f"layers/{name}"])

    def stacked(self, config: DecoderConfig) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in layer_param_specs(config)}


class Decoder(nnx.Module):
    """Decoder-only transformer: embed -> L x (attention + SwiGLU, pre-RMSNorm) -> RMSNorm.

    Args:
      config: the architecture.
      dtype: compute dtype (activations; weights are cast to it at use).
      param_dtype: storage dtype of the weights.
      attention_impl: "xla", "cudnn" or None (JAX picks), passed to
        ``jax.nn.dot_product_attention``; or "splash": Pallas splash attention (TPU; Pallas's
        interpreter elsewhere) for packed and right-padded rows
        (``models.splash``), XLA for the rest.
      remat: "none", "full" (recompute each layer in the backward pass), "dots_saveable"
        (keep matmul outputs), "attention_saveable" (keep only the fused attention's output
        and softmax statistics, cuDNN's or splash's, so the backward pass never reruns the
        flash forward)
        or "dots_attention_saveable" (both: only elementwise work is recomputed).
      activation_rules: logical-axis rules for activation sharding constraints (batch over
        the data axes, heads over tensor), applied only while a mesh with axes
        (data, fsdp, tensor) is set with ``jax.set_mesh``; None disables them.
      mesh: the (data, fsdp, tensor) mesh the params live on, for splash attention's
        ``shard_map`` when no mesh is set with ``jax.set_mesh`` (a one-device trainer and
        direct calls set none; XLA cannot partition a Pallas TPU kernel); unused by others.
      lm_head_dtype: "param": the logits matmul reads the output embedding as stored;
        "compute": cast to ``dtype`` first, like every other weight of the model. The logits
        are float32 either way (float32 accumulation). With float32 params and bfloat16
        activations, "param" makes the lm head a float32 matmul (TF32 on GPUs, half the bf16
        rate; docs/benchmarks.md, "Where the update's time goes").
      rngs: initializer randomness.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        attention_impl: str | None = None,
        remat: str = "none",
        activation_rules: Rules | None = DEFAULT_RULES,
        lm_head_dtype: str = "param",
        mesh: Mesh | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"Decoder: attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}"
            )
        if remat not in REMAT_POLICIES:
            raise ValueError(f"Decoder: remat must be one of {REMAT_POLICIES}, got {remat!r}")
        if lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(f"Decoder: lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {lm_head_dtype!r}")
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.attention_impl = attention_impl
        self.remat = remat
        self.activation_rules = activation_rules
        self.lm_head_dtype = lm_head_dtype
        self.mesh = mesh
        specs = param_specs(config)
        init = tuple((name, shape, kind) for name, (shape, _, kind) in specs.items())
        values = init_values(rngs.params(), init, jnp.dtype(param_dtype))
        params = {
            name: nnx.Param(values[name], logical_axes=axes) for name, (_, axes, _) in specs.items()
        }
        self.embed = params["embed"]
        self.layers = DecoderLayers(config, params)
        self.final_norm = params["final_norm"]
        if not config.tie_word_embeddings:
            self.lm_head = params["lm_head"]

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        lengths: jax.Array | None = None,
        max_segments: int | None = None,
        adapters: dict[str, dict[str, jax.Array]] | None = None,
        adapter_scale: float = 1.0,
    ) -> jax.Array:
        """Final hidden states of ``[B, T]`` tokens: causal attention within each row,
        restricted to equal ``segment_ids`` (packed rows) and to real keys (``attention_mask`` 1).

        Args:
          input_ids: ``[B, T]`` int32.
          positions: ``[B, T]`` int32 RoPE positions (restart per packed segment).
          segment_ids: ``[B, T]`` int32 or None (one segment per row).
          attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding; or None.
          lengths: ``[B]`` int32, for right-padded rows of one sequence each: tokens
            ``[0, lengths[b])`` are real. Replaces ``segment_ids``/``attention_mask`` with a
            mask-free causal attention (cuDNN flash attention on GPU).
          max_segments: static bound on segments per row of packed ``segment_ids``. With
            ``attention_impl="cudnn"`` it selects cuDNN's packed flash-attention kernel
            (no ``[B, T, T]`` mask; ``layers.packed_attention``). 1 (every row one segment
            followed by padding) runs the mask-free ``lengths`` path on any backend.
          adapters: LoRA adapters in the layer path, ``{weight: {"a": [L, *in, r], "b": [L, r,
            *out]}}`` (``models.lora``): the targeted projections compute ``x W + adapter_scale
            * (x A) B`` (``layers.project``), so no merged weight is formed; None: the plain model.
          adapter_scale: ``alpha / r``.

        Returns:
          ``hidden [B, T, D]`` in the compute dtype (the rollout engine keeps its KV cache in
          its own forward, `models.decode`).
        """
        cfg = self.config
        chex.assert_rank(input_ids, 2)
        chex.assert_equal_shape([input_ids, positions])
        B, T = input_ids.shape
        if max_segments == 1 and segment_ids is not None and attention_mask is None:
            # A row of one segment is a right-padded row: no segment table, no cuDNN packed
            # kernel (whose backward scratch grows with the bound; train.packing.PackPlan).
            lengths, segment_ids = jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32), None
        hidden = jnp.take(self.embed[...], input_ids, axis=0).astype(self.dtype)
        constrain = functools.partial(_constrain, rules=self.activation_rules)
        hidden = constrain(hidden, ("batch", "sequence", "embed"))
        layer_weights = self.layers.stacked(cfg)
        block = functools.partial(
            _decoder_block,
            config=cfg,
            dtype=self.dtype,
            implementation=self.attention_impl,
            constrain=constrain,
            positions=positions,
            rules=self.activation_rules,
            mesh=self.mesh,
            **self._attention_inputs(B, T, segment_ids, attention_mask, lengths, max_segments),
        )
        # The adapters are sliced per layer with the weights; None adds no scanned input.
        body = remat_layer(lambda h, w: (block(h, *w, lora_scale=adapter_scale), None), self.remat)
        hidden, _ = jax.lax.scan(body, hidden, (layer_weights, adapters))
        return rms_norm(hidden, self.final_norm[...], cfg.rms_norm_eps)

    def _attention_inputs(self, B, T, segment_ids, attention_mask, lengths, max_segments) -> dict[str, Any]:
        """Which attention every layer runs, as `_decoder_block`'s keyword arguments: mask-free
        over right-padded ``lengths``, cuDNN's or splash's packed kernel, or a ``[B, 1, T, T]`` mask."""
        if lengths is not None:
            if segment_ids is not None or attention_mask is not None:
                raise ValueError("Decoder: pass either lengths or segment_ids/attention_mask, not both")
            chex.assert_shape(lengths, (B,))
            return {"mask": None, "lengths": lengths}
        if segment_ids is not None and max_segments and self.attention_impl in ("cudnn", "splash"):
            if attention_mask is not None:
                raise ValueError("Decoder: the packed cuDNN/splash path takes segment_ids (0 = padding), "
                                 "not attention_mask")
            return {"mask": None, "packed": (segment_ids, max_segments)}
        return {"mask": packed_causal_mask(segment_ids, attention_mask, B, T)}

    def output_embedding(self) -> tuple[jax.Array, str]:
        """``(table, "vd")``: tied embedding ``[V, D]``; ``(kernel, "dv")``: lm_head ``[D, V]``.

        In the compute dtype with ``lm_head_dtype="compute"`` (the cast is inside the caller's
        jit, so the gradient reaches the stored params in their own dtype).
        """
        if self.config.tie_word_embeddings:
            table, layout = self.embed[...], "vd"
        else:
            table, layout = self.lm_head[...], "dv"
        # Whole over fsdp (split over tensor only): each device's rows meet the whole table, which
        # is gathered once per step; left to the partitioner it was gathered again for the loss
        # chunks' recompute in the backward (losses/logprobs.py says why the chunks keep the rows).
        vocab_only = ("vocab", None) if layout == "vd" else (None, "vocab")
        table = _constrain(table, vocab_only, rules=self.activation_rules)
        if self.lm_head_dtype == "compute":
            table = table.astype(self.dtype)
        return table, layout

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 ``[B, T, V]`` logits of ``[B, T, D]`` hidden states (small inputs only)."""
        table, layout = self.output_embedding()
        equation = "btd,vd->btv" if layout == "vd" else "btd,dv->btv"
        return jnp.einsum(equation, hidden.astype(jnp.float32), table.astype(jnp.float32))


def _decoder_block(
    h: jax.Array,
    w: dict[str, jax.Array],
    lora: dict[str, dict[str, jax.Array]] | None = None,
    *,
    config: DecoderConfig,
    dtype,
    implementation: str | None,
    constrain,
    positions: jax.Array,
    mask: jax.Array | None,
    lengths: jax.Array | None = None,
    packed: tuple[jax.Array, int] | None = None,
    rules: Rules | None = None,
    mesh: Mesh | None = None,
    lora_scale: float = 1.0,
) -> jax.Array:
    """One pre-norm block: ``h + Attn(RMSNorm(h))``, then ``h + SwiGLU(RMSNorm(h))``.

    Args:
      h: ``[B, T, D]`` residual stream; w: one layer's weights (``layer_param_specs``).
      lora: one layer's LoRA adapters ``{weight: {"a", "b"}}`` or None; lora_scale: their scale.
      mask: ``[B, 1, T, T]`` bool, or None (``lengths``, ``packed``, or causal splash).
      lengths: ``[B]`` real tokens of right-padded rows, or None.
      packed: ``(segment_ids, max_segments)`` for cuDNN's or splash's packed kernel, or None.
      rules: the activation rules (where splash attention finds the mesh placement).
      mesh: the decoder's mesh, for splash attention when no mesh is set.

    Returns:
      ``h [B, T, D]``.
    """
    cast = {name: value.astype(dtype) for name, value in w.items()}
    adapters = {name: LowRank(ab["a"], ab["b"], lora_scale) for name, ab in (lora or {}).items()}
    eps = config.rms_norm_eps
    inv_freq = rope_frequencies(config)
    x = rms_norm(h, cast["attn_norm"], eps)
    q = project("btd,dhk->bthk", x, cast["wq"], adapters.get("wq"))
    k = project("btd,dhk->bthk", x, cast["wk"], adapters.get("wk"))
    v = project("btd,dhk->bthk", x, cast["wv"], adapters.get("wv"))
    if config.attention_bias:
        q, k, v = q + cast["bq"], k + cast["bk"], v + cast["bv"]
    if config.qk_norm:
        q = rms_norm(q, cast["q_norm"], eps)
        k = rms_norm(k, cast["k_norm"], eps)
    q = constrain(apply_rope(q, positions, inv_freq), ("batch", "sequence", "heads", "head_dim"))
    k = constrain(apply_rope(k, positions, inv_freq), ("batch", "sequence", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "sequence", "kv_heads", "head_dim"))
    if implementation == "splash" and (packed is not None or mask is None):
        # packed rows, or right-padded rows as one segment each (id 0 after the row's length)
        ids = packed[0] if packed is not None else (
            jnp.arange(h.shape[1])[None, :] < (h.shape[1] if lengths is None else lengths[:, None])
        ).astype(jnp.int32)
        out = splash_packed_attention(q, k, v, ids, rules=rules, mesh=mesh)
    elif packed is not None:
        out = packed_attention(q, k, v, *packed)
    else:
        out = attention(q, k, v, mask, None if implementation == "splash" else implementation, lengths=lengths)
    h = h + project("bthk,hkd->btd", out, cast["wo"], adapters.get("wo"))
    x = rms_norm(h, cast["mlp_norm"], eps)
    h = h + swiglu(x, cast["w_gate"], cast["w_up"], cast["w_down"], adapters=adapters)
    return constrain(h, ("batch", "sequence", "embed"))


def _constrain(x: jax.Array, axes: tuple[str, ...], *, rules: Rules | None) -> jax.Array:
    """Pin an activation's sharding by logical axes when a (data, fsdp, tensor) mesh is set.

    Without constraints XLA may resolve "batch on fsdp" x "weights' embed on fsdp" by
    resharding activations instead of gathering weights; pinning batch and heads keeps the
    FSDP + tensor-parallel pattern. Outside ``jax.set_mesh`` this is the identity.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    spec = logical_to_spec(axes, rules, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def split_params(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)``: the static structure and the ``nnx.Param`` state pytree."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def apply(graphdef: nnx.GraphDef, params: nnx.State, *args: Any, **kwargs: Any):
    """Merge ``params`` into ``graphdef`` and call the decoder (a pure function for ``jit``)."""
    return nnx.merge(graphdef, params)(*args, **kwargs)
