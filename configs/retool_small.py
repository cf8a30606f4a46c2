"""ReTool at a size one GPU trains in minutes: a ~25M-parameter model learns multi-turn code use.

Everything is generated locally (docs/retool_small.md), and every stage is the
real one: the ReTool environment (`<code>` / `<interpreter>` layout, the sandbox pool, the
math verifier, +1/-1 outcome reward), the paged rollout engine, the GRPO trainer.

1. Problems that need a program (envs/program_tasks.py): big-number arithmetic, sums of
   sequences, gcd/lcm, counting primes, digit sums of powers and factorials, linear
   equations, binomials, modular powers. Held out for evaluation: larger parameter ranges
   than any training task, and combinations of trained parts never trained together.
2. A byte-level BPE tokenizer (digits split) and a Qwen3-style decoder from scratch
   (train/setup.py prepare_model_assets, as the demo).
3. SFT on scripted-solver demonstrations (envs/program_demos.py): correct programs, answers
   from memory, and programs with a realistic bug whose traceback is read and fixed in a
   second call (or followed by a guess). Every shown output comes from the real sandbox.
4. GRPO in the environment; held-out pass@1 / pass@4, tool-use rate, calls per episode and
   error-recovery rate after SFT and after RL in results.json.

    python launch/tpu_pod.py --config configs/retool_small.py          # one GPU, ~5 min alone
    CONFIG=configs/retool_small.py bash bench/demo_seeds.sh runs/retool_small_seeds 0 1 2   # 3 seeds, ~7 min

configs/retool_small_cpu.py is the same pipeline at a size a CPU test runs.
"""

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
    ScratchModelConfig,
    SFTConfig,
)


def get_config() -> Config:
    return Config(
        name="retool_small",
        seed=0,
        output_dir="runs/retool_small",
        total_steps=30,
        model=ModelConfig(
            compute_dtype="float32",
            param_dtype="float32",
            remat="none",
            scratch=ScratchModelConfig(vocab_size=768, hidden_size=512, intermediate_size=1536, num_layers=8,
                                       num_heads=8, num_kv_heads=4, head_dim=64),
        ),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        rollout=RolloutConfig(
            max_concurrent=256,
            max_prompt_length=160,
            max_sequence_length=512,
            max_new_tokens_per_turn=128,
            temperature=1.0,
            steps_per_dispatch=16,
            cache_dtype="float32",
            kv_cache_bytes=2**32,
        ),
        algorithm=AlgorithmConfig(advantage="grpo", loss="ppo", aggregation="token-mean", group_size=8,
                                  eps_low=0.2, eps_high=0.28, kl_coef=0.0, minibatches=2),
        optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=3, grad_clip=1.0),
        data=DataConfig(prompts_per_step=16),
        environment=EnvironmentConfig(
            name="retool_small",
            max_turns=4,
            max_tool_calls=3,
            max_observation_tokens=128,
            outcome_scheme="pm1",
            num_train_tasks=20000,
            num_eval_tasks=160,
            num_demonstrations=6000,
            sandbox=SandboxConfig(workers=32, timeout_s=5.0, memory_mb=1024),
        ),
        checkpoint=CheckpointConfig(every_steps=0, max_to_keep=1, resume=False),
        logging=LoggingConfig(sample_trajectories=4),
        eval=EvalConfig(every_steps=0, num_tasks=160, samples_per_task=4, temperature=1.0),
        sft=SFTConfig(steps=800, batch_size=64, learning_rate=5e-4, max_length=512),
    )
