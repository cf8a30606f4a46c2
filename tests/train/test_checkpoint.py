"""Checkpointer: sharded round trip, keep-N, data state / rng / config, SIGTERM preemption."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.train.checkpoint import Checkpointer, abstract_target

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sharded_state(seed=0):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    keys = jax.random.split(jax.random.key(seed), 3)
    return {
        "params": {
            "w": jax.device_put(jax.random.normal(keys[0], (8, 4)), NamedSharding(mesh, P("fsdp", "tensor"))),
            "b": jax.device_put(jax.random.normal(keys[1], (4,), jnp.bfloat16), NamedSharding(mesh, P("tensor"))),
        },
        "opt": {"mu": jax.device_put(jnp.arange(16, dtype=jnp.float32), NamedSharding(mesh, P("fsdp"))),
                "count": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P()))},
        "rng": keys[2],
    }


def assert_same(restored, expected):
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert got.dtype == want.dtype and got.shape == want.shape
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        else:
            assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (got.sharding, want.sharding)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sharded_round_trip_with_data_state_rng_and_config(tmp_path):
    state = sharded_state(seed=1)
    data_state = {"grain": {"next_index": 7}, "batches_served": 7, "fingerprint": {"seed": 0, "num_epochs": None}}
    rng = jax.random.key(42)
    config = {"lr": 1e-6, "mesh": [4, 2], "name": "demo"}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.restore_latest(state) is None
        assert ckpt.save(3, state, data_state=data_state, rng=rng, config_dict=config, extra={"params_version": 3})
        ckpt.wait_until_finished()
    # A fresh manager (as after a restart) and a target with other values, same shardings.
    target = sharded_state(seed=2)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        step, restored, got_data, got_rng, got_config, extra = ckpt.restore_latest(target)
    assert step == 3
    assert_same(restored, state)
    assert got_data == data_state and got_config == config and extra == {"params_version": 3}
    np.testing.assert_array_equal(jax.random.key_data(got_rng), jax.random.key_data(rng))
    raw = jax.random.PRNGKey(5)
    with Checkpointer(tmp_path / "raw") as ckpt:
        ckpt.save(1, {"x": jnp.ones(2)}, rng=raw)
        ckpt.wait_until_finished()
        restored = ckpt.restore_latest({"x": jnp.zeros(2)})
    assert restored.rng.dtype == jnp.uint32 and (restored.rng == raw).all() and restored.data_state == {}


def test_restore_into_other_shardings_from_shape_dtype_structs(tmp_path):
    state = sharded_state(seed=1)
    mesh = jax.make_mesh((8,), ("data",))
    replicated = NamedSharding(mesh, P())
    target = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                          else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        restored = ckpt.restore_latest(target)
    assert restored.state["params"]["w"].sharding == replicated
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.asarray(state["params"]["w"]))


def test_target_without_concrete_sharding_is_rejected():
    with pytest.raises(ValueError, match=r"\['w'\] has no concrete sharding"):
        abstract_target({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_keep_n_and_interval(tmp_path):
    state = {"x": jnp.arange(4.0)}
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        saved = [ckpt.save(step, {"x": state["x"] + step}) for step in range(1, 8)]
        assert ckpt.save(7, {"x": state["x"] + 7}, force=True)
        ckpt.wait_until_finished()
        assert saved == [True, True, False, True, False, True, False]  # orbax: the first save always happens
        assert ckpt.all_steps() == [6, 7]
        latest = ckpt.restore_latest({"x": jnp.zeros(4)})
    assert latest.step == 7 and latest.state["x"].tolist() == [7.0, 8.0, 9.0, 10.0]
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]


def test_bad_json_items_name_the_argument(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match="config_dict is not JSON-serializable"):
            ckpt.save(1, {"x": jnp.ones(1)}, config_dict={"f": object()})


def test_sigterm_to_own_process_saves_at_next_step_boundary(tmp_path):
    seen = []
    ckpt = Checkpointer(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ckpt.install_sigterm_handler(callback=seen.append)
        state, step = {"x": jnp.zeros(3)}, 0
        while step < 100:
            state = {"x": state["x"] + 1}
            step += 1
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            if ckpt.should_stop():
                ckpt.save(step, state, data_state={"batches_served": step}, force=True)
                break
        ckpt.wait_until_finished()
        assert seen == [signal.SIGTERM] and ckpt.preemption_requested
        assert step == 4 and ckpt.all_steps() == [4]
        restored = ckpt.restore_latest({"x": jnp.zeros(3)})
        assert restored.state["x"].tolist() == [4.0, 4.0, 4.0] and restored.data_state == {"batches_served": 4}
        assert signal.getsignal(signal.SIGTERM) == previous  # one-shot: a second SIGTERM is not swallowed
    finally:
        ckpt.close()
        signal.signal(signal.SIGTERM, previous)


TRAINER_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    from agentrl_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
    ckpt.install_sigterm_handler()
    restored = ckpt.restore_latest({"x": jnp.zeros(3)})
    step, state = (restored.step, restored.state) if restored else (0, {"x": jnp.zeros(3)})
    print("ready", step, flush=True)
    while True:
        state = {"x": state["x"] + 1}
        step += 1
        time.sleep(0.05)
        if ckpt.should_stop():
            ckpt.save(step, state, force=True)
            break
    ckpt.close()
    print("saved", step, flush=True)
""")


def test_sigterm_to_a_training_process_saves_and_exits_cleanly(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().split() == ["ready", "0"]
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    saved_step = int(out.split()[-1])
    assert saved_step >= 1
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore_latest({"x": jnp.zeros(3)})
    assert restored.step == saved_step and restored.state["x"].tolist() == [float(saved_step)] * 3


def test_resume_through_a_checkpoint_continues_the_data_and_rng_stream(tmp_path):
    from agentrl_jax.data import BatchIterator, TaskRecord

    records = [TaskRecord(prompt=f"q{i}", answer=str(i), id=str(i)) for i in range(10)]

    def run(steps, ckpt_dir=None, resume=False):
        batches, rng, seen = BatchIterator(records, batch_size=4, seed=11), jax.random.key(0), []
        state, start = {"x": jnp.zeros(())}, 0
        with Checkpointer(ckpt_dir or tmp_path / "unused") as ckpt:
            if resume:
                start, state, data_state, rng, _, _ = ckpt.restore_latest(state)
                batches.set_state(data_state)
            for step in range(start + 1, steps + 1):
                ids = [r.id for r in next(batches)]
                noise = jax.random.uniform(jax.random.fold_in(rng, step))
                state = {"x": state["x"] + noise}
                seen.append((ids, float(noise)))
                if ckpt_dir is not None:
                    ckpt.save(step, state, data_state=batches.get_state(), rng=rng)
        return seen, float(state["x"])

    uninterrupted, final = run(7)
    first_part, _ = run(4, ckpt_dir=tmp_path / "ckpt")
    resumed, resumed_final = run(7, ckpt_dir=tmp_path / "ckpt", resume=True)
    assert first_part + resumed == uninterrupted
    assert resumed_final == final


MULTIHOST_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from agentrl_jax.train.checkpoint import Checkpointer

    sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))
    x = jax.make_array_from_process_local_data(sharding, np.full((jax.local_device_count(),), pid, np.float32))
    ckpt = Checkpointer(directory)
    step = 0
    while step < 50:
        step += 1
        if pid == 0 and step == 3:
            ckpt.request_stop()  # only host 0 is "preempted"
        if ckpt.should_stop():
            ckpt.save(step, {"x": x}, force=True)
            break
    ckpt.wait_until_finished()
    restored = ckpt.restore_latest({"x": x})
    ckpt.close()
    print("stopped", step, restored.step, *sorted(float(s.data[0]) for s in restored.state["x"].addressable_shards))
""")


def test_two_processes_agree_to_stop_and_save_together(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    script = tmp_path / "multihost.py"
    script.write_text(MULTIHOST_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, str(script), str(pid), str(port), str(tmp_path / "ckpt")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for pid in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(out.splitlines()[-1].split())  # gloo prints its own lines first
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert outputs == [["stopped", "3", "3", "0.0", "0.0"], ["stopped", "3", "3", "1.0", "1.0"]]


def test_relative_directory_is_resolved(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from agentrl_jax.train.checkpoint import Checkpointer

    monkeypatch.chdir(tmp_path)
    with Checkpointer("runs/rel", async_save=False) as ckpt:
        assert ckpt.directory == str(tmp_path / "runs" / "rel")
        ckpt.save(1, {"w": jnp.ones(3)}, force=True)
        ckpt.wait_until_finished()
    assert (tmp_path / "runs" / "rel" / "1").is_dir()
