"""Architecture description of the decoder family, read from and written to HF config.json.

One frozen dataclass covers Llama 3 / 3.1 / 3.2, Qwen2 / Qwen2.5 and Qwen3 dense models; the
differences are switches (``attention_bias`` for Qwen2's q/k/v bias, ``qk_norm`` for Qwen3's
per-head q/k RMSNorm, ``rope_scaling`` for Llama 3.1's frequency scaling).

transformers 4.x writes ``rope_theta`` / ``rope_scaling`` / ``torch_dtype`` at the top level;
5.x writes them as ``rope_parameters = {"rope_type", "rope_theta", ...}`` and ``dtype``.
:meth:`DecoderConfig.from_hf` reads both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 RoPE frequency scaling (``rope_type = "llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``; shorter than ``original_max_position_embeddings / high_freq_factor`` are kept;
    in between they are interpolated smoothly (Meta, "The Llama 3 Herd of Models", 2024).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a decoder-only transformer.

    Attributes:
      architecture: "llama", "qwen2" or "qwen3".
      vocab_size: V, rows of the embedding table.
      hidden_size: D, the model width.
      intermediate_size: F, the SwiGLU MLP width.
      num_layers: L.
      num_heads: H query heads.
      num_kv_heads: KV heads (GQA); must divide ``num_heads``.
      head_dim: K, width of one head (need not equal D / H: Qwen3).
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: None, or Llama 3.1 frequency scaling.
      tie_word_embeddings: the output projection is the embedding table (``[V, D]``).
      attention_bias: q/k/v projections have a bias (Qwen2).
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
      max_position_embeddings: longest context the checkpoint was trained for.
      bos_token_id: optional beginning-of-sequence id.
      eos_token_ids: end-of-sequence ids (HF allows one int or a list).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(
                f"DecoderConfig.architecture: unsupported {self.architecture!r}; "
                f"supported: {sorted(_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, source: Mapping[str, Any] | str | os.PathLike) -> DecoderConfig:
        """Read an HF ``config.json`` (dict, file or directory) from transformers 4.x or 5.x."""
        hf = _read_json(source)
        arch = _architecture(hf)
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        if legacy_scaling:
            rope = {**legacy_scaling, **rope}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(
                f"config.json: rope type {rope_type!r} is not supported; "
                "supported: 'default', 'llama3'"
            )
        if hf.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported by this decoder")
        if hf.get("use_sliding_window"):
            raise ValueError(
                "config.json: use_sliding_window=true is not supported by this decoder"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"config.json: hidden_act {act!r} is not supported; only 'silu' (SwiGLU)"
            )
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF ``config.json`` dict (transformers 5.x layout, with the 4.x keys as well)."""
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError(
                "DecoderConfig: qwen2 always has q/k/v bias; "
                "attention_bias=False cannot be exported"
            )
        if self.qk_norm != (self.architecture == "qwen3"):
            raise ValueError("DecoderConfig: qk_norm is exportable only as architecture 'qwen3'")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                **dataclasses.asdict(self.rope_scaling),
            }
        out: dict[str, Any] = {
            "architectures": [_MODEL_TYPES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None
            if self.rope_scaling is None
            else {k: v for k, v in rope.items() if k != "rope_theta"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                None
                if not self.eos_token_ids
                else self.eos_token_ids[0]
                if len(self.eos_token_ids) == 1
                else list(self.eos_token_ids)
            ),
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if self.architecture != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            out["mlp_bias"] = False
        return out


def _read_json(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"HF config not found: {path}")
    with open(path) as f:
        return json.load(f)


def _architecture(hf: Mapping[str, Any]) -> str:
    names = hf.get("architectures") or []
    supported = sorted(ARCHITECTURES)
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if names:
        raise ValueError(
            f"config.json: unsupported architecture {', '.join(map(str, names))}; "
            f"supported: {supported}"
        )
    model_type = hf.get("model_type")
    if model_type in _MODEL_TYPES:
        return model_type
    raise ValueError(
        f"config.json: unsupported architecture (model_type={model_type!r}, no 'architectures'); "
        f"supported: {supported}"
    )
