"""The package's layers hold: ``lint-imports`` (import-linter, the contracts in
pyproject.toml's [tool.importlinter]) passes on the package, and fails on a copy with one
upward import, so the contract is live and reads this checkout's package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` run on the package under ``root`` (found first on the path)."""
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_import_contract_is_kept():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, f"lint-imports found imports against the layers:\n{result.stdout}{result.stderr}"
    assert "0 broken" in result.stdout, result.stdout


def test_import_contract_catches_an_upward_import(tmp_path):
    shutil.copytree(ROOT / "agentrl_jax", tmp_path / "agentrl_jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    core = tmp_path / "agentrl_jax" / "config" / "core.py"
    core.write_text(core.read_text() + "\n\ndef _upward():\n    from agentrl_jax.train import setup  # noqa: F401\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "agentrl_jax.config is not allowed to import agentrl_jax.train" in result.stdout, result.stdout
    assert "agentrl_jax.config.core -> agentrl_jax.train.setup" in result.stdout, result.stdout
