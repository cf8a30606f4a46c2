"""The README's first command installs only the base dependencies (`pip install -e .`).

CI installs the test extra, which brings PyTorch, Jupyter and their own dependencies
(jinja2 among them), so a demo that silently relied on one of them would pass CI and fail
for a user. This test computes the dependency closure of the base install from the
installed metadata, builds a site-packages of links to those distributions only, and runs
the demo command on it (``python -S``) with a tiny model for one RL step.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
TINY_DEMO = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "rollout.max_concurrent=8", "data.prompts_per_step=2",
    "algorithm.group_size=4", "environment.num_train_tasks=32", "environment.num_eval_tasks=2",
    "eval.num_tasks=2", "eval.samples_per_task=1", "sft.steps=2", "sft.batch_size=4", "total_steps=1",
]

def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _base_closure() -> set[str]:
    """Canonical names of the installed distributions the base install pulls in (markers evaluated)."""
    seen: set[str] = set()
    stack = [("agentrl-jax", "")]
    while stack:
        name, extra = stack.pop()
        key = _canonical(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                stack.append((req.name, ""))
                stack += [(req.name, e) for e in req.extras]
    return seen


def _base_site(base: set[str], site: Path) -> None:
    """A site-packages of links to the base distributions' files only (their top-level entries)."""
    site.mkdir()
    for dist in md.distributions():
        if _canonical(dist.metadata["Name"]) not in base or _canonical(dist.metadata["Name"]) == "agentrl-jax":
            continue
        root = Path(dist.locate_file(""))
        for f in dist.files or ():
            parts = Path(str(f)).parts
            if not parts or parts[0] in ("..", "bin") or parts[0].endswith(".pth"):
                continue
            link = site / parts[0]
            if not link.exists() and (root / parts[0]).exists():
                link.symlink_to(root / parts[0])


def test_the_demo_runs_on_the_base_dependencies_alone(tmp_path):
    base = _base_closure()
    assert {"jax", "flax", "transformers", "jinja2"} <= base  # the closure is read, not empty
    assert "torch" not in base
    site = tmp_path / "site"
    _base_site(base, site)
    assert (site / "jax").exists() and not (site / "torch").exists()
    cmd = [sys.executable, "-S", "launch/tpu_pod.py", "--config", "configs/demo.py",
           "--set", f"output_dir={tmp_path / 'run'}"]
    for item in TINY_DEMO:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{site}")  # -S: no site-packages, no .pth
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "end" in json.loads((tmp_path / "run" / "results.json").read_text())
