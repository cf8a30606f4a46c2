"""Checkpoints: a small wrapper over orbax `CheckpointManager`, with TPU-preemption handling.

One checkpoint per step directory holds four items:
  state        the train-state pytree (params, optimizer state, step, ...), `StandardSave`:
               sharded arrays are written by every host in parallel.
  data_state   the data iterator's `get_state()` dict (JSON).
  config       the experiment config as a plain dict (JSON).
  meta         the rng key data, and `extra`: any small JSON dict (params version, best score, ...).
and optionally named pytrees beside the train state (`save(trees=...)`, read back one by one
with `restore_tree`): state a run keeps outside the train state, e.g. a lagged teacher's params.

Saving is asynchronous: `save` returns once the arrays are copied off the devices, so the
caller may donate the state to the next step; the files are written in the background.
`wait_until_finished()` blocks until they are on disk (call it before exiting).

Restore needs a target pytree whose array leaves carry concrete shardings (a live train
state, or `jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))` built
from `jax.eval_shape` + the train shardings): arrays come back directly in those shardings.

Preemption: `install_sigterm_handler()` turns SIGTERM (what Cloud TPU sends before a
preemption/maintenance) into a flag. The trainer polls `should_stop()` at every step
boundary; when it returns True the trainer saves, calls `wait_until_finished()` and exits
normally. On several hosts `should_stop()` is a collective that every host calls at the
same step, so all hosts agree to stop at the same step even if only one got the signal.

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
    ckpt.install_sigterm_handler()
    restored = ckpt.restore_latest(state)          # None on a fresh run
    if restored:
        step, state, data_state, rng, config_dict, extra = restored
        batches.set_state(data_state)
    while step < total_steps:
        state, metrics = train_step(state, next(batches))
        step += 1
        stop = ckpt.should_stop()
        if step % save_every == 0 or stop or step == total_steps:
            ckpt.save(step, state, data_state=batches.get_state(), rng=rng, config_dict=config, force=True)
        if stop:
            break
    ckpt.wait_until_finished(); ckpt.close()
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

logger = logging.getLogger(__name__)


_ITEMS = ("state", "data_state", "config", "meta")


class RestoredCheckpoint(NamedTuple):
    """What `restore_latest` returns; unpacks as a tuple in this order."""

    step: int
    state: Any
    data_state: dict
    rng: jax.Array | None
    config_dict: dict
    extra: dict


def _json_dict(value: dict | None, name: str) -> dict:
    """Checks that `value` is a JSON-serializable dict (None -> {}), naming it on failure."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} is not JSON-serializable ({e}); convert it to plain types first") from e


def rng_to_json(rng: jax.Array | None) -> dict | None:
    """A PRNG key (typed `jax.random.key` or raw uint32 `PRNGKey`) as exact JSON."""
    if rng is None:
        return None
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(rng) if typed else rng)
    return {"typed": bool(typed), "impl": str(jax.random.key_impl(rng)) if typed else None,
            "dtype": str(data.dtype), "shape": list(data.shape), "data": data.ravel().tolist()}


def rng_from_json(saved: dict | None) -> jax.Array | None:
    """Inverse of `rng_to_json`, on the default device."""
    if saved is None:
        return None
    data = np.asarray(saved["data"], dtype=saved["dtype"]).reshape(saved["shape"])
    if saved["typed"]:
        return jax.random.wrap_key_data(data, impl=saved["impl"])
    return jax.numpy.asarray(data)


def abstract_target(target: Any) -> Any:
    """Target pytree -> orbax restore target with concrete shardings.

    `jax.Array` leaves become `ShapeDtypeStruct(shape, dtype, sharding=leaf.sharding)`;
    `ShapeDtypeStruct` leaves must already carry a concrete (`Mesh`, not `AbstractMesh`)
    sharding; NumPy arrays and Python scalars are restored as they are.

    Raises:
      ValueError: naming the first leaf without a usable sharding.
    """

    def convert(path, leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            sharding = leaf.sharding
            abstract_mesh = isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
            if sharding is None or abstract_mesh:
                raise ValueError(
                    f"restore target leaf {jax.tree_util.keystr(path)} has no concrete sharding ({sharding}); "
                    "use jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) with a real Mesh")
        return leaf

    return jax.tree_util.tree_map_with_path(convert, target)


def save_pytree(path: str | os.PathLike, tree: Any) -> None:
    """Writes one pytree of (sharded) arrays to `path`, replacing what is there; blocks until done.

    For what a run saves once and reads back on resume (the frozen initial policy after SFT).
    orbax writes to a temporary directory and renames it, so a kill leaves the old copy or
    none, never half of one. Every host calls it (arrays are written collectively).
    """
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(os.fspath(path)), tree, force=True)
        checkpointer.wait_until_finished()


def restore_pytree(path: str | os.PathLike, target: Any) -> Any:
    """The pytree `save_pytree` wrote at `path`, in the shardings of `target` (see `abstract_target`)."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(os.fspath(path)), abstract_target(target))


class Checkpointer:
    """Keep-N async checkpoints of (train state, data state, rng, config, extra).

    Args:
      directory: where step directories are written (created if missing; local or gs://).
      max_to_keep: newest checkpoints kept; older ones are deleted. None keeps all.
      save_interval_steps: `save(..., force=False)` saves only on multiples of this (and the
        first save of a fresh directory, as orbax does).
      async_save: write in a background thread (the default); False blocks in `save`.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, async_save: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep}")
        # orbax refuses relative paths; resolve against the working directory.
        self.directory = os.path.abspath(os.fspath(directory))
        # A process killed during an async save leaves a temporary step directory behind;
        # cleanup_tmp_directories removes it when the next run opens the directory.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._preemption_requested = False
        self._previous_sigterm_handler: Any = None
        self._sigterm_installed = False

    def save(self, step: int, train_state: Any, *, data_state: dict | None = None, rng: jax.Array | None = None,
             config_dict: dict | None = None, extra: dict | None = None, trees: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Starts saving a checkpoint for `step`; returns False when the interval skips it.

        Every host must call this with the same step (the arrays are written collectively).

        Args:
          step: the training step the state corresponds to (restored as `step`).
          train_state: pytree of (sharded) arrays.
          data_state: the data iterator's `get_state()`; JSON-serializable.
          rng: a PRNG key (typed or raw uint32) saved exactly.
          config_dict: the experiment config as plain JSON types.
          extra: any other small JSON dict.
          trees: more pytrees of (sharded) arrays by name, each its own item (`restore_tree`).
          force: save even if `step` is not on the save interval.
        """
        trees = dict(trees or {})
        reserved = sorted(set(trees) & set(_ITEMS))
        if reserved:
            raise ValueError(f"Checkpointer.save: trees may not be named {reserved} (the checkpoint's own items)")
        meta = {"rng": rng_to_json(rng), "extra": _json_dict(extra, "extra")}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(train_state),
            data_state=ocp.args.JsonSave(_json_dict(data_state, "data_state")),
            config=ocp.args.JsonSave(_json_dict(config_dict, "config_dict")),
            meta=ocp.args.JsonSave(meta),
            **{name: ocp.args.StandardSave(tree) for name, tree in trees.items()},
        )
        saved = self._manager.save(int(step), args=args, force=force)
        if saved:
            logger.info("checkpoint save started: step %d -> %s", step, self.directory)
        return saved

    def restore(self, step: int, target: Any) -> RestoredCheckpoint:
        """Restores checkpoint `step` into the shardings of `target` (see `abstract_target`)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_target(target)),
            data_state=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        restored = self._manager.restore(int(step), args=args)
        meta = restored.meta or {}
        return RestoredCheckpoint(
            step=int(step), state=restored.state, data_state=restored.data_state or {},
            rng=rng_from_json(meta.get("rng")), config_dict=restored.config or {}, extra=meta.get("extra") or {})

    def restore_tree(self, step: int, name: str, target: Any) -> Any | None:
        """The pytree saved as ``trees[name]`` at `step`, in `target`'s shardings; None when that
        checkpoint has no such tree (one written before the tree was saved)."""
        args = ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract_target(target))})
        try:
            return self._manager.restore(int(step), args=args)[name]
        except KeyError as e:
            if f'"{name}" was not found' in str(e):
                return None
            raise

    def restore_latest(self, target: Any) -> RestoredCheckpoint | None:
        """The newest complete checkpoint restored into `target`'s shardings, or None if there is none."""
        step = self.latest_step()
        if step is None:
            return None
        logger.info("restoring checkpoint step %d from %s", step, self.directory)
        return self.restore(step, target)

    def latest_step(self) -> int | None:
        """The newest saved step (waits for nothing; in-flight saves are not listed)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps with a checkpoint on disk, ascending."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until every started save is on disk (raises if a background save failed)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, releases the manager and restores the SIGTERM handler."""
        self._manager.wait_until_finished()
        self._manager.close()
        self.uninstall_sigterm_handler()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def install_sigterm_handler(self, callback: Callable[[int], None] | None = None) -> None:
        """On SIGTERM: set the preemption flag, call `callback(signum)`, restore the old handler.

        The handler does no I/O beyond logging: the save happens in the trainer at the
        next step boundary (`should_stop()`). A second SIGTERM goes to the previous
        handler (by default: terminate now). Must be called from the main thread.
        """

        def on_sigterm(signum, frame):
            del frame
            self._preemption_requested = True
            signal.signal(signal.SIGTERM, self._previous_sigterm_handler or signal.SIG_DFL)
            self._sigterm_installed = False
            logger.warning("SIGTERM received: will save a checkpoint and stop at the next step boundary")
            if callback is not None:
                callback(signum)

        self._previous_sigterm_handler = signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm_installed = True

    def uninstall_sigterm_handler(self) -> None:
        """Puts back the handler that was active before `install_sigterm_handler`."""
        if self._sigterm_installed:
            signal.signal(signal.SIGTERM, self._previous_sigterm_handler or signal.SIG_DFL)
            self._sigterm_installed = False

    def request_stop(self) -> None:
        """Sets the preemption flag by hand (e.g. from a time limit or a watchdog)."""
        self._preemption_requested = True

    @property
    def preemption_requested(self) -> bool:
        """Whether this host has seen SIGTERM / `request_stop()` (host-local)."""
        return self._preemption_requested

    def should_stop(self) -> bool:
        """True when any host has requested a stop. A collective on multi-host: call on every host each step."""
        if jax.process_count() == 1:
            return self._preemption_requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self._preemption_requested, dtype=np.int32))
        return bool(np.any(flags))
