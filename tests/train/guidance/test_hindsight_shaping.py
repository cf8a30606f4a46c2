"""The host side of the hindsight teacher (docs/hybrid.md): which hints the teacher reads (failed
episodes only, placebo), and the shaped OPD advantages with their diagnostic metrics."""

import numpy as np
import pytest

from agentrl_jax.envs import bridge_thought, make_tasks
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.train.guidance.distillation import teacher_advantages
from agentrl_jax.train.guidance.hindsight import Verdict, is_failed, placebo_for, teacher_hints


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = ["What is 123*456? Hint: I should call the interpreter: <code>print(123*456)</code> \\boxed{56088}",
              "I should print exactly 12+34: <code>print(12+34)</code>",
              "I should copy the number the interpreter printed into the box, digit by digit."] * 20
    return Tokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", corpus, vocab_size=300,
                                          individual_digits=True))


def episode(tokenizer, task, *, correct):
    prompt = np.asarray(tokenizer.apply_chat([{"role": "user", "content": task["question"]}],
                                             add_generation_prompt=True), np.int32)
    ids = np.concatenate([prompt, np.asarray(tokenizer.encode("\\boxed{1}"), np.int32)])
    n = len(ids)
    return Trajectory(prompt_token_ids=prompt, token_ids=ids, loss_mask=(np.arange(n) >= len(prompt)).astype(np.int8),
                      rollout_logprobs=np.zeros(n, np.float32), params_versions=np.zeros(n, np.int32),
                      reward=float(correct), reward_components={"correct": float(correct)}, task_metadata=task)


def test_only_failed_episodes_keep_their_hints(tokenizer):
    tasks = make_tasks(3, 3, seed=0)
    trajectories = [episode(tokenizer, tasks[0], correct=False), episode(tokenizer, tasks[1], correct=True),
                    episode(tokenizer, tasks[2], correct=False)]
    verdicts = [Verdict("hint", hint="a"), Verdict("hint", hint="b"), Verdict("no_intervention")]
    assert [is_failed(t) for t in trajectories] == [True, False, True]
    hints, metrics = teacher_hints(trajectories, verdicts, only_failed=True)
    assert hints == ["a", None, None] and metrics["judge/dropped_on_solved"] == pytest.approx(1 / 3)
    hints, metrics = teacher_hints(trajectories, verdicts, only_failed=False)
    assert hints == ["a", "b", None] and metrics["judge/dropped_on_solved"] == 0.0


def test_placebo_hints_keep_token_lengths_with_the_real_tokenizer(tokenizer):
    """Groups of 4 episodes per task, the oracle's hints: every placebo is another task's hint
    with exactly as many tokens as the real one."""
    tasks = make_tasks(6, 4, seed=1, operators="*")
    trajectories, hints = [], []
    for k, task in enumerate(tasks):
        for j in range(4):
            trajectories.append(episode(tokenizer, task, correct=False))
            hints.append(None if j == 3 else bridge_thought(task, ("memory", "wrong_code")[k % 2]))
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    placebo, metrics = placebo_for(trajectories, hints, count, np.random.default_rng(0))
    assert metrics == {"placebo/same_length": 1.0, "placebo/other_length": 0.0, "placebo/unmatched": 0.0}
    for i, (real, fake) in enumerate(zip(hints, placebo)):
        if real is None:
            assert fake is None
            continue
        assert count(fake) == count(real) and fake != real
        donor_task = next(t for t in tasks if f"{t['a']}*{t['b']}" in fake)
        assert donor_task is not trajectories[i].task_metadata


def np_shaped(tea, logp, mask, rows, center, clip):
    d = np.where(mask > 0, tea - logp, 0.0)
    out = np.zeros_like(d)
    for b in rows:
        idx = mask[b] > 0
        x = d[b, idx]
        if center:
            x = x - x.mean()
        if clip:
            x = np.clip(x, -clip, clip)
        out[b, idx] = x
    return out


@pytest.mark.parametrize("mode", ["hybrid", "opd"])
def test_shaped_teacher_advantages_against_numpy(mode):
    rng = np.random.default_rng(2)
    rows, width = 5, 9
    tea, logp = rng.normal(-2, 1, (rows, width)), rng.normal(-1, 1, (rows, width))
    mask = (rng.random((rows, width)) < 0.7).astype(np.float32)
    mask[-1] = 0.0  # a padding row
    has = np.array([True, False, True, mode == "opd", False])
    group = rng.normal(size=(rows, width)) * mask
    adv, metrics = teacher_advantages(mode, group, tea, logp, mask, has, lam=0.3, center=True, clip=0.5)
    shaped = np_shaped(tea, logp, mask, np.nonzero(has)[0], center=True, clip=0.5)
    want = shaped if mode == "opd" else np.where(mask > 0, group + 0.3 * shaped, 0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    taught = mask * has[:, None]
    assert metrics["opd/advantage_mean"] == pytest.approx(((tea - logp) * taught).sum() / taught.sum(), rel=1e-5)


def test_term_diagnostics_against_numpy():
    from agentrl_jax.train.guidance.teacher import term_diagnostics

    rng = np.random.default_rng(3)
    tea, logp = rng.normal(-1, 1, (4, 7)), rng.normal(-1, 1, (4, 7))
    tea[:, :3] = logp[:, :3] + rng.normal(0, 0.1, (4, 3))  # a stretch the hint does not concern
    mask = np.ones((4, 7), np.float32)
    mask[2, 5:] = 0
    rows = np.array([True, True, True, False])
    got = term_diagnostics(tea, logp, mask, rows, prefix="x/")
    d = np.where(mask > 0, tea - logp, np.inf)
    assert got["x/min_token"] == pytest.approx(np.mean([d[b].min() for b in range(3)]), rel=1e-5)
    taught = mask * rows[:, None]
    near = ((np.abs(tea - logp) < 0.25) * taught).sum() / taught.sum()
    assert got["x/near_zero_fraction"] == pytest.approx(near, rel=1e-5)


def test_teacher_params_per_choice():
    import jax.numpy as jnp

    from agentrl_jax.train.guidance.teacher import Teacher

    start = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}
    frozen = {"w": jnp.array([9.0, 9.0]), "b": jnp.array(9.0)}
    steps = [{"w": jnp.array([float(k), -float(k)]), "b": jnp.array(float(k))} for k in (1, 2, 3)]
    reference = Teacher("g", "reference", frozen=frozen)
    policy = Teacher("g", "policy")
    snapshot = Teacher("g", "lagged", initial=start, lag_steps=2)
    ema = Teacher("g", "lagged", initial=start, ema_decay=0.75)
    want_ema = {k: np.asarray(v) for k, v in start.items()}
    for step, params in enumerate(steps, 1):
        assert reference.params_for(params) is frozen and reference.params is frozen
        assert policy.params_for(params) is params
        for teacher in (reference, policy, snapshot, ema):
            teacher.observe(params, step)
        want_ema = {k: 0.75 * want_ema[k] + 0.25 * np.asarray(params[k]) for k in want_ema}
        np.testing.assert_allclose(np.asarray(ema.params_for(params)["w"]), want_ema["w"], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(ema.params_for(params)["b"]), want_ema["b"], rtol=1e-6)
        expected = start if step == 1 else steps[1]  # snapshots after updates 2, 4, ...
        np.testing.assert_array_equal(np.asarray(snapshot.params_for(params)["w"]), np.asarray(expected["w"]))
    steps[1]["w"].delete()  # the donating update frees the policy's buffers; the snapshot owns its own
    np.testing.assert_array_equal(np.asarray(snapshot.params["w"]), [2.0, -2.0])
    with pytest.raises(AttributeError, match="no params of its own"):
        _ = policy.params
    for kwargs, message in [({"kind": "reference"}, "frozen params"), ({"kind": "lagged", "initial": start},
                            "exactly one"), ({"kind": "lagged", "initial": start, "lag_steps": 2, "ema_decay": 0.5},
                            "exactly one"), ({"kind": "student"}, "must be one of")]:
        with pytest.raises(ValueError, match=message):
            Teacher("g", **kwargs)


def test_hint_reading_config_fields_are_validated_naming_the_field():
    from agentrl_jax.config import Config, ConfigError, apply_overrides

    base = ["hybrid.mode=hybrid", "hybrid.judge=oracle"]
    ok = apply_overrides(Config(), base + ["hybrid.teacher=lagged", "hybrid.teacher_ema_decay=0.9", "hybrid.center=true",
                                           "hybrid.clip=2", "hybrid.lam_schedule=cosine_decay",
                                           "hybrid.lam_decay_steps=10", "hybrid.placebo=true",
                                           "hybrid.hint_only_failed=true", "hybrid.placebo_diagnostic_every=5"])
    assert ok.hybrid.teacher == "lagged" and ok.hybrid.placebo
    for overrides, field in [
        (base + ["hybrid.teacher=lagged"], "hybrid.teacher_lag_steps"),
        (base + ["hybrid.teacher=lagged", "hybrid.teacher_lag_steps=2", "hybrid.teacher_ema_decay=0.5"],
         "hybrid.teacher_lag_steps"),
        (base + ["hybrid.teacher_lag_steps=2"], "hybrid.teacher_lag_steps"),
        (base + ["hybrid.teacher=policy", "hybrid.judge=teacher"], "hybrid.judge"),
        (base + ["hybrid.clip=-1"], "hybrid.clip"),
        (base + ["hybrid.lam_schedule=linear_warmup"], "hybrid.lam_warmup_steps"),
        (["hybrid.center=true"], "hybrid.center"),
        (["hybrid.mode=hybrid", "hybrid.placebo=true"], "hybrid.placebo"),
        (["hybrid.mode=opd", "hybrid.hint_only_failed=true"], "hybrid.hint_only_failed"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            apply_overrides(Config(), overrides)
