"""GGUF -> HF directory (models/gguf.py) on tiny files written like llama.cpp writes them."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.models import Llama3RopeScaling, Tokenizer
from agentrl_jax.models.gguf import GGUFError, convert_gguf, gguf_decoder_config, hf_tensor_name, open_gguf
from agentrl_jax.models.gguf_cache import converted_gguf
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.safetensors_io import SafetensorsCheckpoint
from agentrl_jax.train.setup import prepare_model_assets
from gguf_helpers import CHAT_TEMPLATE, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
# name -> (architecture, head_dim, tied). Qwen3's heads are 128 wide whatever the width (so the file
# states attention.key_length), which is also what transformers' GGUF loader assumes for qwen3.
MODELS = {"llama": ("llama", 16, False), "qwen2": ("qwen2", 16, True), "qwen3": ("qwen3", 128, True)}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """name -> (gguf path, converted HF dir, HF tensors as quantization leaves them)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, (arch, head_dim, tied) in MODELS.items():
        path = root / f"{name}.gguf"
        expected = write_tiny_gguf(path, arch, head_dim=head_dim, tied=tied, seed=len(out))
        out[name] = (path, convert_gguf(path, root / name), expected)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_converted_tensors_are_the_dequantized_hf_tensors(tiny_ggufs, name):
    """Exact equality with the HF-layout weights: covers names, shapes and Llama's q/k un-permutation."""
    path, directory, expected = tiny_ggufs[name]
    ckpt = SafetensorsCheckpoint(directory)
    assert ckpt.names() == {hf_tensor_name(n) for n in expected}
    for gguf_name, want in expected.items():
        np.testing.assert_array_equal(ckpt.get(hf_tensor_name(gguf_name)), want, err_msg=gguf_name)
    arch, head_dim, tied = MODELS[name]
    config = gguf_decoder_config(open_gguf(path))
    assert (config.architecture, config.head_dim, config.tie_word_embeddings) == (arch, head_dim, tied)
    assert (config.attention_bias, config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_gguf_loader(tiny_ggufs, name):
    """Ours (from the converted directory) vs transformers' own GGUF loader vs transformers on our
    directory. transformers un-permutes Llama's q/k itself: a wrong permutation here breaks the match."""
    path, directory, _ = tiny_ggufs[name]
    ids = np.random.default_rng(0).integers(0, 300, (2, 13))
    positions = np.broadcast_to(np.arange(13), ids.shape)
    ours_model = load_hf_checkpoint(directory)
    hidden = ours_model(ids, positions)
    ours = np.asarray(ours_model.logits(hidden))
    for source in ({"pretrained_model_name_or_path": path.parent, "gguf_file": path.name},
                   {"pretrained_model_name_or_path": directory}):
        hf = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-5, err_msg=str(source))
    assert np.abs(ours).max() > 0.5


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1 scaling as per-frequency divisors; the parameters come back, and
    transformers on the converted directory (its own llama3 RoPE) gives our logits."""
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, "llama", layers=1, rope_scaling=(8.0, 1.0, 4.0, 64))
    config = gguf_decoder_config(open_gguf(path))
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    directory = convert_gguf(path, tmp_path / "hf")
    ids = np.random.default_rng(1).integers(0, 300, (1, 40))
    ours_model = load_hf_checkpoint(directory)
    hidden = ours_model(ids, np.arange(40)[None])
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours_model.logits(hidden)), theirs, atol=2e-5, rtol=1e-5)
    write_tiny_gguf(path, "llama", layers=1, raw={"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)},
                    rope_scaling=(8.0, 1.0, 4.0, 64))
    assert "rope_freqs.weight is not a Llama 3 frequency scaling" in _error(path)


def test_tokenizer_and_chat_template_match_transformers_from_the_file(tiny_ggufs):
    path, directory, _ = tiny_ggufs["llama"]
    ours = Tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "What is 12 times 7? Use Python: print(12 * 7)"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "84"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False)
    assert ours.render_chat(messages, add_generation_prompt=False) == rendered
    assert ours.apply_chat(messages, add_generation_prompt=False) == theirs.encode(rendered, add_special_tokens=False)
    assert rendered.startswith("<|im_start|>user\n") and ours.eos_token_ids == (2,)
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    assert tok_config["chat_template"] == CHAT_TEMPLATE and tok_config["eos_token"] == "<|im_end|>"


def _error(gguf_path) -> str:
    """The GGUFError of converting ``gguf_path``, checked to be one line naming the file, with
    nothing left behind."""
    before = sorted(gguf_path.parent.iterdir())
    with pytest.raises(GGUFError) as info:
        convert_gguf(gguf_path, gguf_path.parent / "out")
    message = str(info.value)
    assert message.startswith(f"{gguf_path}: ") and "\n" not in message
    assert sorted(gguf_path.parent.iterdir()) == before
    return message


def test_truncated_and_foreign_files_are_named(tiny_ggufs, tmp_path):
    data = tiny_ggufs["llama"][0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    assert "truncated or corrupt GGUF file" in _error(cut)
    cut.write_bytes(b"PK\x03\x04 not a model")
    assert "not a GGUF file (starts with b'PK\\x03\\x04', expected b'GGUF')" in _error(cut)


def test_unsupported_architecture_quantization_and_missing_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "gemma", layers=1)
    assert "architecture 'gemma' is not supported; supported: llama, qwen2, qwen3" in _error(path)
    write_tiny_gguf(path, "qwen2", layers=1, skip=("blk.0.attn_v.bias",))
    assert "missing tensor(s) blk.0.attn_v.bias (1 missing)" in _error(path)
    write_tiny_gguf(path, "llama", layers=1, raw={"blk.0.ffn_up.weight": np.zeros((96, 64), np.int32)})
    assert "tensor blk.0.ffn_up.weight has quantization type I32, which is not supported" in _error(path)


def test_model_path_names_a_gguf_converted_once(tiny_ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tiny_ggufs["qwen3"][0]
    config = load_config("configs/demo.py", [f"output_dir={tmp_path / 'run'}", f"model.path={path}"])
    model_dir, tokenizer_dir = prepare_model_assets(config, [])
    assert model_dir == tokenizer_dir and Path(model_dir).parent == tmp_path / "cache" / "agentrl_jax" / "gguf"
    written = os.path.getmtime(os.path.join(model_dir, "model.safetensors"))
    assert prepare_model_assets(config, []) == (model_dir, model_dir)  # a second run reuses the conversion
    assert os.path.getmtime(os.path.join(model_dir, "model.safetensors")) == written
    assert converted_gguf(path) == model_dir
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    config = load_config("configs/demo.py", [f"output_dir={tmp_path / 'run'}", f"model.path={bad}"])
    with pytest.raises(ConfigError, match=rf"^model\.path: {bad}: truncated or corrupt GGUF file \(4 bytes\)"):
        prepare_model_assets(config, [])


def test_conversion_needs_no_pytorch(tiny_ggufs, tmp_path):
    """`pip install agentrl-jax` has no PyTorch; a .gguf model.path must still load."""
    path = tiny_ggufs["llama"][0]
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from agentrl_jax.models.gguf import convert_gguf
        from agentrl_jax.models.hf_io import load_hf_checkpoint
        load_hf_checkpoint(convert_gguf({str(path)!r}, {str(tmp_path / "m")!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_launcher_prints_one_line_for_a_bad_gguf(tmp_path, capsys):
    from repo_scripts import load_script

    launcher = load_script("launch/tpu_pod.py", "tpu_pod_launcher")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 64)
    code = launcher.main(["--config", "demo", "--set", f"model.path={bad}", "--set", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"config error: model.path: {bad}: not a GGUF file (starts with {bytes(4)!r}, expected b'GGUF')\n"


def test_reference_path_may_name_a_gguf(tiny_ggufs, tmp_path, monkeypatch):
    from agentrl_jax.config import Config, apply_overrides
    from agentrl_jax.models import DecoderConfig, split_params
    from agentrl_jax.train.build import check_reference_architecture, reference_params

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, directory, _ = tiny_ggufs["llama"]
    _, initial = split_params(load_hf_checkpoint(directory))
    config = apply_overrides(Config(), ["algorithm.kl_coef=0.1", f"model.reference_path={path}",
                                        "model.reference_dtype=float32"])
    check_reference_architecture(config, DecoderConfig.from_hf(directory))
    reference = reference_params(config, initial, None)
    np.testing.assert_array_equal(np.asarray(reference["embed"][...]), np.asarray(initial["embed"][...]))
    with pytest.raises(ConfigError, match=r"^model\.reference_path: .* has a different architecture"):
        check_reference_architecture(config, DecoderConfig.from_hf(tiny_ggufs["qwen2"][1]))
