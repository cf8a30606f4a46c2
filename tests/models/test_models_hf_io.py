"""HF checkpoint I/O: exact round trip, transformers loads the export, shards, bf16, errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers

from agentrl_jax.models import DecoderConfig, split_params
from agentrl_jax.models.hf_io import (
    CheckpointError,
    load_hf_checkpoint,
    load_hf_params,
    save_hf_checkpoint,
)
from agentrl_jax.models.tiny import save_tiny_hf_checkpoint

IDS = np.random.default_rng(0).integers(0, 97, (2, 12))


def _flat(params):
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(params)
    }


def _hf_logits(path, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


@pytest.mark.parametrize("name", ["qwen2_tied", "llama3_scaled"])
def test_load_export_load_round_trip_is_exact(tiny_checkpoints, tmp_path, name):
    src = tiny_checkpoints[name]
    config, _, params = load_hf_params(src)
    out = save_hf_checkpoint(params, config, tmp_path / "export")
    config2, _, params2 = load_hf_params(out)
    assert config2 == config
    a, b = _flat(params), _flat(params2)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    np.testing.assert_array_equal(_hf_logits(out), _hf_logits(src))
    original = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
    exported = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(
        k for k in original if not (config.tie_word_embeddings and k == "lm_head.weight")
    )
    for key in exported:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)


def test_index_sharded_checkpoints_load_and_export(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["qwen3"]
    model = load_hf_checkpoint(src)
    # A transformers-written index-sharded copy loads to the same params.
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="60KB")
    assert os.path.exists(tmp_path / "hf_sharded" / "model.safetensors.index.json")
    resharded = load_hf_checkpoint(tmp_path / "hf_sharded")
    a, b = _flat(split_params(model)[1]), _flat(split_params(resharded)[1])
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # Our sharded export loads in transformers with the same logits.
    out = save_hf_checkpoint(model, model.config, tmp_path / "ours", max_shard_bytes=40_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 2
    np.testing.assert_array_equal(_hf_logits(out), _hf_logits(src))


def test_bfloat16_export_and_load(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["qwen3"]
    config, _, params = load_hf_params(src)
    out = save_hf_checkpoint(params, config, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    ours = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    reference = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
    for key, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[key].to(torch.bfloat16)), key
    _, _, bf16_params = load_hf_params(out, dtype=jnp.bfloat16)
    a, b = _flat(params), _flat(bf16_params)
    for key in a:
        assert b[key].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a[key].astype(ml_dtypes.bfloat16), b[key], err_msg=key)
    # bf16 weights and compute stay close to transformers' bf16 forward.
    model = load_hf_checkpoint(out, dtype=jnp.bfloat16)
    ours = np.asarray(
        jax.jit(lambda ids: model.logits(model(ids, jnp.arange(12)[None].repeat(2, 0))))(IDS)
    )
    theirs = _hf_logits(out, torch.bfloat16)
    assert np.isfinite(theirs).all()
    assert np.abs(ours - theirs).max() < 0.1 * np.abs(theirs).max()


@pytest.fixture
def broken_copy(tiny_checkpoints, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["qwen3"], dst)
    return dst


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    config.update(changes)
    json.dump(config, open(file, "w"))


def test_missing_tensor_is_named(broken_copy):
    _edit_tensors(broken_copy, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.self_attn.k_norm.weight'\]"
    ):
        load_hf_checkpoint(broken_copy)


def test_unexpected_tensor_is_named(broken_copy):
    _edit_tensors(
        broken_copy,
        lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}),
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor\(s\) \['model.layers.0.mlp.extra.weight'\]"
    ):
        load_hf_checkpoint(broken_copy)


def test_shape_mismatch_is_named(broken_copy):
    _edit_config(broken_copy, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[128, 64\], "
        r"the config implies \[96, 64\]",
    ):
        load_hf_checkpoint(broken_copy)


def test_unsupported_architecture_is_named(broken_copy):
    _edit_config(broken_copy, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture MistralForCausalLM; supported: "
        r"\['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]",
    ):
        load_hf_checkpoint(broken_copy)


HF4_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
    "bos_token_id": 128000,
}


def test_config_reads_transformers_4_and_5_layouts():
    v4 = DecoderConfig.from_hf(HF4_LLAMA)
    v5_dict = {
        k: v for k, v in HF4_LLAMA.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")
    }
    v5_dict["rope_parameters"] = {**HF4_LLAMA["rope_scaling"], "rope_theta": 500000.0}
    v5_dict["dtype"] = "bfloat16"
    v5 = DecoderConfig.from_hf(v5_dict)
    assert v4 == v5
    assert v4.head_dim == 16 and v4.rope_theta == 500000.0 and v4.rope_scaling.factor == 32.0
    assert v4.eos_token_ids == (128001, 128008, 128009) and v4.tie_word_embeddings
    assert DecoderConfig.from_hf(v4.to_hf_dict()) == v4


def test_config_rejects_bad_values():
    with pytest.raises(
        ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"
    ):
        DecoderConfig.from_hf({**HF4_LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        DecoderConfig.from_hf({**HF4_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_tiny_checkpoint_round_trips_through_config(tmp_path):
    path = save_tiny_hf_checkpoint(
        tmp_path / "q2",
        "qwen2",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        num_kv_heads=1,
    )
    config = DecoderConfig.from_hf(path)
    assert config.attention_bias and not config.qk_norm and config.architecture == "qwen2"
