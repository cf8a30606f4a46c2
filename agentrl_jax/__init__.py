"""agentrl_jax: a JAX-native trainer that teaches LLM agents to use tools with RL."""

__version__ = "0.1.0"
