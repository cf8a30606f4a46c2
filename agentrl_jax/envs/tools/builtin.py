"""Built-in tools: a Python interpreter (the sandbox pool), a search engine (a retriever) and
a calculator. Each factory returns a :class:`Tool` for one episode's registry."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import itertools
import math
import operator
from typing import Any

from agentrl_jax.envs.tools.registry import Tool, ToolResult

_sessions = itertools.count()
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_POWER_BITS = 4096  # a ** b is refused when the result would be larger than this


def python_tool(pool: Any, *, stateful: bool = True, timeout_s: float = 10.0) -> Tool:
    """Runs Python in the sandbox pool; stdout and stderr come back. With ``stateful``, the calls
    of one episode share a namespace (a sandbox session, closed when the episode ends) and run
    one at a time."""
    from agentrl_jax.envs.retool import interpreter_text

    session = f"tools-{next(_sessions)}" if stateful else None
    lock = asyncio.Lock()

    async def run(code: str) -> ToolResult:
        async with lock if stateful else contextlib.nullcontext():
            result = await pool.run(code, session=session, timeout_s=timeout_s)
        return ToolResult(interpreter_text(result) or "(no output; print() the values you need)",
                          ok=result.ok, timed_out=result.timed_out)

    async def close() -> None:
        if session is not None:
            await pool.close_session(session)

    return Tool("python", "Run Python code and return what it prints (stdout and stderr).",
                {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                 "required": ["code"], "additionalProperties": False}, run, close=close if stateful else None)


def search_tool(retriever: Any, *, top_k: int = 3) -> Tool:
    """Searches the retriever; the top passages come back as ``Doc i(Title: ..) ..`` lines."""
    from agentrl_jax.envs.retrieval import RetrieverError, format_passages

    async def search(query: str) -> ToolResult:
        if not query.strip():
            return ToolResult("Error: the query is empty.", ok=False)
        try:
            passages = await retriever.search(query, top_k)
        except RetrieverError as e:
            return ToolResult(f"Search failed ({e}).", ok=False, timed_out=e.timed_out)
        if not passages:
            return ToolResult("No results found for this query. Try other keywords.")
        return ToolResult(format_passages(passages[:top_k]))

    return Tool("search", "Search an encyclopedia; returns the best-matching passages.",
                {"type": "object", "properties": {"query": {"type": "string", "description": "What to search for."}},
                 "required": ["query"], "additionalProperties": False}, search)


def evaluate_arithmetic(expression: str) -> int | float:
    """Value of an arithmetic expression (numbers, + - * / // % **, parentheses), parsed with
    ``ast``: nothing else (names, calls, attributes) is evaluated. Raises ValueError."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise ValueError(f"{left} ** {right} is too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"{ast.unparse(node)!r} is not allowed (numbers and + - * / // % ** only)")

    try:
        return value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None


def calculator_tool() -> Tool:
    """Evaluates an arithmetic expression exactly (integers stay integers)."""

    def calculate(expression: str) -> ToolResult:
        try:
            return ToolResult(str(evaluate_arithmetic(expression)))
        except ValueError as e:
            return ToolResult(f"Error: {e}", ok=False)

    return Tool("calculator", "Evaluate an arithmetic expression, e.g. (12 + 3) * 4 ** 2.",
                {"type": "object",
                 "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
                 "required": ["expression"], "additionalProperties": False}, calculate)
