"""ReTool environment (Feng et al., 2025, "ReTool: RL for strategic tool use in LLMs").

The policy interleaves reasoning with code:

    ... <code>
    ```python
    print(2**10)
    ```
    </code>
    <interpreter>
    1024
    </interpreter>
    ... so the answer is \\boxed{1024}

Each action the rollout driver hands to `step` ends at a stop string (`</code>`) or at
end of sequence. What happens to each kind of action (never an exception):

- one closed `<code>` block: run it (cells of an episode share a sandbox session), answer
  `<interpreter>stdout + stderr</interpreter>`, cut to `max_observation_chars` with a marker;
  a timeout or crash is reported inside the interpreter tags.
- several blocks: the first is run, the observation says the others were ignored.
- `<code>` never closed, or an empty block: a short correction, no execution.
- a tool call beyond `max_tool_calls`: not run; the observation asks for the final answer.
- a `\\boxed{}` answer (with no code after it): graded, episode done. Text after the
  answer is allowed but costs the format component.
- neither code nor answer (the model stopped): episode done, graded as no answer.
- `max_turns` actions without an answer: episode done (finish_reason "max_turns").
- cut short by the agent loop (context full): `truncated_result` scores it as no answer.

``ReToolEnvConfig`` is the environment's config section (``environment.name='retool'``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Callable, ClassVar

from agentrl_jax.config import (TOOL_REWARD_CAP, Config, EnvironmentConfig, config_field, overlong_max_tokens,
                                register_environment, require)
from agentrl_jax.envs.base import Environment, StepResult, ToolStats
from agentrl_jax.envs.sandbox import ExecResult, SandboxPool
from agentrl_jax.rewards.boxed import find_boxed_spans
from agentrl_jax.rewards.shaping import RewardWeights, composite_reward
from agentrl_jax.rewards.verifier import MathVerifier

RETOOL_SYSTEM_PROMPT = (
    "Solve the problem step by step. You may run Python by writing <code>\n```python\n...\n```\n</code>; "
    "the result comes back in <interpreter>...</interpreter>. Use print() to see values. "
    "Put the final answer in \\boxed{}.")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n?(.*?)```", re.DOTALL)
_episode_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class ReToolConfig:
    max_turns: int = 8  # policy actions per episode
    max_tool_calls: int = 6
    max_observation_chars: int = 2048
    max_observation_tokens: int | None = None  # enforced when the env has a `count_tokens`
    tool_timeout_s: float = 10.0
    stateful: bool = True  # cells of one episode share a namespace (a sandbox session)
    fenced: bool = True  # a ```python fence inside <code>; False: raw code (short format)
    open_tag: str = "<code>"
    close_tag: str = "</code>"
    system_prompt: str | None = RETOOL_SYSTEM_PROMPT
    reward_weights: RewardWeights = RewardWeights()

    def __post_init__(self):
        for name in ("max_turns", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReToolConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tool_calls < 0:  # 0: a no-tool baseline, every call is answered with the limit message
            raise ValueError(f"ReToolConfig.max_tool_calls must be >= 0, got {self.max_tool_calls}")

    @classmethod
    def from_config(cls, config: Config, base: ReToolConfig | None = None) -> ReToolConfig:
        """The settings of a run's ``environment`` section, over ``base`` (default: ReTool's own, with
        ``environment.system_prompt`` when set). Observations are cut at 4 characters per token
        before the exact token count."""
        env = config.environment
        if base is None:
            base = cls(system_prompt=env.system_prompt or RETOOL_SYSTEM_PROMPT)
        return dataclasses.replace(
            base,
            max_turns=env.max_turns,
            max_tool_calls=env.max_tool_calls,
            max_observation_chars=max(env.max_observation_tokens * 4, 16),
            max_observation_tokens=env.max_observation_tokens,
            tool_timeout_s=env.sandbox.timeout_s,
            reward_weights=reward_weights(config),
        )


def reward_weights(config: Config) -> RewardWeights:
    """The shaping of a run's ``environment`` section (outcome scheme, format, tool and overlong terms)."""
    env = config.environment
    return RewardWeights(
        outcome_scheme=env.outcome_scheme,
        format=env.format_weight,
        tool=env.tool_weight,
        overlong=1.0 if env.overlong_buffer else 0.0,
        max_tokens=overlong_max_tokens(config) if env.overlong_buffer else None,
        tool_cap=TOOL_REWARD_CAP,
        overlong_cache_tokens=max(env.overlong_buffer, 1),
    )


def truncate_middle(text: str, max_chars: int) -> str:
    """Keeps the head and tail of `text` around a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} characters truncated]...\n"
    keep = max(0, max_chars - len(marker))
    return text[:keep // 2] + marker + text[len(text) - (keep - keep // 2):]


def interpreter_text(result: ExecResult) -> str:
    """The body of an `<interpreter>` block for one execution."""
    text = result.stdout
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
    if result.error is not None:
        text += f"\nSandbox error: {result.error}. Try again."
    elif result.timed_out:
        text += "\nTimeoutError: execution exceeded the time limit."
    elif result.exit_status is not None and result.exit_status < 0:
        text += f"\nProcess killed by signal {-result.exit_status}."
    return text.strip("\n")


def record_call(stats: ToolStats, result: ExecResult) -> None:
    """Counts one program run in ``stats``: a call, and a timeout or an error."""
    stats.calls += 1
    stats.timeouts += int(result.timed_out)
    stats.errors += int(not result.timed_out and not result.ok)


def wrap_interpreter(body: str, fenced: bool) -> str:
    return f"\n<interpreter>\n{body}\n</interpreter>\n" if fenced else f"<interpreter>{body}</interpreter>"


def parse_code(action: str, config: ReToolConfig) -> tuple[str | None, str | None]:
    """(code, problem): the first code block of `action`, or a correction message."""
    start = action.find(config.open_tag)
    if start == -1:
        return None, None
    end = action.find(config.close_tag, start)
    if end == -1:
        return None, f"Error: {config.open_tag} was not closed. End your code with {config.close_tag}."
    body = action[start + len(config.open_tag):end]
    if config.fenced:
        fence = _FENCE.search(body)
        body = fence.group(1) if fence else body.replace("```", "")
    if not body.strip():
        return None, f"Error: empty code block. Write code between {config.open_tag} and {config.close_tag}."
    note = None
    if action.find(config.open_tag, end) != -1:
        note = "Note: only the first code block was executed; send one block per turn."
    return body.strip("\n"), note


def initial_messages(config: ReToolConfig, task: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages an episode starts from: the optional system prompt, then the question."""
    messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    return messages + [{"role": "user", "content": str(task["question"])}]


class ReToolEnv(Environment):
    """Math with a Python interpreter; tasks are {"question": str, "answer": str, ...}."""

    def __init__(self, pool: SandboxPool, verifier: MathVerifier, config: ReToolConfig = ReToolConfig(),
                 count_tokens: Callable[[str], int] | None = None):
        self.pool, self.verifier, self.config = pool, verifier, config
        self.count_tokens = count_tokens
        self.stop_strings = (config.close_tag,)
        self.task: dict[str, Any] | None = None

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, str]]:
        return initial_messages(self.config, task)

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        for field in ("question", "answer"):
            if field not in task:
                raise KeyError(f"ReToolEnv task is missing field {field!r}")
        await self.close()
        self.task = task
        self.turns = 0
        self.num_sampled_tokens = 0
        self.tool_stats = ToolStats()
        self.response = ""
        self.session = f"retool-{next(_episode_ids)}" if self.config.stateful else None
        return self.initial_messages(task)

    def limit_observation(self, body: str) -> str:
        """``body`` cut to the episode's observation size (characters, then tokens when counted)."""
        body = truncate_middle(body, self.config.max_observation_chars)
        limit = self.config.max_observation_tokens
        if self.count_tokens is not None and limit is not None:
            while self.count_tokens(body) > limit and len(body) > 64:
                body = truncate_middle(body, int(len(body) * 0.8))
        return body

    def _observe(self, body: str, info: dict[str, Any]) -> StepResult:
        observation = wrap_interpreter(self.limit_observation(body), self.config.fenced)
        self.response += observation
        if self.turns >= self.config.max_turns:
            return self._finish(None, "max_turns", info)
        return StepResult(observation, 0.0, False, info, tool_stats=dataclasses.replace(self.tool_stats))

    async def step(self, action_text: str) -> StepResult:
        """One policy action -> observation; see the module docstring for every case."""
        if self.task is None:
            raise RuntimeError("ReToolEnv.step before reset")
        self.turns += 1
        self.response += action_text
        boxes = find_boxed_spans(action_text)
        code_start = action_text.find(self.config.open_tag)
        if boxes and (code_start == -1 or code_start < boxes[-1][0]):
            return await self._grade(boxes[-1][2], "answer")
        code, problem = parse_code(action_text, self.config)
        if code is None and problem is None:
            return await self._grade(None, "no_answer")
        if code is None:
            return self._observe(problem, {"correction": problem})
        if self.tool_stats.calls >= self.config.max_tool_calls:
            message = "Tool call limit reached. Give your final answer in \\boxed{}."
            return self._observe(message, {"correction": message})
        result = await self.pool.run(code, session=self.session, timeout_s=self.config.tool_timeout_s)
        record_call(self.tool_stats, result)
        body = interpreter_text(result) + (f"\n{problem}" if problem else "")
        return self._observe(body, {"tool": result})

    async def _grade(self, answer: str | None, finish_reason: str) -> StepResult:
        verdict = await self.verifier.averify(answer, str(self.task["answer"]))
        return self._finish(verdict, finish_reason, {"answer": answer})

    def _finish(self, verdict, finish_reason: str, info: dict[str, Any]) -> StepResult:
        """The final StepResult; overlong shaping scores ``num_sampled_tokens`` (set by the agent loop)."""
        correct = bool(verdict is not None and verdict.correct)
        reward, components = composite_reward(
            correct, self.response, num_tokens=self.num_sampled_tokens,
            successful_tool_calls=self.tool_stats.successful, weights=self.config.reward_weights)
        info.update(num_sampled_tokens=self.num_sampled_tokens,
                    verifier_timed_out=bool(verdict is not None and verdict.timed_out))
        return StepResult("", reward, True, info, finish_reason=finish_reason, correct=correct,
                          reward_components=components, tool_stats=dataclasses.replace(self.tool_stats))

    def truncated_result(self, finish_reason: str, num_sampled_tokens: int) -> StepResult:
        """An episode cut short by the agent loop scores as an unanswered one (wrong, plus shaping)."""
        self.num_sampled_tokens = num_sampled_tokens
        return self._finish(None, finish_reason, {"answer": None})

    async def close(self) -> None:
        session, self.__dict__["session"] = getattr(self, "session", None), None
        if session is not None:
            await self.pool.close_session(session)


def code_env_factory(section: EnvironmentConfig, inline_env, settings, pool, verifier, count_tokens):
    """The constructor of a code-interpreter episode: ``inline_env`` (tags in one assistant turn)
    or, with ``layout='native'``, ``envs.tools.NativeReToolEnv`` in ``section.tool_format``."""
    if section.layout == "native":
        from agentrl_jax.envs.tools import NativeReToolEnv  # envs.tools imports this module

        return lambda: NativeReToolEnv(pool, verifier, settings, tool_format=section.tool_format,
                                       count_tokens=count_tokens)
    return lambda: inline_env(pool, verifier, settings, count_tokens=count_tokens)


@register_environment("retool")
@dataclasses.dataclass(frozen=True)
class ReToolEnvConfig(EnvironmentConfig):
    """Math with a Python interpreter (ReTool; this module): tasks from data files, an HF model."""

    name: str = config_field("retool", "Which environment runs the episodes.")

    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def check_paths(self, config: Config) -> None:
        require(bool(config.model.path), "model.path",
                f"is required for environment.name={self.name!r} (set it with --set model.path=...)")
        super().check_paths(config)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        return code_env_factory(self, ReToolEnv, ReToolConfig.from_config(config), pool, verifier, count_tokens)
