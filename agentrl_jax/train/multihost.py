"""Multi-host (multi-process) helpers for the trainer.

The layout:
- Training is SPMD over the global mesh: every host runs the same sequence of jitted
  calls on global arrays.
- Rollouts are host-local: each host has its own engine on a mesh of its local devices,
  its own driver, sandbox pool and share of the prompts (continuous batching makes
  host-local decisions that cannot be lock-stepped across hosts).
- After a step's rollouts, the hosts exchange their finished trajectories
  (:func:`gather_objects`), so every host builds the same global batch and feeds it to
  the mesh with :func:`put_global`.
- Weights reach each host's engine as a replica on its local devices
  (:func:`local_replica`): one all-gather on the mesh, then device-local copies; no host
  memory, no disk.

On one process every helper reduces to its single-host equivalent.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.sharding import make_mesh


def is_multihost() -> bool:
    return jax.process_count() > 1


def check_supported(config: Config) -> None:
    """What several hosts do not support yet fails before anything starts."""
    if not is_multihost():
        return
    n = jax.process_count()
    if config.data.prompts_per_step % n:
        raise ConfigError(f"data.prompts_per_step ({config.data.prompts_per_step}) must be divisible by the "
                          f"number of hosts ({n}): each host rolls out its share")
    if config.hybrid.mode != "none" or config.hybrid.judge != "none":
        raise ConfigError("hybrid.mode / hybrid.judge: not supported on several hosts yet")
    stream = config.async_rl.enabled and config.async_rl.mode == "stream"
    if config.algorithm.dynamic_sampling and not stream:
        raise ConfigError("algorithm.dynamic_sampling: on several hosts only with async_rl.mode='stream' (each "
                          "host filters its own groups)")


def gather_objects(obj: Any) -> list[Any]:
    """Every host's ``obj`` (picklable), in process order, on every host (a collective)."""
    if not is_multihost():
        return [obj]
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([payload.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    return [pickle.loads(gathered[i, : int(sizes[i][0])].tobytes()) for i in range(gathered.shape[0])]


def barrier(name: str) -> None:
    """Wait until every host reached ``name`` (no-op on one host)."""
    if is_multihost():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def put_global(value: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array that is identical on every host, as an array replicated on ``mesh``."""
    return jax.device_put(value, NamedSharding(mesh, PartitionSpec()))


def put_replicated(value: Any, mesh: Mesh | None) -> jax.Array:
    """A host value (identical on every host) replicated on ``mesh`` (None: the default device);
    a device array stays as it is."""
    if isinstance(value, jax.Array):
        return value
    value = np.asarray(value)
    return jnp.asarray(value) if mesh is None else put_global(value, mesh)


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-host) array as numpy, on every host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_mesh(tensor: int) -> Mesh:
    """A mesh over this host's devices for its rollout engine (tensor axis kept if it fits)."""
    n = jax.local_device_count()
    tensor = tensor if tensor > 0 and n % tensor == 0 else 1
    return make_mesh({"data": -1, "tensor": tensor}, devices=jax.local_devices())


def local_replica(params: Any, global_mesh: Mesh, mesh: Mesh) -> Any:
    """``params`` (sharded on the global mesh) as arrays replicated on this host's ``mesh``."""
    if not is_multihost():
        return params
    replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(global_mesh, PartitionSpec()))(params)
    target = NamedSharding(mesh, PartitionSpec())
    by_device = {d: i for i, d in enumerate(mesh.devices.flat)}

    def one(x):
        shards = sorted(x.addressable_shards, key=lambda s: by_device[s.device])
        return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in shards])

    return jax.tree.map(one, replicated)


def write_params_digest(out: Path, local_params: Any, step: int) -> Path:
    """Write this host's ``params_digest/host<i>.json``: the sha256 of every array of
    ``local_params`` (this host's full copy, :func:`local_replica`) by key path, at ``step``.

    The hosts' files are equal exactly when every host holds the same weights bit for bit.
    That is not automatic: JAX does not check that the copies of a replicated piece agree
    across hosts, and a host's engine samples with its own copy.
    """
    digests = {jax.tree_util.keystr(path): hashlib.sha256(np.ascontiguousarray(np.asarray(leaf)).tobytes()).hexdigest()
               for path, leaf in jax.tree_util.tree_flatten_with_path(local_params)[0]}
    path = Path(out) / "params_digest" / f"host{jax.process_index()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "sha256": digests}, indent=1))
    return path
