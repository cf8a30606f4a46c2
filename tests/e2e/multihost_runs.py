"""Runs of `launch/tpu_pod.py` as N `jax.distributed` processes, and what they leave behind.

Shared by the multi-process tests on fake CPU devices and on GPUs: start the processes
(one coordinator on localhost, each process its own devices), read every host's metrics and
weight digests, and read a checkpoint's arrays and data position back (no devices needed,
any process count).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two runs of one program in two processes do not compute alike on GPUs by default: XLA's
# autotuner picks GEMM kernels by timing them in each process, and scatter-adds use atomics.
# Measured: two single-process SmolLM2 runs of one seed (the same SFT) side by side on one
# H200 disagree in their first SFT loss (1.406597 vs 1.406654). A comparison of process counts
# needs the same math in every process.
GPU_DETERMINISM = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"


def process_env(platform: str, index: int, devices: int) -> dict[str, str]:
    """The environment of process ``index`` owning ``devices`` devices: fake CPU devices, or
    GPUs ``index * devices ...`` (CUDA_VISIBLE_DEVICES)."""
    env = dict(os.environ, JAX_PLATFORMS=platform)
    if platform == "cpu":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    else:  # (not the test process's fake CPU device count)
        env["XLA_FLAGS"] = GPU_DETERMINISM
        ids = visible_gpus()
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * devices + i] for i in range(devices))
    return env


def visible_gpus() -> list[str]:
    """The GPUs this test may use: CUDA_VISIBLE_DEVICES's list if set (so a run can be pinned to
    some GPUs of the machine), else every GPU `nvidia-smi -L` lists (none without the tool)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [i.strip() for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def launch(out: Path, processes: int, devices_per_process: int, overrides: list[str], *, platform: str = "cpu",
           config: str = "configs/demo.py", timeout: float = 900) -> float:
    """`launch/tpu_pod.py` as ``processes`` processes writing to ``out`` (asserted rc 0); the wall
    seconds until the last one exited."""
    t0 = time.perf_counter()
    port = free_port()
    procs = []
    for pid in range(processes):
        cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", config, "--set", f"output_dir={out}",
               "--set", "logging.every_host=true"]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(pid)]
        for item in overrides:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=process_env(platform, pid, devices_per_process),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for pid, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {pid} of {processes} failed:\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return time.perf_counter() - t0


def host_metrics(out: Path, host: int = 0) -> dict[int, dict]:
    """Host ``host``'s RL step rows (those with a loss) by step."""
    folder = out / ("metrics" if host == 0 else f"metrics_host{host}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def checkpoint_arrays(out: Path, step: int) -> dict[str, np.ndarray]:
    """The train state saved at ``step`` as NumPy arrays by key path (params, optimizer state, ...)."""
    path = out / "checkpoints" / str(step) / "state"
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}


def data_state(out: Path, step: int) -> dict:
    """The data position saved with the checkpoint of ``step`` (the iterator's JSON state)."""
    return json.loads((out / "checkpoints" / str(step) / "data_state" / "metadata").read_text())


def params_digests(out: Path, processes: int) -> list[dict]:
    """Every host's ``params_digest/host<i>.json`` (written with ``logging.every_host``)."""
    return [json.loads((out / "params_digest" / f"host{i}.json").read_text()) for i in range(processes)]


def sha256(array: np.ndarray) -> str:
    """The digest `train.multihost.write_params_digest` writes for an array."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str]:
    """(largest |a - b| over every array, the key where it is); the keys must match."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    worst = max(a, key=lambda k: float(np.max(np.abs(a[k].astype(np.float64) - b[k]), initial=0.0)))
    return float(np.max(np.abs(a[worst].astype(np.float64) - b[worst]), initial=0.0)), worst
