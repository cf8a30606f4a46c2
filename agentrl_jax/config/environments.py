"""The environment section's base and registry: ``environment.name`` selects a registered section.

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

The built-in sections live with their environments in envs/ (``envs/arithmetic.py``,
``envs/retool.py``, ``envs/retool_small.py``, ``envs/search_config.py``) and register there;
this module imports nothing above config. The package root adds the loader that imports
them the first time the registry is read (``agentrl_jax/__init__.py``), so
``EnvironmentConfig(name="search")`` works after importing only ``agentrl_jax.config``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from agentrl_jax.config.core import SECTION_PATHS, ConfigError, _f, _require, _section, _Section
from agentrl_jax.config.registries import load_registry

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config

#: rewards.shaping.RewardWeights.tool_cap as the ReTool environments build it (envs/retool.py);
#: the base section's ``validate_in`` bounds environment.tool_weight with it.
TOOL_REWARD_CAP = 0.3

_ENVIRONMENTS: dict[str, type[EnvironmentConfig]] = {}


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: ``environment.name=<name>`` selects this EnvironmentConfig subclass.

    The subclass must default its ``name`` field to ``name`` and implement
    ``make_env_factory``. Registering a name twice replaces the first class (a re-run
    config file or notebook cell registers it again); the built-in sections are loaded
    first, so a user's section replaces a built-in one of the same name.
    """
    load_registry("environments")

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
    load_registry("environments")
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
        load_registry("environments")
        if name not in _ENVIRONMENTS:
            raise ConfigError(f"environment.name: unknown environment {name!r}; registered: "
                              f"{', '.join(environment_names())} (a new one registers its section with "
                              "agentrl_jax.config.register_environment, in the config file or a module it "
                              "imports)")
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
                         count_tokens: Callable[[str], int] | None) -> Callable[[], Any]:
        """A zero-argument constructor of a fresh ``envs.base.Environment`` (one per trajectory).

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


SECTION_PATHS.update({"SandboxConfig": "environment.sandbox", "VerifierConfig": "environment.verifier",
                      "EnvironmentConfig": "environment"})
