"""The optional JetStream adapter (`rollout/jetstream/adapter.py`).

Runs where `jetstream.engine.engine_api` imports (it needs seqio / TensorFlow); elsewhere
only the clear ImportError is checked.
"""

import importlib

import jax
import numpy as np
import pytest

from agentrl_jax.rollout import SamplingParams
from agentrl_jax.rollout.jetstream import jetstream_engine


def _jetstream_available() -> bool:
    try:
        importlib.import_module("jetstream.engine.engine_api")
    except Exception:  # noqa: BLE001  (ImportError, or TensorFlow failing inside seqio)
        return False
    return True


@pytest.mark.skipif(_jetstream_available(), reason="jetstream is installed")
def test_without_jetstream_the_adapter_says_what_is_missing(engine):
    with pytest.raises(ImportError, match="needs the jetstream package"):
        jetstream_engine(engine)


@pytest.mark.skipif(not _jetstream_available(), reason="jetstream.engine.engine_api does not import here")
def test_adapter_is_a_jetstream_engine_and_decodes_like_the_engine(engine, params):
    from jetstream.engine import engine_api

    greedy = SamplingParams(temperature=0.0)
    adapter = jetstream_engine(engine, sampling=greedy, tokenizer_path="/tmp/tok")
    assert isinstance(adapter, engine_api.Engine)
    assert (adapter.max_concurrent_decodes, adapter.max_prefill_length) == (4, 32)
    assert adapter.mesh is engine.mesh and adapter.colocated_cpus is None
    prompt = np.arange(5, 17, dtype=np.int32)

    def decode(api, prefill_kwargs):
        out = api.prefill(params=params, padded_tokens=prompt, true_length=prompt.size, **prefill_kwargs)
        prefix = out[0] if isinstance(out, tuple) else out
        state = api.insert(prefix, api.init_decode_state(), 2)
        tokens = []
        for _ in range(4):
            state, result = api.generate(params, state)
            tokens.append(int(jax.device_get(result.get_result_at_slot(2).tokens).ravel()[0]))
        return tokens

    assert decode(adapter, {}) == decode(engine, {"sampler": greedy})
    with pytest.raises(NotImplementedError, match="sampler"):
        adapter.prefill(params=params, padded_tokens=prompt, true_length=prompt.size, sampler=lambda x: x)
    with pytest.raises(NotImplementedError, match="sampler"):
        adapter.generate(params, adapter.init_decode_state(), sampler=lambda x: x)
    with pytest.raises(ValueError, match="tokenizer_path"):
        jetstream_engine(engine).get_tokenizer()
    assert adapter.get_tokenizer().path == "/tmp/tok"
