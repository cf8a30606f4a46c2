"""LoRA in the trainer: the policy's params, its checkpoint restore and its export (docs/lora.md).

With ``model.lora.rank > 0`` the train state's params are ``models.lora.LoraParams``: the loaded
(or post-SFT) model as the frozen base plus fresh adapters. The update trains and the optimizer
holds only the adapters (``train/step.py``); the base is the KL reference (``train/build.py``); the
engine merges the adapters into its own copy at each push (``rollout/weights.py``). A checkpoint
holds the adapters, their optimizer state and a fingerprint of the base (``train/rl/stages.py
save``), so a resume takes the base from the run's model and checks it is the same one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.hf_io import save_hf_checkpoint
from agentrl_jax.models.lora import LoraParams, attach, base_fingerprint, merged_params, with_base, without_base
from agentrl_jax.models.lora_export import save_peft_adapter
from agentrl_jax.sharding import under_mesh
from agentrl_jax.train.checkpoint import Checkpointer, RestoredCheckpoint

#: The PEFT adapter directory beside the merged HF export (``checkpoint.export_hf``), and the
#: base it belongs to when that is not ``model.path`` (a scratch model, or the post-SFT policy).
ADAPTER_EXPORT_DIR = "export_adapter"
BASE_EXPORT_DIR = "export_base"


def policy_params(config: Config, base: Any, model_config: DecoderConfig, mesh: Mesh | None) -> Any:
    """The params RL trains: ``base`` itself, or with ``model.lora`` the base plus fresh adapters
    (seeded from ``config.seed``, placed on ``mesh`` by their logical axes)."""
    lora = config.model.lora
    if lora.rank == 0:
        return base
    key = jax.random.fold_in(jax.random.key(config.seed), 0x10A)
    return attach(base, model_config, lora, key, mesh=mesh, compute_dtype=config.model.compute_dtype)


def jit_donating_state(body: Callable, *, static_argnums: tuple[int, ...], num_inputs: int, state_sharding: Any,
                       mesh: Mesh | None) -> Callable:
    """``jax.jit(body)`` for ``body(state, *inputs, *static) -> (state, metrics)`` that donates the
    train state except a LoRA base, which is passed as its own, undonated argument: the reference
    and the engine read the very same arrays. Without LoRA the whole state is donated.

    With a ``mesh`` the shardings are explicit: the state keeps ``state_sharding``, the
    ``num_inputs`` array arguments and the metrics are replicated.
    """

    def on_split_state(base, state, *args):
        new_state, metrics = body(with_base(state, base), *args)
        return without_base(new_state)[1], metrics

    shardings = {}
    if mesh is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
        base_sharding, rest_sharding = without_base(state_sharding)
        shardings = {"in_shardings": (base_sharding, rest_sharding) + (replicated,) * num_inputs,
                     "out_shardings": (rest_sharding, replicated)}
    jitted = under_mesh(jax.jit(on_split_state, static_argnums=tuple(i + 1 for i in static_argnums),
                                donate_argnums=(1,), **shardings), mesh)

    def update(state, *args):
        base, rest = without_base(state)
        new_state, metrics = jitted(base, rest, *args)
        return with_base(new_state, base), metrics

    return update


def restore_latest(checkpointer: Checkpointer, state: Any) -> RestoredCheckpoint | None:
    """``checkpointer.restore_latest`` for a train state that may hold a LoRA base.

    The checkpoint holds the state without the base; the restored state gets ``state``'s base
    back after checking that it is the base the adapters were trained on.

    Raises:
      ConfigError: the checkpoint's base fingerprint differs from ``state``'s base.
    """
    base, target = without_base(state)
    restored = checkpointer.restore_latest(target)
    if restored is None or base is None:
        return restored
    saved, loaded = restored.extra.get("lora_base"), base_fingerprint(base)
    if saved != loaded:
        raise ConfigError(f"checkpoint.resume: the checkpoint's LoRA adapters were trained on another base model "
                          f"(fingerprint {saved}, this run's base {loaded}); point model.path at that base, or set "
                          "checkpoint.resume=false to start over")
    return restored._replace(state=with_base(restored.state, base))


def export(params: Any, model_config: DecoderConfig, out: str | os.PathLike, *, base_model: str = "") -> list[str]:
    """The HF export of the trained policy into ``out`` (merged weights); with LoRA also the PEFT
    adapter directory ``ADAPTER_EXPORT_DIR`` beside it, and, when ``base_model`` is empty (the base
    is no checkpoint on disk), the base as an HF directory ``BASE_EXPORT_DIR`` that the adapter
    names. Returns the directories written."""
    written = [save_hf_checkpoint(merged_params(params), model_config, out)]
    if isinstance(params, LoraParams):
        parent = os.path.dirname(os.path.abspath(os.fspath(out)))
        if not base_model:
            base_model = save_hf_checkpoint(params.base, model_config, os.path.join(parent, BASE_EXPORT_DIR))
            written.append(base_model)
        written.append(save_peft_adapter(params, model_config, os.path.join(parent, ADAPTER_EXPORT_DIR),
                                         base_model=base_model))
    return written
