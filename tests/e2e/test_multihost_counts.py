"""N `jax.distributed` processes against one process on the same devices, and resuming across
the process count (a checkpoint of N processes in 1, and of 1 in N).

Four runs of `launch/tpu_pod.py --config configs/demo.py`, checkpoints after steps 1 and 2:
  many          N processes, each its share of the devices, 2 RL steps
  one           1 process, all the devices, the same 2 steps
  many_then_one `many`'s checkpoint resumed by 1 process for step 3
  one_then_many `one`'s checkpoint resumed by N processes for step 3
Every host writes its metrics and, at the end, the sha256 of its copy of every weight
(`logging.every_host`). A step's trajectories do not depend on the process count (sampling
seeds by the task's place in the global batch, the batch in global order), so the runs train
on the same tokens; what may differ is the arithmetic order of the collectives (the CPU
collectives across processes, XLA's own inside one): on CPU the states agree within one
float32 ulp. On GPUs the engines' decode GEMMs differ in shape between the layouts (each
host's engine decodes its share on its own GPU), and after the first update a sampled token
can differ; the update of step 1, on the same tokens, is compared on its own.

Each test prints one line `MULTIHOST_REPORT {json}` with what it measured (read by
bench/multigpu_tables.py).

On CPU (fake devices, slow): `pytest -m slow tests/e2e/test_multihost_counts.py`.
On GPUs, one per process (2 and 4 processes; the test process stays on CPU):
`pytest -p no:xdist -m gpu -s tests/e2e/test_multihost_counts.py`.
"""

import json
import shutil

import numpy as np
import pytest
from multihost_runs import (checkpoint_arrays, data_state, host_metrics, launch, max_difference, params_digests,
                            sha256, visible_gpus)
from test_launch_e2e import TINY

# Measured per host and not computed from the shared batch: timings and this host's own
# rollout engine (its slots, its share of the tokens), which differ between hosts by design.
HOST_LOCAL = ("time", "throughput/", "rollout/engine/")
NAMES = ("many", "one", "many_then_one", "one_then_many")


def _shared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(HOST_LOCAL)}


def _hosts(name: str, processes: int) -> int:
    return processes if name in ("many", "one_then_many") else 1


def run_counts(tmp_path, platform: str, devices: int, processes: int, overrides: list[str], timeout: float) -> dict:
    """The four runs above on ``devices`` devices; what they logged and saved."""
    runs = {name: tmp_path / name for name in NAMES}
    first = [*overrides, "total_steps=2", "checkpoint.resume=false", "checkpoint.every_steps=1"]
    seconds = {"many": launch(runs["many"], processes, devices // processes, first, platform=platform,
                              timeout=timeout),
               "one": launch(runs["one"], 1, devices, first, platform=platform, timeout=timeout)}
    shutil.copytree(runs["many"], runs["many_then_one"])
    shutil.copytree(runs["one"], runs["one_then_many"])
    resumed = [*overrides, "total_steps=3", "checkpoint.resume=true"]
    seconds["many_then_one"] = launch(runs["many_then_one"], 1, devices, resumed, platform=platform, timeout=timeout)
    seconds["one_then_many"] = launch(runs["one_then_many"], processes, devices // processes, resumed,
                                      platform=platform, timeout=timeout)
    return collect(runs, processes, devices, platform, seconds)


def collect(runs: dict, processes: int, devices: int, platform: str, seconds: dict) -> dict:
    """What the four runs (folders by name) logged and saved."""
    return {
        "processes": processes, "devices": devices, "platform": platform, "seconds": seconds,
        "metrics": {name: [host_metrics(out, h) for h in range(_hosts(name, processes))] for name, out in runs.items()},
        "digests": {name: params_digests(out, _hosts(name, processes)) for name, out in runs.items()},
        "states": {(name, step): checkpoint_arrays(runs[name], step) for name, step in
                   (("many", 1), ("one", 1), ("many", 2), ("one", 2), ("many_then_one", 3), ("one_then_many", 3))},
        "data": {name: data_state(runs[name], 3) for name in ("many_then_one", "one_then_many")},
    }


def _difference(a: dict, b: dict) -> dict:
    diff, key = max_difference(a, b)
    return {"max_abs": diff, "at": key, "bitwise": all(np.array_equal(a[k], b[k]) for k in a)}


def measure(report: dict) -> dict:
    """What the runs show, as plain JSON (printed for the docs before anything is asserted)."""
    m, states = report["metrics"], report["states"]
    pairs = [(m["many"][0][s], m["one"][0][s]) for s in (1, 2)] + [(m["many_then_one"][0][3],
                                                                     m["one_then_many"][0][3])]
    keys = ("train_tokens", "rollout/trajectories", "rollout/sampled_tokens", "reward/mean")
    return {
        "processes": report["processes"], "devices": report["devices"], "platform": report["platform"],
        "seconds": {k: round(v, 1) for k, v in report["seconds"].items()},
        "steps": [{"step": a["step"], "loss": [a["loss"], b["loss"]], "train_tokens": [a["train_tokens"],
                   b["train_tokens"]], "same_trajectories": all(a[k] == b[k] for k in keys)} for a, b in pairs],
        "hosts_log_the_same": all(_shared(rows[0][s]) == _shared(host[s]) for rows in m.values() for host in rows
                                  for s in host),
        "hosts_hold_the_same_weights": all(d["sha256"] == ds[0]["sha256"] for ds in report["digests"].values()
                                           for d in ds),
        "state_after_step_1": _difference(states["many", 1], states["one", 1]),
        "state_after_step_2": _difference(states["many", 2], states["one", 2]),
        "state_after_step_3_resumed": _difference(states["many_then_one", 3], states["one_then_many", 3]),
    }


def check_counts(report: dict, *, identical_steps: tuple[int, ...], params_atol: dict[int, float]) -> None:
    """Hosts of one run agree bit for bit (metrics and weights); the process counts sample the
    same trajectories at ``identical_steps`` (to a close loss); the saved states after step s
    agree to ``params_atol[s]`` (s missing: measured and printed only)."""
    n, m = report["processes"], report["metrics"]
    summary = measure(report)
    print("\nMULTIHOST_REPORT " + json.dumps(summary))
    for name in ("many", "one_then_many"):  # every host logs the same metrics
        steps = [1, 2] if name == "many" else [3]
        assert len(m[name]) == n, name
        for host in m[name][1:]:  # (host 0's folder may hold the rows of the run it resumed)
            assert sorted(host) == steps, (name, sorted(host))
            for step in steps:
                assert _shared(m[name][0][step]) == _shared(host[step]), (name, step)
    assert summary["hosts_hold_the_same_weights"], {k: [d["step"] for d in v] for k, v in report["digests"].items()}
    # the digests are of the weights the checkpoint holds (the last step's params among its arrays)
    for name, step in (("many", 2), ("one_then_many", 3)):
        digest = report["digests"][name][0]
        assert digest["step"] == step and set(digest["sha256"].values()) <= {
            sha256(a) for a in report["states"][name, step].values()}, name
    assert sorted(m["many"][0]) == sorted(m["one"][0]) == [1, 2]
    # a resumed run keeps the rows its checkpoint's run logged (host 0's folder came with it)
    assert sorted(m["many_then_one"][0]) == sorted(m["one_then_many"][0]) == [1, 2, 3]
    # resumed across the count, both continue from the global batch the checkpoint's run stopped
    # at (the rest of the data state is this host's shard of it)
    assert [d["batches_served"] for d in report["data"].values()] == [3, 3], report["data"]
    for row in summary["steps"]:
        if row["step"] in identical_steps:  # the same trajectories, so the same loss
            assert row["same_trajectories"], row
            many, one = row["loss"]
            assert abs(many - one) <= 1e-4 * abs(one) + 1e-7, row
    for step, atol in params_atol.items():
        what = summary[f"state_after_step_{step}" + ("_resumed" if step == 3 else "")]
        assert what["max_abs"] <= atol, (step, what)
    for name in ("many_then_one", "one_then_many"):
        row = m[name][0][3]
        assert np.isfinite(row["loss"]) and row["skipped"] == 0 and row["update_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4], ids=["2proc", "4proc"])
def test_process_counts_agree_on_cpu(tmp_path, processes):
    # 4 hosts need prompts in multiples of 4 (each rolls out its share)
    overrides = [*TINY, "data.prompts_per_step=4"] if processes == 4 else TINY
    report = run_counts(tmp_path, "cpu", 8, processes, overrides, timeout=900)
    # Measured: the same tokens at every step; the train state within 6.0e-8 (2 processes) and
    # 1.2e-7 (4) after steps 1, 2 and 3, one float32 ulp of the largest weights (the
    # cross-process all-reduce sums in its own order), never bit for bit.
    check_counts(report, identical_steps=(1, 2, 3), params_atol={1: 1e-6, 2: 1e-6, 3: 1e-6})


# entropy_coef: after 20 SFT steps every group of the demo can score the same, and GRPO's loss
# and update are then exactly 0 (measured on 2 and 4 H200s); the entropy term gives every step a
# gradient through the whole model, so the comparison of the updates means something.
GPU_RUN = ["rollout.max_concurrent=64", "sft.steps=20", "algorithm.entropy_coef=0.01", "environment.num_eval_tasks=16", "eval.num_tasks=16",
           "eval.samples_per_task=2", "rollout.warmup=off"]


@pytest.mark.gpu
@pytest.mark.parametrize("processes", [2, 4], ids=["2proc", "4proc"])
def test_process_counts_agree_on_gpus(tmp_path, processes):
    if len(visible_gpus()) < processes:
        pytest.skip(f"needs {processes} CUDA GPUs (nvidia-smi -L, or CUDA_VISIBLE_DEVICES), have {len(visible_gpus())}")
    report = run_counts(tmp_path, "cuda", processes, processes, GPU_RUN, timeout=900)
    # Measured on 2 H100s (before the step-1 checkpoint was compared): step 1 samples the same
    # tokens, step 2 did not (976 vs 977 train tokens). Likely cause, not profiled: each host's
    # engine decodes on one GPU where one process splits the slots over two, so the decode GEMMs
    # have other shapes and round the logits differently, and a sampled token flips. The states
    # are printed, not bounded; a wrong batch order or seed fails step 1. On 2 H200s (94d0074)
    # step 1 itself sampled other tokens (1100 vs 1097): the SFT'd states differed by 3.8e-3,
    # because each process autotuned its own kernels (multihost_runs.GPU_DETERMINISM, since).
    check_counts(report, identical_steps=(1,), params_atol={})
