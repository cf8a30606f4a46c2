"""The engine's decode attention on TPU: which one `choose_decode_attention` picks per platform,
and an engine decoding through the TPU kernel (in Pallas's TPU interpreter) == the XLA one."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW, TINY

from agentrl_jax.rollout.decode_step import choose_decode_attention, choose_prefill_attention
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.paged_prefill import Admission, PrefillRow
from agentrl_jax.rollout.sampling import SamplingParams, request_key
from agentrl_jax.sharding import make_mesh


def _on(platform: str, devices: int = 4):
    """A stand-in for a mesh of ``platform`` devices: the choice reads only their platform."""
    return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)] * devices))


def _model(head_dim: int, dtype=jnp.bfloat16):
    """The choice reads the model's config and compute dtype only."""
    return types.SimpleNamespace(config=dataclasses.replace(TINY, head_dim=head_dim), dtype=dtype)


def test_tpu_picks_its_kernel_where_the_shapes_fit():
    bf16 = _model(128)
    assert choose_decode_attention(None, bf16, _on("tpu"), 16) == "pallas_tpu"
    assert choose_decode_attention("pallas", bf16, _on("tpu"), 32) == "pallas_tpu"  # the backend's kernel
    assert choose_decode_attention("xla", bf16, _on("tpu"), 16) == "xla"
    assert choose_decode_attention(None, _model(128, jnp.float32), _on("tpu"), 8) == "pallas_tpu"  # f32 tiles: 8 rows
    assert choose_decode_attention(None, bf16, _on("tpu"), 8, jnp.float32) == "pallas_tpu"  # the cache dtype counts
    assert choose_decode_attention(None, bf16, _on("tpu"), 8) == "xla"  # half a bf16 tile: falls back
    assert choose_decode_attention(None, _model(64), _on("tpu"), 16) == "xla"  # half the lanes
    with pytest.raises(ValueError, match="head_dim=64 and page_size=16"):
        choose_decode_attention("pallas", _model(64), _on("tpu"), 16)


def test_other_platforms_keep_their_choice():
    bf16 = _model(128)
    assert choose_decode_attention(None, bf16, _on("gpu"), 16) == "pallas"  # the GPU kernel
    assert choose_decode_attention(None, bf16, _on("cpu"), 16) == "xla"
    assert choose_decode_attention("pallas", bf16, _on("cpu"), 16) == "pallas"  # the GPU kernel, interpreted
    assert choose_decode_attention("pallas_tpu", _model(8), _on("cpu"), 4) == "pallas_tpu"  # interpreted: any shape
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        choose_decode_attention("mosaic", bf16, _on("tpu"), 16)


def test_the_prefill_kernel_is_the_gpu_one_only():
    """There is no TPU prefill kernel: a TPU mesh prefills with XLA by default, even where its
    decode takes the TPU kernel; a GPU mesh takes the Pallas prefill where its decode kernel fits."""
    bf16 = _model(128)
    assert choose_prefill_attention(None, bf16, _on("tpu"), 16) == "xla"
    assert choose_prefill_attention(None, bf16, _on("gpu"), 16) == "pallas"
    assert choose_prefill_attention(None, _model(128, jnp.float32), _on("gpu"), 16) == "xla"
    assert choose_prefill_attention(None, bf16, _on("cpu"), 16) == "xla"
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        choose_prefill_attention("pallas_tpu", bf16, _on("tpu"), 16)
    with pytest.raises(ValueError, match="GPU .Triton. kernel"):
        choose_prefill_attention("pallas", bf16, _on("tpu"), 16)
    assert choose_prefill_attention("pallas", bf16, _on("cpu"), 16) == "pallas"  # interpreted: tests


def _decode(engine, model, prompts, steps):
    """Prefill ``prompts`` into slots 0.., then ``steps`` dispatches of 4 greedy steps: tokens, logprobs [S, 4n]."""
    params, state = engine.load_params(model), engine.init_decode_state()
    rows = []
    for slot, prompt in enumerate(prompts):
        pages = engine.pages.alloc(0, -(-len(prompt) // engine.page_size))
        admission = Admission(slot, pages, np.asarray(request_key(slot, 0)), 0, SamplingParams(temperature=0.0))
        rows.append(PrefillRow(0, pages, 0, np.asarray(prompt, np.int32), [admission]))
    state, _ = engine.prefill_insert(params, state, rows)
    tokens, logprobs = [], []
    for _ in range(steps):
        state, result = engine.generate(params, state, num_steps=4)
        tokens.append(np.asarray(result.tokens)[:, :len(prompts)])
        logprobs.append(np.asarray(result.log_prob)[:, :len(prompts)])
    return np.concatenate(tokens).T, np.concatenate(logprobs).T


@pytest.mark.slow
def test_engine_decoding_through_the_tpu_kernel_equals_the_xla_one(tiny_model):
    """Three slots of ragged prompt lengths over pages of 4 (pages grow as they decode), the
    fourth slot inactive: greedy tokens equal, logprobs within 1e-5 (float32)."""
    prompts = [[3, 17, 42, 8, 99, 5, 60], [11, 12], list(range(20, 33))]
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    got = _decode(Engine(tiny_model, mesh=mesh, page_size=4, decode_attention="pallas_tpu", **ENGINE_KW),
                  tiny_model, prompts, steps=2)
    want = _decode(Engine(tiny_model, mesh=mesh, page_size=4, decode_attention="xla", **ENGINE_KW),
                   tiny_model, prompts, steps=2)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
