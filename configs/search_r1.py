"""Search-R1: RL with a search engine on open-domain QA (Jin et al. 2025, arXiv:2503.09516).

The policy reasons, queries a retriever with `<search>query</search>`, reads the top-3
passages in `<information>...</information>` and answers in `<answer>...</answer>`. Four
things are required, a model and the data (a corpus or a retrieval server, train and
eval questions):

    python launch/tpu_pod.py --config search_r1 \\
        --set model.path=/data/Qwen2.5-3B \\
        --set environment.corpus_path=/data/wiki_passages.jsonl \\
        --set data.train_path=/data/nq_hotpotqa_train.jsonl \\
        --set data.eval_path=/data/nq_test.jsonl

With a Search-R1 retrieval server (e5 over the 2018 Wikipedia dump, `retrieval_server.py`)
use `--set environment.retriever_url=http://127.0.0.1:8000/retrieve` instead of
`environment.corpus_path`. The local retriever is BM25 over a JSONL corpus of
{"id", "title", "text"} (or Search-R1's {"id", "contents"}) records, indexed in memory when
the run starts: fine up to about a million passages; use the server for full Wikipedia.
Task files are JSONL/Parquet rows {"question", "answer", "golden_answers"?: [...]}, read with
`data.format="aime"` (extra fields such as golden_answers stay on the task).

Settings follow Search-R1's GRPO recipe (train_grpo.sh, Qwen2.5-3B base):
- GRPO, 5 samples per prompt, 512 prompts per step in 2 minibatches, PPO clip 0.2 (no
  clip-higher), KL to the reference as a loss term with the k3 ("low_var_kl") estimator
  and coefficient 0.001, learning rate 1e-6 with 28.5% of 1005 steps as warmup;
- retrieved tokens masked from the loss (the agent loop appends observations with
  loss_mask 0); reward = exact match of the answer (binary, no format term);
- top-3 passages per search, observations up to 500 tokens, 500 new tokens per turn,
  temperature 1.0; the paper's action budget of 4 searches plus the answer turn (the
  released GRPO script uses 2: --set environment.max_tool_calls=2 environment.max_turns=3).
Its PPO variant needs a critic (GAE); this config is the GRPO one.
"""

from agentrl_jax.config import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
)

TOTAL_STEPS = 1005


def get_config() -> Config:
    return Config(
        name="search_r1",
        seed=0,
        output_dir="runs/search_r1",
        total_steps=TOTAL_STEPS,
        model=ModelConfig(path="", compute_dtype="bfloat16", param_dtype="float32", remat="full"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        rollout=RolloutConfig(
            max_concurrent=256,
            # decode lanes: 128 sequences decode per step, the other slots wait ready (prefilled, or
            # between tool calls) and take the lane of a turn that stops, on the device. 256 multi-turn
            # episodes with 100 ms tools decode faster this way than with a lane per slot (docs/benchmarks.md,
            # "Decode lanes")
            decode_batch=128,
            max_prompt_length=2048,  # Search-R1 max_start_length
            max_sequence_length=4608,  # max_prompt_length 4096 of the rolling context + one 500-token turn
            max_new_tokens_per_turn=500,
            temperature=1.0,
            steps_per_dispatch=16,
        ),
        algorithm=AlgorithmConfig(
            advantage="grpo",
            loss="ppo",
            aggregation="token-mean",
            group_size=5,
            eps_low=0.2,
            eps_high=0.2,
            kl_coef=0.001,
            kl_estimator="k3",
            minibatches=2,
            micro_batch_size=16,
        ),
        optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=round(0.285 * TOTAL_STEPS), weight_decay=0.01,
                                  grad_clip=1.0),
        data=DataConfig(train_path="", eval_path="", format="aime", prompts_per_step=512),
        environment=EnvironmentConfig(
            name="search",
            corpus_path="",
            retriever_url="",
            top_k=3,
            max_turns=5,
            max_tool_calls=4,
            max_observation_tokens=500,
            answer_metric="em",
            outcome_scheme="binary",
            format_weight=0.0,
        ),
        checkpoint=CheckpointConfig(every_steps=100, max_to_keep=3, export_hf=True),
        eval=EvalConfig(every_steps=50, num_tasks=0, samples_per_task=1, temperature=0.0),  # greedy, as verl validates
    )
