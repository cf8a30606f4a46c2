"""JAX's persistent compilation cache, turned on for the rollout (and everything else in the process).

A run compiles a prefill shape per token bucket and a decode program per attention
window; on a 1.7B model each takes seconds to tens of seconds. With the persistent cache
a restarted or resumed run, or the next run of the same config, loads them from disk.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger(__name__)


def use_compilation_cache(path: str | os.PathLike, *, min_compile_seconds: float = 1.0) -> str:
    """Store and look up compiled programs in ``path`` (created) from now on, process-wide.

    JAX decides once, at the first compile, whether a cache is used; the trainer compiles
    before the rollout engine exists, so the decision is reset here (`reset_cache`) and
    the next compile opens the cache at ``path``.

    Args:
      path: the cache directory (``~`` expanded).
      min_compile_seconds: programs that compile faster are not stored (JAX's default, 1 s).

    Returns:
      the absolute path used.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    os.makedirs(path, exist_ok=True)
    current = jax.config.jax_compilation_cache_dir
    if current == path and jax.config.jax_persistent_cache_min_compile_time_secs == min_compile_seconds:
        return path
    if current not in (None, "", path):
        logger.warning("compilation cache: moving from %s to %s", current, path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    compilation_cache.reset_cache()
    logger.info("compilation cache: %s (programs compiling in >= %g s)", path, min_compile_seconds)
    return path
