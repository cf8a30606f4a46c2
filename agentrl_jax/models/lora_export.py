"""LoRA adapters as a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

``peft.PeftModel.from_pretrained(base_hf_model, directory)`` loads it onto the HF base model
and gives the logits of our merged model. The layout is PEFT's for ``nn.Linear``: the HF
weight is ``[out, in]`` and ``y = x W^T + scaling * (x A^T) B^T`` with ``lora_A.weight [r, in]``,
``lora_B.weight [out, r]`` and ``scaling = lora_alpha / r``. Ours is ``y = x (W + s A B)`` with
``A [*in, r]``, ``B [r, *out]`` per layer (``models/lora.py``), so PEFT's A is ours flattened
and transposed, and likewise B. The multi-dimensional ins and outs flatten in the order the HF
export uses (``wq [D, H, K]`` -> ``q_proj [H*K, D]``: row ``h * K + k``).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.lora import TARGETS, LoraParams

_BY_WEIGHT = {weight: (target, module) for target, (weight, module) in TARGETS.items()}


def save_peft_adapter(params: LoraParams, config: DecoderConfig, path: str | os.PathLike, *,
                      base_model: str = "") -> str:
    """Write ``params.adapters`` as a PEFT LoRA adapter directory; returns ``path``.

    Args:
      params: the trained ``LoraParams`` (only the adapters and the scale are written).
      config: the decoder's architecture (for the layer count).
      path: the output directory (created).
      base_model: recorded as ``base_model_name_or_path`` (the HF base the adapter belongs to).
    """
    if not isinstance(params, LoraParams):
        raise TypeError(f"save_peft_adapter: expected LoraParams, got {type(params).__name__}")
    tensors: dict[str, np.ndarray] = {}
    modules, rank = [], None
    for weight, ab in sorted(params.adapters.items()):
        a = np.asarray(jax.device_get(ab["a"]), np.float32)
        b = np.asarray(jax.device_get(ab["b"]), np.float32)
        rank = a.shape[-1]
        module = _BY_WEIGHT[weight][1]
        modules.append(module.split(".")[-1])
        for layer in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].reshape(-1, rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].reshape(rank, -1).T)
    if rank is None:
        raise ValueError("save_peft_adapter: the params have no adapters")
    out = os.fspath(path)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": params.scale * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(modules), "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "inference_mode": True,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return out
