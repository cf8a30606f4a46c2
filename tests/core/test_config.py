"""Config: loading, overrides with type conversion, and errors that name the field."""

import dataclasses
import textwrap

import pytest
from repo_scripts import load_script

from agentrl_jax import config as cfg
from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.envs import ArithmeticEnvConfig, SearchEnvConfig


def test_defaults_are_valid_and_frozen():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 3  # type: ignore[misc]


def test_overrides_convert_types():
    c = apply_overrides(
        Config(),
        [
            "optimizer.learning_rate=3e-6",
            "algorithm.group_size=4",
            "checkpoint.async_save=false",
            "environment.sandbox.timeout_s=2",
            "name=run7",
            "algorithm.aggregation=seq-mean-token-sum",
        ],
    )
    assert c.optimizer.learning_rate == 3e-6
    assert c.algorithm.group_size == 4
    assert c.checkpoint.async_save is False
    assert c.environment.sandbox.timeout_s == 2.0 and isinstance(c.environment.sandbox.timeout_s, float)
    assert c.name == "run7"
    assert c.algorithm.aggregation == "seq-mean-token-sum"


def test_unknown_key_names_the_key_and_lists_known():
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate' in optimizer; known keys: .*learning_rate"):
        apply_overrides(Config(), ["optimizer.lerning_rate=1e-6"])
    with pytest.raises(ConfigError, match=r"unknown key 'optimiser' in the top level"):
        apply_overrides(Config(), ["optimiser.learning_rate=1e-6"])


def test_bad_type_names_the_field():
    with pytest.raises(ConfigError, match=r"algorithm.group_size: expected an int, got 'eight'"):
        apply_overrides(Config(), ["algorithm.group_size=eight"])
    with pytest.raises(ConfigError, match=r"rollout.temperature: expected a float"):
        cfg.RolloutConfig(temperature="hot")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"algorithm.aggregation: got 'mean'; allowed values are 'token-mean'"):
        apply_overrides(Config(), ["algorithm.aggregation=mean"])
    with pytest.raises(ConfigError, match=r"checkpoint.resume: expected a bool"):
        apply_overrides(Config(), ["checkpoint.resume=maybe"])


def test_bad_combinations_name_the_fields():
    with pytest.raises(ConfigError, match=r"algorithm.group_size: must be >= 2 for the group estimator 'grpo'"):
        apply_overrides(Config(), ["algorithm.group_size=1"])
    with pytest.raises(ConfigError, match=r"algorithm.minibatches \(3\) must divide"):
        apply_overrides(Config(), ["algorithm.minibatches=3"])
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_length \(4096\) must be < rollout.max_sequence_length"):
        apply_overrides(Config(), ["rollout.max_prompt_length=4096"])
    with pytest.raises(ConfigError, match=r"environment.sandbox.url: is required"):
        apply_overrides(Config(), ["environment.sandbox.backend=remote"])
    with pytest.raises(ConfigError, match=r"at most one of data/fsdp/tensor may be -1"):
        apply_overrides(Config(), ["mesh.data=-1"])


def test_load_config_file_and_bare_name(tmp_path, monkeypatch):
    p = tmp_path / "mine.py"
    p.write_text(
        textwrap.dedent(
            """
            from agentrl_jax.config import Config, OptimizerConfig
            def get_config():
                return Config(name="mine", optimizer=OptimizerConfig(learning_rate=2e-5))
            """
        )
    )
    c = cfg.load_config(str(p), ["seed=5"])
    assert (c.name, c.seed, c.optimizer.learning_rate) == ("mine", 5, 2e-5)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "other.py").write_text(p.read_text())
    assert cfg.load_config("other").name == "mine"
    with pytest.raises(ConfigError, match=r"config file 'nope' not found; known configs: .*other"):
        cfg.load_config("nope")


def test_dict_round_trip_and_strictness():
    c = apply_overrides(Config(), ["algorithm.loss=gspo", "mesh.tensor=2"])
    assert cfg.from_dict(cfg.to_dict(c)) == c
    d = cfg.to_dict(c)
    d["algorithm"]["epsilon"] = 0.1
    with pytest.raises(ConfigError, match=r"algorithm.epsilon: unknown key"):
        cfg.from_dict(d)


def test_describe_lists_every_field():
    text = cfg.describe()
    assert "optimizer.learning_rate = 1e-06  # Peak learning rate" in text
    assert "environment.sandbox.timeout_s" in text


def test_shipped_configs_load_and_retool_requires_paths():
    assert cfg.load_config("configs/demo.py").environment.name == "arithmetic"
    assert cfg.load_config("configs/demo_hybrid.py").hybrid.mode == "hybrid"
    with pytest.raises(ConfigError, match=r"model.path: is required for environment.name='retool'"):
        cfg.load_config("retool")
    c = cfg.load_config("retool", ["model.path=/m", "data.train_path=/t.parquet", "data.eval_path=/e.jsonl"])
    assert (c.algorithm.eps_low, c.algorithm.eps_high, c.environment.outcome_scheme) == (0.2, 0.28, "pm1")


def test_unknown_loss_name_lists_registered(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.loss: unknown name 'ppo2'; registered: .*cispo.*ppo"):
        cfg.load_config("demo", ["algorithm.loss=ppo2"])


def test_gae_trains_a_critic_with_one_sample_per_prompt():
    c = apply_overrides(Config(), ["algorithm.advantage=gae", "algorithm.group_size=1", "critic.lam=0.95",
                                   "critic.turn_level=true", "critic.learning_rate=1e-5"])
    assert (c.critic.lam, c.critic.turn_level, c.critic.learning_rate) == (0.95, True, 1e-5)
    for overrides, message in [(["critic.gamma=1.5"], r"critic.gamma: must be in \[0, 1\], got 1.5"),
                               (["critic.value_clip=-1"], r"critic.value_clip: must be >= 0"),
                               (["critic.learning_rate=-1"], r"critic.learning_rate: must be >= 0")]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(Config(), ["algorithm.advantage=gae", *overrides])


def test_loss_hparams_from_the_command_line():
    c = apply_overrides(Config(), ["algorithm.loss=cispo", 'algorithm.loss_hparams=[["eps_min", 0.1], ["eps_max", 4]]'])
    assert c.algorithm.loss_hparams == (("eps_min", 0.1), ("eps_max", 4.0))
    with pytest.raises(ConfigError, match=r"algorithm.loss_hparams: loss 'ppo' takes no \['beta'\]"):
        apply_overrides(Config(), ['algorithm.loss_hparams=[["beta", 0.1]]'])
    from agentrl_jax.train.build import loss_settings

    c = apply_overrides(Config(), ["algorithm.loss=cispo"])
    assert dict(loss_settings(c).hparams)["eps_max"] == pytest.approx(1.28)
    c = apply_overrides(c, ['algorithm.loss_hparams=[["eps_max", 4.0]]'])
    assert dict(loss_settings(c).hparams)["eps_max"] == 4.0
    with pytest.raises(ConfigError, match="names repeat"):
        apply_overrides(Config(), ['algorithm.loss_hparams=[["a", 1], ["a", 2]]'])


def test_update_speed_choices_reach_the_trainer():
    """``algorithm.logprob_chunk_tokens`` sets the update's logprob chunks; ``model.lm_head_dtype``
    is 'param' or 'compute' (docs/benchmarks.md, 'Train step')."""
    from agentrl_jax.train.build import loss_settings

    c = apply_overrides(Config(), ["algorithm.logprob_chunk_tokens=8192", "model.lm_head_dtype=compute"])
    assert loss_settings(c).chunk_size == 8192 and c.model.lm_head_dtype == "compute"
    assert loss_settings(Config()).chunk_size == 1024
    with pytest.raises(ConfigError, match=r"algorithm.logprob_chunk_tokens: must be >= 1"):
        apply_overrides(Config(), ["algorithm.logprob_chunk_tokens=0"])
    with pytest.raises(ConfigError, match=r"model.lm_head_dtype: got 'bfloat16'"):
        apply_overrides(Config(), ["model.lm_head_dtype=bfloat16"])


def test_cudnn_attention_needs_16_bit_compute():
    with pytest.raises(ConfigError, match=r"model.attention_impl: 'cudnn' needs model.compute_dtype='bfloat16'"):
        apply_overrides(Config(), ["model.attention_impl=cudnn", "model.compute_dtype=float32"])
    assert apply_overrides(Config(), ["model.attention_impl=cudnn"]).model.compute_dtype == "bfloat16"


# Every key of the former flat environment section, on the environments it applied to.
_SHARED = ["max_turns=5", "max_tool_calls=1", "max_observation_tokens=32", "system_prompt=hi", "outcome_scheme=pm1",
           "format_weight=0.1", "tool_weight=0", "overlong_buffer=0", "sandbox.workers=2", "sandbox.timeout_s=3"]
_OWN = {"demo": ["min_digits=1", "max_digits=3", "num_train_tasks=10", "num_eval_tasks=5", "demo_tool_fraction=0.2"],
        "retool": [],
        "search_r1": ["corpus_path=c.jsonl", "top_k=2", "answer_metric=f1", "retriever_timeout_s=3"]}


@pytest.mark.parametrize("name", sorted(_OWN))
def test_environment_keys_of_the_flat_section_still_set(name):
    keys = [f"environment.{k}" for k in _SHARED + _OWN[name]]
    c = cfg.apply_overrides(cfg.load_config(f"configs/{name}.py") if name == "demo" else _base(name), keys)
    for item in keys:
        key, value = item.split("=")
        got = c
        for part in key.split("."):
            got = getattr(got, part)
        assert str(got) == value or got == type(got)(value), key


def _base(name):
    # load_config would ask for the data paths; the keys are what is under test
    return load_script(f"configs/{name}.py", f"_cfg_{name}").get_config()


def test_switching_environment_from_the_command_line():
    demo = cfg.load_config("configs/demo.py")
    c = cfg.apply_overrides(demo, ["environment.name=search", "environment.corpus_path=c.jsonl",
                                   "environment.sandbox.workers=3"])
    assert isinstance(c.environment, SearchEnvConfig) and c.environment.corpus_path == "c.jsonl"
    assert c.environment.max_turns == demo.environment.max_turns and c.environment.sandbox.workers == 3
    with pytest.raises(cfg.ConfigError, match=r"'min_digits' is a field of environment\.name='arithmetic'"):
        cfg.apply_overrides(demo, ["environment.name=search", "environment.min_digits=2"])
    with pytest.raises(cfg.ConfigError, match=r"environment\.name: unknown environment 'serach'; registered:"):
        cfg.apply_overrides(demo, ["environment.name=serach"])
    assert isinstance(cfg.Config().environment, ArithmeticEnvConfig)


def test_decode_compiler_options_text_reaches_the_engine_as_a_dict_and_bad_text_names_the_field():
    def engine_options(text):
        return apply_overrides(Config(), [f"rollout.decode_compiler_options={text}"]).rollout.engine_kwargs()[
            "decode_compiler_options"]

    assert Config().rollout.engine_kwargs()["decode_compiler_options"] is None  # the engine's platform default
    assert engine_options("none") == {}
    assert engine_options("xla_gpu_enable_triton_gemm=false, xla_gpu_autotune_level=2") == {
        "xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 2}
    with pytest.raises(ConfigError, match=r"rollout.decode_compiler_options: 'cublas' is not name=value"):
        apply_overrides(Config(), ["rollout.decode_compiler_options=cublas"])
