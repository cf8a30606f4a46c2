"""Search-R1 env: BM25 against hand values and a naive reference, EM/F1, every malformed
action, a scripted two-hop episode over the local index, the HTTP backend against a
real server on 127.0.0.1 (retries, timeouts, 4xx), and config loading."""

import asyncio
import collections
import http.server
import json
import math
import re
import shlex
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from repo_scripts import load_script

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.envs import (
    BM25Index,
    LocalRetriever,
    Passage,
    RemoteRetriever,
    RemoteRetrieverConfig,
    RetrieverError,
    SearchConfig,
    SearchEnv,
    ToolStats,
    load_corpus,
    make_search_corpus,
    write_search_corpus,
)
from agentrl_jax.envs.retrieval import parse_retrieval_response, tokenize
from agentrl_jax.envs.search import (
    exact_match,
    normalize_answer,
    parse_action,
    search_reward,
    substring_match,
    token_f1,
    well_formed,
)


def docs(*texts):
    return [Passage(id=str(i), title="", text=t) for i, t in enumerate(texts)]


# --------------------------------------------------------------------------- BM25


def test_tokenizer_lowercases_and_splits_punctuation():
    assert tokenize("The Capital-of ZORVIA, is: Quellin!") == ["the", "capital", "of", "zorvia", "is", "quellin"]


def test_bm25_document_with_query_terms_ranks_first():
    index = BM25Index(docs("the cat sat on the mat", "a dog barked at the mailman", "birds fly south"))
    assert [p.id for p in index.search("dog mailman", 3)] == ["1"]  # only matching documents come back
    assert index.search("quantum chromodynamics", 3) == []


def test_bm25_idf_prefers_the_rare_term():
    # "common" is in 3 of 4 documents, "rare" in 1: a single rare hit beats a double common one.
    index = BM25Index(docs("common common filler", "rare filler words", "common other", "common more"))
    assert index.search("common rare", 2)[0].id == "1"
    assert index.idf["rare"] > index.idf["common"] > 0  # Lucene's idf stays positive


def test_bm25_hand_computed_score_and_ties_in_corpus_order():
    index = BM25Index(docs("a b", "a c c", "d"), k1=1.2, b=0.75)
    n, avgdl = 3, 2.0  # lengths 2, 3, 1
    idf_c = math.log(1 + (n - 1 + 0.5) / (1 + 0.5))
    expected = idf_c * 2 * 2.2 / (2 + 1.2 * (1 - 0.75 + 0.75 * 3 / avgdl))
    assert index.scores("c")[1] == pytest.approx(expected, rel=1e-12)
    same = BM25Index(docs("x y", "x y", "x y"))
    assert [p.id for p in same.search("x", 3)] == ["0", "1", "2"]


def test_bm25_matches_a_naive_reference_on_random_corpora():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(30)]
    corpus = [" ".join(rng.choice(vocab, size=int(rng.integers(1, 20)))) for _ in range(60)]
    index = BM25Index(docs(*corpus), k1=1.5, b=0.75)
    tokenized = [c.split() for c in corpus]
    avgdl = sum(map(len, tokenized)) / len(tokenized)
    df = collections.Counter(t for d in tokenized for t in set(d))
    for _ in range(20):
        query = list(rng.choice(vocab + ["unseen"], size=int(rng.integers(1, 5))))
        reference = []
        for d in tokenized:
            score = 0.0
            for t in query:
                tf = d.count(t)
                if tf:
                    idf = math.log(1 + (len(corpus) - df[t] + 0.5) / (df[t] + 0.5))
                    score += idf * tf * 2.5 / (tf + 1.5 * (0.25 + 0.75 * len(d) / avgdl))
            reference.append(score)
        np.testing.assert_allclose(index.scores(" ".join(query)), reference, rtol=1e-10, atol=1e-12)
        top = index.search(" ".join(query), 5)
        assert [p.score for p in top] == pytest.approx(sorted(reference, reverse=True)[:len(top)], rel=1e-10)


def test_synthetic_corpus_is_answerable_by_search_only():
    data = make_search_corpus(60, seed=3)
    assert data.train and data.held_out
    train_countries = {t["question"] for t in data.train}
    assert not train_countries & {t["question"] for t in data.held_out}
    index = BM25Index(data.passages)
    single_hop = [t for t in data.train + data.held_out if t["hops"] == 1]
    hits = [t["support_ids"][0] in [p.id for p in index.search(t["question"], 3)] for t in single_hop]
    assert np.mean(hits) == 1.0
    assert make_search_corpus(60, seed=3) == data and make_search_corpus(60, seed=4) != data


def test_corpus_loader_skips_and_counts_bad_lines(tmp_path, caplog):
    path = tmp_path / "corpus.jsonl"
    lines = ['{"id": "a", "title": "T", "text": "body"}', "not json",
             '{"id": "b", "contents": "\\"Zorvia\\"\\nFacts"}', '{"id": "c"}']
    path.write_text("\n".join(lines) + "\n")
    passages = load_corpus(path)
    assert [(p.id, p.title, p.text) for p in passages] == [("a", "T", "body"), ("b", "Zorvia", "Facts")]
    assert "2 bad lines" in caplog.text
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_corpus(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- answer metrics


def test_normalization_em_f1_hand_cases():
    assert normalize_answer("  The Eiffel Tower! ") == "eiffel tower"
    assert exact_match("the eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower", "Paris"]) == 0.0
    assert exact_match("paris", ["Eiffel Tower", "Paris"]) == 1.0
    assert token_f1("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert token_f1("x x", ["x x y"]) == pytest.approx(0.8)  # multiset overlap 2: P = 1, R = 2/3
    assert token_f1("London", ["Paris", "london"]) == 1.0  # max over golden answers
    assert token_f1("the", ["a"]) == 1.0 and token_f1("", ["Paris"]) == 0.0
    assert substring_match("it is Paris, France", ["paris"]) == 1.0


def test_reward_scheme():
    em = SearchConfig()
    assert search_reward("Paris", ["paris"], formatted=True, config=em) == (
        1.0, {"outcome": 1.0, "em": 1.0, "f1": 1.0, "format": 1.0})
    assert search_reward(None, ["paris"], formatted=True, config=em)[0] == 0.0
    assert search_reward(" ", ["paris"], formatted=True, config=SearchConfig(format_score=0.2))[0] == 0.0
    lam = SearchConfig(format_score=0.2)
    assert search_reward("Lyon", ["paris"], formatted=True, config=lam)[0] == pytest.approx(0.2)
    assert search_reward("Paris", ["paris"], formatted=False, config=lam)[0] == pytest.approx(0.8)
    f1 = SearchConfig(answer_metric="f1")
    assert search_reward("Paris France", ["paris"], formatted=True, config=f1)[0] == pytest.approx(2 / 3)
    assert search_reward("Lyon", ["paris"], formatted=True, config=SearchConfig(outcome_scheme="pm1"))[0] == -1.0
    with pytest.raises(ValueError, match="format_score"):
        SearchConfig(format_score=1.0)


# --------------------------------------------------------------------------- the environment


@pytest.fixture(scope="module")
def corpus():
    return make_search_corpus(40, seed=0)


@pytest.fixture(scope="module")
def retriever(corpus):
    return LocalRetriever(BM25Index(corpus.passages))


def play(env, task, actions):
    async def episode():
        await env.reset(task)
        steps = []
        for action in actions:
            steps.append(await env.step(action))
            if steps[-1].done:
                break
        await env.close()
        return steps

    return asyncio.run(episode())


def test_scripted_two_hop_episode(corpus, retriever):
    task = next(t for t in corpus.train if t["hops"] == 2)
    capital = task["question"].rsplit(" ", 1)[1].rstrip("?")
    env = SearchEnv(retriever)
    assert set(env.stop_strings) == {"</search>", "</answer>"}
    messages = asyncio.run(env.reset(task))
    assert messages[-1]["role"] == "user" and task["question"] in messages[-1]["content"]
    action = f"<think>Which country has capital {capital}?</think>\n<search> capital {capital} </search>"
    first = play(env, task, [action])[0]
    assert not first.done and first.reward == 0.0
    assert first.observation_text.startswith("\n\n<information>Doc 1(Title: ")
    assert first.observation_text.endswith("</information>\n\n")
    country = next(p.title for p in corpus.passages if p.id == task["support_ids"][0])
    assert f"The capital of {country} is {capital}" in first.observation_text.split("Doc 2")[0]
    steps = play(env, task, [f"<search>capital {capital}</search>",
                             f"<think>It is {country}.</think><search>official currency of {country}</search>",
                             f"<think>Found it.</think>\n<answer> the {task['answer']} </answer>"])
    assert f"currency of {country} is the {task['answer']}" in steps[1].observation_text
    final = steps[-1]
    assert final.done and final.reward == 1.0 and final.correct
    assert final.finish_reason == "answer"
    assert final.tool_stats == ToolStats(calls=2, errors=0, timeouts=0)
    assert final.reward_components["format"] == 1.0
    assert final.info["queries"] == [f"capital {capital}", f"official currency of {country}"]


TASK = {"question": "What is the capital of Zorvia?", "answer": "Quellin", "golden_answers": ["Quellin", "Quel"]}


@pytest.mark.parametrize("action,kind,correction", [
    ("<search>capital of Zorvia", "unclosed_search", "was not closed"),
    ("<search>   </search>", "empty_query", "query was empty"),
    ("<answer>Quellin", "unclosed_answer", "<answer> was not closed"),
    ("<answer>Quellin</answer><search>capital</search>", "answer_and_search", "one action per turn"),
])
def test_malformed_actions_get_a_correction_and_no_search(retriever, action, kind, correction):
    env = SearchEnv(retriever)
    step = play(env, TASK, [action])[0]
    assert parse_action(action).kind == kind
    assert not step.done and correction in step.observation_text and "<information>" not in step.observation_text
    assert step.tool_stats.calls == 0 and env.corrections == 1
    recovered = play(env, TASK, [action, "<answer>Quellin</answer>"])[-1]
    assert recovered.done and recovered.correct and recovered.reward == 1.0
    assert recovered.reward_components["format"] == float(kind == "empty_query")


def test_text_after_answer_is_graded_without_format(retriever):
    step = play(SearchEnv(retriever, SearchConfig(format_score=0.1)), TASK,
                ["<answer>Quel</answer> and some more text"])[0]
    assert step.done and step.correct and step.info["text_after_answer"]
    assert step.reward_components == {"outcome": 1.0, "em": 1.0, "f1": 1.0, "format": 0.0}
    assert step.reward == pytest.approx(0.9)


def test_policy_written_information_breaks_format(retriever):
    step = play(SearchEnv(retriever), TASK, ["<information>made up</information><answer>Quellin</answer>"])[0]
    assert step.correct and step.reward_components["format"] == 0.0 and step.reward == 1.0
    assert not well_formed("<answer>a</answer><answer>b</answer>") and well_formed("<think>x</think><answer>a</answer>")


def test_no_action_ends_the_episode_as_no_answer(retriever):
    step = play(SearchEnv(retriever), TASK, ["I do not know."])[0]
    assert step.done and step.finish_reason == "no_answer" and step.reward == 0.0 and not step.correct


def test_limits_turns_searches_and_observation_size(retriever):
    env = SearchEnv(retriever, SearchConfig(max_turns=3, max_searches=1, max_observation_chars=120))
    steps = play(env, TASK, ["<search>capital</search><search>second</search>", "<search>again</search>",
                             "<search>third</search>"])
    assert len(steps[0].observation_text) <= 120 + len("\n\n<information></information>\n\n")
    assert "characters truncated" in steps[0].observation_text
    assert "Search limit (1) reached" in steps[1].observation_text
    assert steps[2].done and steps[2].finish_reason == "max_turns" and steps[2].reward == 0.0
    assert steps[2].tool_stats.calls == 1
    multi = play(SearchEnv(retriever), TASK, ["<search>capital</search> <search>more</search>"])[0]
    assert "only the first query was searched" in multi.observation_text


def test_token_limit_on_observations(retriever):
    env = SearchEnv(retriever, SearchConfig(max_observation_tokens=20), count_tokens=lambda s: len(s.split()))
    step = play(env, TASK, ["<search>capital of a country</search>"])[0]
    body = step.observation_text.split("<information>")[1].split("</information>")[0]
    assert len(body.split()) <= 20 and "truncated" in body


def test_bad_tasks_and_misuse_fail_clearly(retriever):
    env = SearchEnv(retriever)
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(env.step("<answer>x</answer>"))
    with pytest.raises(ValueError, match="golden_answers"):
        asyncio.run(env.reset({"question": "q", "answer": 3}))
    with pytest.raises(KeyError, match="question"):
        asyncio.run(env.reset({"answer": "a"}))


# --------------------------------------------------------------------------- remote backend


class RetrievalServer:
    """Search-R1's POST /retrieve on 127.0.0.1, answered by a BM25 index; failures on demand."""

    def __init__(self, index, fail_first=0, fail_status=503, sleep_first=0, sleep_s=0.0, scores=True):
        self.requests, self.index = [], index
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                number = len(outer.requests)
                if self.path != "/retrieve":
                    return self.send_error(404)
                if number <= sleep_first:
                    time.sleep(sleep_s)
                if number <= fail_first:
                    return self.send_error(fail_status)
                results = []
                for query in body["queries"]:
                    hits = outer.index.search(query, body["topk"])
                    docs_ = [{"id": p.id, "contents": p.contents} for p in hits]
                    results.append([{"document": d, "score": p.score} for d, p in zip(docs_, hits)] if scores
                                   else docs_)
                data = json.dumps({"result": results}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve(retriever):
    servers = []

    def start(**kwargs):
        servers.append(RetrievalServer(retriever.index, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def remote(url, **kwargs):
    return RemoteRetriever(RemoteRetrieverConfig(url=url, **{"backoff_s": 0.01, **kwargs}))


@pytest.mark.parametrize("scores", [True, False])
def test_remote_matches_local(serve, retriever, scores):
    server = serve(scores=scores)
    query = "official currency of the country"
    got = asyncio.run(remote(server.url).search(query, 3))
    local = retriever.index.search(query, 3)
    assert [(p.id, p.title, p.text) for p in got] == [(p.id, p.title, p.text) for p in local]
    if scores:
        assert [p.score for p in got] == pytest.approx([p.score for p in local])
    assert server.requests == [{"queries": [query], "topk": 3, "return_scores": True}]


def test_remote_retries_5xx_then_succeeds(serve):
    server = serve(fail_first=2)
    backend = remote(server.url, max_retries=3)
    assert len(asyncio.run(backend.search("capital", 2))) == 2
    assert len(server.requests) == 3 and backend.counts["retries"] == 2


def test_remote_retries_a_timeout_then_succeeds(serve):
    server = serve(sleep_first=1, sleep_s=1.0)
    backend = remote(server.url, timeout_s=0.3, max_retries=2)
    assert asyncio.run(backend.search("capital", 1))
    assert len(server.requests) == 2 and backend.counts["retries"] == 1


def test_remote_failures_become_search_failed_observations(serve):
    timing_out = serve(sleep_first=10, sleep_s=0.6)
    env = SearchEnv(remote(timing_out.url, timeout_s=0.2, max_retries=1))
    step = play(env, TASK, ["<search>capital</search>"])[0]
    assert not step.done and "Search failed" in step.observation_text and "<information>" in step.observation_text
    assert step.tool_stats == ToolStats(calls=1, errors=0, timeouts=1)
    with pytest.raises(RetrieverError) as error:
        asyncio.run(remote(timing_out.url, timeout_s=0.2, max_retries=0).search("q", 1))
    assert error.value.timed_out

    client_error = serve(fail_first=10, fail_status=400)
    env = SearchEnv(remote(client_error.url, max_retries=3))
    step = play(env, TASK, ["<search>capital</search>"])[0]
    assert "Search failed" in step.observation_text and "HTTP Error 400" in step.observation_text
    assert step.tool_stats == ToolStats(calls=1, errors=1, timeouts=0)
    assert len(client_error.requests) == 1  # a 4xx is not retried

    closed = RemoteRetriever(RemoteRetrieverConfig(url="http://127.0.0.1:9/retrieve", max_retries=0))
    step = play(SearchEnv(closed), TASK, ["<search>capital</search>", "<answer>Quellin</answer>"])
    assert "Search failed" in step[0].observation_text and step[1].tool_stats.errors == 1


def test_env_deadline_bounds_a_slow_retriever(serve):
    slow = serve(sleep_first=10, sleep_s=0.5)
    env = SearchEnv(remote(slow.url, timeout_s=5.0), SearchConfig(search_timeout_s=0.2))
    step = play(env, TASK, ["<search>capital</search>"])[0]
    assert "timed out after 0.2s" in step.observation_text and step.tool_stats.timeouts == 1


def test_malformed_server_answers_are_errors():
    with pytest.raises(ValueError):
        parse_retrieval_response({"results": []})
    with pytest.raises(ValueError, match="text"):
        parse_retrieval_response({"result": [[{"document": {"id": 1}}]]})
    with pytest.raises(ValueError, match="url"):
        RemoteRetrieverConfig(url="localhost:8000")


# --------------------------------------------------------------------------- config


def test_search_r1_config_requires_its_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"environment.corpus_path: is required .*retriever_url"):
        load_config("search_r1")
    with pytest.raises(ConfigError, match="model.path: is required"):
        load_config("search_r1", ["environment.corpus_path=c.jsonl"])
    with pytest.raises(ConfigError, match="not both"):
        load_config("search_r1", ["environment.corpus_path=c.jsonl", "environment.retriever_url=http://h:1/r"])
    with pytest.raises(ConfigError, match="environment.retriever_url: must start with http"):
        load_config("search_r1", ["environment.retriever_url=h:1"])
    config = load_config("search_r1", ["model.path=m", "environment.retriever_url=http://127.0.0.1:8000/retrieve",
                                       "data.train_path=t.jsonl", "data.eval_path=e.jsonl"])
    assert config.environment.top_k == 3 and config.algorithm.group_size == 5 and config.algorithm.kl_coef == 0.001


def test_setup_builds_search_envs_and_tasks_from_files(tmp_path):
    from agentrl_jax.train import setup

    paths = write_search_corpus(tmp_path, 30, seed=1)
    config = load_config("search_r1", ["model.path=m", f"environment.corpus_path={paths['corpus']}",
                                       f"data.train_path={paths['train']}", f"data.eval_path={paths['eval']}"])
    train, held_out = setup.load_tasks(config)
    assert train and held_out and all(isinstance(t["golden_answers"], list) for t in train)
    make_env = setup.env_factory(config, pool=None, verifier=None)
    env = make_env()
    assert isinstance(env, SearchEnv) and env.config.top_k == 3 and env.config.max_searches == 4
    task = train[0]
    steps = play(env, task, [f"<search>{task['question']}</search>", f"<answer>{task['answer']}</answer>"])
    assert task["answer"] in steps[0].observation_text and steps[1].reward == 1.0


DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _doc_blocks(language):
    section = DOC.read_text().split("## Search-R1", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def test_docs_example_runs(tmp_path, monkeypatch, capsys):
    (example,) = _doc_blocks("python")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, str(DOC), "exec"), {"__name__": "docs_example"})  # noqa: S102  (the doc is ours)
    assert capsys.readouterr().out.startswith("1.0 answer ToolStats(calls=2, errors=0, timeouts=0, malformed=0)")
    assert (tmp_path / "search_data" / "corpus.jsonl").is_file()


def test_docs_launch_command_loads():
    launcher = load_script("launch/tpu_pod.py")
    (command,) = _doc_blocks("bash")
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["python", "launch/tpu_pod.py"]
    args = launcher.parse_args(argv[2:])
    config = load_config(args.config, args.overrides)
    assert config.environment.name == "search" and config.environment.corpus_path.endswith("wiki_passages.jsonl")
