"""A registry of tools a model can call: name, description, JSON-schema arguments, a function.

Tools are what the chat template shows the model (``ToolRegistry.schemas()``, passed as
``tools=`` to ``Tokenizer.apply_chat``) and what a parsed call runs. A call is checked
before it runs: an unknown name or arguments that do not fit the schema (jsonschema, draft
2020-12) give an error message for the model, never an exception. A tool's own failure
(an exception, a timeout) also becomes its result text, flagged for the tool statistics.

User functions register with a schema::

    registry = ToolRegistry()

    @registry.function(description="Look up a stock price.",
                       parameters={"type": "object", "properties": {"ticker": {"type": "string"}},
                                   "required": ["ticker"]})
    async def price(ticker: str) -> str:
        ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from agentrl_jax.envs.tools.parsers import MalformedCall, ToolCall

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool returns: the text the model reads, and whether it failed or timed out."""

    text: str
    ok: bool = True
    timed_out: bool = False


ToolFn = Callable[..., "Awaitable[str | ToolResult] | str | ToolResult"]


@dataclasses.dataclass(frozen=True)
class Tool:
    """One callable tool.

    name: what the model calls it by. description: what it does, for the model.
    parameters: JSON schema of the arguments object (``{"type": "object", "properties": ...}``).
    fn: called with the arguments as keyword arguments; returns text or a ToolResult,
      synchronously or as a coroutine. close: an optional coroutine function run when the
      episode ends (e.g. closing a sandbox session).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: ToolFn
    close: Callable[[], Awaitable[None]] | None = None

    def __post_init__(self):
        from jsonschema import Draft202012Validator

        if not _NAME.match(self.name):
            raise ValueError(f"Tool name {self.name!r} must match {_NAME.pattern}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"Tool {self.name!r}: parameters must be a JSON schema with \"type\": \"object\"")
        Draft202012Validator.check_schema(dict(self.parameters))
        object.__setattr__(self, "_validator", Draft202012Validator(dict(self.parameters)))

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI function format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}

    def argument_errors(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` do not fit the schema (the first few problems), or None."""
        errors = sorted(self._validator.iter_errors(dict(arguments)), key=lambda e: list(e.path))
        if not errors:
            return None
        return "; ".join((f"{'.'.join(map(str, e.path))}: " if e.path else "") + e.message for e in errors[:3])


class ToolRegistry:
    """The tools of one episode, by name; checks and runs parsed calls."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"ToolRegistry: a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def function(self, *, description: str, parameters: Mapping[str, Any], name: str | None = None):
        """Decorator: registers a function as a tool (its ``__name__`` unless ``name``)."""

        def register(fn: ToolFn) -> ToolFn:
            self.add(Tool(name or fn.__name__, description, parameters, fn))
            return fn

        return register

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self._tools.values()]

    def check(self, call: ToolCall | MalformedCall) -> ToolCall | MalformedCall:
        """``call`` if it can run, else a MalformedCall saying why (unknown tool, bad arguments)."""
        if isinstance(call, MalformedCall):
            return call
        if call.name not in self._tools:
            return MalformedCall("unknown_tool", f"unknown tool {call.name!r}; the tools are "
                                                 f"{', '.join(self.names) or '(none)'}", name=call.name)
        problem = self._tools[call.name].argument_errors(call.arguments)
        if problem is not None:
            return MalformedCall("bad_arguments", f"invalid arguments for {call.name!r}: {problem}", name=call.name)
        return call

    async def run(self, call: ToolCall, *, timeout_s: float) -> ToolResult:
        """Runs a checked call; an exception or a timeout becomes a failed ToolResult."""
        tool = self._tools[call.name]
        try:
            result = tool.fn(**call.arguments)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return ToolResult(f"Error: {call.name} timed out after {timeout_s}s.", ok=False, timed_out=True)
        except Exception as e:  # noqa: BLE001  (a failing tool costs the call, not the episode)
            logger.info("tool %s failed: %r", call.name, e)
            return ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", ok=False)
        return result if isinstance(result, ToolResult) else ToolResult(str(result))

    async def close(self) -> None:
        for tool in self._tools.values():
            if tool.close is not None:
                await tool.close()
