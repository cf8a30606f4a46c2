"""Every repository path the docs and the code's docstrings and comments name exists.

Where paths are read from:
- the text of README.md and docs/*.md;
- the comments and string literals (docstrings, config help texts) of every ``.py`` file
  under agentrl_jax/, configs/, bench/ and launch/ (read with ``tokenize``, so code is not).

What counts as a path: a run of path characters (letters, digits, ``_ . - * { } ,``) that
contains a ``/`` and does not start inside a longer word or path (not right after a word
character or one of ``/ ~ : . - , { } *``: absolute paths like ``/data/x.parquet``,
``~/.cache/...`` and URLs are not read), trailing ``.`` and ``,`` dropped, and that either ends in one of ``EXTENSIONS`` or starts with one of the repository's top-level
folders (``TOP_LEVEL``: ``docs/rollout_results/``, ``tests/e2e``). Anything else with a
slash (``pi/old``, metric names like ``rollout/response_length``) is not a path.

What is not a repository path, by rule: a path whose first part is in ``NOT_IN_REPO``:
where a run writes (``runs/...``, a run's ``metrics/metrics.jsonl``), placeholders of a
documented command or a docstring (``OUT/``, ``DIR/``, ``logdir/``, ``trace_dir/``), and
files of other projects named next to the project (Search-R1's ``search_r1/...``,
SandboxFusion's ``sandbox/...``).

How a path resolves: ``{a,b}`` is expanded as a shell would and ``*`` must match at least
one file; then the path must exist relative to the repository root, or to ``agentrl_jax/``
(package-relative: ``train/setup.py`` is agentrl_jax/train/setup.py), or to the folder of
the file that names it (docs/benchmarks.md's ``rollout_results/...``).

A section of docs/benchmarks.md named after the file (``docs/benchmarks.md, "Decode lanes"``,
quoted with ' or ", the name may wrap across lines) must begin one of its headings.

A last test keeps out what the repository must not mention: a design document or seed
notes that are not in it, development rounds ("the tenth session") and issue numbers.
"""

from __future__ import annotations

import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agentrl_jax"
CODE_DIRS = ("agentrl_jax", "configs", "bench", "launch")
EXTENSIONS = (".py", ".md", ".png", ".json", ".jsonl", ".sh", ".ipynb", ".toml", ".log")
TOP_LEVEL = ("agentrl_jax", "configs", "docs", "bench", "launch", "tests", "notebooks")
NOT_IN_REPO = {"runs", "metrics", "OUT", "DIR", "logdir", "trace_dir", "search_r1", "sandbox"}

PATH = re.compile(r"(?<![\w/~:.{}*,-])((?:[\w.*{},-]+/)+[\w.*{},-]*)")
FORBIDDEN = {
    "a design document that is not in the repository": re.compile(r"DESIGN\.md"),
    "seed notes that are not in the repository": re.compile(r"(?<![\w-])seeds/"),
    "a development round": re.compile(
        r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
        r"thirteenth|fourteenth|fifteenth|\d+(?:st|nd|rd|th))[ -]sessions?\b",
        re.IGNORECASE,
    ),
    "an issue number": re.compile(r"\bissues? #?\d+|(?<![\w&])#\d+\b", re.IGNORECASE),
}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_files() -> list[Path]:
    return [path for folder in CODE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a file says in words: a doc's lines, a module's comments
    and string literals (a string's lines numbered from where it starts)."""
    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), start=1))
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            row = token.start[0]
            lines += [(row + offset, line) for offset, line in enumerate(token.string.splitlines())]
    return lines


def is_repository_path(candidate: str) -> bool:
    first = candidate.split("/", 1)[0]
    if first in NOT_IN_REPO or first.startswith("."):
        return False
    return candidate.endswith(EXTENSIONS) or first in TOP_LEVEL


def expand_braces(pattern: str) -> list[str]:
    """``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json`` (every brace group, as a shell does)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(pick) for pick in itertools.product(*choices)]


def resolves(candidate: str, named_in: Path) -> bool:
    for path in expand_braces(candidate):
        bases = (ROOT, PACKAGE, named_in.parent)
        if not any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in bases):
            return False
    return True


def mentioned_paths() -> list[tuple[str, str]]:
    """(file:line, path) for every repository path named in the docs and the code's prose."""
    found = []
    for file in doc_files() + code_files():
        for number, line in prose(file):
            for candidate in (c.rstrip(".,") for c in PATH.findall(line)):
                if is_repository_path(candidate):
                    found.append((f"{file.relative_to(ROOT)}:{number}", candidate))
    return found


def test_the_scan_finds_the_paths_the_docs_name():
    """The extraction itself: it must see paths, or the existence check below proves nothing."""
    named = {path for _, path in mentioned_paths()}
    for expected in ("train/rl/loop.py", "configs/retool.py", "docs/async.md", "bench/rollout.py"):
        assert expected in named, f"{expected} is no longer found by the scan"
    assert len(named) > 100, f"only {len(named)} distinct paths found"
    for not_a_path in ("runs/demo", "pi/old", "rollout/response_length", "/data/aime_2024.jsonl"):
        assert not any(is_repository_path(c) for c in PATH.findall(f"see {not_a_path} here")), not_a_path
    assert expand_braces("a/b_{x,y}_{1,2}.json") == ["a/b_x_1.json", "a/b_x_2.json", "a/b_y_1.json", "a/b_y_2.json"]


def test_every_path_the_docs_and_docstrings_name_exists():
    missing = [f"{where}: {path}" for where, path in mentioned_paths() if not resolves(path, ROOT / where.split(":")[0])]
    assert not missing, f"{len(missing)} named paths do not exist in the repository:\n" + "\n".join(missing)


BENCHMARK_SECTION = re.compile(r"benchmarks\.md,?\s*\(?([\"'])(.+?)\1", re.DOTALL)


def test_benchmark_sections_named_exist():
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "benchmarks.md").read_text(), re.MULTILINE)
    named = []
    for file in doc_files() + code_files():
        text = "\n".join(line for _, line in prose(file))
        for _, name in BENCHMARK_SECTION.findall(text):
            named.append((file.relative_to(ROOT), " ".join(name.split())))
    assert len(named) > 10, f"only {len(named)} benchmark sections named: the scan broke"
    missing = [f"{where}: {name!r}" for where, name in named
               if not any(h.lower().startswith(name.lower()) for h in headings)]
    assert not missing, "sections of docs/benchmarks.md that no heading begins with:\n" + "\n".join(missing)


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_no_mention_of_what_is_not_in_the_repository(what):
    pattern = FORBIDDEN[what]
    hits = [
        f"{file.relative_to(ROOT)}:{number}: {line.strip()}"
        for file in doc_files() + code_files()
        for number, line in prose(file)
        if pattern.search(line)
    ]
    assert not hits, f"{what} is mentioned:\n" + "\n".join(hits)
