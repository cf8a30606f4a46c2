"""Teacher role, OPD / hybrid advantages, PRM judge parsing and judges (docs/hybrid.md)."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.train.guidance.distillation import (
    hindsight_contexts,
    teacher_advantages,
    teacher_context,
    teacher_logprobs,
)
from agentrl_jax.train.guidance.hindsight import (
    JUDGE_TEMPLATE,
    ArithmeticOracleJudge,
    ModelJudge,
    apply_prm_reward,
    judge_metrics,
    judge_prompt,
    parse_judge_output,
)
from agentrl_jax.train.step import forward_logprobs

CORPUS = [
    "What is 12*34? <code>print(12*34)</code> <interpreter>408</interpreter> \\boxed{408}",
    "Hint: I should call the interpreter before answering.",
    "Score: 1 \\boxed{-1} The interpreter printed the result; copy it into the answer.",
] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", CORPUS, vocab_size=320,
                                individual_digits=True)
    return Tokenizer(path)


def tiny_model(vocab: int, seed: int = 0):
    cfg = DecoderConfig(
        architecture="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=False, attention_bias=False, qk_norm=True, max_position_embeddings=512,
    )
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def make_trajectory(tokenizer, question, sampled_chunks, observations, *, reward=0.0, correct=None, meta=None):
    """A trajectory laid out like the agent loop's: prompt, then sampled / observation pieces."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat(messages, add_generation_prompt=True)
    ids, mask, turns = list(prompt), [0] * len(prompt), list(messages)
    for i, chunk in enumerate(sampled_chunks):
        piece = tokenizer.encode(chunk)
        ids += piece
        mask += [1] * len(piece)
        turns.append({"role": "assistant", "content": chunk})
        if i < len(observations):
            obs = tokenizer.encode(observations[i])
            ids += obs
            mask += [0] * len(obs)
            turns.append({"role": "tool", "content": observations[i]})
    n = len(ids)
    components = {} if correct is None else {"correct": float(correct)}
    return Trajectory(
        prompt_token_ids=np.asarray(prompt, np.int32), token_ids=np.asarray(ids, np.int32),
        loss_mask=np.asarray(mask, np.int8), rollout_logprobs=np.zeros(n, np.float32),
        params_versions=np.full(n, -1, np.int32), turns=turns, reward=reward, reward_components=components,
        task_metadata=meta or {},
    )


def reference_logprobs(model, ids):
    """log softmax(logits[k])[ids[k+1]] for one sequence, by a plain forward + NumPy."""
    x = jnp.asarray(np.asarray(ids, np.int32)[None])
    hidden = model(x, jnp.arange(x.shape[1])[None])
    logits = np.asarray(model.logits(hidden)[0], np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


# ------------------------------------------------------------------ teacher alignment


@pytest.mark.parametrize("placement", ["user_message", "assistant_prefix"])
def test_teacher_logprobs_equal_a_direct_forward_on_the_concatenated_sequence(tokenizer, placement):
    model = tiny_model(tokenizer.vocab_size)
    graphdef, params = split_params(model)
    trajectories = [
        make_trajectory(tokenizer, "What is 12*34?", ["<code>print(12*34)</code>", "\\boxed{408}"],
                        ["<interpreter>408</interpreter>"]),
        make_trajectory(tokenizer, "What is 7*5?", ["\\boxed{36}"], []),
        make_trajectory(tokenizer, "What is 99*2?", ["<code>print(99*2)</code>", "\\boxed{198}"],
                        ["<interpreter>198</interpreter>"]),
    ]
    hints = ["I should call the interpreter before answering.", None, "copy it into the answer."]
    fmt = "\nHint: {hint}"
    contexts = [teacher_context(t, h, tokenizer, placement=placement, hint_format=fmt) if h else None
                for t, h in zip(trajectories, hints)]
    width = 64
    fn = jax.jit(lambda arrays: forward_logprobs(graphdef, params, arrays, temperature=1.0, chunk_size=16))
    aligned, has_teacher = teacher_logprobs(fn, trajectories, contexts, (4, width), row_multiple=2,
                                            pad_token_id=tokenizer.pad_token_id)
    np.testing.assert_array_equal(has_teacher, [True, False, True, False])
    assert not aligned[1].any() and not aligned[3].any()
    for i in (0, 2):
        t, hint = trajectories[i], hints[i]
        # The concatenation, built independently of teacher_context:
        if placement == "user_message":
            question = t.turns[0]["content"] + fmt.format(hint=hint)
            teacher_prompt = tokenizer.apply_chat([{"role": "user", "content": question}])
        else:
            teacher_prompt = list(t.prompt_token_ids) + tokenizer.encode(fmt.format(hint=hint))
        P, Pt = len(t.prompt_token_ids), len(teacher_prompt)
        assert Pt > P
        concatenated = teacher_prompt + list(t.token_ids[P:])
        assert contexts[i].token_ids == concatenated
        direct = reference_logprobs(model, concatenated)
        for j in range(P, len(t.token_ids)):  # every response token j, student target index j - 1
            np.testing.assert_allclose(aligned[i, j - 1], direct[j - P + Pt - 1], atol=2e-5)
        assert not aligned[i, : P - 1].any() and not aligned[i, len(t.token_ids) - 1:].any()


def test_context_without_hint_is_the_student_sequence(tokenizer):
    t = make_trajectory(tokenizer, "What is 3*4?", ["\\boxed{12}"], [])
    ctx = teacher_context(t, None, tokenizer)
    assert ctx.token_ids == t.token_ids.tolist() and ctx.shift == 0
    assert ctx.loss_mask == t.loss_mask.tolist()
    with pytest.raises(ValueError, match="placement"):
        teacher_context(t, "x", tokenizer, placement="system")


def test_hindsight_contexts_select_rows_by_mode(tokenizer):
    ts = [make_trajectory(tokenizer, f"What is {i}*2?", ["\\boxed{1}"], []) for i in range(3)]
    hints = [None, "I should call the interpreter.", None]
    kw = {"placement": "user_message", "hint_format": "\nHint: {hint}"}
    hybrid = hindsight_contexts(ts, hints, tokenizer, mode="hybrid", **kw)
    assert [c is not None for c in hybrid] == [False, True, False]
    opd = hindsight_contexts(ts, hints, tokenizer, mode="opd", **kw)
    assert all(c is not None for c in opd) and opd[0].shift == 0 and opd[1].shift > 0
    plain = hindsight_contexts(ts, None, tokenizer, mode="hybrid", **kw)
    assert all(c is not None and c.shift == 0 for c in plain)


# ------------------------------------------------------------------ advantages


def test_opd_advantage_sign_and_magnitude_by_hand():
    teacher = np.array([[-0.5, -3.0, -1.0, 0.0]], np.float32)
    student = np.array([[-2.0, -1.0, -1.0, -7.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    adv, metrics = teacher_advantages("opd", np.zeros_like(mask), teacher, student, mask, np.array([True]), lam=1.0)
    # teacher more confident than the student -> push up (+1.5); less -> push down (-2); equal -> 0
    np.testing.assert_allclose(adv, [[1.5, -2.0, 0.0, 0.0]])
    assert metrics["opd/advantage_mean"] == pytest.approx((1.5 - 2.0 + 0.0) / 3)
    assert metrics["opd/kl_student_teacher"] == pytest.approx(-(1.5 - 2.0) / 3)


def test_hybrid_equals_group_advantage_exactly_without_a_hint():
    rng = np.random.default_rng(0)
    R, T = 6, 10
    mask = (rng.random((R, T)) > 0.3).astype(np.float32)
    group = (rng.normal(size=(R, 1)) * mask).astype(np.float32)
    teacher = rng.normal(size=(R, T)).astype(np.float32) - 2
    student = rng.normal(size=(R, T)).astype(np.float32) - 2
    has = np.array([True, False, True, False, False, True])
    adv, _ = teacher_advantages("hybrid", group, teacher, student, mask, has, lam=0.5)
    np.testing.assert_array_equal(adv[~has], group[~has])  # bitwise: pure GRPO
    np.testing.assert_allclose(adv[has], (group + 0.5 * (teacher - student) * mask)[has], rtol=1e-6, atol=1e-6)
    zero_lam, _ = teacher_advantages("hybrid", group, teacher, student, mask, has, lam=0.0)
    np.testing.assert_array_equal(zero_lam, group)


# ------------------------------------------------------------------ judge output parsing


def count_words(s):
    return len(s.split())


@pytest.mark.parametrize(
    "text, status, hint, score",
    [
        ("Score: 0.25\n\\boxed{I should define x with symbols('x') first.}", "hint",
         "I should define x with symbols('x') first.", 0.25),
        ("Score: 1\n\\boxed{-1}", "no_intervention", None, 1.0),
        ("\\boxed{ -1 }", "no_intervention", None, None),
        ("the attempt looks fine to me", "malformed", None, None),
        ("Score: 0.5 \\boxed{unclosed", "malformed", None, 0.5),
        ("\\boxed{}", "malformed", None, None),
        ("Score: 7\n\\boxed{use {a, b} as a set}", "hint", "use {a, b} as a set", None),  # score out of range
        ("\\boxed{-1} on second thought \\boxed{apply mod 1000 after each product}", "hint",
         "apply mod 1000 after each product", None),  # the last box decides
        ("\\boxed{" + "word " * 20 + "}", "too_long", None, None),
    ],
)
def test_parse_judge_output(text, status, hint, score):
    v = parse_judge_output(text, count_tokens=count_words, max_hint_tokens=10)
    assert (v.status, v.hint, v.score) == (status, hint, score)
    assert v.raw == text
    assert v.hint_tokens == (count_words(hint) if hint else (20 if status == "too_long" else 0))


def test_leaked_hints_are_refused_and_counted():
    """The leakage guard: a bridge thought that states the gold answer is no hint."""
    text = "Score: 0\n\\boxed{The interpreter printed 4{,}080; I should copy it.}"
    leaked = parse_judge_output(text, count_tokens=count_words, max_hint_tokens=20, answer="4080")
    assert (leaked.status, leaked.hint, leaked.score) == ("leaked", None, 0.0)
    kept = parse_judge_output(text, count_tokens=count_words, max_hint_tokens=20, answer="4081")
    assert kept.status == "hint"
    unchecked = parse_judge_output(text, count_tokens=count_words, max_hint_tokens=20)
    assert unchecked.status == "hint"
    metrics = judge_metrics([leaked, kept, unchecked, leaked])
    assert metrics["judge/leaked"] == 0.5 and metrics["judge/hint_fraction"] == 0.5
    assert "never state the final" in JUDGE_TEMPLATE and "discarded" in JUDGE_TEMPLATE


def test_hinted_sft_prompt_is_the_teachers_context(tokenizer):
    """The hint-following SFT data renders the user message exactly as the teacher context
    (placement user_message) does, so the teacher is scored in the context it was trained on."""
    from agentrl_jax.config import Config
    from agentrl_jax.envs import arithmetic_demonstrations, bridge_thought, make_tasks

    config = dataclasses.replace(Config(), environment=dataclasses.replace(
        Config().environment, demo_hint_fraction=1.0, min_digits=2, max_digits=2))
    task = make_tasks(1, 2, seed=0)[0]
    conversation = arithmetic_demonstrations(config, [task])[0]
    hint = conversation[0]["content"][len(task["question"]):].split("Hint: ", 1)[1]
    assert hint in {bridge_thought(task, m) for m in ("memory", "wrong_code", "not_copied")}
    sft_prompt = tokenizer.apply_chat(conversation[:1], add_generation_prompt=True)
    trajectory = make_trajectory(tokenizer, task["question"], ["\\boxed{1}"], [], meta=task)
    context = teacher_context(trajectory, hint, tokenizer, placement="user_message",
                              hint_format=config.hybrid.hint_format)
    assert context.token_ids[:context.prompt_length] == list(sft_prompt)


def test_judge_prompt_renders_the_episode_and_outcome(tokenizer):
    t = make_trajectory(tokenizer, "What is 12*34?", ["<code>print(12*34)</code>", "\\boxed{407}"],
                        ["<interpreter>408</interpreter>"], correct=False, meta={"answer": "408"})
    t = dataclasses.replace(t, finish_reason="answer")
    text = judge_prompt(JUDGE_TEMPLATE, t)
    for piece in ("What is 12*34?", "[Model] <code>print(12*34)</code>", "[Tool] <interpreter>408</interpreter>",
                  "[Model] \\boxed{407}", "incorrect (answer)", "\\boxed{-1}"):
        assert piece in text
    custom = judge_prompt("{problem}|{reference_answer}|{{literal}}|{trajectory}", t)
    assert custom.startswith("What is 12*34?|408|{literal}|[Model]")


def test_oracle_judge_hints_from_the_tool_feedback(tokenizer):
    meta = {"a": 12, "b": 34, "op": "*", "answer": "408"}
    mk = lambda chunks, obs, correct: make_trajectory(tokenizer, "What is 12*34?", chunks, obs,
                                                      correct=correct, reward=float(correct), meta=meta)
    episodes = [
        mk(["<code>print(12*34)</code>", "\\boxed{408}"], ["<interpreter>408</interpreter>"], True),
        mk(["\\boxed{418}"], [], False),  # answered from memory
        mk(["<code>print(12*43)</code>", "\\boxed{516}"], ["<interpreter>516</interpreter>"], False),
        mk(["<code>print(12*34)</code>", "\\boxed{480}"], ["<interpreter>408</interpreter>"], False),
    ]
    judge = ArithmeticOracleJudge(lambda s: len(tokenizer.encode(s)), max_hint_tokens=64)
    verdicts = asyncio.run(judge(episodes))
    assert [v.status for v in verdicts] == ["no_intervention", "hint", "hint", "hint"]
    assert verdicts[1].hint == "I should call the interpreter: <code>print(12*34)</code>"
    assert "print exactly 12*34" in verdicts[2].hint
    assert verdicts[3].hint == "I should copy the number the interpreter printed into the box, digit by digit."
    assert all("408" not in v.hint for v in verdicts[1:])  # no hint gives the answer away
    assert [v.score for v in verdicts] == [1.0, 0.0, 0.0, 0.0]
    strict = ArithmeticOracleJudge(lambda s: len(tokenizer.encode(s)), max_hint_tokens=3)
    assert [v.status for v in asyncio.run(strict(episodes))][1:] == ["too_long"] * 3
    metrics = judge_metrics(verdicts)
    assert metrics["judge/hint_fraction"] == 0.75 and metrics["judge/no_intervention"] == 0.25
    assert metrics["judge/malformed"] == 0 and metrics["judge/prm_score"] == 0.25
    apply_prm_reward(episodes, verdicts, 0.5)
    assert episodes[0].reward == 1.5 and episodes[1].reward == 0.0
    assert episodes[0].reward_components["prm_score"] == 1.0


# ------------------------------------------------------------------ model judge through the driver


def test_model_judge_decodes_with_its_params_through_the_driver_and_restores(tokenizer):
    from agentrl_jax.rollout.driver import Driver
    from agentrl_jax.rollout.engine import Engine
    from agentrl_jax.sharding import make_mesh

    policy = tiny_model(tokenizer.vocab_size, seed=0)
    _, policy_params = split_params(policy)
    _, judge_params = split_params(tiny_model(tokenizer.vocab_size, seed=1))
    engine = Engine(policy, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=4,
                    max_target_length=192, max_prefill_length=64, min_prefill_bucket=16, cache_dtype=None)
    episodes = [make_trajectory(tokenizer, "What is 12*34?", ["\\boxed{418}"], [], correct=False)] * 2
    template = "Problem: {problem}\n{trajectory}\nOutcome: {outcome}"
    ids = tokenizer.apply_chat([{"role": "user", "content": judge_prompt(template, episodes[0])}])

    async def main():
        async with Driver(engine, policy_params, params_version=3, eos_token_ids=tokenizer.eos_token_ids) as driver:
            judge = ModelJudge(driver, tokenizer, template=template, max_new_tokens=12, max_hint_tokens=8,
                               params=judge_params)
            verdicts = await judge(episodes, (policy_params, 3))
            version_after = driver.params_version
            after = await driver.generate(ids, SamplingGreedy, stop_token_ids=tokenizer.eos_token_ids,
                                          max_new_tokens=12)
        async with Driver(engine, judge_params, eos_token_ids=tokenizer.eos_token_ids) as direct:
            expected = await direct.generate(ids, SamplingGreedy, stop_token_ids=tokenizer.eos_token_ids,
                                             max_new_tokens=12)
        return verdicts, version_after, after, expected

    from agentrl_jax.rollout.sampling import SamplingParams

    SamplingGreedy = SamplingParams(temperature=0.0)
    verdicts, version_after, after, expected = asyncio.run(main())
    expected_text = tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert [v.raw for v in verdicts] == [expected_text] * 2  # decoded with the judge's params
    assert all(v.status in ("hint", "no_intervention", "malformed", "too_long") for v in verdicts)
    assert version_after == 3 and after.params_versions == [3] * len(after.token_ids)  # the policy is back
    assert after.token_ids != expected.token_ids


# ------------------------------------------------------------------ config


def test_hybrid_config_validation_names_the_field():
    c = apply_overrides(Config(), ["hybrid.mode=hybrid", "hybrid.judge=oracle", "hybrid.lam=0.5",
                                   "hybrid.hint_placement=assistant_prefix"])
    assert c.hybrid.lam == 0.5
    for overrides, message in [
        (["hybrid.mode=hybrid", "hybrid.teacher=checkpoint"], "hybrid.teacher_path"),
        (["hybrid.lam=-1"], "hybrid.lam"),
        (["hybrid.hint_format=no placeholder"], "hybrid.hint_format"),
        (["hybrid.judge_template={trajectory} {nope}"], "hybrid.judge_template"),
        (["hybrid.judge_template={problem}"], "hybrid.judge_template"),
        (["hybrid.judge=oracle", "environment.name=retool"], "hybrid.judge"),
        (["hybrid.mode=hybrid", "algorithm.advantage=gae"], "algorithm.advantage"),
        (["hybrid.prm_weight=0.5"], "hybrid.prm_weight"),
        (["hybrid.hint_placement=system"], "hybrid.hint_placement"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            apply_overrides(Config(), overrides)


# ------------------------------------------------------------------ the real entry point


@pytest.mark.slow
def test_demo_hybrid_command_runs_two_steps_with_hints(tmp_path):
    """`launch/tpu_pod.py --config configs/demo_hybrid.py` with a tiny model (about 3 minutes on 2 cores)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    tiny = ["model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
            "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
            "model.scratch.vocab_size=320", "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=12",
            "rollout.max_sequence_length=96", "data.prompts_per_step=2", "algorithm.group_size=4",
            "environment.num_train_tasks=64", "environment.num_eval_tasks=4", "eval.num_tasks=4",
            "eval.samples_per_task=2", "sft.steps=3", "sft.batch_size=8", "total_steps=2",
            "checkpoint.resume=false", f"output_dir={tmp_path / 'run'}", "hybrid.prm_weight=0.1"]
    cmd = [sys.executable, str(root / "launch" / "tpu_pod.py"), "--config", "configs/demo_hybrid.py"]
    for item in tiny:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, check=False, cwd=root, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        # exactly the hinted episodes get a teacher signal (an untrained policy is mostly wrong)
        assert r["opd/teacher_fraction"] == r["judge/hint_fraction"] > 0
        assert np.isfinite(r["opd/kl_student_teacher"]) and r["judge/malformed"] == 0
    samples = (tmp_path / "run" / "metrics" / "samples.jsonl").read_text()
    assert '"tag": "hint_0"' in samples and "I should" in samples


def test_frozen_teacher_copy_survives_the_donating_update():
    """astype to the same dtype aliases buffers; the frozen copy must own its own."""
    from agentrl_jax.train.build import frozen_copy

    params = {"w": jnp.arange(4.0), "b": jnp.ones(2, jnp.bfloat16)}
    frozen = frozen_copy(params, "float32")
    assert frozen["b"].dtype == jnp.float32
    params["w"].delete()  # what donate_argnums does to the policy's buffers
    np.testing.assert_array_equal(np.asarray(frozen["w"]), [0, 1, 2, 3])
