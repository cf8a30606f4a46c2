"""HF safetensors checkpoints <-> the stacked-layer ``Decoder``.

Loading reads tensor by tensor straight into (sharded) device arrays: every param is built
with ``jax.make_array_from_callback`` whose callback reads, for one device's index, only that
block of each layer's tensor from a memory-mapped safetensors file. The host never holds
more than one device block at a time, never a second copy of the model. The files are read
and written by `safetensors_io`.

Sharding and NNX: the params carry their logical axes as ``logical_axes`` metadata, not as
flax's ``out_sharding``, so NNX never shards eagerly and needs no ``jax.set_mesh``. The
loader builds the module abstractly (``nnx.eval_shape``), creates each array with its
``NamedSharding`` from :func:`agentrl_jax.sharding.logical_sharding`, and ``nnx.merge``s
the arrays into the graph; the model then runs eagerly or under ``jax.jit`` with the
shardings propagated from its params (checked in tests on 8 fake devices).

Export writes ``config.json`` and safetensors (an index over several files above
``max_shard_bytes``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads; it
materializes one tensor (one layer's weight) at a time on the host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.decoder import Decoder, split_params
from agentrl_jax.models.params import layer_param_specs
from agentrl_jax.models.safetensors_io import DTYPE_NAMES, CheckpointError, SafetensorsCheckpoint, write_safetensors
from agentrl_jax.sharding import DEFAULT_RULES, Rules, logical_sharding

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorView:
    """One of our arrays as a view of an HF tensor: ``ours = hf.reshape(split).transpose(perm)``.

    Attributes:
      hf_name: the tensor name (``{layer}`` is filled per layer for stacked params).
      groups: for each HF dimension, the sizes it splits into (``q_proj.weight [H*K, D]`` is
        ``((H, K), (D,))``).
      perm: our dimension i is split dimension ``perm[i]``.
    """

    hf_name: str
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def split_shape(self) -> tuple[int, ...]:
        return tuple(s for g in self.groups for s in g)

    def read(self, tensor: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
        """Our block ``ours[index]`` read from ``tensor`` (only its covering HF block)."""
        sizes = self.split_shape
        split_index: list[slice] = [slice(None)] * len(sizes)
        for ours_dim, split_dim in enumerate(self.perm):
            split_index[split_dim] = index[ours_dim]
        hf_index, block_shape, inner_index = [], [], []
        dim = 0
        for group in self.groups:
            outer = split_index[dim]
            inner_size = math.prod(group[1:])
            hf_index.append(slice(outer.start * inner_size, outer.stop * inner_size))
            block_shape += [outer.stop - outer.start, *group[1:]]
            inner_index += [slice(None), *split_index[dim + 1 : dim + len(group)]]
            dim += len(group)
        block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)[tuple(inner_index)]
        return block.transpose(self.perm)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        """The inverse: our full array back to the HF tensor."""
        return ours.transpose(np.argsort(self.perm)).reshape(self.hf_shape)


def tensor_views(config: DecoderConfig) -> dict[tuple[str, ...], TensorView]:
    """Our param path (as in ``nnx.state(model, nnx.Param)``) -> its HF tensor view."""
    D, F, H, KV, K, V = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.vocab_size,
    )
    p = "model.layers.{layer}."
    layer = {
        "attn_norm": TensorView(p + "input_layernorm.weight", ((D,),), (0,)),
        "wq": TensorView(p + "self_attn.q_proj.weight", ((H, K), (D,)), (2, 0, 1)),
        "wk": TensorView(p + "self_attn.k_proj.weight", ((KV, K), (D,)), (2, 0, 1)),
        "wv": TensorView(p + "self_attn.v_proj.weight", ((KV, K), (D,)), (2, 0, 1)),
        "wo": TensorView(p + "self_attn.o_proj.weight", ((D,), (H, K)), (1, 2, 0)),
        "mlp_norm": TensorView(p + "post_attention_layernorm.weight", ((D,),), (0,)),
        "w_gate": TensorView(p + "mlp.gate_proj.weight", ((F,), (D,)), (1, 0)),
        "w_up": TensorView(p + "mlp.up_proj.weight", ((F,), (D,)), (1, 0)),
        "w_down": TensorView(p + "mlp.down_proj.weight", ((D,), (F,)), (1, 0)),
        "bq": TensorView(p + "self_attn.q_proj.bias", ((H, K),), (0, 1)),
        "bk": TensorView(p + "self_attn.k_proj.bias", ((KV, K),), (0, 1)),
        "bv": TensorView(p + "self_attn.v_proj.bias", ((KV, K),), (0, 1)),
        "q_norm": TensorView(p + "self_attn.q_norm.weight", ((K,),), (0,)),
        "k_norm": TensorView(p + "self_attn.k_norm.weight", ((K,),), (0,)),
    }
    views = {("layers", name): layer[name] for name in layer_param_specs(config)}
    views[("embed",)] = TensorView("model.embed_tokens.weight", ((V,), (D,)), (0, 1))
    views[("final_norm",)] = TensorView("model.norm.weight", ((D,),), (0,))
    if not config.tie_word_embeddings:
        views[("lm_head",)] = TensorView("lm_head.weight", ((V,), (D,)), (1, 0))
    return views


def _hf_names(config: DecoderConfig, views: dict[tuple[str, ...], TensorView]) -> dict[str, tuple]:
    """Every expected HF tensor name -> (our path, layer or None)."""
    out = {}
    for path, view in views.items():
        if path[0] == "layers":
            for layer in range(config.num_layers):
                out[view.hf_name.format(layer=layer)] = (path, layer)
        else:
            out[view.hf_name] = (path, None)
    return out


def _check_tensors(config: DecoderConfig, ckpt: SafetensorsCheckpoint, views) -> None:
    expected = _hf_names(config, views)
    present = ckpt.names()
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"{ckpt.directory}: missing tensor(s) {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} missing) for architecture {config.architecture!r}"
        )
    extra = present - set(expected)
    ignorable = {n for n in extra if n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        ignorable.add("lm_head.weight")  # a tied checkpoint may store the shared table twice
    if ignorable:
        logger.info(
            "hf_io: ignoring %d unused tensor(s): %s", len(ignorable), sorted(ignorable)[:5]
        )
    unexpected = sorted(extra - ignorable)
    if unexpected:
        raise CheckpointError(
            f"{ckpt.directory}: unexpected tensor(s) {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)} unexpected) for "
            f"architecture {config.architecture!r}"
        )
    for name, (path, _) in expected.items():
        want = views[path].hf_shape
        if ckpt.shape(name) != want:
            raise CheckpointError(
                f"{ckpt.directory}: tensor {name} has shape {list(ckpt.shape(name))}, the config "
                f"implies {list(want)}"
            )


def _normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _make_array(ckpt, view: TensorView, stacked: bool, shape, dtype, sharding) -> jax.Array:
    def block(index):
        index = _normalize(index, shape)
        if not stacked:
            return view.read(ckpt.get(view.hf_name), index).astype(dtype)
        layers = range(index[0].start, index[0].stop)
        return np.stack(
            [
                view.read(ckpt.get(view.hf_name.format(layer=i)), index[1:]).astype(dtype)
                for i in layers
            ]
        )

    return jax.make_array_from_callback(shape, sharding, block)


def load_hf_params(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    compute_dtype=None,
    attention_impl: str | None = None,
    remat: str = "none",
    lm_head_dtype: str = "param",
) -> tuple[DecoderConfig, nnx.GraphDef, nnx.State]:
    """Read config.json and the safetensors of ``path`` into ``(config, graphdef, params)``.

    Args:
      path: an HF model directory.
      dtype: storage dtype of the params on device.
      mesh: shard the params on this mesh by their logical axes (None: default device).
      rules: the logical-axis rule table (params, and the decoder's activation constraints).
      compute_dtype, attention_impl, remat, lm_head_dtype: passed to :class:`Decoder`
        (compute dtype defaults to ``dtype``).

    Raises:
      CheckpointError: missing / unexpected tensor or a shape mismatch.
      ValueError: an unsupported architecture (from ``DecoderConfig.from_hf``).
    """
    config = DecoderConfig.from_hf(path)
    ckpt = SafetensorsCheckpoint(path)
    views = tensor_views(config)
    _check_tensors(config, ckpt, views)
    abstract = nnx.eval_shape(
        lambda: Decoder(
            config,
            dtype=compute_dtype or dtype,
            param_dtype=dtype,
            attention_impl=attention_impl,
            remat=remat,
            activation_rules=rules,
            lm_head_dtype=lm_head_dtype,
            mesh=mesh,
        )
    )
    graphdef, abstract_params = split_params(abstract)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def materialize(key_path, variable: nnx.Variable):
        our_path = tuple(getattr(k, "key", k) for k in key_path)
        axes = variable.get_metadata()["logical_axes"]
        shape = tuple(variable.shape)
        if mesh is None:
            sharding = SingleDeviceSharding(jax.devices()[0])
        else:
            sharding = logical_sharding(axes, mesh, rules, shape=shape)
        array = _make_array(
            ckpt, views[our_path], our_path[0] == "layers", shape, np_dtype, sharding
        )
        return variable.replace(array)

    params = jax.tree_util.tree_map_with_path(
        materialize, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return config, graphdef, params


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    compute_dtype=None,
    attention_impl: str | None = None,
    remat: str = "none",
    lm_head_dtype: str = "param",
) -> Decoder:
    """A :class:`Decoder` with the weights of the HF directory ``path`` (:func:`load_hf_params`)."""
    _, graphdef, params = load_hf_params(
        path,
        dtype=dtype,
        mesh=mesh,
        rules=rules,
        compute_dtype=compute_dtype,
        attention_impl=attention_impl,
        remat=remat,
        lm_head_dtype=lm_head_dtype,
    )
    return nnx.merge(graphdef, params)


def _hf_tensors(
    config: DecoderConfig, params: nnx.State, np_dtype
) -> Iterator[tuple[str, tuple, Any]]:
    """(HF name, HF shape, thunk producing the numpy tensor) in checkpoint order."""
    views = tensor_views(config)
    flat = {
        tuple(getattr(k, "key", k) for k in key_path): v
        for key_path, v in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
    }
    if set(flat) != set(views):
        raise CheckpointError(
            f"save_hf_checkpoint: params {sorted(flat)} do not match config {sorted(views)}"
        )
    for name, (path, layer) in sorted(_hf_names(config, views).items()):
        array, view = flat[path], views[path]

        def thunk(array=array, view=view, layer=layer):
            value = array[...] if layer is None else array[...][layer]
            return view.to_hf(np.asarray(jax.device_get(value)).astype(np_dtype))

        yield name, view.hf_shape, thunk


def save_hf_checkpoint(
    model_or_params: Decoder | nnx.State,
    config: DecoderConfig,
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    max_shard_bytes: int = 2 * 1024**3,
) -> str:
    """Write ``config.json`` and safetensors that ``transformers`` loads.

    Args:
      model_or_params: a Decoder or its ``nnx.Param`` state.
      config: the architecture (written as config.json).
      path: output directory (created).
      dtype: dtype of the written tensors (float32, bfloat16, float16).
      max_shard_bytes: above this, tensors are split over several files with an index.

    Returns:
      ``path`` as a string.
    """
    params = (
        nnx.state(model_or_params, nnx.Param)
        if isinstance(model_or_params, nnx.Module)
        else model_or_params
    )
    np_dtype = np.dtype(jnp.dtype(dtype))
    if np_dtype not in DTYPE_NAMES:
        raise ValueError(f"save_hf_checkpoint: dtype {np_dtype} cannot be written to safetensors")
    out = os.fspath(path)
    os.makedirs(out, exist_ok=True)
    write_safetensors(out, list(_hf_tensors(config, params, np_dtype)), np_dtype, max_shard_bytes)
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        np_dtype.name, np_dtype.name
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(dtype=dtype_name), f, indent=2)
    return out
