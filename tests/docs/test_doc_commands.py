"""Every shell command shown in docs/*.md is exercised here, cheaply.

Fenced blocks tagged ``bash`` (or ``sh``/``shell``) are commands. Each command is checked
by what it is:

- ``python launch/tpu_pod.py ...``: the flags parse with the launcher's own parser; with
  ``--describe`` the launcher runs and prints the fields; otherwise the config file and
  every ``--set`` override load and validate (``load_config``), which is what fails first
  for a wrong key, value or file. Training itself is covered by tests/e2e and the notebooks.
- ``python -m agentrl_jax.assets ...``: the arguments parse (running it downloads a model).
- ``pip install -e '.[extra]'``: the extra exists in pyproject.toml.
- ``gcloud ... --command "..."``: the inner commands are checked the same way.
- ``srun [options] python ...``: the python command is checked the same way.
- ``VAR=value`` prefixes are allowed; anything else is an unknown command and fails.

A block whose info string carries a tag from NOT_IN_CI (```` ```bash tpu ````) needs
hardware or data CI does not have: its commands are parsed and their configs loaded, but
nothing is executed, and only such blocks may contain ``gcloud``.

The docs written for newcomers (DOCS_WITH_KEYS) are also checked for drift: every config
key they name in backticks must exist, the config errors quoted in troubleshooting.md
must be the ones the code raises, and relative links must point at existing files and
headings.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from repo_scripts import load_script

from agentrl_jax.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOCS_WITH_KEYS = ["architecture.md", "algorithms.md", "async.md", "environments.md", "running.md", "troubleshooting.md"]
SHELL_LANGS = {"bash", "sh", "shell"}
NOT_IN_CI = {
    "tpu": "needs a Cloud TPU VM or pod slice",
    "gpu": "needs a CUDA GPU",
    "multihost": "needs several hosts",
    "data": "needs external checkpoints or datasets",
    "long": "an experiment that runs for tens of minutes; the configs it names load in tests/core",
}
SECTIONS = ("model", "mesh", "rollout", "algorithm", "optimizer", "data", "environment", "checkpoint",
            "logging", "eval", "sft", "hybrid", "critic")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "ipynb", "parquet"}
FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)\n(.*?)^```", re.DOTALL | re.MULTILINE)


LAUNCHER = load_script("launch/tpu_pod.py", "tpu_pod_launcher")


def shell_blocks():
    """(doc name, tags, commands) for every shell block of docs/*.md."""
    blocks = []
    for doc in DOCS:
        for lang, info, body in FENCE.findall(doc.read_text()):
            if lang not in SHELL_LANGS:
                continue
            text = re.sub(r"\\\n\s*", " ", body)  # join continuation lines
            commands = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            blocks.append((doc.name, set(info.split()), commands))
    return blocks


BLOCKS = shell_blocks()


def check_launch(argv: list[str]) -> str:
    """Parse the launcher flags and load the config; run --describe. Returns what was done."""
    args = LAUNCHER.parse_args(argv)
    if args.coordinator:
        assert args.num_processes and args.process_id is not None, "--coordinator needs --num-processes/--process-id"
    if args.describe:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert LAUNCHER.main(argv) == 0
        assert "algorithm.loss = " in out.getvalue()
        return "described"
    load_config(args.config, args.overrides)
    return f"loaded {args.config} with {len(args.overrides)} overrides"


def check_pip(argv: list[str]) -> str:
    assert argv[:2] == ["pip", "install"], argv
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for target in argv[2:]:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", target)
        if match:
            for extra in match.group(1).split(","):
                assert extra in extras, f"pip extra {extra!r} is not in pyproject.toml ({sorted(extras)})"
        else:
            assert target in ("-e", "."), f"unexpected pip argument {target!r}"
    return "pip extras exist"


def check_command(command: str, tags: set[str]) -> list[str]:
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        argv = argv[1:]  # environment assignments
    assert argv, f"empty command {command!r}"
    head = argv[0]
    if head == "python" and len(argv) > 1 and argv[1] == "launch/tpu_pod.py":
        return [check_launch(argv[2:])]
    if head == "python" and argv[1:3] == ["-m", "agentrl_jax.assets"]:
        from agentrl_jax.assets import parse_args

        parse_args(argv[3:])
        return ["assets arguments parse"]
    if head == "pip":
        return [check_pip(argv)]
    if head == "cd":
        return ["cd"]
    if head == "srun":  # a SLURM job step: the launcher command after srun's own options
        assert tags & set(NOT_IN_CI), "an srun command must sit in a block tagged as not run in CI"
        assert "python" in argv, f"srun without a python command: {command!r}"
        return check_command(shlex.join(argv[argv.index("python"):]), tags)
    if head == "gcloud":
        assert tags & set(NOT_IN_CI), "a gcloud command must sit in a block tagged as not run in CI"
        inner = argv[argv.index("--command") + 1]
        return [done for part in inner.split("&&") for done in check_command(part.strip(), tags)]
    raise AssertionError(f"no check for command {command!r}: add one to {__file__} or tag its block {sorted(NOT_IN_CI)}")


def test_docs_show_commands():
    assert len(BLOCKS) >= 8, "the docs lost their command blocks"


@pytest.mark.parametrize("doc,tags,commands", BLOCKS, ids=[f"{b[0]}:{i}" for i, b in enumerate(BLOCKS)])
def test_every_documented_command(doc, tags, commands):
    unknown = {t for t in tags if t not in NOT_IN_CI}
    assert not unknown, f"{doc}: unknown block tags {unknown}; known: {NOT_IN_CI}"
    assert commands, f"{doc}: empty shell block"
    if "long" in tags:
        return  # a shell script (loops, variables) around launch commands of shipped configs
    for command in commands:
        assert check_command(command, tags)


def test_describe_is_shown_and_lists_every_section():
    assert any("--describe" in c for _, _, cmds in BLOCKS for c in cmds)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        LAUNCHER.main(["--config", "demo", "--describe"])
    for section in SECTIONS:
        assert f"\n{section}." in out.getvalue(), section


def _key_exists(path: str) -> bool:
    import dataclasses
    import typing

    classes = [Config]
    for part in path.split("."):
        # a section with variants (environment): the key exists in one of them
        classes = [v for c in classes for v in (c.variants().values() if hasattr(c, "variants") else [c])]
        classes = [typing.get_type_hints(c)[part] for c in classes if part in {f.name for f in dataclasses.fields(c)}]
        if not classes:
            return False
    return True


@pytest.mark.parametrize("name", DOCS_WITH_KEYS)
def test_config_keys_named_in_docs_exist(name):
    text = (ROOT / "docs" / name).read_text()
    spans = re.findall(r"`([^`\n]+)`", text)
    keys = set()
    for span in spans:
        if "unknown key" in span:
            continue  # a quoted error message about a mistyped key
        for match in re.finditer(rf"\b((?:{'|'.join(SECTIONS)})(?:\.[a-z_]+)+)", span):
            start = match.start()
            if (start > 0 and span[start - 1] in "/._") or match.group(1).rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue  # part of a path, a file name or a longer name
            keys.add(match.group(1))
    assert keys, f"{name} names no config keys"
    missing = sorted(k for k in keys if not _key_exists(k))
    assert not missing, f"{name} names config keys that do not exist: {missing}"


# The config errors quoted in troubleshooting.md, with the overrides that raise them.
QUOTED_ERRORS = [
    ("demo", ["algorithm.los=1"], "override 'algorithm.los': unknown key 'los' in algorithm; known keys: "),
    ("demo", ["algorithm.aggregation=mean"], "algorithm.aggregation: got 'mean'; allowed values are 'token-mean', "),
    ("demo", ["algorithm.loss=my_pg"], "algorithm.loss: unknown name 'my_pg'; registered: cispo, gspo, "),
    ("demo", ["algorithm.minibatches=3"],
     "algorithm.minibatches (3) must divide data.prompts_per_step * algorithm.group_size (64)"),
    ("retool", [], "model.path: is required for environment.name='retool' (set it with --set model.path=...)"),
    ("demo", ["algorithm.group_size=1"], "algorithm.group_size: must be >= 2 for the group estimator 'grpo' (got 1)"),
]


@pytest.mark.parametrize("config,overrides,message", QUOTED_ERRORS, ids=[m[:30] for _, _, m in QUOTED_ERRORS])
def test_quoted_config_errors_are_the_real_ones(config, overrides, message):
    assert message in (ROOT / "docs" / "troubleshooting.md").read_text()
    with pytest.raises(ConfigError) as error:
        load_config(config, overrides)
    assert message in str(error.value)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", DOCS_WITH_KEYS)
def test_relative_links_resolve(name):
    text = (ROOT / "docs" / name).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        file_part, _, anchor = target.partition("#")
        path = (ROOT / "docs" / file_part) if file_part else ROOT / "docs" / name
        assert path.exists(), f"{name}: broken link {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{name}: no heading for #{anchor} in {path.name}"
