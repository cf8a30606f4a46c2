"""Model configs shared by the model tests."""

from agentrl_jax.models import DecoderConfig

# Small Qwen3 with every switch that changes the cache path on: GQA (2 query heads per kv
# head), q/k/v bias and q/k norm; a prime vocabulary so no dimension divides by accident.
SMALL_QWEN3 = DecoderConfig(
    architecture="qwen3",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
    qk_norm=True,
)
