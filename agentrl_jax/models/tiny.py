"""Tiny random-init HF checkpoints and byte-level BPE tokenizers for CPU tests and the demo.

Everything is saved as an ordinary HF directory, so the rest of the code loads it exactly
like a downloaded checkpoint:

- ``save_scratch_checkpoint``: the scratch model of a run (``model.scratch``), initialized in
  JAX and written by our own exporter, so the base install (no PyTorch) can create it.
- ``save_tiny_hf_checkpoint``: a model made by ``transformers`` itself (needs PyTorch, the
  test extra), the independent reference of the parity tests.
- ``train_tiny_tokenizer``: a byte-level BPE tokenizer trained with ``tokenizers``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

QWEN_CHAT_TEMPLATE = (
    # ChatML turns; with ``tools`` a system block lists their JSON schemas and asks for
    # Hermes-style calls, and assistant ``tool_calls`` render as <tool_call> JSON blocks (the
    # format envs/tools/parsers.py reads), so the scratch model can train native tool calls.
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (system + '\\n\\n' if system else '') + '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call.function.name"
    " + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def save_tiny_hf_checkpoint(
    path: str | os.PathLike,
    architecture: str = "qwen3",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 512,
    eos_token_id: int | list[int] | None = None,
    bos_token_id: int | None = None,
    init_std: float = 0.1,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> str:
    """Save a random-init float32 ``transformers`` causal LM with ``save_pretrained``.

    Args:
      path: output directory.
      architecture: "llama", "qwen2" (q/k/v bias always) or "qwen3" (q/k norm always).
      rope_scaling: e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}``.
      init_std: std of the random weights (larger than HF's 0.02 so logits differ visibly).
      max_shard_size: passed to ``save_pretrained`` (e.g. "20KB") to force an index-sharded
        checkpoint.

    Returns:
      ``path`` as a string.
    """
    import torch
    import transformers

    if architecture not in _HF_CLASSES:
        raise ValueError(f"architecture must be one of {sorted(_HF_CLASSES)}, got {architecture!r}")
    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[architecture])
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        initializer_range=init_std,
    )
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    kwargs["rope_parameters"] = rope
    if architecture != "qwen2":
        kwargs["attention_bias"] = attention_bias
    config = config_cls(**kwargs)
    config.architectures = [_HF_CLASSES[architecture][1]]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        # Norm weights and biases start at 1 / 0 in HF; randomize them so parity tests see them.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(os.fspath(path), **save_kwargs)
    return os.fspath(path)


def save_scratch_checkpoint(path: str | os.PathLike, config, *, init_std: float = 0.1, seed: int = 0) -> str:
    """Save a random-init float32 checkpoint of ``config`` (a ``DecoderConfig``) without PyTorch.

    The init follows ``save_tiny_hf_checkpoint``'s distribution: weight matrices and the
    embedding N(0, init_std^2), norm scales 1 + N(0, 0.01), biases N(0, 0.01); each tensor
    draws from its own key (``fold_in(seed, index)``), so the weights depend on the seed
    and the architecture only. Written with ``save_hf_checkpoint`` (config.json +
    safetensors that ``transformers`` loads).

    Returns:
      ``path`` as a string.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from agentrl_jax.models.decoder import Decoder
    from agentrl_jax.models.hf_io import save_hf_checkpoint

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    key = jax.random.key(seed)

    def init(index, path, leaf):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(jax.random.fold_in(key, index), leaf.shape, jnp.float32)
        if "norm" in name:
            return 1.0 + 0.1 * noise
        if "bias" in name:
            return 0.1 * noise
        return init_std * noise

    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    values = [init(i, path, leaf) for i, (path, leaf) in enumerate(leaves)]
    params = jax.tree_util.tree_unflatten(treedef, values)
    return save_hf_checkpoint(params, config, path)


def train_tiny_tokenizer(
    path: str | os.PathLike,
    texts: Iterable[str],
    vocab_size: int,
    *,
    chat_template: str = QWEN_CHAT_TEMPLATE,
    individual_digits: bool = False,
    special_tokens: Sequence[str] = CHATML_SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    bos_token: str | None = None,
    split_pattern: str | None = None,
    generation_eos_tokens: Sequence[str] = (),
) -> str:
    """Train a byte-level BPE tokenizer and save it as a transformers tokenizer directory.

    With ``individual_digits`` every digit is its own token (as in Llama 3 and Qwen), which
    makes copying and arithmetic over numbers learnable by tiny models.

    By default the special tokens are ChatML's (``<|endoftext|>`` id 0, ``<|im_start|>`` id 1,
    ``<|im_end|>`` id 2); eos is ``<|im_end|>``, pad is ``<|endoftext|>``. Another model
    family's layout takes its own ``special_tokens`` (ids in order from 0), eos, pad and bos,
    and ``split_pattern``: the pre-tokenizer regex of its tokenizer.json (Llama 3 and Qwen2
    split text with one, then map bytes), which decides where BPE may merge across a chat
    template's glue. ``generation_eos_tokens`` are written to generation_config.json as its
    eos ids (Llama 3.1 Instruct stops at several).

    Returns:
      ``path`` as a string.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_pattern is None)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if individual_digits else []
    if split_pattern is not None:
        steps.append(pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    named = {eos_token, pad_token, bos_token}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        pad_token=pad_token,
        **({"bos_token": bos_token} if bos_token else {}),
        additional_special_tokens=[t for t in special_tokens if t not in named],
    )
    fast.chat_template = chat_template
    out = os.fspath(path)
    fast.save_pretrained(out)
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    # transformers 5 writes the template to chat_template.jinja; 4.x reads it from here.
    tok_config["chat_template"] = chat_template
    with open(config_path, "w") as f:
        json.dump(tok_config, f, indent=2)
    if generation_eos_tokens:
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [tokenizer.token_to_id(t) for t in generation_eos_tokens]}, f)
    return out
