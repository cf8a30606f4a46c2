"""Packed rows == padded rows: logprobs, losses, gradients; token-budget micro-batches == one batch.

Everything runs the real tiny decoder in float32 on CPU (XLA attention with the segment
mask); the padded baseline runs the mask-free ``lengths`` path, so the two layouts share
no attention code.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_decoder import tiny_decoder

from agentrl_jax.losses import global_normalizer
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.layers import segment_table
from agentrl_jax.train.batch import TokenRecord, build_batch
from agentrl_jax.train.packing import (
    pack_arrays,
    packed_logprobs,
    packing_stats,
    plan_packing,
    segment_bound,
    unpack,
)
from agentrl_jax.train.sft import batch_arrays, run_sft, sft_settings
from agentrl_jax.train.step import (
    LossSettings,
    forward_logprobs,
    init_train_state,
    policy_loss,
    update_step,
)

FIELDS = ("input_ids", "positions", "segment_ids", "targets", "loss_mask", "advantages", "sequence_ids",
          "rollout_logprobs", "params_versions")


_tiny = functools.lru_cache(maxsize=1)(tiny_decoder)


LENGTHS = (5, 19, 11, 3, 24, 8, 14, 2, 17, 9)


def _padded(lengths=LENGTHS, row_length=32, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for n in lengths:
        mask = (np.arange(n) >= min(2, n - 1)).astype(int)
        lp = np.where(mask, -rng.random(n), 0.0)
        recs.append(TokenRecord(rng.integers(1, 64, n).tolist(), mask.tolist(), lp.tolist(), [3] * n,
                                (mask * rng.normal()).tolist()))
    batch = build_batch(recs, row_length=row_length)
    return {k: np.asarray(getattr(batch, k)) for k in FIELDS}


def _lengths(padded):
    return padded["segment_ids"].sum(axis=1)


def test_plan_is_first_fit_decreasing_deterministic_and_bounded():
    lengths = [7, 3, 9, 3, 4, 0]
    plan = plan_packing(lengths, 10, padded_length=16)
    assert plan.rows == ((2,), (0, 1), (4, 3))  # 9 | 7+3 | 4+3 (ties keep input order); row 5 is empty
    assert plan == plan_packing(lengths, 10, padded_length=16)
    np.testing.assert_array_equal(plan.segment_ids()[1], [1] * 7 + [2] * 3)
    capped = plan_packing([1] * 5, 10, padded_length=4, max_segments=2)
    assert [len(r) for r in capped.rows] == [2, 2, 1]
    micro = plan_packing(lengths, 10, padded_length=16, micro_batch_tokens=20, row_multiple=2)
    assert (micro.rows_per_micro, micro.num_rows, micro.num_micro_batches) == (2, 4, 2)
    with pytest.raises(ValueError, match="more than the packed row length 8"):
        plan_packing(lengths, 8, padded_length=16)
    stats = packing_stats(plan)
    assert plan.num_rows == 4 and stats["pack/fill"] == pytest.approx(26 / 40)  # 3 rows, bucketed to 4


def test_segment_bound_is_the_most_trajectories_of_a_row_rounded_up_to_a_power_of_two():
    """The attention kernel is compiled for the rows the plan holds, not for ``max_segments``
    (cuDNN's packed backward scratch grows with the bound times the row length)."""
    assert plan_packing([7, 3, 9, 3, 4], 10, padded_length=16).segment_bound == 2  # 9 | 7+3 | 4+3
    assert plan_packing([9, 8, 10], 10, padded_length=16).segment_bound == 1  # one trajectory per row
    assert plan_packing([2] * 5, 10, padded_length=4).segment_bound == 8  # five in one row
    assert plan_packing([2] * 5, 10, padded_length=4, max_segments=5).segment_bound == 5  # never above the cap
    assert plan_packing([0, 0], 10, padded_length=4).segment_bound == 1  # nothing to pack
    assert (segment_bound(3), segment_bound(64), segment_bound(65)) == (4, 64, 0)  # 0: more than the kernel's cap


@pytest.mark.parametrize("lengths", [(30, 28, 25, 31), (5, 19, 11, 3, 24, 8, 14, 2)])
def test_sft_on_its_segment_bound_equals_the_segment_mask(lengths):
    """``run_sft`` compiles the attention for the batch's segment bound (one conversation per
    row: the mask-free path; several: the packed kernel, the segment mask on CPU): one SFT
    update equals the segment-mask update of the same batch."""
    graphdef, params = _tiny()
    rng = np.random.default_rng(3)
    records = [TokenRecord(rng.integers(1, 64, n).tolist(), [0, 0] + [1] * (n - 2), [0.0] * n, [-1] * n,
                           [0.0, 0.0] + [1.0] * (n - 2)) for n in lengths]
    opt = optax.sgd(0.5)
    got, _ = run_sft(init_train_state(jax.tree.map(jnp.copy, params), opt, 0), graphdef=graphdef, optimizer=opt, records=records, steps=1,
                     batch_size=len(records), row_length=32, seed=0)
    batch = build_batch(records, pack=True, row_length=32)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=sft_settings(),
                                     num_micro_batches=1, num_sequences=len(records)))
    want, _ = step(init_train_state(params, opt, 0), batch_arrays(batch),
                   global_normalizer(jnp.asarray(batch.loss_mask), "token-mean"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0),
                 got.params, want.params)
    assert not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), got.params, params))


def test_rows_of_one_trajectory_run_mask_free_and_equal_the_segment_mask():
    """Segment bound 1 routes packed rows to the mask-free ``lengths`` attention: the same
    logprobs as the segment-mask path, and the very program of padded rows."""
    graphdef, params = _tiny()
    padded = _padded(lengths=(24, 30, 17), row_length=32)
    plan = plan_packing(_lengths(padded), 32, padded_length=32)
    assert plan.segment_bound == 1
    packed = {k: jnp.asarray(v) for k, v in pack_arrays(plan, padded).items()}
    fwd = functools.partial(forward_logprobs, graphdef, temperature=0.7, packed=True)
    mask_free, masked = (functools.partial(fwd, max_segments=m) for m in (1, 0))
    real = packed["segment_ids"] > 0
    np.testing.assert_allclose(np.asarray(jax.jit(mask_free)(params, packed))[real],
                               np.asarray(jax.jit(masked)(params, packed))[real], atol=1e-5, rtol=0)
    program = lambda fn: str(jax.make_jaxpr(fn)(params, packed))
    padded_rows = functools.partial(forward_logprobs, graphdef, temperature=0.7)
    assert program(mask_free) == program(padded_rows) != program(masked)


def test_pack_unpack_round_trip_and_layout():
    padded = _padded()
    plan = plan_packing(_lengths(padded), 32, padded_length=32, max_segments=3)
    packed = pack_arrays(plan, padded)
    assert packed["input_ids"].shape == (plan.num_rows, 32) and plan.num_rows < len(LENGTHS)
    for name in ("input_ids", "targets", "loss_mask", "advantages", "rollout_logprobs", "params_versions"):
        real = padded["segment_ids"] > 0
        back = unpack(plan, packed[name], fill=-7)
        np.testing.assert_array_equal(back[real], padded[name][real], err_msg=name)
        assert (back[~real] == -7).all()
    # Positions restart per segment; targets never cross a segment; padding has params_version -1.
    for r in range(plan.num_rows):
        for seg in set(packed["segment_ids"][r]) - {0}:
            idx = np.flatnonzero(packed["segment_ids"][r] == seg)
            np.testing.assert_array_equal(packed["positions"][r, idx], np.arange(len(idx)))
            assert packed["loss_mask"][r, idx[-1]] == 0
    assert (packed["params_versions"][packed["segment_ids"] == 0] == -1).all()
    np.testing.assert_array_equal(np.asarray(unpack(plan, jnp.asarray(packed["loss_mask"]))), padded["loss_mask"])
    # the fused kernel's segment table
    offsets, seg_lengths = segment_table(jnp.asarray(packed["segment_ids"]), 3)
    for r, members in enumerate(plan.rows):
        want = [int(_lengths(padded)[i]) for i in members]
        np.testing.assert_array_equal(np.asarray(seg_lengths[r]), want + [-1] * (3 - len(want)))
        np.testing.assert_array_equal(np.asarray(offsets[r]), list(np.cumsum([0] + want[:-1])) + [-1] * (4 - len(want)))


@pytest.mark.parametrize("chunk_size", [1024, 7])
def test_packed_logprobs_equal_padded(chunk_size):
    graphdef, params = _tiny()
    padded = _padded()
    plan = plan_packing(_lengths(padded), 48, padded_length=32)
    packed = pack_arrays(plan, padded)
    fwd = jax.jit(forward_logprobs, static_argnums=0, static_argnames=("temperature", "chunk_size", "with_entropy",
                                                                        "packed"))
    kw = dict(temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    lp_pad, ent_pad = fwd(graphdef, params, {k: jnp.asarray(v) for k, v in padded.items()}, **kw)
    lp_pack, ent_pack = fwd(graphdef, params, {k: jnp.asarray(v) for k, v in packed.items()}, packed=True, **kw)
    real = padded["segment_ids"] > 0
    for a, b in ((lp_pad, lp_pack), (ent_pad, ent_pack)):
        np.testing.assert_allclose(np.asarray(unpack(plan, b))[real], np.asarray(a)[real], atol=1e-5, rtol=0)
    if chunk_size == 7:  # the trainer's route: plan, pack, micro-batches of 96 tokens, unpack
        bounds = []

        def forward(p, arrays, bound):
            assert all(isinstance(v, jax.Array) for v in arrays.values())
            bounds.append(bound)
            return fwd(graphdef, p, arrays, packed=True, **kw)[0]

        inputs = {k: padded[k] for k in ("input_ids", "positions", "segment_ids", "targets")}
        got = packed_logprobs(forward, params, inputs, row_tokens=48, micro_batch_tokens=96)
        assert isinstance(got, jax.Array) and got.shape == padded["input_ids"].shape  # stays on the device
        got = np.asarray(got)
        np.testing.assert_allclose(got[real], np.asarray(lp_pad)[real], atol=1e-5, rtol=0)
        assert (got[~real] == 0).all()
        assert bounds and set(bounds) == {plan_packing(_lengths(padded), 48, padded_length=32).segment_bound}


def _grads(settings, arrays, normalizer, num_sequences, micro_rows):
    """Summed gradients (and loss) of ``policy_loss`` over micro-batches of ``micro_rows`` rows."""
    graphdef, params = _tiny()
    grad_fn = jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnums=(1, 4, 5))
    total, loss = None, 0.0
    for start in range(0, arrays["input_ids"].shape[0], micro_rows):
        micro = {k: jnp.asarray(v[start : start + micro_rows]) for k, v in arrays.items()}
        (value, _), g = grad_fn(params, graphdef, micro, normalizer, settings, num_sequences)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
        loss += float(value)
    return loss, total


def test_packed_loss_and_gradients_equal_padded_and_micro_batches_equal_one_batch():
    """GSPO (a sequence-level ratio) with seq-mean-token-mean: both need the sequence ids."""
    padded = _padded()
    padded["old_logprobs"] = padded["rollout_logprobs"] + 0.05 * padded["loss_mask"]
    z = global_normalizer(jnp.asarray(padded["loss_mask"]), "seq-mean-token-mean")
    common = dict(loss="gspo", aggregation="seq-mean-token-mean", temperature=0.7, entropy_coef=0.01, chunk_size=16)
    ref_loss, ref_grads = _grads(LossSettings(**common), padded, z, None, len(LENGTHS))
    # the padded reference is one batch of 10 rows; packed: 2 micro-batches of 64 tokens (2 rows of 32)
    plan = plan_packing(_lengths(padded), 32, padded_length=32, micro_batch_tokens=64)
    assert plan.num_micro_batches == 2
    packed = pack_arrays(plan, padded)
    got_loss, got_grads = _grads(LossSettings(**common, packed=True), packed, z, len(LENGTHS), plan.rows_per_micro)
    assert got_loss == pytest.approx(ref_loss, abs=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0),
                 got_grads, ref_grads)


def test_padding_invariance():
    """More padding per row and extra empty rows change no logprob of a real token."""
    graphdef, params = _tiny()
    padded = _padded()
    real = padded["segment_ids"] > 0
    out = []
    for row_length, multiple in ((32, 1), (64, 4)):
        plan = plan_packing(_lengths(padded), row_length, padded_length=32, row_multiple=multiple)
        packed = {k: jnp.asarray(v) for k, v in pack_arrays(plan, padded).items()}
        logp = jax.jit(forward_logprobs, static_argnums=0, static_argnames=("temperature", "packed"))(
            graphdef, params, packed, temperature=1.0, packed=True)
        out.append(np.asarray(unpack(plan, logp))[real])
    assert plan.num_rows == 4 and len(plan.rows) == 2
    np.testing.assert_allclose(out[0], out[1], atol=1e-5, rtol=0)


def test_on_policy_old_logprobs_from_the_update_forward_equal_a_separate_pass():
    """One minibatch, one epoch, sampled by these params: ``old = sg(logp)`` of the update's own
    forward gives the same update as a separate old-logprob forward."""
    graphdef, params = _tiny()
    padded = _padded()
    plan = plan_packing(_lengths(padded), 32, padded_length=32, micro_batch_tokens=64)
    arrays = {k: jnp.asarray(v) for k, v in pack_arrays(plan, padded).items()}
    base = dict(loss="ppo", aggregation="seq-mean-token-mean", chunk_size=16, packed=True, correction="tis",
                correction_hparams=(("cap", 2.0), ("level", "token")))
    z = global_normalizer(jnp.asarray(padded["loss_mask"]), "seq-mean-token-mean")
    opt = optax.sgd(0.1)
    separate = dict(arrays, old_logprobs=jax.jit(forward_logprobs, static_argnums=0, static_argnames=(
        "temperature", "packed"))(graphdef, params, arrays, temperature=1.0, packed=True))
    out = []
    for settings, batch in ((LossSettings(**base), separate), (LossSettings(**base, old_from_current=True), arrays)):
        step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=settings,
                                         num_micro_batches=plan.num_micro_batches, num_sequences=len(LENGTHS)))
        out.append(step(init_train_state(params, opt, 0), batch, z))
    (s1, m1), (s2, m2) = out
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac"):
        if key in m1:
            assert float(m1[key]) == pytest.approx(float(m2[key]), abs=1e-6), key
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0),
                 s1.params, s2.params)
    assert float(m1["grad_norm"]) > 0


def _avals(jaxpr):
    """Every intermediate aval of a jaxpr, inside scans, maps, checkpoints and conds too."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


def test_long_packed_row_has_no_float32_token_by_vocab_array_forward_or_backward():
    """A 32k-token packed row at Qwen's 152k vocabulary: the update's whole forward and
    backward (decoder, chunked logprobs + entropy, loss) never holds more than one chunk of
    float32 logits. Traced only (abstract shapes): nothing of this size is allocated."""
    vocab, rows, row_length, chunk = 151936, 1, 32768, 1024
    cfg = DecoderConfig(
        architecture="qwen3", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=row_length,
    )
    graphdef, params = nnx.eval_shape(lambda: split_params(Decoder(cfg, rngs=nnx.Rngs(0))))
    ints = jax.ShapeDtypeStruct((rows, row_length), jnp.int32)
    floats = jax.ShapeDtypeStruct((rows, row_length), jnp.float32)
    micro = {k: ints for k in ("input_ids", "positions", "segment_ids", "targets", "sequence_ids")}
    micro.update({k: floats for k in ("loss_mask", "advantages", "old_logprobs", "rollout_logprobs")})
    settings = LossSettings(loss="ppo", aggregation="seq-mean-token-mean", entropy_coef=0.01, chunk_size=chunk,
                            packed=True)
    grad_fn = jax.grad(lambda p, m: policy_loss(p, graphdef, m, jnp.float32(1.0), settings, 64)[0])
    jaxpr = jax.make_jaxpr(grad_fn)(params, micro)
    vocab_arrays = [a for a in _avals(jaxpr.jaxpr) if vocab in getattr(a, "shape", ())]
    assert any(a.shape == (chunk, vocab) and a.dtype == jnp.float32 for a in vocab_arrays)  # the check sees chunks
    largest = max(int(np.prod(a.shape)) // vocab for a in vocab_arrays)
    assert largest <= chunk, [a.shape for a in vocab_arrays if int(np.prod(a.shape)) // vocab > chunk]
