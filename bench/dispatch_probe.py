"""Which host calls block while the device is busy? (A probe of JAX's asynchronous dispatch.)

The rollout driver queues a prefill and a decode dispatch before it reads the previous
dispatch's results; that only overlaps host and device work if none of the calls it makes
on the way waits for the device. This probe queues a long computation, then times each
kind of call the engine makes while it runs: a call that takes about as long as the busy
computation blocked on it. On GPU a program with a `lax.cond` on a device value is one
(XLA copies the predicate to the host and waits for it before it launches a branch).

    python bench/dispatch_probe.py
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def main() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data", None))

    @jax.jit
    def busy(x):
        return jax.lax.fori_loop(0, 200, lambda i, y: jnp.tanh(y @ y), x)

    small = jax.jit(lambda t, s: (t + 1, s * 2))
    donating = jax.jit(lambda state, t: (state + t.sum(), t), donate_argnums=(0,))
    # a branch chosen by a device value (the sampler's former "does any row truncate?" cond)
    branching = jax.jit(lambda state: jax.lax.cond(state.sum() > 0, lambda: state + 1, lambda: state - 1))
    # the same inside a loop, as the sampler's cond sat inside the decode dispatch's fori_loop
    looped = jax.jit(lambda state: jax.lax.fori_loop(
        0, 4, lambda i, s: jax.lax.cond(s.sum() > 0, lambda: s + 1, lambda: s - 1), state))
    n = 4096 if jax.default_backend() == "gpu" else 160  # tens of ms of work either way
    x = jnp.ones((n, n), jnp.bfloat16) * 1e-3
    state = jnp.zeros((1024, 1024), jnp.float32)
    table = np.arange(64 * 80, dtype=np.int32).reshape(64, 80)
    t_dev = jax.device_put(table)
    # compile everything once
    jax.block_until_ready((busy(x), small(t_dev, t_dev), donating(jnp.zeros_like(state), t_dev), small(table, table),
                           branching(state), looped(state)))

    t0 = time.perf_counter()
    jax.block_until_ready(busy(x))
    busy_ms = 1e3 * (time.perf_counter() - t0)

    probes = {
        "device_put numpy": lambda s: jax.device_put(table.copy()),
        "device_put numpy, sharding": lambda s: jax.device_put(table.copy(), rows),
        "jit, device args": lambda s: small(t_dev, t_dev),
        "jit, numpy args": lambda s: small(table, table),
        "jit, donating a busy output": lambda s: donating(s, t_dev),
        "copy_to_host_async of a busy output": lambda s: s.copy_to_host_async(),
        "jit with a lax.cond on a device value": lambda s: branching(s),
        "jit with that lax.cond inside a fori_loop": lambda s: looped(s),
    }
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "busy_ms": round(busy_ms, 2)}
    for name, probe in probes.items():
        times = []
        for _ in range(5):
            y = busy(x)
            s = jnp.zeros_like(state) + y[0, 0].astype(jnp.float32)  # depends on the busy computation
            t0 = time.perf_counter()
            probe(s)
            times.append(1e3 * (time.perf_counter() - t0))
            jax.block_until_ready(y)
        out[name + " (ms)"] = round(float(np.median(times)), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
