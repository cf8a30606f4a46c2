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


def test_a_config_built_after_importing_only_config_knows_the_built_ins():
    """In a fresh interpreter: the built-in environments and the loss checks register when a
    Config first needs them, and the package root stays light (the answer-verifier workers
    import it: no JAX, no environments)."""
    code = """
import sys
import agentrl_jax.rewards.math_equiv  # what a verifier worker process imports
loaded = [m for m in ("jax", "agentrl_jax.envs", "agentrl_jax.losses") if m in sys.modules]
assert not loaded, loaded
from agentrl_jax.config import AlgorithmConfig, Config, ConfigError, EnvironmentConfig, apply_overrides
config = Config(environment=EnvironmentConfig(name="retool_small", num_train_tasks=10))
assert type(config.environment).__name__ == "ReToolSmallEnvConfig", type(config.environment)
assert type(apply_overrides(Config(), ["environment.name=search"]).environment).__name__ == "SearchEnvConfig"
try:
    Config(algorithm=AlgorithmConfig(loss="ppo2"))
except ConfigError as e:
    assert str(e).startswith("algorithm.loss: unknown name 'ppo2'; registered: "), e
else:
    raise AssertionError("an unknown loss was accepted")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
