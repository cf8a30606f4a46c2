"""Teacher alignment per teacher choice (docs/hybrid.md), through the ``compute_logprobs`` stage of the RL step.

For each ``hybrid.teacher`` (frozen reference, the current policy, a lagged snapshot and an
EMA of the policy) the teacher logprobs that enter the advantage must be those of the
intended params on [prompt + hint + response], token for token; checked against a plain
forward of those params and a NumPy log-softmax, with mode "opd" (A = tea - old, no shaping)
so the teacher's logprobs are read back from the advantages.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.config import Config, apply_overrides
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.train.batch import build_batch
from agentrl_jax.train.build import build_step_functions
from agentrl_jax.train.episodes import trajectory_record
from agentrl_jax.train.guidance.hindsight import Verdict
from agentrl_jax.train.guidance.old_policy import OldPolicy
from agentrl_jax.train.guidance.teacher import Teacher
from agentrl_jax.train.rl import stages
from agentrl_jax.train.rl.roles import Roles, StepFunctions

HINT_FORMAT = "\nHint: {hint}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = ["What is 12*34? <code>print(12*34)</code> <interpreter>408</interpreter> \\boxed{408}",
              "Hint: I should call the interpreter before answering."] * 20
    return Tokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", corpus, vocab_size=300,
                                          individual_digits=True))


def model(vocab: int, seed: int) -> Decoder:
    cfg = DecoderConfig(architecture="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                        rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        max_position_embeddings=512)
    return Decoder(cfg, rngs=nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids):
    m = nnx.merge(graphdef, params)
    hidden = m(ids[None], jnp.arange(ids.shape[0])[None])
    return m.logits(hidden)[0]


def direct_logprobs(graphdef, params, ids) -> np.ndarray:
    """log softmax(logits[k])[ids[k+1]] of one sequence: a plain forward + NumPy."""
    logits = np.asarray(_logits(graphdef, params, jnp.asarray(np.asarray(ids, np.int32))), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def episode(tokenizer, question, answer):
    prompt = tokenizer.apply_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    ids = list(prompt) + tokenizer.encode(answer)
    n = len(ids)
    return Trajectory(prompt_token_ids=np.asarray(prompt, np.int32), token_ids=np.asarray(ids, np.int32),
                      loss_mask=(np.arange(n) >= len(prompt)).astype(np.int8), rollout_logprobs=np.zeros(n, np.float32),
                      params_versions=np.zeros(n, np.int32), turns=[{"role": "user", "content": question}],
                      reward=0.0, reward_components={"correct": 0.0}, group_id=0)


@functools.cache
def step_functions(graphdef, pad_token_id: int) -> StepFunctions:
    """One jitted forward for every case (same graph definition and temperature); no update runs."""
    config = apply_overrides(Config(), ["rollout.temperature=1.0"])
    return build_step_functions(config, graphdef, None, None, None, pad_token_id)


@pytest.fixture(scope="module")
def models(tokenizer):
    graphdef, policy = split_params(model(tokenizer.vocab_size, 0))
    return graphdef, policy, split_params(model(tokenizer.vocab_size, 1))[1], split_params(model(tokenizer.vocab_size, 2))[1]


@pytest.mark.parametrize("choice", ["reference", "policy", "lagged_snapshot", "lagged_ema"])
def test_teacher_logprobs_come_from_the_chosen_params(tokenizer, models, choice):
    graphdef, policy, reference, later = models
    teacher_kind = choice.split("_")[0]
    overrides = ["hybrid.mode=opd", "hybrid.judge=oracle", f"hybrid.teacher={teacher_kind}", "rollout.temperature=1.0"]
    if choice == "lagged_snapshot":
        teacher = Teacher(graphdef, "lagged", initial=policy, lag_steps=2)
        overrides.append("hybrid.teacher_lag_steps=2")
    elif choice == "lagged_ema":
        teacher = Teacher(graphdef, "lagged", initial=policy, ema_decay=0.5)
        overrides.append("hybrid.teacher_ema_decay=0.5")
    else:
        teacher = Teacher(graphdef, teacher_kind, frozen=reference if teacher_kind == "reference" else None)
    config = apply_overrides(Config(), overrides)
    config = dataclasses.replace(config, hybrid=dataclasses.replace(config.hybrid, hint_format=HINT_FORMAT))
    expected = {"reference": reference, "policy": policy, "lagged_snapshot": later,
                "lagged_ema": jax.tree.map(lambda a, b: 0.25 * a + 0.75 * b, policy, later)}[choice]
    for update in (1, 2):  # the lagged teachers follow `later`: snapshot after update 2, EMA twice
        teacher.observe(later, update)
    trajectories = [episode(tokenizer, "What is 12*34?", "\\boxed{418}"),
                    episode(tokenizer, "What is 7*5?", "\\boxed{35}")]
    verdicts = [Verdict("hint", hint="I should call the interpreter before answering."), Verdict("no_intervention")]
    batch = build_batch([trajectory_record(t) for t in trajectories])
    roles, old_policy = Roles(policy=graphdef, teacher=teacher), OldPolicy(config.async_rl, 0)
    arrays, _ = stages.compute_logprobs(config, roles, old_policy, step_functions(graphdef, tokenizer.pad_token_id),
                                        tokenizer, batch, policy, 0, trajectories, verdicts, step=0)
    teacher_logp = np.asarray(arrays["advantages"]) + np.asarray(arrays["old_logprobs"])  # mode opd: A = tea - old
    for i, hint in enumerate(["I should call the interpreter before answering.", None]):
        t = trajectories[i]
        question = t.turns[0]["content"] + (HINT_FORMAT.format(hint=hint) if hint else "")
        teacher_prompt = tokenizer.apply_chat([{"role": "user", "content": question}], add_generation_prompt=True)
        P, Pt = len(t.prompt_token_ids), len(teacher_prompt)
        direct = direct_logprobs(graphdef, expected, list(teacher_prompt) + list(t.token_ids[P:]))
        old = direct_logprobs(graphdef, policy, t.token_ids)
        for j in range(P, len(t.token_ids)):  # response token j sits at student index j - 1
            np.testing.assert_allclose(teacher_logp[i, j - 1], direct[j - P + Pt - 1], atol=3e-5)
            np.testing.assert_allclose(np.asarray(arrays["old_logprobs"])[i, j - 1], old[j - 1], atol=3e-5)


@pytest.mark.parametrize("kind", ["snapshot", "ema"])
def test_a_resumed_run_restores_the_lagged_teacher_from_the_checkpoint(tmp_path, models, kind):
    """The lagged params go into the checkpoint the RL loop writes (``stages.save``, real orbax)
    and come back on resume, not the resumed policy that ``build_roles`` starts a teacher at."""
    from agentrl_jax.train.checkpoint import Checkpointer

    graphdef, policy, reference, later = models
    lag = {"lag_steps": 2} if kind == "snapshot" else {"ema_decay": 0.5}
    teacher = Teacher(graphdef, "lagged", initial=policy, **lag)
    for update, params in enumerate([later, later, reference], start=1):  # snapshot: `later`; EMA: a mix of all
        teacher.observe(params, update)
    overrides = ["hybrid.mode=hybrid", "hybrid.teacher=lagged",
                 "hybrid.teacher_lag_steps=2" if kind == "snapshot" else "hybrid.teacher_ema_decay=0.5"]
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        stages.save(checkpointer, apply_overrides(Config(), overrides), Roles(graphdef, teacher=teacher),
                    {"params": reference}, 3, 3, data_state={})
    saved = jax.tree.map(np.asarray, teacher.params)

    resumed = Teacher(graphdef, "lagged", initial=reference, **lag)  # as build_roles(policy_params=resumed)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(resumed.params)))
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        assert resumed.restore(checkpointer, 3)
    for want, got in zip(jax.tree.leaves(saved), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert jax.tree.structure(resumed.params) == jax.tree.structure(teacher.params)


def test_a_checkpoint_without_the_lagged_teacher_keeps_the_resumed_policy(tmp_path, models, caplog):
    from agentrl_jax.train.checkpoint import Checkpointer

    graphdef, policy, reference, _ = models
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(1, {"params": policy}, force=True)  # what a run wrote before the teacher was saved
    teacher = Teacher(graphdef, "lagged", initial=reference, lag_steps=1)
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        assert not teacher.restore(checkpointer, 1)
    assert "holds no lagged teacher" in caplog.text
    for want, got in zip(jax.tree.leaves(reference), jax.tree.leaves(teacher.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="may not be named"), Checkpointer(tmp_path / "other") as checkpointer:
        checkpointer.save(1, {"params": policy}, trees={"meta": policy}, force=True)
