"""Native tool calling: the Hermes/Qwen and Llama 3.x parsers, the tool registry, the generic
tool-calling environment (every malformed-call kind with the observation the model gets
back, concurrent calls, limits), and ReTool / Search-R1 in the native layout with the real
sandbox, verifier and retriever."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agentrl_jax.envs.retrieval import BM25Index, LocalRetriever, Passage
from agentrl_jax.envs.retool import ReToolConfig
from agentrl_jax.envs.search import SearchConfig
from agentrl_jax.envs.tools import (NativeReToolEnv, NativeSearchEnv, Tool, ToolCall, ToolCallingEnv,
                                    ToolEnvConfig, ToolRegistry, ToolResult, calculator_tool, evaluate_arithmetic,
                                    format_calls, parse_hermes, parse_llama3)
from agentrl_jax.envs.tools.parsers import MalformedCall
from agentrl_jax.rewards import MathVerifier, RewardWeights

TASK = {"question": "What is 6 * 7?", "answer": "42"}


def call(name, **arguments):
    return format_calls([ToolCall(name, arguments)], "hermes")


# --------------------------------------------------------------------------- parsers


def test_hermes_parses_content_and_calls_and_round_trips():
    calls = [ToolCall("python", {"code": "print('a\\nb')"}), ToolCall("calculator", {"expression": "2 ** 10"})]
    text = format_calls(calls, "hermes", content="<think>\nplan\n</think>\n\nLet me check.")
    parsed = parse_hermes(text)
    assert parsed.content == "<think>\nplan\n</think>\n\nLet me check."
    assert list(parsed.calls) == calls
    assert parse_hermes(format_calls(calls, "hermes")).content == ""
    assert parse_hermes("The answer is \\boxed{4}.") .calls == ()
    stringified = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert stringified.calls == (ToolCall("f", {"x": 1}),)


@pytest.mark.parametrize("text,reason", [
    ("<tool_call>\n{'name': 'python'}\n</tool_call>", "not valid JSON"),
    ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n["python"]\n</tool_call>', 'must be a JSON object with a "name"'),
    ('Thinking... <tool_call>\n{"name": "python", "arguments": {}}', "was not closed"),
])
def test_hermes_malformed_calls_are_bad_json(text, reason):
    (malformed,) = parse_hermes(text).calls
    assert isinstance(malformed, MalformedCall) and malformed.kind == "bad_json" and reason in malformed.reason


def test_llama3_parses_one_json_call_and_leaves_answers_alone():
    call_text = format_calls([ToolCall("calculator", {"expression": "6*7"})], "llama3")
    assert call_text == '{"name": "calculator", "parameters": {"expression": "6*7"}}'
    assert parse_llama3(call_text).calls == (ToolCall("calculator", {"expression": "6*7"}),)
    assert parse_llama3('<|python_tag|>{"name": "f", "arguments": {"a": 1}}').calls == (ToolCall("f", {"a": 1}),)
    assert parse_llama3("The answer is 42.").calls == ()
    assert parse_llama3('{"answer": 42}').calls == ()  # JSON without a name is not a call
    (bad,) = parse_llama3('{"name": "calculator", "parameters": {"expression": }').calls
    assert bad.kind == "bad_json"
    (not_object,) = parse_llama3('{"name": "calculator", "parameters": [1, 2]}').calls
    assert not_object.kind == "bad_arguments" and not_object.name == "calculator"


# --------------------------------------------------------------------------- registry and tools


def test_calculator_matches_python_on_random_expressions():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.randint(-50, 50) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice(["+", "-", "*", "//", "%", "/"])
        if op2 in ("//", "%", "/") and c == 0:
            c = 3
        expression = f"({a} {op1} {b}) {op2} {c}"
        assert evaluate_arithmetic(expression) == eval(expression), expression
    assert evaluate_arithmetic("2 ** 100") == 2 ** 100
    for bad, message in [("__import__('os')", "not allowed"), ("x + 1", "not allowed"), ("9 ** 9 ** 9", "too large"),
                         ("1 / 0", "division by zero"), ("1 +", "not an arithmetic expression")]:
        with pytest.raises(ValueError, match=message):
            evaluate_arithmetic(bad)


def test_registry_checks_calls_and_turns_failures_into_results():
    registry = ToolRegistry([calculator_tool()])

    @registry.function(description="Always fails.", parameters={"type": "object", "properties": {}})
    def broken():
        raise RuntimeError("disk on fire")

    @registry.function(description="Too slow.", parameters={"type": "object", "properties": {}})
    async def slow():
        await asyncio.sleep(5)

    assert registry.names == ["calculator", "broken", "slow"]
    assert registry.schemas()[0]["function"]["parameters"]["required"] == ["expression"]
    unknown = registry.check(ToolCall("calc", {}))
    assert unknown.kind == "unknown_tool" and "calculator, broken, slow" in unknown.reason
    missing = registry.check(ToolCall("calculator", {}))
    assert missing.kind == "bad_arguments" and "'expression' is a required property" in missing.reason
    wrong_type = registry.check(ToolCall("calculator", {"expression": 42}))
    assert wrong_type.kind == "bad_arguments" and "expression: 42 is not of type 'string'" in wrong_type.reason
    extra = registry.check(ToolCall("calculator", {"expression": "1", "mode": "exact"}))
    assert extra.kind == "bad_arguments" and "'mode' was unexpected" in extra.reason
    failed = asyncio.run(registry.run(ToolCall("broken", {}), timeout_s=1.0))
    assert failed == ToolResult("Error: broken failed: RuntimeError: disk on fire", ok=False)
    timed_out = asyncio.run(registry.run(ToolCall("slow", {}), timeout_s=0.05))
    assert timed_out.timed_out and not timed_out.ok
    with pytest.raises(ValueError, match="already registered"):
        registry.add(calculator_tool())
    with pytest.raises(ValueError, match="must be a JSON schema"):
        Tool("t", "", {"type": "string"}, lambda: "")


# --------------------------------------------------------------------------- the generic environment


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


def calculator_env(**config):
    return ToolCallingEnv(lambda: ToolRegistry([calculator_tool()]), ToolEnvConfig(**config))


@pytest.mark.parametrize("action,kind,observation", [
    ("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"\n</tool_call>", "bad_json",
     "Error: the tool call is not valid JSON (Expecting ',' delimiter at line 1 column 57). Write a call as "
     "<tool_call>\n{\"name\": <tool>, \"arguments\": {...}}\n</tool_call>."),
    (call("calc", expression="6*7"), "unknown_tool",
     "Error: unknown tool 'calc'; the tools are calculator."),
    (call("calculator", expr="6*7"), "bad_arguments",
     "Error: invalid arguments for 'calculator': 'expression' is a required property; Additional properties "
     "are not allowed ('expr' was unexpected)."),
])
def test_every_malformed_call_kind_gets_an_error_observation(action, kind, observation):
    env = calculator_env()
    first, second = play(env, TASK, [action, "It is 42"])
    assert not first.done and first.observation_text == ""
    assert [m["content"] for m in first.observation_messages] == [observation]
    assert first.observation_messages[0]["role"] == "tool"
    assert first.info["malformed"] == [kind]
    assert (first.tool_stats.calls, first.tool_stats.errors, first.tool_stats.malformed) == (1, 1, 1)
    assert second.done and second.correct is False and second.info["malformed_counts"] == {kind: 1}


def test_calls_of_one_turn_run_concurrently_and_answer_in_order():
    def make_registry():
        registry = ToolRegistry()

        @registry.function(description="Waits, then echoes.", parameters={
            "type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]})
        async def wait(value: int) -> str:
            await asyncio.sleep(0.4)
            return str(value)

        return registry

    env = ToolCallingEnv(make_registry, ToolEnvConfig(max_calls_per_turn=4))
    action = format_calls([ToolCall("wait", {"value": v}) for v in (3, 1, 2)], "hermes")
    start = time.perf_counter()
    (step,) = play(env, TASK, [action])
    assert time.perf_counter() - start < 1.0  # three 0.4 s calls, concurrently
    assert [m["content"] for m in step.observation_messages] == ["3", "1", "2"]
    assert step.tool_stats.calls == 3 and step.tool_stats.successful == 3


def test_call_limits_and_turn_limit():
    env = calculator_env(max_calls_per_turn=2, max_tool_calls=3, max_turns=3)
    three = format_calls([ToolCall("calculator", {"expression": f"{i} + 1"}) for i in range(3)], "hermes")
    first, second, third = play(env, TASK, [three, three, three])
    assert [m["content"] for m in first.observation_messages] == ["1", "2", "Not run: at most 2 calls per turn."]
    assert [m["content"] for m in second.observation_messages][0] == "1"
    assert second.observation_messages[1]["content"].startswith("Not run: the tool call limit (3) is reached")
    assert second.tool_stats.calls == 3
    assert third.done and third.finish_reason == "max_turns" and third.correct is False


def test_final_answer_is_graded_by_the_default_exact_match():
    (step,) = play(calculator_env(), TASK, [" 42\n"])
    assert step.done and step.finish_reason == "answer" and step.correct and step.reward == 1.0


# --------------------------------------------------------------------------- ReTool and Search-R1, native


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


def test_native_retool_runs_python_in_a_session_and_grades_the_boxed_answer(loop_thread, pool, verifier):
    settings = ReToolConfig(reward_weights=RewardWeights(outcome_scheme="binary", tool=1.0))
    env = NativeReToolEnv(pool, verifier, settings)

    async def episode():
        messages = await env.reset(TASK)
        steps = [await env.step(call("python", code="x = 6 * 7")), await env.step(call("python", code="print(x)")),
                 await env.step("The product is \\boxed{42}.")]
        await env.close()
        return messages, steps

    messages, (first, second, final) = loop_thread.run(episode())
    assert "python tool" in messages[0]["content"] and "<code>" not in messages[0]["content"]
    assert [t["function"]["name"] for t in env.tools] == ["python"]
    assert first.observation_messages[0]["content"] == "(no output; print() the values you need)"
    assert second.observation_messages == [{"role": "tool", "name": "python", "content": "42"}]
    assert final.done and final.correct and final.finish_reason == "answer"
    assert final.reward_components["outcome"] == 1.0 and final.reward_components["tool"] == pytest.approx(0.2)
    wrong = NativeReToolEnv(pool, verifier, settings)
    (step,) = loop_thread.run(_play_async(wrong, TASK, ["It is \\boxed{41}"]))
    assert step.done and not step.correct and step.reward == 0.0


async def _play_async(env, task, actions):
    await env.reset(task)
    steps = [await env.step(a) for a in actions]
    await env.close()
    return steps


def test_native_search_calls_the_retriever_and_scores_the_answer_tag():
    passages = [Passage("1", "Zorvia", "The capital of Zorvia is Quellin."),
                Passage("2", "Moons", "Io orbits Jupiter.")]
    env = NativeSearchEnv(LocalRetriever(BM25Index(passages)), SearchConfig(top_k=1))
    task = {"question": "What is the capital of Zorvia?", "answer": "Quellin"}
    searched, answered = play(env, task, [call("search", query="capital of Zorvia"), "<answer> Quellin </answer>"])
    assert searched.observation_messages[0]["content"] == "Doc 1(Title: Zorvia) The capital of Zorvia is Quellin."
    assert "search tool" in asyncio.run(env.reset(task))[-1]["content"]
    assert answered.done and answered.correct and answered.reward == 1.0
    (no_tag,) = play(env, task, ["Quellin"])
    assert no_tag.done and not no_tag.correct and no_tag.reward == 0.0


def test_native_arithmetic_demonstration_replays_in_the_env(loop_thread, pool, verifier, tmp_path):
    """An SFT demonstration in the native layout, rendered by the scratch model's template, is
    what the environment answers and grades: the sampled turns parse into the same call."""
    import numpy as np

    from agentrl_jax.envs.arithmetic import arithmetic_config, demonstration, make_tasks
    from agentrl_jax.models.tiny import train_tiny_tokenizer
    from agentrl_jax.models.tokenizer import Tokenizer

    task = make_tasks(1, 4, seed=0)[0]
    demo = demonstration(task, "tool", np.random.default_rng(0), layout="native")
    tok = Tokenizer(train_tiny_tokenizer(tmp_path / "tok", [task["question"], str(demo)] * 10, 320))
    env = NativeReToolEnv(pool, verifier, arithmetic_config())
    messages = loop_thread.run(env.reset(task)) + demo
    ids, mask = tok.conversation_ids(messages, tools=env.tools)
    edges = [0, *np.flatnonzero(np.diff(mask)) + 1, len(mask)]
    turns = [tok.decode(ids[a:b], skip_special_tokens=True) for a, b in zip(edges[:-1], edges[1:]) if mask[a]]
    assert turns[0].startswith("<tool_call>\n{\"name\": \"python\"") and len(turns) == 2
    first, final = loop_thread.run(_play_async(env, task, turns))
    assert first.observation_messages == [demo[1]]
    assert final.done and final.correct and final.finish_reason == "answer"


def test_native_retool_without_an_answer_and_cut_short(loop_thread, pool, verifier):
    settings = ReToolConfig(reward_weights=RewardWeights(outcome_scheme="pm1"))
    env = NativeReToolEnv(pool, verifier, settings)
    (step,) = loop_thread.run(_play_async(env, TASK, ["I do not know."]))
    assert step.done and step.finish_reason == "no_answer" and step.reward == -1.0 and step.correct is False
    loop_thread.run(env.reset(TASK))
    cut = env.truncated_result("max_tokens", 100)
    assert cut.finish_reason == "max_tokens" and cut.reward == -1.0 and cut.reward_components["outcome"] == -1.0
