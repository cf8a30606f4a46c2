"""``lm_head_dtype``: the logits matmul in the compute dtype, on the trainer's and the engine's side.

"param" (the default) runs ``hidden @ E^T`` with the output embedding as stored (float32
params: a float32 matmul); "compute" casts it to the compute dtype first, like every other
weight. Checked against NumPy, for no change in a float32 model, for gradients that reach
the float32 params, and for the engine computing the very logits the trainer does.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.losses import token_logprobs
from agentrl_jax.models import Decoder, DecoderConfig, output_logits, split_params
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.sampling import next_token_logits
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

TIED = DecoderConfig(architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)


def _model(lm_head_dtype, dtype=jnp.bfloat16, config=TIED):
    return Decoder(config, dtype=dtype, param_dtype=jnp.float32, lm_head_dtype=lm_head_dtype, rngs=nnx.Rngs(0))


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_compute_lm_head_is_a_bf16_matmul_with_float32_logits():
    model = _model("compute")
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(5, 64)), jnp.bfloat16)
    table, layout = model.output_embedding()
    assert table.dtype == jnp.bfloat16 and model.embed[...].dtype == jnp.float32
    logits = output_logits(hidden, table, layout)
    assert logits.dtype == jnp.float32
    want = np.asarray(hidden, np.float64) @ _bf16(model.embed[...]).T  # bf16 inputs, exact products
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-6)
    # "param" multiplies by the float32 table: different numbers (by about the table's bf16 rounding)
    param_table, _ = _model("param").output_embedding()
    param_logits = np.asarray(output_logits(hidden, param_table, layout))
    np.testing.assert_allclose(param_logits, np.asarray(hidden, np.float64) @ np.asarray(param_table, np.float64).T,
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(param_logits, want, rtol=0, atol=1e-6)


def _plain_logits(hidden, table, layout):
    """The logits matmul left to autodiff (what ``output_logits`` was before its custom VJP)."""
    contraction = (((1,), (1,)), ((), ())) if layout == "vd" else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(hidden, table, contraction, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_logits_gradient_matmuls_run_in_the_forward_dtype(layout):
    """bf16 inputs: the float32 cotangent is rounded to bf16 once and both gradient matmuls
    take bf16 operands (autodiff would promote them to float32: TF32 on a GPU); the gradients
    equal NumPy's products of the rounded cotangent. Float32 or mixed inputs: autodiff's numbers."""
    rng = np.random.default_rng(4)
    cotangent = jnp.asarray(rng.normal(size=(6, 96)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(6, 64)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(size=(96, 64) if layout == "vd" else (64, 96)), jnp.bfloat16)

    def grads(fn, h, e):
        return jax.jit(jax.grad(lambda h, e: jnp.sum(fn(h, e, layout) * cotangent), argnums=(0, 1)))(h, e)

    program = jax.jit(jax.grad(lambda h, e: jnp.sum(output_logits(h, e, layout) * cotangent), (0, 1)))
    operand_types = re.findall(r"stablehlo.dot_general .*: \((.*)\) ->", program.lower(hidden, table).as_text())
    # the two gradient matmuls (the loss is linear in the logits: the forward one is dead code)
    assert len(operand_types) == 2 and all("f32" not in t for t in operand_types), operand_types
    d_hidden, d_table = grads(output_logits, hidden, table)
    g, h, e = _bf16(cotangent), np.asarray(hidden, np.float64), np.asarray(table, np.float64)
    e_vd = e if layout == "vd" else e.T
    np.testing.assert_allclose(np.asarray(d_hidden, np.float64), g @ e_vd, rtol=1e-2, atol=1e-2)
    want_table = g.T @ h if layout == "vd" else h.T @ g
    np.testing.assert_allclose(np.asarray(d_table, np.float64), want_table, rtol=1e-2, atol=1e-2)
    for h_dtype, e_dtype in ((jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32)):
        args = hidden.astype(h_dtype), table.astype(e_dtype)
        for a, b in zip(grads(output_logits, *args), grads(_plain_logits, *args), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


def _loss_and_grads(model):
    """Mean NLL of random targets from random hidden states, and its gradients (params, hidden)."""
    graphdef, params = split_params(model)
    hidden = jnp.asarray(np.random.default_rng(3).normal(size=(2, 12, 64)), model.dtype)

    def loss(p, h):
        table, layout = nnx.merge(graphdef, p).output_embedding()
        return -jnp.mean(token_logprobs(h, table, IDS, chunk_size=8, embedding_layout=layout))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, hidden)


def test_compute_lm_head_changes_nothing_in_a_float32_model():
    (l0, g0), (l1, g1) = (_loss_and_grads(_model(h, dtype=jnp.float32)) for h in ("param", "compute"))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_compute_lm_head_gradients_reach_the_float32_params():
    (l0, g0), (l1, g1) = (_loss_and_grads(_model(h)) for h in ("param", "compute"))
    assert float(l1) == pytest.approx(float(l0), rel=1e-2)
    param_grads, hidden_grad = g1
    assert {a.dtype for a in jax.tree.leaves(param_grads)} == {jnp.dtype(jnp.float32)}
    assert hidden_grad.dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all() and np.linalg.norm(a - b) <= 3e-2 * np.linalg.norm(b) + 1e-7


@pytest.mark.parametrize("tied", [True, False])
def test_engine_computes_the_trainers_logits(tied):
    """The engine stores the output embedding in the compute dtype (as every layer weight, which the
    decode forward casts there before use anyway): its logits (sampling, reported logprobs) are the
    trainer's to the bit, and a tied table's input lookup is unchanged."""
    model = _model("compute", config=dataclasses.replace(TIED, tie_word_embeddings=tied))
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=2,
                    max_target_length=32, max_prefill_length=16, min_prefill_bucket=16, attend_granule=16,
                    cache_dtype=None)
    params = engine.load_params(model)
    table, layout = params.output_embedding()
    assert table.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(params.layers)} == {jnp.dtype(jnp.bfloat16)}
    hidden = jnp.asarray(np.random.default_rng(2).normal(size=(3, 64)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(next_token_logits(hidden, table, layout)),
                                  np.asarray(output_logits(hidden, *model.output_embedding())))
    np.testing.assert_array_equal(np.asarray(jnp.take(params.embed, IDS, axis=0).astype(jnp.bfloat16), np.float32),
                                  np.asarray(jnp.take(model.embed[...], IDS, axis=0).astype(jnp.bfloat16), np.float32))
    assert _model("param").lm_head_dtype == "param"
    with pytest.raises(ValueError, match="lm_head_dtype"):
        _model("bfloat16")
