"""Search-R1 environment (Jin et al., 2025, "Search-R1: Training LLMs to Reason and Leverage
Search Engines with Reinforcement Learning").

The policy alternates reasoning with search-engine calls and ends with an answer:

    <think>I need the capital of Zorvia.</think>
    <search>capital of Zorvia</search>
    <information>Doc 1(Title: Zorvia) The capital of Zorvia is Quellin.
    ...</information>
    <answer>Quellin</answer>

Decoding stops at `</search>` or `</answer>`. The retrieved passages come back inside
`<information>` tags; the agent loop appends them with loss_mask 0, so retrieved tokens
never enter the policy loss (Search-R1's "retrieved token masking").

What happens to each kind of action (never an exception):

- one closed `<search>q</search>` with a non-empty query: the retriever's top-k passages,
  `<information>Doc 1(Title: ..) ..</information>`, cut to `max_observation_chars` (and
  `max_observation_tokens` when the env has `count_tokens`) with a marker. No result:
  a "no results" observation. A retriever failure or timeout: an observation saying the
  search failed, counted in `tool_stats.errors` / `tool_stats.timeouts`.
- several searches in one action: the first is run, the observation says so.
- an empty query, or `<search>` / `<answer>` never closed: a short correction, no search.
- a search beyond `max_searches`: not run; the observation asks for the final answer.
- a closed answer and a closed search in the same action: a correction asking for one
  action per turn; nothing is run or graded.
- a closed `<answer>a</answer>`: graded, episode done ("answer"). Text after `</answer>`
  is allowed but sets the format component to 0.
- neither a search nor an answer (the model stopped): done, graded as no answer.
- `max_turns` actions without an answer: done ("max_turns"), graded as no answer.
- cut short by the agent loop (context full): `truncated_result` grades it as no answer.

Reward (Search-R1's rule-based outcome reward; the lambda_f term is the format reward of
Jin et al.'s follow-up empirical study of Search-R1, 2025), with the answer
metric s in [0, 1] (EM by default, or token F1 / substring EM) and f = 1 when the
response is well formed (one final, non-empty `<answer>`, balanced `<search>` tags, no
`<information>` written by the policy, nothing after the answer):

    r = (1 - lambda_f) * s + lambda_f * f            ("binary" scheme; Search-R1: lambda_f = 0)
    r_pm1 = 2 r - 1                                   ("pm1" scheme, ReTool-style +-1)

`correct` is always exact match, so pass@k means the same thing whatever the reward.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import string
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentrl_jax.envs.base import Environment, StepResult, ToolStats
from agentrl_jax.envs.retrieval import Retriever, RetrieverError, format_passages

if TYPE_CHECKING:
    from agentrl_jax.config import Config

logger = logging.getLogger(__name__)

SEARCH_PROMPT_TEMPLATE = (
    "Answer the question below. Think inside <think> and </think> whenever you get new information. "
    "If you are missing knowledge, query a search engine with <search> query </search>; the top results "
    "come back between <information> and </information>. You may search several times. When you need no "
    "more information, give only the final answer inside <answer> and </answer>, for example "
    "<answer> Paris </answer>. Question: {question}\n")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


# --------------------------------------------------------------------------- answer metrics


def normalize_answer(text: str) -> str:
    """SQuAD normalization (Rajpurkar et al., 2016): lowercase, drop punctuation and articles, squash spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized golden answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(g) for g in golden_answers))


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if any normalized golden answer occurs in the normalized prediction (Search-R1's `subem`)."""
    predicted = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in predicted for g in golden_answers))


def token_f1(prediction: str, golden_answers: Sequence[str]) -> float:
    """Max over golden answers of the SQuAD token F1.

    With the multiset overlap c = |tokens(p) & tokens(g)|: precision c/|p|, recall c/|g|,
    F1 = 2 P R / (P + R); 0 when either side normalizes to nothing (and they differ).
    """
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for golden in golden_answers:
        gold = normalize_answer(golden).split()
        if not predicted or not gold:
            best = max(best, float(predicted == gold))
            continue
        common = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


ANSWER_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "em": exact_match, "f1": token_f1, "subem": substring_match}


def golden_answers(task: dict[str, Any]) -> list[str]:
    """The task's accepted answers: `golden_answers` (list) if present, else `answer` (str or list)."""
    answers = task.get("golden_answers", task.get("answer"))
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"search task needs 'answer' (a string) or 'golden_answers' (a list of strings), "
                         f"got {answers!r}")
    return list(answers)


# --------------------------------------------------------------------------- config and parsing


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    top_k: int = 3  # passages per search (Search-R1: 3)
    max_turns: int = 4  # policy actions per episode (Search-R1: action budget 4)
    max_searches: int = 3
    max_observation_chars: int = 2000  # ~500 tokens, Search-R1's max_obs_length
    max_observation_tokens: int | None = None  # enforced when the env has a `count_tokens`
    search_timeout_s: float = 60.0  # deadline of one search, retries included
    answer_metric: Literal["em", "f1", "subem"] = "em"
    format_score: float = 0.0  # lambda_f in the module docstring
    outcome_scheme: Literal["binary", "pm1"] = "binary"
    prompt_template: str = SEARCH_PROMPT_TEMPLATE  # the user message; must contain {question}
    system_prompt: str | None = None

    def __post_init__(self):
        for name in ("top_k", "max_turns", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"SearchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_searches < 0:  # 0: a no-search baseline
            raise ValueError(f"SearchConfig.max_searches must be >= 0, got {self.max_searches}")
        if self.answer_metric not in ANSWER_METRICS:
            raise ValueError(f"SearchConfig.answer_metric must be one of {sorted(ANSWER_METRICS)}, "
                             f"got {self.answer_metric!r}")
        if self.outcome_scheme not in ("binary", "pm1"):
            raise ValueError(f"SearchConfig.outcome_scheme must be 'binary' or 'pm1', got {self.outcome_scheme!r}")
        if not 0 <= self.format_score < 1:
            raise ValueError(f"SearchConfig.format_score must be in [0, 1), got {self.format_score}")
        if self.search_timeout_s <= 0:
            raise ValueError(f"SearchConfig.search_timeout_s must be > 0, got {self.search_timeout_s}")
        if "{question}" not in self.prompt_template:
            raise ValueError("SearchConfig.prompt_template must contain '{question}'")

    @classmethod
    def from_config(cls, config: Config) -> SearchConfig:
        """The settings of a run's ``environment`` section (``environment.name='search'``).

        ``max_tool_calls`` bounds the searches; ``format_weight`` is the format score; observations
        are cut at 4 characters per token before the exact token count.
        """
        env = config.environment
        return cls(
            top_k=env.top_k,
            max_turns=env.max_turns,
            max_searches=env.max_tool_calls,
            max_observation_chars=max(env.max_observation_tokens * 4, 16),
            max_observation_tokens=env.max_observation_tokens,
            answer_metric=env.answer_metric,
            format_score=env.format_weight,
            outcome_scheme=env.outcome_scheme,
            system_prompt=env.system_prompt or None,
        )


@dataclasses.dataclass(frozen=True)
class SearchAction:
    """What one policy action asks for.

    kind: "answer" | "search" | "empty_query" | "unclosed_search" | "unclosed_answer" |
      "answer_and_search" | "none". content: the answer or query, stripped.
    text_after_answer: non-space text follows `</answer>`. extra_searches: closed searches
    after the first.
    """

    kind: str
    content: str = ""
    text_after_answer: bool = False
    extra_searches: int = 0


def parse_action(action: str) -> SearchAction:
    """Classifies one policy action (see the module docstring for what each kind does)."""
    answer, searches = _ANSWER.search(action), list(_SEARCH.finditer(action))
    if answer and searches:
        return SearchAction("answer_and_search")
    if answer:
        return SearchAction("answer", answer.group(1).strip(), text_after_answer=bool(action[answer.end():].strip()))
    if searches:
        query = searches[0].group(1).strip()
        return SearchAction("search" if query else "empty_query", query, extra_searches=len(searches) - 1)
    if "<search>" in action:
        return SearchAction("unclosed_search")
    if "<answer>" in action:
        return SearchAction("unclosed_answer")
    return SearchAction("none")


def well_formed(policy_text: str) -> bool:
    """Search-R1's format check on the policy's own text (observations excluded)."""
    answers = list(_ANSWER.finditer(policy_text))
    return (len(answers) == 1 and not policy_text[answers[0].end():].strip()
            and policy_text.count("<answer>") == 1
            and policy_text.count("<search>") == policy_text.count("</search>")
            and "<information>" not in policy_text and "</information>" not in policy_text)


def search_reward(answer: str | None, answers: Sequence[str], *, formatted: bool,
                  config: SearchConfig) -> tuple[float, dict[str, float]]:
    """(reward, components) for a final answer (None: no answer); equations in the module docstring."""
    prediction = answer if answer is not None else ""
    scores = {name: (metric(prediction, answers) if answer is not None else 0.0)
              for name, metric in ANSWER_METRICS.items()}
    outcome = scores[config.answer_metric]
    fmt = float(formatted and bool(answer and answer.strip()))  # an empty answer is not well formed
    reward = (1.0 - config.format_score) * outcome + config.format_score * fmt
    if config.outcome_scheme == "pm1":
        reward = 2.0 * reward - 1.0
    return reward, {"outcome": outcome, "em": scores["em"], "f1": scores["f1"], "format": fmt}


def truncate_tail(text: str, max_chars: int) -> str:
    """Keeps the head of `text` (the best-ranked passages) and a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} characters truncated]"
    return text[:max(0, max_chars - len(marker))] + marker


def wrap_information(body: str) -> str:
    return f"\n\n<information>{body}</information>\n\n"


# --------------------------------------------------------------------------- environment


class SearchEnv(Environment):
    """Question answering with a search engine; tasks are {"question", "answer" | "golden_answers"}.

    The retriever is shared by all episodes (one `SearchEnv` per trajectory, one index per run).
    """

    stop_strings = ("</search>", "</answer>")

    def __init__(self, retriever: Retriever, config: SearchConfig = SearchConfig(),
                 count_tokens: Callable[[str], int] | None = None):
        self.retriever, self.config, self.count_tokens = retriever, config, count_tokens
        self.task: dict[str, Any] | None = None

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        question = str(task["question"]).strip()
        return messages + [{"role": "user", "content": self.config.prompt_template.format(question=question)}]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        if "question" not in task:
            raise KeyError("SearchEnv task is missing field 'question'")
        self.answers = golden_answers(task)
        self.task = task
        self.turns = 0
        self.corrections = 0
        self.num_sampled_tokens = 0
        self.tool_stats = ToolStats()
        self.policy_text = ""
        self.queries: list[str] = []
        return self.initial_messages(task)

    async def step(self, action_text: str) -> StepResult:
        """One policy action -> observation or final reward; see the module docstring for every case."""
        if self.task is None:
            raise RuntimeError("SearchEnv.step before reset")
        self.turns += 1
        self.policy_text += action_text
        action = parse_action(action_text)
        info: dict[str, Any] = {"action": action.kind, "num_sampled_tokens": self.num_sampled_tokens}
        if action.kind == "answer":
            info["text_after_answer"] = action.text_after_answer
            return self._finish(action.content, "answer", info)
        if action.kind == "none":
            return self._finish(None, "no_answer", info)
        if action.kind != "search":
            return self._correct(_CORRECTIONS[action.kind], info)
        if self.tool_stats.calls >= self.config.max_searches:
            return self._correct(f"Search limit ({self.config.max_searches}) reached. Give your final answer "
                                 "inside <answer> and </answer>.", info)
        body = await self._search(action.content, info)
        if action.extra_searches:
            body += "\nNote: only the first query was searched; send one <search> per turn."
        return self._observe(wrap_information(self._limit(body)), info)

    async def _search(self, query: str, info: dict[str, Any]) -> str:
        self.tool_stats.calls += 1
        self.queries.append(query)
        info["query"] = query
        try:
            passages = await asyncio.wait_for(self.retriever.search(query, self.config.top_k),
                                              self.config.search_timeout_s)
        except (asyncio.TimeoutError, TimeoutError) as e:
            return self._failed(f"timed out after {self.config.search_timeout_s}s", True, info, e)
        except RetrieverError as e:
            return self._failed(str(e), e.timed_out, info, e)
        except Exception as e:  # noqa: BLE001  (a broken retriever costs the search, not the run)
            return self._failed(f"{type(e).__name__}: {e}", False, info, e)
        info["num_passages"] = len(passages)
        if not passages:
            return "No results found for this query. Try other keywords."
        return format_passages(passages[:self.config.top_k])

    def _failed(self, reason: str, timed_out: bool, info: dict[str, Any], error: BaseException) -> str:
        self.tool_stats.timeouts += int(timed_out)
        self.tool_stats.errors += int(not timed_out)
        info["search_error"] = reason
        logger.warning("search failed for query %r: %r", info.get("query"), error)
        return f"Search failed ({reason}). Try again or answer with what you know."

    def _limit(self, body: str) -> str:
        body = truncate_tail(body, self.config.max_observation_chars)
        limit = self.config.max_observation_tokens
        if self.count_tokens is not None and limit is not None:
            while self.count_tokens(body) > limit and len(body) > 64:
                body = truncate_tail(body, int(len(body) * 0.8))
        return body

    def _correct(self, message: str, info: dict[str, Any]) -> StepResult:
        self.corrections += 1
        info["correction"] = message
        return self._observe(f"\n{message}\n", info)

    def _observe(self, observation: str, info: dict[str, Any]) -> StepResult:
        if self.turns >= self.config.max_turns:
            return self._finish(None, "max_turns", info)
        return StepResult(observation, 0.0, False, info, tool_stats=dataclasses.replace(self.tool_stats))

    def truncated_result(self, finish_reason: str, num_sampled_tokens: int) -> StepResult:
        """An episode cut short by the agent loop scores as an unanswered one."""
        return self._finish(None, finish_reason, {"num_sampled_tokens": num_sampled_tokens})

    def _finish(self, answer: str | None, finish_reason: str, info: dict[str, Any]) -> StepResult:
        reward, components = search_reward(answer, self.answers, formatted=well_formed(self.policy_text),
                                           config=self.config)
        info.update(answer=answer, corrections=self.corrections, queries=list(self.queries))
        return StepResult("", reward, True, info, finish_reason=finish_reason, correct=components["em"] == 1.0,
                          reward_components=components, tool_stats=dataclasses.replace(self.tool_stats))


_CORRECTIONS = {
    "empty_query": "Your search query was empty. Write the query between <search> and </search>.",
    "unclosed_search": "Your <search> was not closed. Write <search> query </search>.",
    "unclosed_answer": "Your <answer> was not closed. Write <answer> final answer </answer>.",
    "answer_and_search": "Give one action per turn: either <search> query </search> or <answer> ... </answer>.",
}


__all__ = [
    "ANSWER_METRICS", "SEARCH_PROMPT_TEMPLATE", "SearchAction", "SearchConfig", "SearchEnv", "exact_match",
    "golden_answers", "normalize_answer", "parse_action", "search_reward", "substring_match", "token_f1",
    "truncate_tail", "well_formed", "wrap_information",
]
