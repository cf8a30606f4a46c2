"""The engine decodes LoRA params merged into its copy: sampled logprobs equal the trainer's
forward on the same ``LoraParams`` (float32), and differ from the base model's."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_rollout_engine import PROMPT, run_requests

from agentrl_jax.config import LoraConfig
from agentrl_jax.models.lora import attach
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.train.step import forward_logprobs


def _trainer_logprobs(graphdef, params, tokens):
    seq = np.concatenate([PROMPT, tokens]).astype(np.int32)
    n = seq.size - 1
    batch = {"input_ids": jnp.asarray(seq[:-1])[None], "targets": jnp.asarray(seq[1:])[None],
             "positions": jnp.arange(n, dtype=jnp.int32)[None], "segment_ids": jnp.ones((1, n), jnp.int32)}
    return np.asarray(forward_logprobs(graphdef, params, batch, temperature=1.0)[0, PROMPT.size - 1:])


def test_engine_logprobs_equal_trainer_logprobs_with_lora(engine, tiny_model):
    graphdef, base = nnx.split(tiny_model, nnx.Param)
    params = attach(base, tiny_model.config, LoraConfig(rank=4, alpha=8.0), jax.random.key(3))
    rng = np.random.default_rng(0)
    params = params.replace(adapters={k: {"a": v["a"], "b": jnp.asarray(rng.standard_normal(v["b"].shape),
                                                                         jnp.float32)}
                                      for k, v in params.adapters.items()})
    sampler = SamplingParams(temperature=1.0, seed=5)
    [(tokens, logprobs)] = run_requests(engine, engine.load_params(params), [PROMPT], [0], sampler)
    np.testing.assert_allclose(logprobs, _trainer_logprobs(graphdef, params, np.asarray(tokens)), atol=1e-5)
    base_logprobs = _trainer_logprobs(graphdef, base, np.asarray(tokens))
    assert np.abs(np.asarray(logprobs) - base_logprobs).max() > 1e-2  # the adapters were merged
