"""The package stays readable in pieces: no module over 400 lines, no function over 80.

A function may be longer when its ``def`` line, or the line just above it (and its
decorators), says why with a comment ``# long: <why>`` (a kernel body that reads best in
one piece, say). The failure message lists every offender with its length.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
_LONG_REASON = re.compile(r"#\s*long:\s*\S")

def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, def node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def oversized(root: Path, package: str = "agentrl_jax") -> dict[str, int]:
    """{"path" or "path::function": its length in lines} for every module over
    MAX_MODULE_LINES and every function (``def`` line to its last line) over
    MAX_FUNCTION_LINES without a ``# long: <why>`` comment on its ``def`` line or the line
    above it (above its decorators, if it has any)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            found[name] = len(lines)
        for qualname, node in _functions(ast.parse("\n".join(lines), filename=name)):
            length = node.end_lineno - node.lineno + 1
            top = min([node.lineno] + [d.lineno for d in node.decorator_list])  # above its decorators
            remarks = [lines[node.lineno - 1]] + ([lines[top - 2]] if top > 1 else [])
            if length > MAX_FUNCTION_LINES and not any(_LONG_REASON.search(line) for line in remarks):
                found[f"{name}::{qualname}"] = length
    return found


def test_no_module_or_function_over_the_limits():
    over = oversized(ROOT)
    assert not over, (f"over {MAX_MODULE_LINES} lines a module / {MAX_FUNCTION_LINES} a function (split it by "
                      "what it is, or say why it is long with '# long: <why>' on the def line):\n"
                      + "\n".join(f"  {name}: {n} lines" for name, n in sorted(over.items())))


def test_the_check_finds_long_modules_and_functions_and_honours_a_reason(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("def fine():\n    return 1\n")
    (tmp_path / "pkg" / "shapes.py").write_text(
        f"class Engine:\n    def step(self):\n{body.replace('    ', '        ')}\n\n"
        f"# long: one kernel body reads best in one piece\n@staticmethod\ndef kernel():\n{body}\n\n"
        f"def forward():  # long: the attention strategies, each a few lines\n{body}\n\n"
        f"def unexplained():  # long:\n{body}\n"
        + "".join(f"# filler {i}\n" for i in range(MAX_MODULE_LINES)))
    found = oversized(tmp_path, "pkg")
    assert found == {"pkg/shapes.py": found["pkg/shapes.py"], "pkg/shapes.py::Engine.step": MAX_FUNCTION_LINES + 1,
                     "pkg/shapes.py::unexplained": MAX_FUNCTION_LINES + 1}, found
    assert found["pkg/shapes.py"] > MAX_MODULE_LINES
