"""One conversion per GGUF file, in the user's cache: what ``model.path`` pointing at a ``.gguf`` loads.

:func:`hf_directory` maps a model path to an HF directory: the path itself, or for a ``.gguf``
file its conversion (``models/gguf.py``) in ``$XDG_CACHE_HOME/agentrl_jax/gguf/``, named after the
file's sha256, so runs and seeds share one conversion and a changed file is converted anew.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from agentrl_jax.models.gguf import _CONVERSION_VERSION, GGUFError, convert_gguf


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file (remembered per path, size and modification time)."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _sha256(real, stat.st_size, stat.st_mtime_ns)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/agentrl_jax`` (default ``~/.cache/agentrl_jax``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl_jax"


def converted_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The HF directory of ``gguf_path``, converted once into ``cache_dir`` (default
    ``cache_root() / "gguf"``) under the file's sha256, so runs and seeds share one conversion and
    a changed file is converted anew.

    Raises:
      GGUFError: the file cannot be read or converted.
    """
    gguf_path = os.fspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise GGUFError(f"{gguf_path}: no such GGUF file")
    stem = Path(gguf_path).name.removesuffix(".gguf")
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf"
    out = root / f"{stem}-{file_sha256(gguf_path)[:16]}-v{_CONVERSION_VERSION}"
    if not (out / "config.json").is_file():
        try:
            convert_gguf(gguf_path, out)
        except FileExistsError:  # a concurrent run converted the same file first
            if not (out / "config.json").is_file():
                raise
    return str(out)


def hf_directory(path: str) -> str:
    """An HF directory for a model path: ``path`` itself, or for a ``.gguf`` file its
    :func:`converted_gguf` directory."""
    return converted_gguf(path) if path.endswith(".gguf") else path
