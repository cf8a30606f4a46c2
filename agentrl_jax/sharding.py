"""Device mesh and logical-axis sharding.

Every array that lives on the mesh names its dimensions with *logical* axes (``embed``,
``heads``, ``vocab``, ...). One rule table maps logical axes onto the three mesh axes
``(data, fsdp, tensor)``. The same model code therefore runs on 1 CPU device, 8 fake CPU
devices, one GPU and a TPU slice: only the mesh shape and the rule table change.

Training and inference use the same params pytree under two rule tables: training shards
weights over ``fsdp`` and ``tensor``; inference keeps only ``tensor`` (weights replicated
over the data axes so every decode slot group has the whole model). Moving between the
two is a ``jax.device_put`` (:func:`reshard`), never a trip through host memory or disk.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrl_jax.config import ConfigError

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Logical axis -> mesh axes. Batch-like axes go over the data-parallel axes; weight axes
# over fsdp (the model width) and tensor (heads, mlp, vocab).
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("slots", ("data", "fsdp")),
    ("sequence", None),
    ("cache_sequence", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
)


def inference_rules(rules: Rules = DEFAULT_RULES) -> Rules:
    """The rule table for decoding: weights keep tensor parallelism, drop fsdp.

    During decode every step reads every weight, so all-gathering fsdp shards each step
    would dominate; the inference layout replicates weights over the data axes instead.
    Batch-like axes (``batch``, ``slots``) keep their data-parallel mapping.
    """
    batch_like = {"batch", "slots"}
    out = []
    for name, axes in rules:
        if name not in batch_like:
            axes = _drop_axis(axes, "fsdp")
            axes = _drop_axis(axes, "data")
        out.append((name, axes))
    return tuple(out)


def _drop_axis(axes: MeshAxes, drop: str) -> MeshAxes:
    if axes is None:
        return None
    if isinstance(axes, str):
        return None if axes == drop else axes
    kept = tuple(a for a in axes if a != drop)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def resolve_mesh_shape(shape: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Resolve a mesh shape in which at most one axis is -1 ("fill the rest").

    Args:
      shape: sizes for (a subset of) ``MESH_AXES``; missing axes are 1.
      n_devices: number of devices the mesh must cover exactly.

    Returns:
      A dict with every axis of ``MESH_AXES`` and a product equal to ``n_devices``.

    Raises:
      ConfigError: a shape these devices cannot take (it comes from the config's ``mesh``).
    """
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ConfigError(f"mesh: unknown axes {sorted(unknown)}; the axes are {list(MESH_AXES)}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ConfigError(f"mesh: axis sizes must be positive or -1, got {sizes}")
    if len(fill) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1 (fill), got {fill}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"mesh: {n_devices} devices are not divisible by the fixed axes {sizes} (product {known})"
            )
        sizes[fill[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(
            f"mesh: shape {sizes} covers {math.prod(sizes.values())} devices but {n_devices} are "
            "available; use -1 on one axis to fill"
        )
    return sizes


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a ``(data, fsdp, tensor)`` mesh with Auto axis types.

    ``jax.make_mesh`` defaults to Explicit axis types in recent JAX; this project relies on
    sharding propagation under ``jit`` (Auto), so the mesh is built directly.

    Args:
      shape: axis sizes, one of them may be -1; default: everything on ``fsdp``.
      devices: the devices to use (default: all of ``jax.devices()``).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(shape or {"fsdp": -1}, len(devices))
    dims = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(dims, devices=devices)
    except Exception:  # noqa: BLE001  (fake CPU devices have no topology: plain reshape)
        grid = np.asarray(devices, dtype=object).reshape(dims)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        return Mesh(grid, MESH_AXES, axis_types=(axis_type.Auto,) * len(MESH_AXES))
    return Mesh(grid, MESH_AXES)


def _rules_dict(rules: Rules) -> dict[str, MeshAxes]:
    table: dict[str, MeshAxes] = {}
    for name, axes in rules:
        if name in table:
            raise ValueError(f"sharding rules: logical axis {name!r} appears twice")
        if axes is not None:
            for a in (axes,) if isinstance(axes, str) else axes:
                if a not in MESH_AXES:
                    raise ValueError(
                        f"sharding rules: {name!r} maps to unknown mesh axis {a!r}; "
                        f"mesh axes are {list(MESH_AXES)}"
                    )
        table[name] = axes
    return table


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Map logical dimension names to a ``PartitionSpec``.

    A mesh axis is used at most once per spec (the first dimension that asks for it gets
    it). When ``shape`` and ``mesh`` are given, a dimension whose size is not divisible by
    the product of its mesh axes is replicated instead (tiny test models with 2 kv heads
    on a 4-way tensor axis), and that decision is logged once.

    Args:
      logical_axes: one name (or None) per array dimension.
      rules: the logical -> mesh table.
      shape: the array shape, to check divisibility.
      mesh: the mesh, to read axis sizes.
    """
    table = _rules_dict(rules)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"sharding: logical axis {name!r} has no rule; known: {sorted(table)}"
            )
        axes = table[name]
        axes_t = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        axes_t = tuple(a for a in axes_t if a not in used)
        if mesh is not None:
            axes_t = tuple(a for a in axes_t if mesh.shape[a] > 1)
        if shape is not None and mesh is not None and axes_t:
            size = math.prod(mesh.shape[a] for a in axes_t)
            if shape[dim] % size:
                _log_replicated(name, shape[dim], axes_t, size)
                axes_t = ()
        used.update(axes_t)
        spec.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return PartitionSpec(*spec)


_logged: set[tuple] = set()


def _log_replicated(name: str, dim: int, axes: tuple[str, ...], size: int) -> None:
    key = (name, dim, axes)
    if key not in _logged:
        _logged.add(key)
        logger.info(
            "sharding: logical axis %r of size %d is not divisible by mesh axes %s (size %d); "
            "replicating it",
            name,
            dim,
            axes,
            size,
        )


def logical_sharding(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """A ``NamedSharding`` for one array from its logical dimension names."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, shape=shape, mesh=mesh))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(axes_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, shapes: Any = None) -> Any:
    """Shardings for a pytree given a matching pytree of logical-axes tuples.

    Args:
      axes_tree: a pytree whose leaves are tuples of logical names (one per dimension).
      mesh: the mesh.
      rules: the logical -> mesh table.
      shapes: optional pytree with the same structure whose leaves have ``.shape`` (arrays
        or ``jax.ShapeDtypeStruct``), used to replicate non-divisible dimensions.
    """
    if shapes is None:
        return jax.tree.map(lambda ax: logical_sharding(ax, mesh, rules), axes_tree, is_leaf=_is_axes)
    return jax.tree.map(
        lambda ax, s: logical_sharding(ax, mesh, rules, shape=s.shape),
        axes_tree,
        shapes,
        is_leaf=_is_axes,
    )


def reshard(tree: Any, shardings: Any, *, donate: bool = False) -> Any:
    """Move a pytree of arrays into new shardings with ``jax.device_put`` (no host copy)."""
    return jax.device_put(tree, shardings, donate=donate)


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def under_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` (a jitted step) called with ``mesh`` set by ``jax.set_mesh``, so the decoder's
    activation constraints (batch over the data axes, heads over tensor) apply while it traces.

    Without them XLA's propagation alone keeps FSDP's weights and optimizer state sharded
    but computes every row on every device (docs/benchmarks.md, "Several GPUs of one host").
    """
    if mesh is None or mesh.size == 1:  # nothing to split; the constraints would only move XLA's fusions
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    return call
