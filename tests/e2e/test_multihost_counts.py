"""Two `jax.distributed` processes against one process on the same devices, and resuming
across the process count (a checkpoint of 2 processes in 1, and of 1 in 2).

Four runs of `launch/tpu_pod.py --config configs/demo.py`:
  two          2 processes, each half the devices, 2 RL steps (checkpoint at step 2)
  one          1 process, all the devices, the same 2 steps
  two_then_one `two`'s checkpoint resumed by 1 process for step 3
  one_then_two `one`'s checkpoint resumed by 2 processes for step 3
Every host writes its metrics (`logging.every_host`). A step's trajectories do not depend on
the process count (sampling seeds by the task's place in the global batch, the batch in
global order), so the runs train on the same tokens; what may differ is the arithmetic
order of the collectives (the CPU collectives across processes, XLA's own inside one): on
CPU the states agree within one float32 ulp. On GPUs the engines' decode GEMMs differ in
shape between the layouts, and after the first update a sampled token can differ.

On CPU (fake devices, slow): `pytest -m slow tests/e2e/test_multihost_counts.py`.
On 2 GPUs, one per process:
`pytest -p no:xdist -m gpu -s tests/e2e/test_multihost_counts.py` (the test process stays on CPU).
"""

import shutil
import subprocess

import numpy as np
import pytest
from multihost_runs import checkpoint_arrays, host_metrics, launch, max_difference
from test_launch_e2e import TINY

# Measured per host and not computed from the shared batch: timings and this host's own
# rollout engine (its slots, its share of the tokens), which differ between hosts by design.
HOST_LOCAL = ("time", "throughput/", "rollout/engine/")


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _shared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(HOST_LOCAL)}


def run_counts(tmp_path, platform: str, devices: int, overrides: list[str], timeout: float) -> dict:
    """The four runs above on ``devices`` devices; what they logged and saved."""
    runs = {name: tmp_path / name for name in ("two", "one", "two_then_one", "one_then_two")}
    first = [*overrides, "total_steps=2", "checkpoint.resume=false"]
    launch(runs["two"], 2, devices // 2, first, platform=platform, timeout=timeout)
    launch(runs["one"], 1, devices, first, platform=platform, timeout=timeout)
    shutil.copytree(runs["two"], runs["two_then_one"])
    shutil.copytree(runs["one"], runs["one_then_two"])
    resumed = [*overrides, "total_steps=3", "checkpoint.resume=true"]
    launch(runs["two_then_one"], 1, devices, resumed, platform=platform, timeout=timeout)
    launch(runs["one_then_two"], 2, devices // 2, resumed, platform=platform, timeout=timeout)
    return {
        "metrics": {name: [host_metrics(out, h) for h in range(2 if name in ("two", "one_then_two") else 1)]
                    for name, out in runs.items()},
        "step2": {name: checkpoint_arrays(runs[name], 2) for name in ("two", "one")},
        "step3": {name: checkpoint_arrays(runs[name], 3) for name in ("two_then_one", "one_then_two")},
    }


def check_counts(report: dict, *, identical_steps: tuple[int, ...], params_atol: float | None) -> None:
    """Hosts of one run agree bit for bit; the process counts sample the same trajectories at
    ``identical_steps`` (to a close loss); the saved states agree to ``params_atol`` (None:
    printed only)."""
    m = report["metrics"]
    for name, steps in (("two", [1, 2]), ("one_then_two", [3])):  # every host logs the same metrics
        host0, host1 = m[name]
        assert sorted(host1) == steps, (name, sorted(host1))
        for step in steps:
            assert _shared(host0[step]) == _shared(host1[step]), (name, step)
    assert sorted(m["two"][0]) == sorted(m["one"][0]) == [1, 2]
    # a resumed run keeps the rows its checkpoint's run logged (host 0's folder came with it)
    assert sorted(m["two_then_one"][0]) == sorted(m["one_then_two"][0]) == [1, 2, 3]
    pairs = [(m["two"][0][s], m["one"][0][s]) for s in (1, 2)] + [(m["two_then_one"][0][3], m["one_then_two"][0][3])]
    keys = ("train_tokens", "rollout/trajectories", "rollout/sampled_tokens", "reward/mean")
    print("\nsteps (2 processes, 1 process):", [(two["step"], two["loss"], one["loss"], two["train_tokens"],
                                                 one["train_tokens"]) for two, one in pairs])
    diffs = {"step 2, 2 processes vs 1": max_difference(report["step2"]["two"], report["step2"]["one"]),
             "step 3, 2->1 vs 1->2 resumed": max_difference(report["step3"]["two_then_one"],
                                                           report["step3"]["one_then_two"])}
    print("largest |difference| of the saved train state:", diffs)
    for two, one in pairs:
        if two["step"] in identical_steps:  # the same trajectories, so the same loss
            assert {k: two[k] for k in keys} == {k: one[k] for k in keys}, two["step"]
            assert abs(two["loss"] - one["loss"]) <= 1e-4 * abs(one["loss"]) + 1e-7, two["step"]
    for what, (diff, key) in diffs.items():
        assert params_atol is None or diff <= params_atol, (what, key, diff)
    for name in ("two_then_one", "one_then_two"):
        row = m[name][0][3]
        assert np.isfinite(row["loss"]) and row["skipped"] == 0 and row["update_norm"] > 0


@pytest.mark.slow
def test_process_counts_agree_on_cpu(tmp_path):
    report = run_counts(tmp_path, "cpu", 8, TINY, timeout=900)
    # Measured: step 1's loss and gradient norm bit for bit, the train state within 1.04e-7 after
    # steps 2 and 3 (one float32 ulp at 1.0; the cross-process all-reduce sums in its own order).
    check_counts(report, identical_steps=(1, 2, 3), params_atol=1e-6)


GPU_RUN = ["rollout.max_concurrent=64", "sft.steps=20", "environment.num_eval_tasks=16", "eval.num_tasks=16",
           "eval.samples_per_task=2", "rollout.warmup=off"]


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 CUDA GPUs (nvidia-smi -L)")
def test_process_counts_agree_on_two_gpus(tmp_path):
    report = run_counts(tmp_path, "cuda", 2, GPU_RUN, timeout=900)
    # Measured on 2 H100s: step 1 samples the same tokens, step 2 did not (976 vs 977 train
    # tokens). Likely cause, not profiled: each host's engine decodes on one GPU where one process
    # splits the slots over two, so the decode GEMMs have other shapes and round the logits
    # differently, and a sampled token flips. The states are printed, not bounded; a wrong batch
    # order or seed fails step 1.
    check_counts(report, identical_steps=(1,), params_atol=None)
