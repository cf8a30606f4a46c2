"""The engine's copy of the weights: placed in the inference sharding, re-laid out for decoding.

The trainer's params are a stacked `nnx.State` in the training sharding; decoding wants one
dict per layer with fused QKV and gate/up (`models.decode.DecodeParams`) in the inference
sharding (tensor parallelism only). `EngineWeights.load` does both on the device, once per
weight update, and never donates the caller's buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from agentrl_jax.models import Decoder, DecoderConfig, param_shardings
from agentrl_jax.models.decode import DecodeParams, decode_params_axes, to_decode_params
from agentrl_jax.models.lora import LoraParams, merged_params
from agentrl_jax.sharding import Rules, tree_shardings


class EngineWeights:
    """Places params in the engine's sharding and dtype and re-lays them out as `DecodeParams`.

    Args:
      config: the decoder's config.
      abstract: the decoder's abstract params (`split_params(model)[1]`).
      mesh: the engine's mesh.
      rules: the inference rule table.
      param_dtype: the default dtype of floating leaves.
      output_dtype: dtype of the output embedding (the tied ``embed`` or ``lm_head``) after
        any ``load`` cast, or None for the load dtype: the decoder's compute dtype when the
        model runs its logits matmul in it (``Decoder(lm_head_dtype="compute")``), so the
        engine's logprobs are the trainer's. The tied table's lookup casts to the compute dtype
        anyway, so storing it there changes no input embedding.

    Attributes:
      param_shardings: the trainer-layout params in the inference sharding.
      decode_param_shardings: the `DecodeParams` sharding.
    """

    def __init__(self, config: DecoderConfig, abstract: nnx.State, mesh: Mesh, rules: Rules, param_dtype: Any,
                 output_dtype: Any = None):
        self._mesh = mesh
        self._param_dtype = param_dtype
        self._output_dtype = output_dtype
        self._output_name = "embed" if config.tie_word_embeddings else "lm_head"
        self.param_shardings = param_shardings(abstract, mesh, rules)
        layout = jax.eval_shape(functools.partial(to_decode_params, config), abstract)
        self.decode_param_shardings = tree_shardings(decode_params_axes(config), mesh, rules, shapes=layout)
        self._to_decode_params = jax.jit(
            functools.partial(to_decode_params, config), out_shardings=self.decode_param_shardings
        )
        self._reshard: dict[Any, Any] = {}

    def load(self, params: nnx.State | Decoder | DecodeParams | LoraParams, dtype: Any = None) -> DecodeParams:
        """See `Engine.load_params`. ``LoraParams`` are merged (``W + scale * A B``) into the
        engine's copy: on the engine's devices, inside the reshard, when the base is already
        there (only the adapters are new each push); else merged where they are, then copied."""
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        dtype = dtype if dtype is not None else self._param_dtype

        output_dtype = self._output_dtype if self._output_dtype is not None else dtype

        def cast(path, x):
            to = output_dtype if getattr(path[0], "key", getattr(path[0], "name", None)) == self._output_name else dtype
            return x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != to else x

        if isinstance(params, DecodeParams):
            return jax.device_put(jax.tree.map_with_path(cast, params), self.decode_param_shardings)
        return self._to_decode_params(self._place(params, cast, (dtype, output_dtype)))

    def _place(self, params: nnx.State, cast, dtype: tuple) -> nnx.State:
        """``params`` cast and in the inference sharding.

        Arrays already on the engine's devices are resharded by a jitted identity with
        ``out_shardings`` (on-device collectives, far faster than ``jax.device_put`` between the two
        shardings: docs/benchmarks.md, "Weight push"). Anything else (host arrays, other devices) goes through
        ``jax.device_put``, a device-to-device copy between devices.
        """
        mesh_devices = set(self._mesh.devices.flat)
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) and set(x.sharding.device_set) == mesh_devices for x in leaves):
            key = (tuple(jnp.dtype(d) for d in dtype), isinstance(params, LoraParams))
            if key not in self._reshard:
                self._reshard[key] = jax.jit(
                    lambda tree: jax.tree.map_with_path(cast, merged_params(tree)), out_shardings=self.param_shardings
                )
            return self._reshard[key](params)
        return jax.device_put(jax.tree.map_with_path(cast, merged_params(params)), self.param_shardings)
