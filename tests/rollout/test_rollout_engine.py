"""Engine: teacher-forced parity, exact trainer logprobs, batch/slot invariance, prefix extension,
group prefill, sharded == single-device."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_helpers import ENGINE_KW, TINY, make_model, teacher_forced

from agentrl_jax.losses.logprobs import token_logprobs
from agentrl_jax.models import Decoder
from agentrl_jax.rollout.jetstream import DensePrefixEngine
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.rollout.state import attend_bucket
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

STEPS = 4
GREEDY = SamplingParams(temperature=0.0)


def run_requests(engine, params, prompts, slots, sampler, dispatches=2):
    """Prefill each prompt into its slot, decode `dispatches * STEPS` steps; per-request tokens/logprobs."""
    state = engine.init_decode_state()
    out = {}
    for prompt, slot in zip(prompts, slots):
        prefix, first = engine.prefill(params=params, padded_tokens=prompt, true_length=len(prompt), sampler=sampler)
        state = engine.insert(prefix, state, slot)
        out[slot] = ([int(first.tokens[0])], [float(first.log_prob[0])])
    for _ in range(dispatches):
        state, result = engine.generate(params, state, num_steps=STEPS)
        result = result.convert_to_numpy()
        for slot in slots:
            assert result.valid[:, slot].all()
            out[slot][0].extend(result.tokens[:, slot].tolist())
            out[slot][1].extend(result.log_prob[:, slot].tolist())
    return [out[s] for s in slots]


def trainer_logprobs(model, prompt, generated, temperature):
    seq = np.concatenate([prompt, generated]).astype(np.int32)
    hidden = teacher_forced(model, seq)
    table, layout = model.output_embedding()
    targets = jnp.asarray(seq[1:])[None]
    logp = token_logprobs(hidden[:, :-1], table, targets, temperature=temperature, embedding_layout=layout)
    return np.asarray(logp[0, len(prompt) - 1 :]), np.asarray(model.logits(hidden)[0])


PROMPT = np.array([3, 17, 42, 8, 99, 5, 60], np.int32)


def test_greedy_matches_teacher_forced_argmax_and_trainer_logprobs(engine, params, tiny_model):
    [(tokens, logprobs)] = run_requests(engine, params, [PROMPT], [0], GREEDY)
    assert len(tokens) == 1 + 2 * STEPS
    ref_logp, logits = trainer_logprobs(tiny_model, PROMPT, tokens, 1.0)
    argmax = np.argmax(logits, -1)[len(PROMPT) - 1 : -1]
    np.testing.assert_array_equal(tokens, argmax)
    assert len(set(tokens)) > 1, "degenerate model: greedy repeats one token"
    np.testing.assert_allclose(logprobs, ref_logp, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_trainer_logprobs(engine, params, tiny_model, temperature):
    sampler = SamplingParams(temperature=temperature, seed=123)
    [(tokens, logprobs)] = run_requests(engine, params, [PROMPT], [1], sampler)
    ref_logp, logits = trainer_logprobs(tiny_model, PROMPT, tokens, temperature)
    np.testing.assert_allclose(logprobs, ref_logp, atol=1e-5)
    # the sampled sequence is not the greedy one (the sampler really samples)
    assert tokens != list(np.argmax(logits, -1)[len(PROMPT) - 1 : -1])


def test_greedy_independent_of_batch_and_slot_order(engine, params):
    other_a = np.array([9, 9, 1, 2], np.int32)
    other_b = np.arange(20, 40, dtype=np.int32)
    alone = run_requests(engine, params, [PROMPT], [0], GREEDY)[0]
    crowded = run_requests(engine, params, [other_b, PROMPT, other_a], [0, 3, 2], GREEDY)[1]
    assert alone[0] == crowded[0]
    # GPU GEMMs reduce in a batch-dependent order (~4e-6 seen on an H200); CPU agrees to 1e-7
    np.testing.assert_allclose(alone[1], crowded[1], atol=1e-5)


def test_seeded_sampling_independent_of_slot(engine, params):
    sampler = SamplingParams(temperature=1.0, seed=7)
    a = run_requests(engine, params, [PROMPT], [0], sampler)[0]
    b = run_requests(engine, params, [np.array([1, 2, 3], np.int32), PROMPT], [1, 2], sampler)[1]
    assert a[0] == b[0]


def test_extending_prefix_equals_prefill_from_scratch(engine, params):
    """Turn 1 decodes, its KV row is extracted, turn 2 prefills only [last token] + observation."""
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, padded_tokens=PROMPT, true_length=len(PROMPT), sampler=GREEDY)
    state = engine.insert(prefix, state, 2)
    state, result = engine.generate(params, state, num_steps=STEPS)
    turn1 = [int(first.tokens[0])] + np.asarray(result.tokens[:, 2]).tolist()
    observation = np.array([70, 71, 72, 73, 74], np.int32)
    # turn-1 tokens except the last are in the cache (with N-step dispatch, later ones may be too)
    kept = engine.extract_prefix(state, 2, length=len(PROMPT) + len(turn1) - 1, generated=len(turn1))
    new_tokens = np.concatenate([[turn1[-1]], observation]).astype(np.int32)
    prefix2, first2 = engine.prefill(
        params=params, existing_prefix=kept, padded_tokens=new_tokens, true_length=len(new_tokens), sampler=GREEDY
    )
    state = engine.insert(prefix2, state, 0)
    state, result2 = engine.generate(params, state, num_steps=STEPS)
    extended = ([int(first2.tokens[0])] + np.asarray(result2.tokens[:, 0]).tolist(),
                [float(first2.log_prob[0])] + np.asarray(result2.log_prob[:, 0]).tolist())

    whole = np.concatenate([PROMPT, turn1, observation]).astype(np.int32)
    [scratch] = run_requests(engine, params, [whole], [1], GREEDY, dispatches=1)
    assert extended[0] == scratch[0]
    np.testing.assert_allclose(extended[1], scratch[1], atol=1e-5)


def test_group_prefill_bulk_insert(engine, params):
    """One prefill, G=4 slots: each sample has its own key; sample 0 equals the lone request."""
    sampler = SamplingParams(temperature=1.0, seed=5)
    prefix, first = engine.prefill(
        params=params, padded_tokens=PROMPT, true_length=len(PROMPT), sampler=sampler, num_samples=4
    )
    assert first.tokens.shape == (4,)
    state = engine.bulk_insert(prefix, engine.init_decode_state(), [3, 1, 0, 2])
    state, result = engine.generate(params, state, num_steps=STEPS)
    samples = [[int(first.tokens[g])] + np.asarray(result.tokens[:, s]).tolist() for g, s in enumerate([3, 1, 0, 2])]
    assert len({tuple(s) for s in samples}) > 1, "group samples are identical"
    lone = run_requests(engine, params, [PROMPT], [0], sampler, dispatches=1)[0]
    assert samples[0] == lone[0]
    with pytest.raises(ValueError, match="num_samples"):
        engine.bulk_insert(prefix, state, [0, 1])


def test_too_long_prompt_errors(engine, params):
    with pytest.raises(ValueError, match="max_prefill_length"):
        engine.prefill(params=params, padded_tokens=np.zeros(40, np.int32), true_length=40)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_decoding_equals_single_device(engine, params, tiny_model):
    mesh = make_mesh({"data": 2, "tensor": 4})
    sharded = DensePrefixEngine(tiny_model, mesh=mesh, **ENGINE_KW)
    sharded_params = sharded.load_params(tiny_model)
    state = sharded.init_decode_state()
    assert state.cache.k[0].sharding.spec[:2] == ("data", "tensor")
    wqkv = sharded_params.layers[0]["wqkv"]  # [D, KV, G + 2, K]: whole kv-head groups per tensor shard
    assert wqkv.sharding.spec[1] == "tensor" and wqkv.addressable_shards[0].data.shape[1] == 1
    prompts = [PROMPT, np.arange(30, 50, dtype=np.int32)]
    ref = run_requests(engine, params, prompts, [1, 2], GREEDY)
    got = run_requests(sharded, sharded_params, prompts, [1, 2], GREEDY)
    for r, g in zip(ref, got):
        assert r[0] == g[0]
        np.testing.assert_allclose(r[1], g[1], atol=1e-5)


def test_sampling_params_are_arrays_no_recompile(engine, params, tiny_model):
    """top_k=1 at temperature 0.9 decodes the greedy tokens, reports the tau=0.9 trainer logprob and a
    truncated logprob of 0; changing temperature/top-k/top-p reuses the compiled step (one program
    with the top-k / top-p path, compiled when a slot first truncates)."""
    greedy_tokens = run_requests(engine, params, [PROMPT], [0], GREEDY, dispatches=1)[0][0]

    def run(samplers):
        state = engine.init_decode_state()
        for slot, sampler in enumerate(samplers):
            prefix, _ = engine.prefill(params=params, padded_tokens=PROMPT, true_length=len(PROMPT), sampler=sampler)
            assert bool(prefix.truncating) == sampler.truncates
            prefix = jax.device_put(prefix, engine.get_prefix_destination_sharding(prefix.capacity))  # as JetStream moves it
            state = engine.insert(prefix, state, slot)
            if slot == 0:
                first = prefix
        state, result = engine.generate(params, state, num_steps=STEPS)
        return [int(first.first_tokens[0])] + np.asarray(result.tokens[:, 0]).tolist(), result

    run([SamplingParams(0.8, top_k=1, seed=4), SamplingParams(0.6, top_p=0.4, seed=5), SamplingParams(1.2, seed=6)])
    compiled = {key: fn._cache_size() for key, fn in engine._generate_fns.items()}
    tokens, result = run(
        [SamplingParams(0.9, top_k=1, seed=1), SamplingParams(0.5, top_p=0.3, seed=2), SamplingParams(1.5, seed=3)]
    )
    assert {key: fn._cache_size() for key, fn in engine._generate_fns.items()} == compiled
    assert tokens == greedy_tokens
    np.testing.assert_allclose(np.asarray(result.truncated_log_prob[:, 0]), 0.0, atol=1e-6)
    ref_logp, _ = trainer_logprobs(tiny_model, PROMPT, tokens, 0.9)
    np.testing.assert_allclose(np.asarray(result.log_prob[:, 0]), ref_logp[1:], atol=1e-5)


def test_weights_are_stored_in_the_compute_dtype_with_the_same_results():
    """A bf16-compute model with float32 master params: the engine keeps its layer weights in bf16
    (half the bytes a decode step reads) and samples what float32-stored weights give, since the
    decode forward casts every weight to the compute dtype before use; the untied lm head keeps
    float32 (``lm_head_dtype="param"``: float32 logits).

    Bitwise on CPU. On a GPU the two programs differ (the float32 weights' casts fuse into XLA's
    GEMMs, which may then tile and accumulate differently), so a bf16 product can round the
    other way: the same tokens, logprobs within 5e-3 (measured: 1.7e-3 at most on an H200). A
    weight left in float32, or the lm head cast to bf16, moves them by about 1e-2 or more."""
    model = Decoder(TINY, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    engine = DensePrefixEngine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **ENGINE_KW)
    stored = engine.load_params(model)
    assert {x.dtype for x in jax.tree.leaves(stored.layers)} == {jnp.dtype(jnp.bfloat16)}
    assert stored.lm_head.dtype == jnp.float32
    sampler = SamplingParams(1.0, seed=7)
    got = run_requests(engine, stored, [PROMPT, PROMPT[:3]], [0, 2], sampler, dispatches=1)
    want = run_requests(engine, engine.load_params(model, dtype=jnp.float32), [PROMPT, PROMPT[:3]], [0, 2], sampler,
                        dispatches=1)
    if jax.default_backend() == "cpu":
        assert got == want
    else:
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=5e-3)


def test_attend_bucket_edges():
    assert [attend_bucket(n, 10_000) for n in (1, 256, 257, 1024, 1025, 2048, 2049, 4097)] == [
        256, 256, 512, 1024, 1280, 2048, 2560, 5120
    ]
    assert attend_bucket(300, 300) == 300  # never past the cache
    assert [attend_bucket(n, 64, granule=16) for n in (1, 16, 17, 33, 63)] == [16, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="length"):
        attend_bucket(0, 64)


def test_window_covers_a_slot_that_crosses_a_bucket_inside_a_dispatch(engine, params, tiny_model):
    """A 13-token slot decoding 4 steps reaches entry 16: the window must be 32, not 16, and a
    longer slot that was freed must not widen it. Tokens equal the full-cache window's."""
    prompt = np.arange(40, 53, dtype=np.int32)
    state = engine.init_decode_state()
    long_prefix, _ = engine.prefill(params=params, padded_tokens=np.arange(30), true_length=30, sampler=GREEDY)
    state = engine.free_resource(3, engine.insert(long_prefix, state, 3))
    prefix, first = engine.prefill(params=params, padded_tokens=prompt, true_length=len(prompt), sampler=GREEDY)
    state = engine.insert(prefix, state, 0)
    assert engine.attend_window(state, STEPS) == 32 < engine.max_target_length
    tokens = {}
    for window in (None, engine.max_target_length):
        run_state = engine.insert(prefix, engine.init_decode_state(), 0)
        run_state, result = engine.generate(params, run_state, num_steps=STEPS, attend_len=window)
        tokens[window] = [int(first.tokens[0])] + np.asarray(result.tokens[:, 0]).tolist()
        run_state, result = engine.generate(params, run_state, num_steps=STEPS, attend_len=window)
        tokens[window] += np.asarray(result.tokens[:, 0]).tolist()
    assert tokens[None] == tokens[engine.max_target_length]
    _, logits = trainer_logprobs(tiny_model, prompt, tokens[None], 1.0)
    np.testing.assert_array_equal(tokens[None], np.argmax(logits, -1)[len(prompt) - 1 : -1])
    assert (STEPS, 32, False) in engine._generate_fns  # (steps, window, no top-k / top-p slot)


@pytest.fixture(scope="module")
def pallas_model():
    """The tiny model with a head dim the GPU kernel accepts (Triton blocks: a power of two >= 16)."""
    return make_model(0, head_dim=16)


@pytest.fixture(scope="module")
def pallas_engine(pallas_model):
    """The Pallas decode-attention path (interpreted off GPU) on one device."""
    return DensePrefixEngine(pallas_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), decode_attention="pallas", **ENGINE_KW)


def test_pallas_decode_attention_matches_teacher_forcing(pallas_engine, pallas_model):
    params = pallas_engine.load_params(pallas_model)
    pool = pallas_engine.init_decode_state().cache.k[0]  # [N, KV, P, K]: pages of P entries
    assert pool.shape[2] == pallas_engine.page_size
    [(tokens, logprobs)] = run_requests(pallas_engine, params, [PROMPT], [2], GREEDY)
    ref_logp, logits = trainer_logprobs(pallas_model, PROMPT, tokens, 1.0)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1)[len(PROMPT) - 1 : -1])
    assert len(set(tokens)) > 1, "degenerate model: greedy repeats one token"
    np.testing.assert_allclose(logprobs, ref_logp, atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_pallas_decoding_equals_single_device(pallas_engine, pallas_model):
    """The kernel runs per (slots, kv heads) shard under shard_map."""
    sharded = DensePrefixEngine(pallas_model, mesh=make_mesh({"data": 2, "tensor": 4}), decode_attention="pallas", **ENGINE_KW)
    prompts = [PROMPT, np.arange(30, 50, dtype=np.int32)]
    ref = run_requests(pallas_engine, pallas_engine.load_params(pallas_model), prompts, [1, 2], GREEDY)
    got = run_requests(sharded, sharded.load_params(pallas_model), prompts, [1, 2], GREEDY)
    for r, g in zip(ref, got):
        assert r[0] == g[0]
        np.testing.assert_allclose(r[1], g[1], atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_load_params_from_the_trainer_layout_and_from_other_devices(engine, params, tiny_model):
    """Weights in the trainer's FSDP sharding (same devices: the jitted reshard) or on other
    devices (disaggregated: device_put) decode exactly like the directly loaded ones, and
    never share buffers with the caller's arrays."""
    from flax import nnx

    from agentrl_jax.models import param_shardings
    from agentrl_jax.sharding import DEFAULT_RULES

    devices = jax.devices()
    engine_mesh = make_mesh({"data": 2, "tensor": 2}, devices=devices[:4])
    placed = DensePrefixEngine(tiny_model, mesh=engine_mesh, **ENGINE_KW)
    state = nnx.state(tiny_model, nnx.Param)
    prompts = [PROMPT]
    ref = run_requests(engine, params, prompts, [1], GREEDY)
    for train_devices in (devices[:4], devices[4:]):  # colocated, then disaggregated
        train_mesh = make_mesh({"fsdp": -1}, devices=train_devices)
        trainer_params = jax.device_put(state, param_shardings(state, train_mesh, DEFAULT_RULES))
        got_params = placed.load_params(trainer_params)
        trained = {leaf.addressable_shards[0].data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(trainer_params)}
        for leaf in jax.tree.leaves(got_params):
            assert set(leaf.sharding.device_set) == set(engine_mesh.devices.flat)
            assert leaf.addressable_shards[0].data.unsafe_buffer_pointer() not in trained
        got = run_requests(placed, got_params, prompts, [1], GREEDY)
        assert got[0][0] == ref[0][0]
        np.testing.assert_allclose(got[0][1], ref[0][1], atol=1e-5)


def test_compilation_cache_dir_stores_compiled_programs(tmp_path, tiny_model):
    """`DensePrefixEngine(compilation_cache_dir=...)` turns JAX's persistent cache on even after earlier compiles
    (the test session has compiled plenty): the next compiled program lands in the directory."""
    from jax.experimental.compilation_cache import compilation_cache

    from agentrl_jax.rollout.compile_cache import use_compilation_cache

    cache = tmp_path / "xla"
    try:
        DensePrefixEngine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), compilation_cache_dir=str(cache),
               **ENGINE_KW)
        assert jax.config.jax_compilation_cache_dir == str(cache)
        use_compilation_cache(cache, min_compile_seconds=0)  # the tiny program compiles in far less than 1 s
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
        assert any(cache.iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        compilation_cache.reset_cache()


def test_decode_compiler_options_default_per_platform_and_bad_options_name_the_field(tiny_model):
    from agentrl_jax.rollout.engine_config import GPU_DECODE_COMPILER_OPTIONS

    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    default = DensePrefixEngine(tiny_model, mesh=mesh, **ENGINE_KW).decode_compiler_options
    assert default == (GPU_DECODE_COMPILER_OPTIONS if jax.devices()[0].platform == "gpu" else {})
    assert DensePrefixEngine(tiny_model, mesh=mesh, decode_compiler_options={}, **ENGINE_KW).decode_compiler_options == {}
    for bad in ({"xla_no_such_option": True}, {"xla_gpu_enable_triton_gemm": "maybe"}, ["xla_gpu_enable_triton_gemm"]):
        with pytest.raises(ValueError, match="decode_compiler_options"):
            DensePrefixEngine(tiny_model, mesh=mesh, decode_compiler_options=bad, **ENGINE_KW)


def test_decode_compiler_options_decode_the_same_tokens(engine, params, tiny_model):
    """The decode program compiled with other XLA options (on GPU: XLA's Triton GEMMs instead of the
    default cuBLAS ones; on CPU: no backend optimization) decodes the same tokens and logprobs."""
    options = ({"xla_gpu_enable_triton_gemm": True} if jax.devices()[0].platform == "gpu"
               else {"xla_backend_optimization_level": 0})
    other = DensePrefixEngine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), decode_compiler_options=options,
                   **ENGINE_KW)
    sampler = SamplingParams(temperature=1.0, seed=5)
    [(ref_tokens, ref_logp)] = run_requests(engine, params, [PROMPT], [0], sampler)
    [(tokens, logp)] = run_requests(other, other.load_params(tiny_model), [PROMPT], [0], sampler)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA chooses between cuBLAS and Triton GEMMs on GPU only")
def test_gpu_decode_weight_matmuls_run_on_cublas_by_default():
    """At the 1.7B shape's batch-64 decode step XLA would pick Triton GEMMs (forced here by turning
    off its cuBLAS fallback); the engine's default options compile cuBLAS ones instead."""
    model = Decoder(dataclasses.replace(TINY, vocab_size=4096, hidden_size=2048, intermediate_size=6144, num_layers=1,
                                        num_heads=16, num_kv_heads=8, head_dim=128),
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    kw = {"max_concurrent_decodes": 64, "max_target_length": 256, "max_prefill_length": 64, "cache_dtype": None}

    def compiled_text(options):
        engine = DensePrefixEngine(model, mesh=mesh, decode_compiler_options=options, **kw)
        params, state = engine.load_params(model), engine.init_decode_state()
        attend = engine.table_width * engine.page_size
        return engine._generate_fn(4, attend, False).lower(params, state).compile().as_text()

    def targets(text):
        return sorted(set(re.findall(r'custom_call_target="([^"]*)"', text)))

    def gemm_calls(text):  # cuBLAS GEMM custom calls: __cublas$gemm, __cublas$lt$matmul
        return re.findall(r'custom_call_target="(__cublas[^"]*)"', text)

    default = compiled_text(None)
    forced = compiled_text({"xla_gpu_enable_triton_gemm": True, "xla_gpu_cublas_fallback": False})
    # the layer's four weight matmuls (QKV, output, gate/up, down), and the logits'
    assert len(gemm_calls(default)) >= 4, f"default: {len(gemm_calls(default))} cuBLAS GEMMs; {targets(default)}"
    assert len(gemm_calls(forced)) < len(gemm_calls(default)), (
        f"the options did not reach the decode program: {len(gemm_calls(forced))} cuBLAS GEMMs with Triton forced, "
        f"{len(gemm_calls(default))} by default; {targets(forced)}")


def test_engine_config_from_the_rollout_section_and_bad_settings_name_the_field():
    from agentrl_jax.config.rollout import RolloutConfig
    from agentrl_jax.rollout.engine_config import EngineConfig

    section = RolloutConfig(max_concurrent=16, max_sequence_length=512, max_prompt_length=128, decode_batch=8,
                            page_size=16, kv_cache_bytes=1 << 20, cache_dtype="float32", decode_compiler_options="none")
    got = EngineConfig.from_rollout(section)
    assert (got.max_concurrent_decodes, got.max_target_length, got.max_prefill_length, got.decode_batch,
            got.page_size, got.kv_cache_bytes, got.cache_dtype, got.decode_compiler_options) == (
        16, 512, 128, 8, 16, 1 << 20, jnp.float32, {})
    default = EngineConfig.from_rollout(RolloutConfig())  # the section's 0 / "" / "default" mean the engine's choice
    assert (default.decode_batch, default.kv_cache_bytes, default.kv_cache_memory_fraction,
            default.compilation_cache_dir, default.decode_compiler_options, default.cache_dtype) == (
        None, None, None, None, None, jnp.bfloat16)
    assert EngineConfig() == default  # one set of defaults: the engine's are the section's
    with pytest.raises(ValueError, match="Engine: page_size must be >= 1, got 0"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="Engine: device_stop_sequences"):
        EngineConfig(device_stop_sequences=(2, 0))
