"""The run lifecycle pieces of train/run.py and train/build.py that need no training: resume step,
starting over, frozen models from the starting policy. End to end (kill -9, resume):
tests/e2e/test_launch_e2e.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.train.build import build_roles
from agentrl_jax.train.checkpoint import Checkpointer, restore_pytree, save_pytree
from agentrl_jax.train.run import _resume_step, _start_over


def test_resume_step_is_the_newest_checkpoint_and_refuses_one_past_total_steps(tmp_path):
    config = apply_overrides(Config(), [f"output_dir={tmp_path}", "total_steps=4", "checkpoint.resume=true"])
    assert _resume_step(config, tmp_path) is None
    with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        for step in (2, 5):
            ckpt.save(step, {"x": jnp.ones(2)}, force=True)
    with pytest.raises(ConfigError, match=r"total_steps: 4 is below the step of the checkpoint to resume \(5"):
        _resume_step(config, tmp_path)
    assert _resume_step(apply_overrides(config, ["total_steps=5"]), tmp_path) == 5
    assert _resume_step(apply_overrides(config, ["checkpoint.resume=false"]), tmp_path) is None


def test_start_over_removes_the_outputs_of_an_earlier_run_and_nothing_else(tmp_path):
    for name in ("checkpoints/3", "metrics", "sft_metrics", "init/model", "export"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "f").write_text("x")
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    _start_over(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_pytree_save_replaces_and_restores_exactly_in_the_target_shardings(tmp_path):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(jax.make_mesh((4, 2), ("fsdp", "tensor")), P("fsdp", "tensor"))
    first = {"w": jax.device_put(jax.random.normal(jax.random.key(0), (8, 4)), sharding)}
    second = {"w": jax.device_put(jax.random.normal(jax.random.key(1), (8, 4)), sharding)}
    save_pytree(tmp_path / "p", first)
    save_pytree(tmp_path / "p", second)  # a run that starts over writes it again
    restored = restore_pytree(tmp_path / "p", {"w": jnp.zeros((8, 4))})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(second["w"]))
    target = {"w": jax.device_put(jnp.zeros((8, 4)), sharding)}
    assert restore_pytree(tmp_path / "p", target)["w"].sharding == sharding


def test_frozen_models_are_copies_of_the_starting_policy_not_of_the_trained_state():
    """Resume bug: reference, teacher and judge were copied from the restored (trained) policy.
    The roles are built from the starting policy alone: the trained state is not an input."""
    config = apply_overrides(Config(), ["algorithm.kl_coef=0.1", "hybrid.mode=hybrid", "hybrid.judge=reference",
                                        "hybrid.teacher_dtype=float32", "model.reference_dtype=bfloat16"])
    initial = {"w": jnp.arange(4.0)}
    roles = build_roles(config, "graphdef", initial, None, tokenizer=None, driver=None, start_step=3)
    np.testing.assert_array_equal(np.asarray(roles.reference["w"], np.float32), [0, 1, 2, 3])
    assert roles.reference["w"].dtype == jnp.bfloat16
    assert roles.policy == roles.teacher.graphdef == "graphdef" and roles.teacher.params["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(roles.teacher.params["w"]), [0, 1, 2, 3])
    assert roles.judge.params is roles.reference and roles.judge.calls == 3
    roles.check(config)


def test_reference_teacher_is_the_reference_checkpoint_in_any_dtype(monkeypatch):
    """teacher=reference with model.reference_path and another dtype was a copy of the starting policy."""
    from agentrl_jax.train import build

    config = apply_overrides(Config(), ["algorithm.kl_coef=0.1", "model.reference_path=/ref", "hybrid.mode=hybrid",
                                        "hybrid.teacher_dtype=float32", "model.reference_dtype=bfloat16"])
    initial = {"w": jnp.arange(4.0)}
    # the checkpoint at /ref: its params (loading an HF checkpoint is tested in tests/models)
    monkeypatch.setattr(build, "reference_params",
                        lambda config, initial, mesh: {"w": jnp.arange(4.0, dtype=jnp.bfloat16) + 50})
    roles = build_roles(config, "graphdef", initial, None, tokenizer=None, driver=None, start_step=0)
    assert roles.teacher.params["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(roles.teacher.params["w"]), [50, 51, 52, 53])


def test_resume_without_the_saved_post_sft_policy_is_refused(tmp_path):
    from agentrl_jax.train.run import _restore_initial_policy

    with pytest.raises(ConfigError, match="checkpoint.resume: the reference / teacher is the post-SFT policy"):
        _restore_initial_policy(tmp_path, {"w": jnp.zeros(2)})
    save_pytree(tmp_path / "init" / "sft_policy", {"w": jnp.ones(2)})
    np.testing.assert_array_equal(np.asarray(_restore_initial_policy(tmp_path, {"w": jnp.zeros(2)})["w"]), [1, 1])


def test_a_reference_of_another_architecture_is_refused_before_training(tmp_path):
    from transformers import Qwen3Config

    from agentrl_jax.models import DecoderConfig
    from agentrl_jax.train.build import check_reference_architecture

    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16)
    Qwen3Config(**hf).save_pretrained(tmp_path / "same")
    Qwen3Config(**{**hf, "hidden_size": 48}).save_pretrained(tmp_path / "wider")
    policy = DecoderConfig.from_hf(tmp_path / "same")
    for path, ok in ((tmp_path / "same", True), (tmp_path / "wider", False)):
        config = apply_overrides(Config(), ["algorithm.kl_coef=0.1", f"model.reference_path={path}"])
        if ok:
            check_reference_architecture(config, policy)
        else:
            with pytest.raises(ConfigError, match=r"model.reference_path: .* \(hidden_size: 48 vs the policy's 32\)"):
                check_reference_architecture(config, policy)
