"""Load the repository's scripts (bench/, launch/, configs/) as modules, by path: they are not
in a package, and several import their siblings relative to the repository root."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str | None = None) -> ModuleType:
    """The module of ``ROOT / path`` (e.g. "bench/async_step.py"), executed; ``name``: its module
    name (default: the file's stem)."""
    file = ROOT / path
    spec = importlib.util.spec_from_file_location(name or file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
