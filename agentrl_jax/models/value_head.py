"""The critic's model: the policy's decoder trunk with a scalar value head in place of the LM head.

The trunk is the policy's ``Decoder`` (same layers, attention, remat, sharding rules); the LM
head is dropped (an untied ``lm_head`` [D, V] would be dead weight with optimizer state), and
``V(h_t) = h_t . w + b`` reads the final hidden state of every position. The head is a
[D] -> 1 projection, so unlike the logprobs nothing needs chunking: the [B, T, D] hidden
states are contracted in the compute dtype with float32 accumulation, no float32 copy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from agentrl_jax.models.decoder import Decoder
from agentrl_jax.sharding import DEFAULT_RULES, logical_sharding


class ValueModel(nnx.Module):
    """``values = model(input_ids, positions, **decoder_kwargs)``: [B, T] float32.

    Args:
      trunk: the decoder (its ``lm_head``, if any, is removed: the critic never computes logits).
      rngs: the head's initializer randomness.
    """

    def __init__(self, trunk: Decoder, *, rngs: nnx.Rngs):
        if hasattr(trunk, "lm_head"):
            del trunk.lm_head
        self.trunk = trunk
        hidden_size = trunk.config.hidden_size
        # std 1 / (D + 1), as OpenRLHF's value head: the values start near 0 (the final norm
        # makes |h| ~ sqrt(D)), a neutral baseline for outcome rewards, yet the trunk gets a
        # gradient from the first update (a zero head would leave it none).
        init = jax.random.normal(rngs.params(), (hidden_size,), jnp.float32) / (hidden_size + 1)
        self.value_head = nnx.Param(init, logical_axes=("embed",))
        self.value_bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

    def __call__(self, input_ids: jax.Array, positions: jax.Array, **decoder_kwargs: Any) -> jax.Array:
        hidden = self.trunk(input_ids, positions, **decoder_kwargs)
        head = self.value_head[...].astype(hidden.dtype)
        values = jnp.einsum("btd,d->bt", hidden, head, preferred_element_type=jnp.float32)
        return values + self.value_bias[...]


def value_model_from_policy(graphdef: nnx.GraphDef, params: nnx.State, *, seed: int = 0
                            ) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)`` of a critic whose trunk is a copy of the policy ``(graphdef, params)``.

    The trunk's params keep the policy's shardings (copies that own their buffers: the
    policy's update donates its own); the head is laid out by the same logical-axis rules
    on the params' mesh. ``seed``: the head's initialization.
    """
    trunk = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    critic = ValueModel(trunk, rngs=nnx.Rngs(seed))
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        rules = trunk.activation_rules or DEFAULT_RULES
        for name in ("value_head", "value_bias"):
            param = getattr(critic, name)
            axes = param.get_metadata()["logical_axes"]
            param.set_value(jax.device_put(param[...], logical_sharding(axes, sharding.mesh, rules, shape=param.shape)))
    return nnx.split(critic, nnx.Param)
