"""Rematerialization policies of the decoder layer: what the backward pass keeps.

``jax.checkpoint`` around each layer of the scan trades memory for recompute. Besides JAX's
own policies, two keep the outputs of the fused attention forward (the attention output
and its softmax statistics, all its backward kernel reads besides q, k, v: cuDNN's on GPU,
the splash kernel's on TPU), so the backward pass never reruns the flash forward.
docs/benchmarks.md ("Train step") measures them all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from agentrl_jax.models.splash import RESIDUAL_NAME as _SPLASH_RESIDUALS

REMAT_POLICIES = ("none", "full", "dots_saveable", "attention_saveable", "dots_attention_saveable")
# The primitive of cuDNN's fused attention forward in jax._src.cudnn.fused_attention_stablehlo
# (jax 0.10-0.11; tests/models/test_models_layers.py checks on a GPU that the policy finds it).
_CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


def saves_attention(prim, *_, **params) -> bool:
    """Remat policy: keep what the fused attention forward returns (output, softmax stats):
    cuDNN's primitive, or the splash kernel's residuals, which it tags with
    ``checkpoint_name`` (a ``name`` primitive)."""
    if prim.name == "name":
        return params.get("name") == _SPLASH_RESIDUALS
    return prim.name == _CUDNN_ATTENTION_FORWARD


def remat_layer(fn: Callable, policy: str) -> Callable:
    """``fn`` under ``jax.checkpoint`` with the named policy.

    "none": no remat; "full": recompute the whole layer; "dots_saveable": keep matmul
    outputs; "attention_saveable": keep the fused attention forward's outputs; and
    "dots_attention_saveable": both, so only elementwise work is recomputed. On the XLA
    attention path there is no fused forward: "attention_saveable" equals "full" and
    "dots_attention_saveable" equals "dots_saveable".
    """
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {policy!r}")
    if policy == "none":
        return fn
    dots = jax.checkpoint_policies.dots_saveable
    saveable = {
        "full": None,
        "dots_saveable": dots,
        "attention_saveable": saves_attention,
        "dots_attention_saveable": jax.checkpoint_policies.save_from_both_policies(dots, saves_attention),
    }[policy]
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)
