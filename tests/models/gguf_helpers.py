"""Tiny GGUF files written the way llama.cpp's converter writes them, for the GGUF tests.

Weights are drawn in HF layout, Llama's q/k rows are permuted as ``convert_hf_to_gguf.py``'s
``LlamaModel.permute`` does, then each tensor is quantized with ``gguf.quants.quantize``. The
tokenizer is a byte-level BPE trained on a small corpus, stored as GGUF metadata.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np

from agentrl_jax.models.tiny import train_tiny_tokenizer

Q = gguf.GGMLQuantizationType
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 12 times 7? Use Python to check.",
          "print(12 * 7) gives 84, so the answer is 84."] * 30
WIDTH, FFN, HEADS, KV_HEADS = 64, 96, 4, 2  # in-features are multiples of 32, the quantization block


def llama_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotate-half rows to interleaved pairs."""
    shape = rows.shape
    return rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_divisors(head_dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
    """``rope_freqs.weight`` as convert_hf_to_gguf.py's ``LlamaModel.generate_extra_tensors`` computes it."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            divisors.append(1)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, np.float32)


def _tokenizer(directory: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges) of a tiny ChatML byte-level BPE."""
    train_tiny_tokenizer(directory, CORPUS, 320)
    with open(directory / "tokenizer.json") as f:
        spec = json.load(f)
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, [3 if t in special else 1 for t in tokens], merges


def _qtype(gguf_name: str) -> Q:
    """A mix of what llama.cpp writes: Q8_0 embedding, Q4_1 / Q8_0 matrices, F16 head, F32 norms."""
    if gguf_name == "token_embd.weight":
        return Q.Q8_0
    if gguf_name == "output.weight":
        return Q.F16
    if "norm" in gguf_name or gguf_name.endswith(".bias"):
        return Q.F32
    return Q.Q4_1 if gguf_name.startswith("blk.0.") else Q.Q8_0


def write_tiny_gguf(path: str | os.PathLike, arch: str, *, head_dim: int = WIDTH // HEADS, tied: bool = True,
                    layers: int = 2, seed: int = 0, skip: tuple[str, ...] = (),
                    raw: dict[str, np.ndarray] | None = None,
                    rope_scaling: tuple[float, float, float, int] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny ``arch`` model as GGUF; returns the HF tensors as quantization leaves them.

    Args:
      skip: GGUF tensor names left out (to test a missing tensor).
      raw: GGUF tensor name -> array stored as it is instead (to test an unsupported type).
      rope_scaling: Llama 3.1 (factor, low_freq_factor, high_freq_factor, original context), stored as
        llama.cpp does: the context as metadata, the per-frequency divisors as ``rope_freqs.weight``.
    """
    raw = raw or {}
    path = Path(path)
    tokens, types, merges = _tokenizer(path.parent / f"{path.stem}-tokenizer")
    rng = np.random.default_rng(seed)
    D, F, H, KV, K, V = WIDTH, FFN, HEADS, KV_HEADS, head_dim, len(tokens)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not tied:
        shapes["output.weight"] = (V, D)
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (D,), b + "attn_q.weight": (H * K, D), b + "attn_k.weight": (KV * K, D),
                   b + "attn_v.weight": (KV * K, D), b + "attn_output.weight": (D, H * K),
                   b + "ffn_norm.weight": (D,), b + "ffn_gate.weight": (F, D), b + "ffn_up.weight": (F, D),
                   b + "ffn_down.weight": (D, F)}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (H * K,), b + "attn_k.bias": (KV * K,), b + "attn_v.bias": (KV * K,)}
        if arch == "qwen3":
            shapes |= {b + "attn_q_norm.weight": (K,), b + "attn_k_norm.weight": (K,)}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(K)
    writer.add_layer_norm_rms_eps(1e-6)
    if K != D // H:
        writer.add_key_length(K)
        writer.add_value_length(K)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    if rope_scaling is not None:
        writer.add_rope_scaling_orig_ctx_len(rope_scaling[3])
        writer.add_tensor("rope_freqs.weight", raw.get("rope_freqs.weight", llama3_rope_divisors(K, 10000.0, *rope_scaling)))
    expected = {}
    for name, shape in shapes.items():
        hf = rng.normal(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name or "bias" in name else 0.2, shape)
        hf = hf.astype(np.float32)
        qtype = _qtype(name)
        stored = hf
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            stored = llama_permute(hf, H if ".attn_q." in name else KV)
        data = gguf.quants.quantize(stored, qtype)
        # quantization is per row, so it commutes with permuting rows: the HF tensor is the
        # quantized unpermuted one
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(hf, qtype), qtype).reshape(shape)
        if name in raw:
            writer.add_tensor(name, raw[name])
        elif name not in skip:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
