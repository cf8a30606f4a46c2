"""JetStream's Engine API over the rollout engine, for users of JetStream's orchestrator and tools.

Optional: the trainer's rollout (`rollout.Driver` over `rollout.Engine`) prefills straight
into KV pages and never imports this package. `DensePrefixEngine` adds JetStream's
dense-prefix calls (`prefill` -> `insert` / `bulk_insert`, `extract_prefix`) to the engine;
`jetstream_engine` wraps one as a ``jetstream.engine.engine_api.Engine`` where that package
imports.
"""

from agentrl_jax.rollout.jetstream.adapter import jetstream_engine
from agentrl_jax.rollout.jetstream.dense_prefix import DensePrefixEngine

__all__ = ["DensePrefixEngine", "jetstream_engine"]
