"""The layout and chat-template settings of a run: ``environment.layout`` / ``tool_format`` pick
the inline or native environment of a section, ``model.chat_template_kwargs`` reaches every
render; a layout a section does not implement, or a reserved template key, is an error
naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from agentrl_jax.config import (Config, ConfigError, EnvironmentConfig, apply_overrides, config_field, load_config,
                                register_environment)
from agentrl_jax.config.environments import _ENVIRONMENTS
from agentrl_jax.envs import ArithmeticEnv, ReToolEnv, SearchEnv
from agentrl_jax.envs.tools import NativeReToolEnv, NativeSearchEnv


def factory(config: Config):
    return config.environment.make_env_factory(config, pool=None, verifier=None, count_tokens=None)


def test_layout_selects_the_inline_or_native_environment(tmp_path):
    arithmetic = apply_overrides(Config(), ["environment.layout=native", "environment.tool_format=llama3"])
    env = factory(arithmetic)()
    assert isinstance(env, NativeReToolEnv) and env.config.tool_format == "llama3" and env.stop_strings == ()
    assert type(factory(Config())()) is ArithmeticEnv
    retool = apply_overrides(Config(), ["environment.name=retool"])
    assert type(factory(retool)()) is ReToolEnv
    assert isinstance(factory(apply_overrides(retool, ["environment.layout=native"]))(), NativeReToolEnv)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "Zorvia", "text": "The capital is Quellin."}) + "\n")
    search = apply_overrides(Config(), ["environment.name=search", f"environment.corpus_path={corpus}"])
    assert type(factory(search)()) is SearchEnv
    assert isinstance(factory(apply_overrides(search, ["environment.layout=native"]))(), NativeSearchEnv)


def test_a_layout_the_section_does_not_implement_is_refused():
    @register_environment("inline_only")
    @dataclass(frozen=True)
    class InlineOnly(EnvironmentConfig):
        name: str = config_field("inline_only", "Which environment runs the episodes.")

        def make_env_factory(self, config, *, pool, verifier, count_tokens):
            raise AssertionError("not built in this test")

    try:
        with pytest.raises(ConfigError, match=r"environment\.layout: 'native' is not implemented by "
                                              r"environment\.name='inline_only' \(it has \['inline'\]\)"):
            apply_overrides(Config(), ["environment.name=inline_only", "environment.layout=native"])
    finally:
        _ENVIRONMENTS.pop("inline_only")
    with pytest.raises(ConfigError, match=r"environment\.tool_format: got 'qwen'"):
        apply_overrides(Config(), ["environment.tool_format=qwen"])


def test_chat_template_kwargs_from_the_command_line_and_the_qwen3_config():
    config = apply_overrides(Config(), ['model.chat_template_kwargs={"enable_thinking": false}'])
    assert config.model.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"model\.chat_template_kwargs: sets \['add_generation_prompt', "
                                          r"'tools'\], which each render passes itself"):
        apply_overrides(Config(), ['model.chat_template_kwargs={"tools": [], "add_generation_prompt": true}'])
    with pytest.raises(ConfigError, match=r"model\.chat_template_kwargs: expected JSON"):
        apply_overrides(Config(), ["model.chat_template_kwargs=enable_thinking"])
    qwen3 = load_config("configs/retool_qwen3_native.py", ["model.path=/m", "data.train_path=t.jsonl",
                                                            "data.eval_path=e.jsonl"])
    assert (qwen3.environment.name, qwen3.environment.layout, qwen3.environment.tool_format) == (
        "retool", "native", "hermes")
    assert qwen3.model.chat_template_kwargs == {"enable_thinking": True}
