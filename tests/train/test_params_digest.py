"""`multihost.write_params_digest`: one sha256 per array, of its bytes, whatever its sharding."""

import hashlib
import json

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from agentrl_jax.sharding import make_mesh
from agentrl_jax.train import multihost


def test_the_digest_is_of_the_whole_array_whatever_its_sharding(tmp_path):
    rng = np.random.default_rng(0)
    host = {"embed": rng.standard_normal((8, 4)).astype(np.float32), "norm": np.ones(4, np.float32)}
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    sharded = {"embed": jax.device_put(host["embed"], NamedSharding(mesh, PartitionSpec("fsdp"))),
               "norm": jax.device_put(host["norm"], NamedSharding(mesh, PartitionSpec()))}
    written = json.loads(multihost.write_params_digest(tmp_path, sharded, step=3).read_text())
    assert written["step"] == 3
    assert written["sha256"] == {f"['{k}']": hashlib.sha256(v.tobytes()).hexdigest() for k, v in host.items()}
    host["embed"][0, 0] = np.nextafter(host["embed"][0, 0], np.float32(np.inf))  # one ulp: another digest
    changed = json.loads(multihost.write_params_digest(tmp_path, host, step=3).read_text())
    assert changed["sha256"]["['embed']"] != written["sha256"]["['embed']"]
    assert changed["sha256"]["['norm']"] == written["sha256"]["['norm']"]
