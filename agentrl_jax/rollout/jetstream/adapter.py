"""Our `DensePrefixEngine` as a `jetstream.engine.engine_api.Engine`, for JetStream's orchestrator and tools.

Optional: the trainer never imports this module, and it needs the ``jetstream`` package.
State of that package (checked 2026-11): PyPI ``google-jetstream`` is at 0.2.2, an older
API (``prefill`` returns only the prefix, no ``bulk_insert``/``free_resource``); GitHub
HEAD (0.3.0, not on PyPI) has the API our engine implements natively. Either way
``jetstream.engine.engine_api`` imports ``token_utils``, which imports ``seqio`` (and so
TensorFlow), so the package does not import in a plain JAX environment; install it with
its requirements (``pip install google-jetstream seqio`` or from GitHub) to use this.

`jetstream_engine(engine)` returns an instance of a subclass of whichever
``engine_api.Engine`` is installed, delegating to the engine:

- ``prefill``/``prefill_multisampling``/``insert``/``bulk_insert``/``generate``/
  ``free_resource``/``load_params``/``init_decode_state`` and the properties map one to
  one (0.2.2's ``prefill`` gets only the prefix back).
- JetStream's ``ExistingPrefix`` carries the engine's own prefix object in ``.cache``.
- Sampling is the engine's (exact logprobs): the adapter's `SamplingParams` apply to every
  request; a JetStream ``sampler`` callable is refused (it could not report logprobs).
- ``get_tokenizer`` returns ``TokenizerParameters(path=tokenizer_path)``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from agentrl_jax.rollout.jetstream.dense_prefix import DensePrefixEngine
from agentrl_jax.rollout.sampling import SamplingParams


def jetstream_engine(engine: DensePrefixEngine, *, sampling: SamplingParams | None = None, tokenizer_path: str | None = None):
    """Wrap `engine` as a ``jetstream.engine.engine_api.Engine`` (see the module docstring).

    Raises:
      ImportError: ``jetstream.engine.engine_api`` cannot be imported (with the reason).
    """
    try:
        from jetstream.engine import engine_api
    except ImportError as e:
        raise ImportError(
            f"jetstream_engine needs the jetstream package (google-jetstream with seqio; see "
            f"agentrl_jax/rollout/jetstream/adapter.py): {e}"
        ) from e
    cls = _adapter_class(engine_api)
    return cls(engine, sampling=sampling or SamplingParams(), tokenizer_path=tokenizer_path)


@functools.cache
def _adapter_class(engine_api) -> type:  # long: a class defined here, so the jetstream import stays optional
    # Long, but one idea: the class must subclass whichever `engine_api.Engine` is installed, so it
    # is defined here; its methods are one-line delegations to the engine.
    returns_first_token = "sampler" in inspect.signature(engine_api.Engine.prefill).parameters

    class JetStreamEngine(engine_api.Engine):
        """agentrl_jax's rollout engine behind JetStream's Engine API."""

        def __init__(self, engine: DensePrefixEngine, *, sampling: SamplingParams, tokenizer_path: str | None):
            self.engine = engine
            self.sampling = sampling
            self.tokenizer_path = tokenizer_path

        def _prefill(self, params, existing_prefix, padded_tokens, true_length, sampler, num_samples):
            if sampler is not None:
                raise NotImplementedError(
                    "JetStreamEngine: agentrl_jax samples inside the engine (exact logprobs); pass "
                    "SamplingParams to jetstream_engine(..., sampling=) instead of a sampler callable"
                )
            existing = getattr(existing_prefix, "cache", existing_prefix)  # ExistingPrefix or our Prefix
            prefix, first = self.engine.prefill(
                params=params, existing_prefix=existing, padded_tokens=padded_tokens, true_length=true_length,
                sampler=self.sampling, num_samples=num_samples,
            )
            return (prefix, first) if returns_first_token else prefix

        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length, sampler=None,
                    request_id=None) -> Any:
            del request_id
            return self._prefill(params, existing_prefix, padded_tokens, true_length, sampler, 1)

        def prefill_multisampling(self, *, params, existing_prefix=None, padded_tokens, true_length, sampler=None,
                                  num_samples: int = 1, request_id=None) -> Any:
            del request_id
            return self._prefill(params, existing_prefix, padded_tokens, true_length, sampler, num_samples)

        def generate(self, params, decode_state, sampler=None) -> Any:
            if sampler is not None:
                raise NotImplementedError("JetStreamEngine: a sampler callable is not supported (see prefill)")
            return self.engine.generate(params, decode_state)

        def insert(self, prefix, decode_state, slot: int, request_id=None) -> Any:
            del request_id
            return self.engine.insert(prefix, decode_state, slot)

        def bulk_insert(self, prefix, decode_state, slots: list[int]) -> Any:
            return self.engine.bulk_insert(prefix, decode_state, slots)

        def free_resource(self, slot: int) -> Any:
            return self.engine.free_resource(slot)

        def load_params(self, *args, **kwargs) -> Any:
            return self.engine.load_params(*args, **kwargs)

        def get_prefix_destination_sharding(self) -> Any:
            return self.engine.get_prefix_destination_sharding()

        def get_tokenizer(self) -> Any:
            from jetstream.engine import tokenizer_pb2

            if self.tokenizer_path is None:
                raise ValueError("JetStreamEngine: pass jetstream_engine(..., tokenizer_path=) to use get_tokenizer")
            return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path)

        def init_decode_state(self, *args, **kwargs) -> Any:
            return self.engine.init_decode_state(*args, **kwargs)

        @property
        def max_concurrent_decodes(self) -> int:
            return self.engine.max_concurrent_decodes

        @property
        def samples_per_slot(self) -> int:
            return self.engine.samples_per_slot

        @property
        def max_prefill_length(self) -> int:
            return self.engine.max_prefill_length

        @property
        def mesh(self):
            return self.engine.mesh

        @property
        def colocated_cpus(self):
            return None

        @property
        def use_chunked_prefill(self) -> bool:
            return False

        @property
        def prefill_chunk_size(self) -> int:
            return self.engine.max_prefill_length

    return JetStreamEngine
