"""LoRA adapters on the decoder: ``x W + (alpha / r) (x A) B`` in the layer, or merged weights.

LoRA: Low-Rank Adaptation of Large Language Models (arXiv:2106.09685). ``LoraParams`` holds the
frozen base params (the decoder's ``nnx.State``) and a separate trainable tree of adapters. A
forward takes them two ways (``decoder_inputs``):

- ``impl="in_layer"`` (the default): the decoder gets the base and the adapters, and each
  targeted projection computes ``x W + scale * (x A) B`` (``layers.project``). Neither a merged
  weight nor its gradient is formed: the update holds the base, the adapters and activations.
- ``impl="merged"``: ``merged_params`` forms ``W[l] + scale * A[l] @ B[l]`` for the targeted
  stacked weights and the decoder runs on them; the forward holds a merged copy and the backward
  its full-size gradient before projecting it onto A and B.

The engine always decodes merged weights (``merged_params`` at each push), so it runs one dense
model at full speed. The KL reference is the base itself (adapters off). Dropout on the adapter
input cannot be written as a weight merge and is not offered: in RL it would also make the
trainer's logprobs differ from the sampler's.

Shapes (the decoder's stacked layout, ``models/decoder.py``): an adapter on a weight
``[L, *in, *out]`` is ``a [L, *in, r]`` and ``b [L, r, *out]`` (``wq [L, D, H, K]``:
``a [L, D, r]``, ``b [L, r, H, K]``; ``wo [L, H, K, D]``: ``a [L, H, K, r]``, ``b [L, r, D]``).
``a`` starts uniform in ``+-1/sqrt(fan_in)`` (PEFT's default), ``b`` at zero, so a fresh
adapter leaves the model unchanged.
"""

from __future__ import annotations

import math
import string
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from agentrl_jax.config import LoraConfig
from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.decoder import layer_param_specs
from agentrl_jax.sharding import DEFAULT_RULES, Rules, tree_shardings

#: ``model.lora.targets`` name -> (the decoder's stacked weight, HF module under ``layers.{i}``).
TARGETS = {
    "q": ("wq", "self_attn.q_proj"),
    "k": ("wk", "self_attn.k_proj"),
    "v": ("wv", "self_attn.v_proj"),
    "o": ("wo", "self_attn.o_proj"),
    "gate": ("w_gate", "mlp.gate_proj"),
    "up": ("w_up", "mlp.up_proj"),
    "down": ("w_down", "mlp.down_proj"),
}
# Input dimensions of each weight (after L); the rest are its outputs.
_IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


@struct.dataclass
class LoraParams:
    """The policy's params under LoRA: the frozen ``base`` and the trainable ``adapters``.

    Attributes:
      base: the decoder's ``nnx.State`` (frozen; any float dtype), or None where a caller has
        taken it out (``without_base``).
      adapters: ``{weight name: {"a": [L, *in, r], "b": [L, r, *out]}}``.
      scale: ``alpha / rank`` (static).
      dtype: the merged weights' dtype (static): the decoder's compute dtype, to which it casts
        every weight at use anyway, so a bfloat16 run holds the merged copy (and its gradient) in
        bfloat16; None: float32 where either side is (a bfloat16 sum would round the update away).
      impl: how the trainer's forward applies the adapters (static): "in_layer" or "merged".
    """

    base: Any
    adapters: dict[str, dict[str, jax.Array]]
    scale: float = struct.field(pytree_node=False, default=1.0)
    dtype: Any = struct.field(pytree_node=False, default=None)
    impl: str = struct.field(pytree_node=False, default="in_layer")


def adapter_shapes(config: DecoderConfig, lora: LoraConfig) -> dict[str, dict[str, tuple[tuple[int, ...], tuple]]]:
    """``{weight: {"a"|"b": (shape, logical axes)}}``; the rank dimension is replicated (axis None)."""
    specs = layer_param_specs(config)
    L, r = config.num_layers, lora.rank
    out = {}
    for target in lora.targets:
        name = TARGETS[target][0]
        shape, axes = specs[name]
        k = _IN_DIMS[name]
        out[name] = {"a": ((L, *shape[:k], r), ("layers", *axes[:k], None)),
                     "b": ((L, r, *shape[k:]), ("layers", None, *axes[k:]))}
    return out


def init_adapters(config: DecoderConfig, lora: LoraConfig, key: jax.Array, *, dtype=jnp.float32,
                  mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES) -> dict[str, dict[str, jax.Array]]:
    """Fresh adapters (``a`` uniform in +-1/sqrt(fan_in), ``b`` zero), placed by their logical
    axes on ``mesh`` when one is given."""
    if lora.rank <= 0:
        raise ValueError(f"init_adapters: model.lora.rank must be > 0, got {lora.rank}")
    shapes = adapter_shapes(config, lora)
    adapters = {}
    for i, (name, parts) in enumerate(sorted(shapes.items())):
        a_shape = parts["a"][0]
        bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
        a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        adapters[name] = {"a": a.astype(dtype), "b": jnp.zeros(parts["b"][0], dtype)}
    if mesh is not None:
        axes = {name: {part: spec[1] for part, spec in parts.items()} for name, parts in shapes.items()}
        adapters = jax.device_put(adapters, tree_shardings(axes, mesh, rules, shapes=adapters))
    return adapters


def attach(base: nnx.State, config: DecoderConfig, lora: LoraConfig, key: jax.Array, *,
           mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES, compute_dtype: Any = None) -> LoraParams:
    """``base`` with fresh float32 adapters (the optimizer's master copy) for ``lora.targets``;
    ``compute_dtype``: the decoder's (``LoraParams.dtype``)."""
    adapters = init_adapters(config, lora, key, mesh=mesh, rules=rules)
    dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
    return LoraParams(base=base, adapters=adapters, scale=lora.alpha / lora.rank, dtype=dtype, impl=lora.impl)


def delta(a: jax.Array, b: jax.Array) -> jax.Array:
    """``A @ B`` per layer: ``[L, *in, r] x [L, r, *out] -> [L, *in, *out]`` in float32."""
    letters = iter(string.ascii_lowercase[2:])
    ins = "".join(next(letters) for _ in a.shape[1:-1])
    outs = "".join(next(letters) for _ in b.shape[2:])
    return jnp.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a.astype(jnp.float32), b.astype(jnp.float32))


def merged_params(params: Any) -> Any:
    """The decoder params a forward uses: ``params`` itself, or for ``LoraParams`` the base with
    ``W + scale * A B`` on the targeted weights, summed in float32, stored in ``params.dtype``."""
    if not isinstance(params, LoraParams):
        return params
    if params.base is None:
        raise ValueError("merged_params: these LoraParams carry no base (taken out by without_base)")
    layers = dict(params.base["layers"])
    for name, ab in params.adapters.items():
        variable = layers[name]
        w = variable[...]
        dtype = params.dtype or jnp.promote_types(w.dtype, ab["a"].dtype)
        layers[name] = variable.replace((w.astype(jnp.float32) + params.scale * delta(ab["a"], ab["b"])).astype(dtype))
    merged = nnx.State(dict(params.base))
    merged["layers"] = nnx.State(layers)
    return merged


def decoder_inputs(params: Any) -> tuple[Any, dict[str, Any]]:
    """``(state, call keywords)`` of the trainer's forward: ``nnx.merge(graphdef, state)(...,
    **keywords)``. The base and the decoder's ``adapters``/``adapter_scale`` for in-layer LoRA;
    ``merged_params(params)`` and no keywords otherwise (plain params, or ``impl="merged"``)."""
    if not isinstance(params, LoraParams) or params.impl == "merged":
        return merged_params(params), {}
    if params.impl != "in_layer":
        raise ValueError(f"LoraParams.impl must be 'in_layer' or 'merged', got {params.impl!r}")
    if params.base is None:
        raise ValueError("decoder_inputs: these LoraParams carry no base (taken out by without_base)")
    return params.base, {"adapters": params.adapters, "adapter_scale": params.scale}


def adapters_off(params: Any) -> Any:
    """The base model of ``LoraParams`` (the KL reference for free); other params as they are."""
    return params.base if isinstance(params, LoraParams) else params


def trainable(params: Any) -> Any:
    """What the optimizer updates: the adapters of ``LoraParams``, else all of ``params``."""
    return params.adapters if isinstance(params, LoraParams) else params


def with_trainable(params: Any, values: Any) -> Any:
    """``params`` with its trainable part replaced by ``values`` (inverse of ``trainable``)."""
    return params.replace(adapters=values) if isinstance(params, LoraParams) else values


def without_base(state: Any) -> tuple[Any, Any]:
    """``(base or None, state with LoraParams.base set to None)`` for a train state.

    The update donates its train state; the frozen base must not be donated (the reference and
    the engine read the very same arrays), so the jitted update takes it as its own argument.
    Checkpoints store the state without it.
    """
    params = getattr(state, "params", None)
    if not isinstance(params, LoraParams):
        return None, state
    return params.base, state.replace(params=params.replace(base=None))


def with_base(state: Any, base: Any) -> Any:
    """Inverse of ``without_base``."""
    if base is None:
        return state
    return state.replace(params=state.params.replace(base=base))


@jax.jit
def _leaf_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.sum(x.astype(jnp.float32)) for x in leaves] + [jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in leaves]


def base_fingerprint(base: nnx.State) -> str:
    """A short fingerprint of the frozen base (names, shapes, dtypes and per-leaf sums): what a
    LoRA checkpoint records so that resuming on a different base fails with a clear error."""
    import hashlib

    flat = jax.tree_util.tree_flatten_with_path(base)[0]
    sums = jax.device_get(_leaf_sums([x for _, x in flat]))
    text = ";".join(f"{jax.tree_util.keystr(p)}:{x.shape}:{x.dtype}" for p, x in flat)
    text += ";" + ",".join(f"{float(s):.6e}" for s in sums)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

