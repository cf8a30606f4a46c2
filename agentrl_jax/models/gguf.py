"""GGUF files (llama.cpp's checkpoint format) -> HF directories the loader reads.

A GGUF file carries the architecture as metadata (``llama.block_count``, ...), the tokenizer
(vocabulary, merges, chat template) and the tensors, most of them quantized in blocks (Q4_1:
32 weights share a float16 scale and minimum). :func:`convert_gguf` dequantizes each tensor to
float32 with the ``gguf`` package (llama.cpp's own reader), gives it its HF name and writes an
HF directory: config.json, model.safetensors and the tokenizer files. Everything downstream
loads that directory like any HF checkpoint, without PyTorch. A 4-bit file so becomes a float32
model: the quantization error stays in the weights, the memory saving does not.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of
Llama's q and k projections within each head, from HF's rotate-half layout (first half of a
head's dims, then the second half) to GGML's interleaved pairs; :func:`_unpermute` undoes it.
Qwen2 and Qwen3 are written unpermuted.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from agentrl_jax.models.config import DecoderConfig, Llama3RopeScaling
from agentrl_jax.models.hf_io import tensor_views
from agentrl_jax.models.safetensors_io import write_safetensors
from agentrl_jax.models.layers import rope_inverse_frequencies

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Block formats gguf.quants dequantizes in NumPy that llama.cpp writes for these models.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Bumped whenever convert_gguf writes different files, so cached conversions are redone.
_CONVERSION_VERSION = 1

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_MISSING = object()


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file and what is wrong."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
    or None for a tensor these architectures do not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped; tensors are read when used).

    Raises:
      GGUFError: no such file, not a GGUF file, or truncated / corrupt.
    """
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({os.path.getsize(path)} bytes): {e}") from e


def _value(reader, key: str, default: Any = _MISSING) -> Any:
    """A scalar or string metadata value; arrays come back as their length."""
    import gguf

    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        return len(field.data)
    part = field.parts[field.data[0]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def gguf_decoder_config(reader) -> DecoderConfig:
    """The :class:`DecoderConfig` a GGUF file's metadata and tensor list describe.

    Raises:
      GGUFError: an unsupported architecture or feature, or metadata that contradicts itself.
    """
    path = reader.data.filename
    arch = _value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    heads = int(_value(reader, f"{arch}.attention.head_count"))
    width = int(_value(reader, f"{arch}.embedding_length"))
    head_dim = int(_value(reader, f"{arch}.attention.key_length", width // heads))
    for key, want in ((f"{arch}.attention.value_length", head_dim), (f"{arch}.rope.dimension_count", head_dim),
                      (f"{arch}.expert_count", 0)):
        got = _value(reader, key, want)
        if got != want:
            raise GGUFError(f"{path}: {key} = {got} is not supported (this decoder needs {want})")
    scaling_type = _value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none" or ("rope_freqs.weight" in names and arch != "llama"):
        raise GGUFError(f"{path}: RoPE scaling ({'rope_freqs.weight' if scaling_type == 'none' else scaling_type}) "
                        f"is not supported for {arch} GGUF files")
    theta = _float32(_value(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = _llama3_scaling(reader, head_dim, theta) if "rope_freqs.weight" in names else None
    vocab = _value(reader, "tokenizer.ggml.tokens", None) or _value(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens or {arch}.vocab_size: the vocabulary size is unknown")
    eos = [_value(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    try:
        return DecoderConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=width,
            intermediate_size=int(_value(reader, f"{arch}.feed_forward_length")),
            num_layers=int(_value(reader, f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(_value(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=_float32(_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(_value(reader, f"{arch}.context_length", 4096)),
            bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
    except GGUFError:
        raise
    except ValueError as e:  # DecoderConfig's own checks
        raise GGUFError(f"{path}: {e}") from e


def _llama3_scaling(reader, head_dim: int, theta: float) -> Llama3RopeScaling | None:
    """Llama 3.1 frequency scaling from llama.cpp's ``rope_freqs.weight``.

    llama.cpp's converter stores the divisor of each RoPE frequency, not the parameters. ``factor``
    is the largest divisor; in the band between, ``1 / d = (1 - s) / factor + s`` with ``s`` linear
    in ``M / wavelength``, which gives ``low_freq_factor`` and ``high_freq_factor``. ``M`` is the
    metadata's original context length, else 8192, what the converter assumes. The recovered
    parameters must reproduce every divisor.
    """
    from gguf.quants import dequantize

    path = reader.data.filename
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise GGUFError(f"{path}: rope_freqs.weight has {divisors.size} entries, expected head_dim / 2 = "
                        f"{head_dim // 2}")
    if np.allclose(divisors, 1.0):
        return None
    original = int(_value(reader, "llama.rope.scaling.original_context_length", 8192))
    plain = rope_inverse_frequencies(head_dim, theta, None)
    factor = float(divisors.max())
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    scaling = None
    if band.sum() >= 2:
        smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(original * plain[band].astype(np.float64) / (2 * np.pi), smooth, 1)
        low = -intercept / slope
        scaling = Llama3RopeScaling(factor=_rounded(factor), low_freq_factor=_rounded(low),
                                    high_freq_factor=_rounded(low + 1 / slope),
                                    original_max_position_embeddings=original)
    if scaling is None or not np.allclose(plain / rope_inverse_frequencies(head_dim, theta, scaling), divisors,
                                          rtol=1e-4):
        raise GGUFError(f"{path}: rope_freqs.weight is not a Llama 3 frequency scaling this converter can "
                        "recover (RoPE scaling is otherwise not supported)")
    return scaling


def _rounded(value: float) -> float:
    """Six significant digits: the parameters are round numbers, the fit is not exact."""
    return float(f"{value:.6g}")


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _tensor_plan(reader, config: DecoderConfig) -> list[tuple[str, tuple[int, ...], Any]]:
    """(HF name, HF shape, GGUF tensor) for every tensor, checked against ``config``."""
    path = reader.data.filename
    expected: dict[str, tuple[int, ...]] = {}
    for view in tensor_views(config).values():
        for layer in range(config.num_layers) if "{layer}" in view.hf_name else [None]:
            expected[view.hf_name.format(layer=layer)] = view.hf_shape
    plan = []
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # read into config.rope_scaling (llama only, checked there)
        hf_name = hf_tensor_name(tensor.name)
        if hf_name not in expected:
            raise GGUFError(f"{path}: unexpected tensor {tensor.name} for a {config.architecture} model "
                            f"with {config.num_layers} layers")
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, "
                            f"which is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
        if shape != expected[hf_name]:
            raise GGUFError(f"{path}: tensor {tensor.name} has shape {list(shape)}, the metadata implies "
                            f"{list(expected[hf_name])}")
        plan.append((hf_name, shape, tensor))
    missing = sorted(set(expected) - {hf_name for hf_name, _, _ in plan})
    if missing:
        gguf_names = {v: k for k, v in _GLOBAL_NAMES.items()} | {
            f"model.layers.{{}}.{v}": f"blk.{{}}.{k}" for k, v in _LAYER_NAMES.items()}
        shown = [_gguf_name(name, gguf_names) for name in missing[:5]]
        raise GGUFError(f"{path}: missing tensor(s) {', '.join(shown)}{' ...' if len(missing) > 5 else ''} "
                        f"({len(missing)} missing) for a {config.architecture} model")
    return sorted(plan, key=lambda entry: entry[0])


def _gguf_name(hf_name: str, gguf_names: dict[str, str]) -> str:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if match is None:
        return gguf_names[hf_name]
    return gguf_names[f"model.layers.{{}}.{match.group(2)}"].format(match.group(1))


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: within each head, GGML's interleaved (even, odd) pairs back to
    HF's halves. ``permute`` maps ``w.reshape(H, 2, K // 2, ...)`` to ``swapaxes(1, 2)``."""
    shape = rows.shape
    return rows.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _dequantize(tensor, shape: tuple[int, ...], config: DecoderConfig) -> np.ndarray:
    """One GGUF tensor as the float32 HF tensor of ``shape``."""
    from gguf.quants import dequantize

    weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if config.architecture == "llama":
        kind = _LAYER_TENSOR.fullmatch(tensor.name)
        kind = kind.group(2) if kind else ""
        if kind.startswith("attn_q."):
            weights = _unpermute(weights, config.num_heads)
        elif kind.startswith("attn_k."):
            weights = _unpermute(weights, config.num_kv_heads)
    return weights


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write the HF directory of a GGUF file: config.json, float32 safetensors, tokenizer.

    The files are written into a temporary directory next to ``out_dir`` that is renamed at the
    end, so ``out_dir`` either does not exist or is complete.

    Args:
      gguf_path: a ``.gguf`` file of a Llama, Qwen2 or Qwen3 model.
      out_dir: the directory to create; must not exist.

    Returns:
      ``out_dir`` as a string.

    Raises:
      GGUFError: the file cannot be read or converted (the message names it and the problem).
      FileExistsError: ``out_dir`` exists (another process may have just finished it).
    """
    gguf_path, out = os.fspath(gguf_path), os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out):
        raise FileExistsError(f"convert_gguf: {out} already exists")
    reader = open_gguf(gguf_path)
    config = gguf_decoder_config(reader)
    plan = _tensor_plan(reader, config)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        entries = [(name, shape, functools.partial(_dequantize, tensor, shape, config))
                   for name, shape, tensor in plan]
        write_safetensors(tmp, entries, np.dtype(np.float32))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config.to_hf_dict(dtype="float32"), f, indent=2)
        _save_tokenizer(reader, gguf_path, tmp, config)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(tmp, out)
        except OSError as e:
            if os.path.exists(out):
                raise FileExistsError(f"convert_gguf: {out} already exists") from e
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s to %s (%d tensors, float32)", gguf_path, out, len(plan))
    return out


def _save_tokenizer(reader, gguf_path: str, directory: str, config: DecoderConfig) -> None:
    """The tokenizer and chat template transformers builds from the file's metadata, saved so
    that transformers 4.x and 5.x both read the template, and the stop ids as generation_config."""
    try:
        tokenizer = _gguf_tokenizer(reader, gguf_path, config.architecture)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise GGUFError(f"{gguf_path}: transformers cannot build the tokenizer from its metadata: {e}") from e
    if len(tokenizer) > config.vocab_size:
        raise GGUFError(f"{gguf_path}: the tokenizer has {len(tokenizer)} tokens, the embedding "
                        f"{config.vocab_size} rows")
    tokenizer.save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    # transformers 5 writes the template to chat_template.jinja; 4.x reads it from here.
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    else:
        logger.warning("%s has no chat template (tokenizer.chat_template)", gguf_path)
    with open(config_path, "w") as f:
        json.dump(tok_config, f, indent=2)
    if config.eos_token_ids:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}, f,
                      indent=2)


def _gguf_tokenizer(reader, gguf_path: str, architecture: str):
    """What ``AutoTokenizer.from_pretrained(gguf_file=...)`` builds, without PyTorch.

    transformers 5's GGUF reader imports PyTorch, its tokenizer converter does not: the metadata
    is read here with ``gguf`` and handed to that converter, as ``get_gguf_tokenizer`` would.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:  # transformers 4.x, whose GGUF tokenizer loader needs PyTorch anyway
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                             gguf_file=os.path.basename(gguf_path))
    grouped = {group: {name: _contents(reader, f"tokenizer.{key}") for key, name in renames.items()
                       if reader.get_field(f"tokenizer.{key}") is not None}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary
        tok_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict.get("tokens", [])
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _value(reader, f"tokenizer.ggml.{key}_token_id", None)
        tok_config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


def _contents(reader, key: str) -> Any:
    """A metadata value in full: arrays as lists."""
    import gguf

    field = reader.get_field(key)
    if field.types[0] != gguf.GGUFValueType.ARRAY:
        return _value(reader, key)
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [field.parts[i][0].item() for i in field.data]
