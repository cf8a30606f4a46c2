"""Environments, the tool sandbox pool and the Environment API the agent loop drives.

Importing this package registers the built-in environment sections (arithmetic, retool,
retool_small, search) with ``agentrl_jax.config.register_environment``.
"""

from agentrl_jax.envs.arithmetic import (ArithmeticEnv, ArithmeticEnvConfig, arithmetic_config,
                                        arithmetic_demonstrations, bridge_thought, demonstration,
                                        hinted_demonstration, make_tasks)
from agentrl_jax.envs.base import FINISH_REASONS, TRUNCATED_REASONS, Environment, StepResult, ToolStats, Trajectory
from agentrl_jax.envs.remote_sandbox import RemoteSandbox, RemoteSandboxConfig
from agentrl_jax.envs.retool import (ReToolConfig, ReToolEnv, ReToolEnvConfig, interpreter_text, parse_code,
                                     truncate_middle)
from agentrl_jax.envs.retool_small import ReToolSmallEnvConfig
from agentrl_jax.envs.retrieval import (BM25Index, LocalRetriever, Passage, RemoteRetriever, RemoteRetrieverConfig,
                                        Retriever, RetrieverError, load_corpus)
from agentrl_jax.envs.search import SearchConfig, SearchEnv, exact_match, normalize_answer, token_f1
from agentrl_jax.envs.search_config import SearchEnvConfig, make_retriever
from agentrl_jax.envs.search_corpus import make_search_corpus, write_search_corpus
from agentrl_jax.envs.sandbox import ExecResult, SandboxPoolConfig, SandboxPool, make_sandbox
from agentrl_jax.envs.tools import (NativeReToolEnv, NativeSearchEnv, Tool, ToolCallingEnv, ToolEnvConfig,
                                    ToolRegistry, ToolResult)

__all__ = [
    "FINISH_REASONS", "TRUNCATED_REASONS",
    "ArithmeticEnv", "ArithmeticEnvConfig", "BM25Index", "NativeReToolEnv", "NativeSearchEnv", "Tool",
    "ToolCallingEnv", "ToolEnvConfig", "ToolRegistry", "ToolResult", "Environment", "ExecResult", "LocalRetriever",
    "Passage", "RemoteRetriever", "RemoteRetrieverConfig", "RemoteSandbox", "RemoteSandboxConfig", "ReToolConfig",
    "ReToolEnv", "ReToolEnvConfig", "ReToolSmallEnvConfig", "Retriever", "RetrieverError", "SandboxPoolConfig",
    "SandboxPool", "SearchConfig", "SearchEnv", "SearchEnvConfig", "StepResult", "ToolStats", "Trajectory",
    "arithmetic_config", "arithmetic_demonstrations", "bridge_thought", "demonstration", "exact_match",
    "hinted_demonstration", "interpreter_text", "load_corpus", "make_retriever", "make_sandbox",
    "make_search_corpus", "make_tasks", "normalize_answer", "parse_code", "token_f1", "truncate_middle",
    "write_search_corpus",
]
