"""Two `jax.distributed` processes on localhost CPU run 2 RL steps of the tiny config.

Each process has 4 CPU devices; the training mesh (data=2, fsdp=2, tensor=2) spans all 8.
Each host rolls out its half of the prompts on its own engine, the hosts exchange
trajectories, and both run the same jitted updates on global arrays.
"""

import json
import math
import os
import socket
import subprocess
import sys

from test_launch_e2e import ROOT, TINY, assert_counts_of_samples


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(out, steps: int, overrides=()) -> list[tuple[str, str]]:
    """``launch/tpu_pod.py`` on the tiny demo as two `jax.distributed` processes of 4 CPU devices
    each, ``steps`` RL steps into ``out``; every process's (stdout, stderr), after both exited 0."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = []
    for pid in (0, 1):
        cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
               "--set", f"output_dir={out}", "--set", f"total_steps={steps}", "--set", "checkpoint.resume=false"]
        for item in [*TINY, *overrides]:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, f"process failed:\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return outputs


def test_two_processes_run_two_rl_steps(tmp_path):
    out = tmp_path / "run"
    launch_two_processes(out, 2)
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["skipped"] == 0 and m["update_norm"] > 0
        # both hosts' trajectories are in the batch: 2 prompts (one per host) x 4 samples
        assert m["rollout/trajectories"] == 8
        assert m["train_tokens"] > 0 and m["rollout/sampled_tokens"] > 0
        assert m["logprob_gap_train_infer"] < 1e-4
    results = json.loads((out / "results.json").read_text())
    assert_counts_of_samples(results["end"]["pass_at_1"], int(results["end"]["num_tasks"]) * 2)
