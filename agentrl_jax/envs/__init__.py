"""Environments, the tool sandbox pool and the Environment API the agent loop drives."""

from agentrl_jax.envs.arithmetic import ArithmeticEnv, arithmetic_config, demonstration, make_tasks
from agentrl_jax.envs.base import Environment, StepResult, ToolStats, Trajectory
from agentrl_jax.envs.remote_sandbox import RemoteSandbox, RemoteSandboxConfig
from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv, interpreter_text, parse_code, truncate_middle
from agentrl_jax.envs.sandbox import ExecResult, SandboxConfig, SandboxPool

__all__ = [
    "ArithmeticEnv", "Environment", "ExecResult", "RemoteSandbox", "RemoteSandboxConfig", "ReToolConfig",
    "ReToolEnv", "SandboxConfig", "SandboxPool", "StepResult", "ToolStats", "Trajectory", "arithmetic_config",
    "demonstration", "interpreter_text", "make_tasks", "parse_code", "truncate_middle",
]
