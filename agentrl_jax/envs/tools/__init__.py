"""Native tool calling: a tool registry, parsers of the Hermes/Qwen and Llama 3.x call formats,
and a generic tool-calling environment (plus ReTool and Search-R1 on top of it)."""

from agentrl_jax.envs.tools.builtin import calculator_tool, evaluate_arithmetic, python_tool, search_tool
from agentrl_jax.envs.tools.env import CALL_HELP, Grade, ToolCallingEnv, ToolEnvConfig
from agentrl_jax.envs.tools.parsers import (MALFORMED_KINDS, PARSERS, TOOL_FORMATS, MalformedCall, ParsedTurn,
                                            ToolCall, format_calls, parse_hermes, parse_llama3, parser_for)
from agentrl_jax.envs.tools.registry import Tool, ToolRegistry, ToolResult
from agentrl_jax.envs.tools.tasks import NativeReToolEnv, NativeSearchEnv

__all__ = [
    "CALL_HELP", "MALFORMED_KINDS", "PARSERS", "TOOL_FORMATS", "Grade", "MalformedCall", "NativeReToolEnv",
    "NativeSearchEnv", "ParsedTurn", "Tool", "ToolCall", "ToolCallingEnv", "ToolEnvConfig", "ToolRegistry",
    "ToolResult", "calculator_tool", "evaluate_arithmetic", "format_calls", "parse_hermes", "parse_llama3",
    "parser_for", "python_tool", "search_tool",
]
