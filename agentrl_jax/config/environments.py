"""One config section per environment; ``environment.name`` selects it.

The ``environment`` section of a Config is an :class:`EnvironmentConfig`: the fields
every environment shares (turn and tool limits, outcome scheme, reward shaping, the code
sandbox), plus the fields of the environment that ``name`` selects. Each environment
registers its own section, a subclass that adds its fields, validates them at load and
builds the environment::

    @register_environment("toy")
    @dataclass(frozen=True)
    class ToyEnvConfig(EnvironmentConfig):
        name: str = _f("toy", "Which environment runs the episodes.")
        target: int = _f(3, "toy: the number to guess.")

        def make_env_factory(self, config, *, pool, verifier, count_tokens):
            return lambda: ToyEnv(self.target)

Then ``--set environment.name=toy --set environment.target=5`` works like any other key,
and ``EnvironmentConfig(name="toy", target=5)`` builds a ``ToyEnvConfig`` (the base class
constructs the section its ``name`` selects, so config files name one class for every
environment). A key of another environment's section is an error naming the keys the
selected one knows.

``environment.layout`` picks how tools are called: "inline" tags in one assistant turn, or
"native" chat turns in the model's own tool-call format (``environment.tool_format``;
envs/tools/). A section lists the layouts its environment implements in ``layouts``.

The built-in sections (arithmetic, retool, search) translate themselves into their
environment's settings with that environment's ``from_config`` (``envs/retool.py``,
``envs/arithmetic.py``, ``envs/search.py``); nothing in ``train/`` knows their fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from agentrl_jax.config.core import SECTION_PATHS, ConfigError, _f, _require, _section, _Section

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config
    from agentrl_jax.envs.base import Environment

#: rewards.shaping.RewardWeights.tool_cap as the ReTool environments build it (envs/retool.py).
TOOL_REWARD_CAP = 0.3

_ENVIRONMENTS: dict[str, type[EnvironmentConfig]] = {}


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: ``environment.name=<name>`` selects this EnvironmentConfig subclass.

    The subclass must default its ``name`` field to ``name`` and implement
    ``make_env_factory``. Registering a name twice replaces the first class (a re-run
    config file or notebook cell registers it again).
    """

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, EnvironmentConfig)):
            raise TypeError(f"register_environment({name!r}): {cls!r} is not an EnvironmentConfig subclass")
        default = cls.__dataclass_fields__["name"].default
        if default != name:
            raise TypeError(f"register_environment({name!r}): {cls.__name__}.name must default to {name!r} "
                            f"(declare name: str = _f({name!r}, ...)), got {default!r}")
        if cls.make_env_factory is EnvironmentConfig.make_env_factory:
            raise TypeError(f"register_environment({name!r}): {cls.__name__} must implement make_env_factory")
        _ENVIRONMENTS[name] = cls
        return cls

    return register


def environment_names() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(_ENVIRONMENTS)


@dataclass(frozen=True)
class SandboxConfig(_Section):
    """The code sandbox the ReTool environments run cells in (envs/sandbox.py, envs/remote_sandbox.py)."""

    backend: Literal["local", "remote"] = _f("local", "Local fork-server pool or a SandboxFusion server.")
    url: str = _f("", "SandboxFusion base URL for the remote backend.")
    workers: int = _f(8, "Concurrent executions.")
    timeout_s: float = _f(5.0, "Wall-clock limit per execution.")
    memory_mb: int = _f(1024, "Address-space limit (MB above the warm interpreter) per execution, and per "
                              "stateful session (all cells of an episode).")
    max_output_bytes: int = _f(16384, "Output cap; longer output is truncated with a marker.")
    require_isolation: bool = _f(False, "Local backend: refuse to start unless cells get their own uid and "
                                        "network and mount namespaces (root with CAP_SYS_ADMIN); by default "
                                        "a missing protection is logged and counted (sandbox/protections_missing).")

    def validate(self) -> None:
        _require(self.workers >= 1, self._path("workers"), "must be >= 1")
        _require(self.timeout_s > 0, self._path("timeout_s"), "must be > 0")
        _require(self.memory_mb >= 1, self._path("memory_mb"), "must be >= 1")
        _require(
            self.backend != "remote" or bool(self.url),
            self._path("url"),
            "is required when environment.sandbox.backend='remote'",
        )


@dataclass(frozen=True)
class VerifierConfig(_Section):
    """The math-answer verifier's worker pool (rewards/verifier.py, docs/verifier.md).

    Integer, fraction and decimal answers are decided in-process; LaTeX-heavy ones go to a
    worker process with a hard timeout, about 35 calls/s per two workers.
    """

    workers: int = _f(2, "Worker processes for answers the in-process exact path cannot decide (LaTeX parsing); "
                         "raise it when many episodes end at once with symbolic answers.")
    timeout_s: float = _f(5.0, "Wall-clock limit per verification in a worker; a timed-out answer is wrong, "
                               "counted, and its worker replaced.")
    memory_mb: int = _f(2048, "Address-space limit of each worker.")

    def validate(self) -> None:
        _require(self.workers >= 1, self._path("workers"), "must be >= 1")
        _require(self.timeout_s > 0, self._path("timeout_s"), "must be > 0")
        _require(self.memory_mb >= 64, self._path("memory_mb"), "must be >= 64 (the worker imports sympy)")


@dataclass(frozen=True)
class EnvironmentConfig(_Section):
    """The fields every environment shares; a registered subclass adds its own (module docstring).

    ``EnvironmentConfig(name=..., ...)`` constructs the registered subclass for ``name``.
    """

    name: str = _f("arithmetic", "Which environment runs the episodes: a registered name (built in: "
                                 "arithmetic, retool, search); it selects the section's other fields.")
    max_turns: int = _f(4, "Assistant turns per episode.")
    max_tool_calls: int = _f(3, "Tool calls (interpreter runs, searches) per episode; a call past it is not "
                                "run and asks for the final answer. 0: a no-tool baseline.")
    max_observation_tokens: int = _f(256, "Tokens of one interpreter answer (truncated with a marker).")
    system_prompt: str = _f("", "System message; empty: the environment's default.")
    outcome_scheme: Literal["pm1", "binary"] = _f("pm1", "Outcome reward: +1/-1 (ReTool) or 1/0.")
    format_weight: float = _f(0.0, "Weight of the format reward.")
    tool_weight: float = _f(0.0, "Weight of the (capped) tool-call shaping.")
    overlong_buffer: int = _f(0, "DAPO overlong shaping buffer in tokens (0: off).")
    sandbox: SandboxConfig = _section(SandboxConfig, "The code-execution sandbox.")
    verifier: VerifierConfig = _section(VerifierConfig, "The math-answer verifier's worker pool.")
    layout: Literal["inline", "native"] = _f(
        "inline", "How tools are called: 'inline' tags inside one assistant turn (<code>/<interpreter>, "
                  "<search>/<information>), or 'native' chat turns (assistant -> tool messages -> assistant) in "
                  "the model's own tool-call format, with the tools listed by its chat template "
                  "(docs/chat_formats.md).")
    tool_format: Literal["hermes", "llama3"] = _f(
        "hermes", "layout='native': the call format the model writes: 'hermes' (<tool_call> JSON blocks: "
                  "Hermes, Qwen2.5, Qwen3) or 'llama3' (a JSON object per turn: Llama 3.1-3.3).")

    #: ``make_tasks`` returns tasks for both splits (no data files needed).
    generates_tasks: ClassVar[bool] = False
    #: The layouts this environment implements.
    layouts: ClassVar[tuple[str, ...]] = ("inline",)

    def __new__(cls, *args: Any, **kwargs: Any) -> EnvironmentConfig:
        if cls is EnvironmentConfig:  # the base builds the section its name selects
            cls = cls.variant(args[0] if args else kwargs.get("name", "arithmetic"))
        return super().__new__(cls)

    @classmethod
    def variant(cls, name: str) -> type[EnvironmentConfig]:
        if name not in _ENVIRONMENTS:
            raise ConfigError(f"environment.name: unknown environment {name!r}; registered: "
                              f"{', '.join(environment_names())} (a new one registers its section with "
                              "agentrl_jax.config.register_environment)")
        return _ENVIRONMENTS[name]

    @classmethod
    def variants(cls) -> dict[str, type[EnvironmentConfig]]:
        return {name: _ENVIRONMENTS[name] for name in environment_names()}

    def validate(self) -> None:
        selected = self.variant(self.name)
        _require(type(self) is selected, self._path("name"),
                 f"{self.name!r} selects {selected.__name__}, but this section is a {type(self).__name__}; build it "
                 f"with EnvironmentConfig(name={self.name!r}, ...) or --set environment.name={self.name}")
        _require(self.max_turns >= 1, self._path("max_turns"), "must be >= 1")
        _require(self.layout in self.layouts, self._path("layout"),
                 f"{self.layout!r} is not implemented by environment.name={self.name!r} (it has {list(self.layouts)})")
        _require(self.max_tool_calls >= 0, self._path("max_tool_calls"), "must be >= 0")
        for key in ("format_weight", "tool_weight", "overlong_buffer"):
            _require(getattr(self, key) >= 0, self._path(key), f"must be >= 0, got {getattr(self, key)}")

    def validate_in(self, config: Config) -> None:
        """Checks against the rest of the Config (run by ``Config.validate``): by default, the
        shaping of ``rewards.shaping.composite_reward``, which the built-in ReTool environments use."""
        if self.overlong_buffer:
            limit = overlong_max_tokens(config)
            _require(self.overlong_buffer <= limit, "environment.overlong_buffer",
                     f"({self.overlong_buffer}) must be <= the longest response ({limit} tokens: "
                     "min(rollout.max_new_tokens_per_turn * environment.max_turns, rollout.max_sequence_length "
                     "- rollout.max_prompt_length)); the soft overlong penalty starts that many tokens before it")
        margin = 1.0 if self.outcome_scheme == "binary" else 2.0  # right minus wrong answer
        _require(self.tool_weight * TOOL_REWARD_CAP < margin, "environment.tool_weight",
                 f"({self.tool_weight}) times the tool bonus cap {TOOL_REWARD_CAP} must stay below the outcome "
                 f"margin {margin}, or tool calls could outweigh a correct answer")

    def check_paths(self, config: Config) -> None:
        """Paths a run needs but a config file may leave to the command line (checked by
        ``load_config`` after the overrides). By default the task files, unless ``make_tasks``
        generates them (``generates_tasks``)."""
        if not self.generates_tasks:
            for key, value in (("data.train_path", config.data.train_path), ("data.eval_path", config.data.eval_path)):
                _require(bool(value), key, f"is required for environment.name={self.name!r} (set it with --set "
                                           f"{key}=...)")

    def make_tasks(self, config: Config, split: Literal["train", "eval"]) -> list[dict[str, Any]] | None:
        """Generated task dicts for ``split`` when its data path is empty; None: tasks come from
        ``data.train_path`` / ``data.eval_path`` only (the default)."""
        del config, split
        return None

    def make_demonstrations(self, config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]] | None:
        """SFT cold-start conversations the environment writes itself from its training ``tasks``
        (used when ``sft.steps > 0`` and ``data.sft_path`` is empty); None: they come from
        ``data.sft_path`` only (the default)."""
        del config, tasks
        return None

    def make_env_factory(self, config: Config, *, pool: Any, verifier: Any,
                         count_tokens: Callable[[str], int] | None) -> Callable[[], Environment]:
        """A zero-argument constructor of a fresh environment (one per trajectory).

        Args:
          config: the whole run's Config (e.g. the rollout limits an environment scores against).
          pool: the run's code sandbox (``environment.sandbox``), for environments that run code.
          verifier: the run's ``rewards.verifier.MathVerifier``.
          count_tokens: the policy tokenizer's token count of a text.
        """
        raise NotImplementedError(f"{type(self).__name__}.make_env_factory")


def overlong_max_tokens(config: Config) -> int:
    """L_max of DAPO's overlong shaping: the most tokens the policy can write in one episode.

    The per-turn budget times the turns, but never more than the context leaves after a
    full-length prompt: with a 16k context and 16 turns of 4k tokens, the episode is cut by
    the context long before 64k, and an L_max of 64k would never shape anything.
    """
    r = config.rollout
    return min(r.max_new_tokens_per_turn * config.environment.max_turns, r.max_sequence_length - r.max_prompt_length)


@register_environment("arithmetic")
@dataclass(frozen=True)
class ArithmeticEnvConfig(EnvironmentConfig):
    """The CPU demo: multi-digit sums and products with a Python tool (envs/arithmetic.py)."""

    name: str = _f("arithmetic", "Which environment runs the episodes.")
    min_digits: int = _f(2, "arithmetic: smallest operand width of generated tasks.")
    max_digits: int = _f(4, "arithmetic: largest operand width of generated tasks.")
    num_train_tasks: int = _f(4000, "arithmetic: generated training tasks (when data.train_path is empty).")
    num_eval_tasks: int = _f(200, "arithmetic: generated held-out tasks (when data.eval_path is empty).")
    demo_tool_fraction: float = _f(0.5, "arithmetic SFT: fraction of the unhinted demonstrations that call the tool.")
    demo_hint_fraction: float = _f(
        0.0, "arithmetic SFT: fraction of demonstrations whose user message ends with a bridge thought (the oracle "
        "judge's hint in hybrid.hint_format) that the assistant follows (exact code, copied result); these teach "
        "the post-SFT policy, later the teacher, to read hints (docs/hybrid.md).")

    generates_tasks: ClassVar[bool] = True
    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def validate(self) -> None:
        super().validate()
        _require(1 <= self.min_digits <= self.max_digits, "environment.min_digits/max_digits",
                 f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        _require(0 <= self.demo_tool_fraction <= 1, self._path("demo_tool_fraction"), "must be in [0, 1]")
        _require(0 <= self.demo_hint_fraction <= 1, self._path("demo_hint_fraction"), "must be in [0, 1]")
        _require(self.num_train_tasks >= 1, self._path("num_train_tasks"), "must be >= 1")
        _require(self.num_eval_tasks >= 1, self._path("num_eval_tasks"), "must be >= 1")

    def validate_in(self, config: Config) -> None:
        super().validate_in(config)
        _require(not self.demo_hint_fraction or config.hybrid.hint_placement == "user_message",
                 self._path("demo_hint_fraction"),
                 f"({self.demo_hint_fraction}) writes the hint into the user message, as the teacher reads it with "
                 f"hybrid.hint_placement='user_message'; with {config.hybrid.hint_placement!r} the demonstrations "
                 "would teach another context than the teacher sees (set hint_placement='user_message')")
        _require(not self.demo_hint_fraction or self.layout == "inline", self._path("demo_hint_fraction"),
                 "hint-following demonstrations are written in the inline layout only; "
                 "set environment.layout='inline' or demo_hint_fraction=0")

    def make_tasks(self, config: Config, split: Literal["train", "eval"]) -> list[dict[str, Any]]:
        from agentrl_jax.envs.arithmetic import make_tasks

        widths = range(self.min_digits, self.max_digits + 1)
        count = self.num_train_tasks if split == "train" else self.num_eval_tasks
        per = -(-count // len(widths))
        split_name = "train" if split == "train" else "held_out"
        return [t for d in widths for t in make_tasks(per, d, seed=config.seed, split=split_name)]

    def make_demonstrations(self, config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
        from agentrl_jax.train.setup import arithmetic_demonstrations

        return arithmetic_demonstrations(config, tasks)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        from agentrl_jax.envs.arithmetic import ArithmeticEnv

        return _code_env_factory(self, ArithmeticEnv, ArithmeticEnv.config_from(config), pool, verifier, count_tokens)


def _code_env_factory(section: EnvironmentConfig, inline_env, settings, pool, verifier, count_tokens):
    """The constructor of a code-interpreter episode: ``inline_env`` (tags in one assistant turn)
    or, with ``layout='native'``, ``envs.tools.NativeReToolEnv`` in ``section.tool_format``."""
    if section.layout == "native":
        from agentrl_jax.envs.tools import NativeReToolEnv

        return lambda: NativeReToolEnv(pool, verifier, settings, tool_format=section.tool_format,
                                       count_tokens=count_tokens)
    return lambda: inline_env(pool, verifier, settings, count_tokens=count_tokens)


@register_environment("retool")
@dataclass(frozen=True)
class ReToolEnvConfig(EnvironmentConfig):
    """Math with a Python interpreter (ReTool; envs/retool.py): tasks from data files, an HF model."""

    name: str = _f("retool", "Which environment runs the episodes.")

    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def check_paths(self, config: Config) -> None:
        _require(bool(config.model.path), "model.path",
                 f"is required for environment.name={self.name!r} (set it with --set model.path=...)")
        super().check_paths(config)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv

        return _code_env_factory(self, ReToolEnv, ReToolConfig.from_config(config), pool, verifier, count_tokens)


@register_environment("retool_small")
@dataclass(frozen=True)
class ReToolSmallEnvConfig(EnvironmentConfig):
    """Generated problems that need a program, in the ReTool environment, with scripted-solver SFT
    demonstrations (envs/program_tasks.py, envs/program_demos.py; configs/retool_small.py)."""

    name: str = _f("retool_small", "Which environment runs the episodes.")
    families: tuple[str, ...] = _f(("bignum", "seqsum", "gcdlcm", "primes", "digits", "lineq", "binom", "modpow"),
                                   "retool_small: problem families (envs/program_tasks.py FAMILIES).")
    num_train_tasks: int = _f(20000, "retool_small: generated training tasks (when data.train_path is empty).")
    num_eval_tasks: int = _f(160, "retool_small: generated held-out tasks (when data.eval_path is empty).")
    combo_fraction: float = _f(0.5, "retool_small: fraction of held-out tasks that are held-out combinations "
                                     "(the rest: training variants with held-out parameter ranges).")
    num_demonstrations: int = _f(4000, "retool_small SFT: demonstrations written by the scripted solver, one "
                                       "per training task from the first.")
    demo_styles: tuple[float, float, float, float] = _f(
        (0.45, 0.25, 0.2, 0.1), "retool_small SFT: weights of the demonstration styles tool, memory, fix (a buggy "
                                "program, its traceback, the fix), give_up (a buggy program, then a guess).")

    generates_tasks: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        from agentrl_jax.envs.program_tasks import FAMILIES

        unknown = sorted(set(self.families) - set(FAMILIES))
        _require(bool(self.families) and not unknown, self._path("families"),
                 f"unknown families {unknown or 'none given'}; known: {', '.join(FAMILIES)}")
        for key in ("num_train_tasks", "num_eval_tasks", "num_demonstrations"):
            _require(getattr(self, key) >= 1, self._path(key), "must be >= 1")
        _require(0 <= self.combo_fraction <= 1, self._path("combo_fraction"), "must be in [0, 1]")
        _require(min(self.demo_styles) >= 0 and sum(self.demo_styles) > 0, self._path("demo_styles"),
                 f"must be non-negative weights with a positive sum, got {self.demo_styles}")

    def make_tasks(self, config: Config, split: Literal["train", "eval"]) -> list[dict[str, Any]]:
        from agentrl_jax.envs.program_tasks import make_tasks

        train, held_out = make_tasks(self.num_train_tasks, self.num_eval_tasks, seed=config.seed,
                                     families=self.families, combo_fraction=self.combo_fraction)
        return train if split == "train" else held_out

    def make_demonstrations(self, config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
        from agentrl_jax.envs.program_demos import STYLES, demonstrations, run_blocking
        from agentrl_jax.envs.retool import ReToolConfig
        from agentrl_jax.train.setup import make_sandbox

        async def write():
            async with make_sandbox(config) as pool:
                return await demonstrations(tasks[:self.num_demonstrations], pool, ReToolConfig.from_config(config),
                                            fractions=dict(zip(STYLES, self.demo_styles)), seed=config.seed)
        return run_blocking(write())

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv

        return _code_env_factory(self, ReToolEnv, ReToolConfig.from_config(config), pool, verifier, count_tokens)


@register_environment("search")
@dataclass(frozen=True)
class SearchEnvConfig(EnvironmentConfig):
    """Search-R1 question answering over a retriever (envs/search.py)."""

    name: str = _f("search", "Which environment runs the episodes.")
    corpus_path: str = _f("", "search: JSONL corpus ({id, title, text} per line) for the local BM25 retriever.")
    retriever_url: str = _f("", "search: a Search-R1 retrieval server endpoint (http://host:8000/retrieve) "
                                "used instead of the local index.")
    top_k: int = _f(3, "search: passages returned per query.")
    answer_metric: Literal["em", "f1", "subem"] = _f(
        "em", "search: answer score in the reward (exact match, token F1, substring match); "
              "environment.format_weight is the weight of the format term.")
    retriever_timeout_s: float = _f(10.0, "search: HTTP timeout of one retrieval request (retried 3 times).")

    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def validate(self) -> None:
        super().validate()
        _require(self.top_k >= 1, self._path("top_k"), "must be >= 1")
        _require(self.retriever_timeout_s > 0, self._path("retriever_timeout_s"), "must be > 0")
        _require(not self.retriever_url or self.retriever_url.startswith(("http://", "https://")),
                 self._path("retriever_url"), f"must start with http:// or https://, got {self.retriever_url!r}")
        _require(not (self.corpus_path and self.retriever_url), "environment.corpus_path/retriever_url",
                 "set one retriever: a local corpus or a remote server, not both")
        _require(0 <= self.format_weight < 1, self._path("format_weight"),
                 f"must be in [0, 1) for environment.name='search', got {self.format_weight}")

    def validate_in(self, config: Config) -> None:
        """The search reward is the answer score and the format term only: other shaping fails."""
        for key, value in (("overlong_buffer", self.overlong_buffer), ("tool_weight", self.tool_weight)):
            _require(not value, f"environment.{key}",
                     f"({value}) has no effect with environment.name='search' (its reward is the answer "
                     "score and environment.format_weight only); set it to 0")

    def check_paths(self, config: Config) -> None:
        _require(bool(self.corpus_path or self.retriever_url), "environment.corpus_path",
                 "is required for environment.name='search' (set it with --set environment.corpus_path=corpus.jsonl, "
                 "or use a retrieval server with --set environment.retriever_url=http://host:8000/retrieve)")
        _require(bool(config.model.path), "model.path",
                 f"is required for environment.name={self.name!r} (set it with --set model.path=...)")
        super().check_paths(config)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        from agentrl_jax.envs.search import SearchConfig, SearchEnv, make_retriever

        del pool, verifier  # a search episode runs no code and grades by string match
        retriever, settings = make_retriever(self), SearchConfig.from_config(config)
        if self.layout == "native":
            from agentrl_jax.envs.tools import NativeSearchEnv

            return lambda: NativeSearchEnv(retriever, settings, tool_format=self.tool_format,
                                           count_tokens=count_tokens)
        return lambda: SearchEnv(retriever, settings, count_tokens=count_tokens)


SECTION_PATHS.update({"SandboxConfig": "environment.sandbox", "VerifierConfig": "environment.verifier",
                      "EnvironmentConfig": "environment"})
