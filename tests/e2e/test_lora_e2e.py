"""The demo command with ``--set model.lora.rank=4``: two RL steps on LoRA adapters over the
post-SFT base (KL reference and teacher = the base), exact engine logprobs, both exports; and a
resume that continues exactly like an uninterrupted run (slow)."""

import json

import numpy as np
import pytest
import torch
import transformers
from test_launch_e2e import FROZEN_MODELS, _launch, _metrics

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optimizer.learning_rate=1e-3", *FROZEN_MODELS]


@pytest.mark.slow
def test_lora_demo_trains_two_steps_and_exports_peft_and_merged(tmp_path):
    out = tmp_path / "run"
    _launch(out, "total_steps=2", "checkpoint.resume=false", "checkpoint.export_hf=true", *LORA)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert np.isfinite(m["loss"]) and m["skipped"] == 0 and m["update_norm"] > 0
        assert m["logprob_gap_train_infer"] < 1e-4  # the engine decodes the merged adapters exactly
    assert steps[2]["kl_k3"] > 0  # the policy moved away from the base, the reference
    peft = pytest.importorskip("peft")
    ids = torch.tensor([[5, 9, 40, 7, 100, 3]])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    config = json.loads((out / "export_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(out / "export_base")  # the post-SFT base, exported too
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "export_base", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "export_adapter").eval()
    with torch.no_grad():
        np.testing.assert_allclose(adapted(ids).logits.numpy(), merged(ids).logits.numpy(), atol=1e-4)


@pytest.mark.slow
def test_lora_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    """Two steps, then the same command to step 3: the adapters and their AdamW state come back
    from the checkpoint, the base (the post-SFT policy) from the run's own saved copy."""
    out = tmp_path / "run"
    _launch(out, "total_steps=2", "checkpoint.resume=false", *LORA)
    _launch(out, "total_steps=3", "checkpoint.resume=true", *LORA)
    straight = tmp_path / "straight"
    _launch(straight, "total_steps=3", "checkpoint.resume=false", *LORA)
    resumed, uninterrupted = _metrics(out), _metrics(straight)
    assert sorted(resumed) == [1, 2, 3] and resumed[3]["kl_k3"] > 0
    for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "param_norm", "kl_k3",
                "logprob_gap_train_infer"):
        assert resumed[3][key] == pytest.approx(uninterrupted[3][key], rel=1e-4, abs=1e-6), key
