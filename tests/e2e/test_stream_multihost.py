"""Two `jax.distributed` processes on localhost CPU run asynchronous RL on the tiny config: the
stream (async_rl.mode='stream') and the step admission (mode='step').

Each process rolls out its half of the groups on its own engine (the stream: each step every
process takes its share of finished groups under the staleness bound), the processes exchange
them, and every process trains the same batch: the trainer compares a digest of the batch across processes every step
(and stops on a mismatch), and the test compares the digests each process logged.
"""

import json
import math
import re

import pytest
from test_multihost import launch_two_processes


@pytest.mark.slow  # two processes, compiles in each: ~2 min on the 2-core CPU
@pytest.mark.parametrize("mode", ["stream", "step"])
def test_two_processes_run_async_rl_and_train_identical_batches(tmp_path, mode):
    out = tmp_path / "run"
    outputs = launch_two_processes(out, 3, ["sft.steps=0", "async_rl.enabled=true", f"async_rl.mode={mode}",
                                            "async_rl.max_staleness=1", "async_rl.old_logprobs=snapshot"])
    digests = [re.findall(r"batch digest (\w+) \((\d+) trajectories", stderr) for _, stderr in outputs]
    assert len(digests[0]) == 3 and digests[0] == digests[1], digests  # the same batch, every step
    assert all(n == "8" for _, n in digests[0]) and len({d for d, _ in digests[0]}) == 3
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(steps) == [1, 2, 3]
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["update_norm"] > 0
        assert m["rollout/trajectories"] == 8  # 2 prompts (one per process) x 4 samples
        assert m["async/trajectory_staleness_max"] <= 1 and m["async/staleness_violations"] == 0
