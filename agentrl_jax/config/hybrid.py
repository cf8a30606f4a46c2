"""The hybrid section: teacher, on-policy distillation, PRM judge and hindsight hints (docs/hybrid.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl_jax.config.core import ConfigError, DType, _f, _require, _Section


JUDGE_FIELDS = ("problem", "trajectory", "outcome", "reward", "reference_answer")


@dataclass(frozen=True)
class HybridConfig(_Section):
    """Teacher, on-policy distillation, PRM judge and hindsight bridge thoughts (docs/hybrid.md).

    mode "opd": A_t = tea_t - old_t on every trajectory (pure on-policy distillation).
    mode "hybrid": A_t = A_group + lam * (tea_t - old_t) on trajectories with a teacher
    signal (a judge hint; every trajectory when judge="none"), pure A_group elsewhere.
    With a judge, the teacher scores the response under [prompt + bridge thought + response].
    """

    mode: Literal["none", "opd", "hybrid"] = _f("none", "Teacher signal in the advantage: off, pure OPD, or hybrid.")
    lam: float = _f(1.0, "lambda: weight of the OPD term in the hybrid advantage A_group + lambda * A_opd.")
    teacher: Literal["reference", "checkpoint", "policy", "lagged"] = _f(
        "reference", "The teacher: the frozen reference (model.reference_path if set, else the starting "
        "policy; no extra memory when the dtypes match), the HF checkpoint at hybrid.teacher_path, the "
        "current policy before the update (self-distillation with the hint, as SDPO / OPSD), or a lagged "
        "copy of the policy (hybrid.teacher_lag_steps or hybrid.teacher_ema_decay).")
    teacher_path: str = _f("", "HF checkpoint of the teacher when hybrid.teacher='checkpoint'.")
    teacher_dtype: DType = _f("bfloat16", "Dtype of the frozen teacher params (reference / checkpoint teachers).")
    teacher_lag_steps: int = _f(0, "teacher='lagged': copy the policy's params into the teacher every N steps.")
    teacher_ema_decay: float = _f(0.0, "teacher='lagged': instead of snapshots, an EMA of the policy's params "
                                       "(theta_T <- decay * theta_T + (1 - decay) * theta after every step).")
    hint_only_failed: bool = _f(False, "Drop the judge's hints on episodes that solved their task (counted as "
                                       "judge/dropped_on_solved).")
    center: bool = _f(False, "Center the OPD term per trajectory (subtract its mean over the trajectory's loss "
                             "tokens): the hint's uniform offset and the frozen teacher's KL-to-start part cancel.")
    clip: float = _f(0.0, "Clip the OPD term per token to [-clip, clip] (after centering); 0: off.")
    lam_schedule: Literal["constant", "linear_warmup", "linear_decay", "cosine_decay"] = _f(
        "constant", "lambda over the RL steps (losses.opd_lambda): constant, linear warmup from 0 over "
        "lam_warmup_steps, or a linear / cosine decay to lam_final over lam_decay_steps.")
    lam_warmup_steps: int = _f(0, "lam_schedule='linear_warmup': steps of the ramp from 0 to lam.")
    lam_decay_steps: int = _f(0, "lam_schedule='linear_decay' / 'cosine_decay': steps from lam to lam_final.")
    lam_final: float = _f(0.0, "lambda at the end of a decay.")
    placebo: bool = _f(False, "Placebo control: the teacher reads another task's hint of the same token length "
                              "(rewards.hints.placebo_hints) instead of the trajectory's own.")
    placebo_diagnostic_every: int = _f(
        0, "Every N steps (from the first) also score the hinted trajectories under placebo hints and log "
        "opd/placebo_min_token and opd/placebo_near_zero_fraction (one more teacher pass); 0: never.")
    judge: Literal["none", "policy", "reference", "teacher", "oracle"] = _f(
        "none", "Who writes bridge thoughts / PRM scores after an episode: nobody, a model through the "
        "rollout driver (current policy, reference or teacher params), or a scripted oracle (arithmetic, retool_small).")
    judge_template: str = _f("", "Judge prompt with {problem} {trajectory} {outcome} {reward} {reference_answer}; "
                                 "empty: the built-in template (agentrl_jax.train.guidance.hindsight).")
    judge_max_new_tokens: int = _f(256, "Decoding budget of one judge answer.")
    judge_temperature: float = _f(0.0, "Judge sampling temperature (0: greedy).")
    max_hint_tokens: int = _f(64, "A bridge thought longer than this many tokens is rejected (counted).")
    hint_placement: Literal["user_message", "assistant_prefix"] = _f(
        "user_message", "Where the teacher context carries the hint: appended to the last user message "
        "(prompt re-templated) or as tokens right after the generation prompt, before the response.")
    hint_format: str = _f("\n\nHint: {hint}", "Text inserted for a hint; must contain {hint}.")
    prm_weight: float = _f(0.0, "Weight of the judge's PRM score (in [0, 1]) added to the reward (0: off).")
    sample_hints: int = _f(4, "Hints written as tensorboard text per logged step.")

    def validate(self) -> None:
        _require(self.lam >= 0, self._path("lam"), "must be >= 0")
        _require(self.teacher != "checkpoint" or bool(self.teacher_path), self._path("teacher_path"),
                 "is required when hybrid.teacher='checkpoint'")
        _require(self.max_hint_tokens >= 1, self._path("max_hint_tokens"), "must be >= 1")
        _require(self.judge_max_new_tokens >= 1, self._path("judge_max_new_tokens"), "must be >= 1")
        _require(self.judge_temperature >= 0, self._path("judge_temperature"), "must be >= 0")
        _require(self.prm_weight >= 0, self._path("prm_weight"), "must be >= 0")
        _require("{hint}" in self.hint_format, self._path("hint_format"), "must contain {hint}")
        if self.judge_template:
            import string

            try:
                names = {f for _, f, _, _ in string.Formatter().parse(self.judge_template) if f is not None}
            except ValueError as e:
                raise ConfigError(f"hybrid.judge_template: not a format string ({e})") from None
            unknown = names - set(JUDGE_FIELDS)
            _require(not unknown, self._path("judge_template"),
                     f"unknown fields {sorted(unknown)}; allowed: {', '.join(JUDGE_FIELDS)} "
                     "(write literal braces as {{ }})")
            _require("trajectory" in names, self._path("judge_template"), "must contain {trajectory}")
        _require(self.prm_weight == 0 or self.judge != "none", self._path("prm_weight"),
                 "needs a judge (hybrid.judge != 'none')")
        self._validate_teacher_signal()

    def _validate_teacher_signal(self) -> None:
        """The hint-reading options: each must be able to act (a teacher, hints), none silently ignored."""
        lagged = self.teacher == "lagged"
        _require(not lagged or (self.teacher_lag_steps >= 1) != (0 < self.teacher_ema_decay < 1),
                 self._path("teacher_lag_steps"), "teacher='lagged' needs exactly one of teacher_lag_steps >= 1 "
                 f"or 0 < teacher_ema_decay < 1 (got {self.teacher_lag_steps}, {self.teacher_ema_decay})")
        _require(lagged or (self.teacher_lag_steps == 0 and self.teacher_ema_decay == 0),
                 self._path("teacher_lag_steps"), "teacher_lag_steps / teacher_ema_decay need teacher='lagged'")
        _require(self.judge != "teacher" or self.teacher in ("reference", "checkpoint"), self._path("judge"),
                 f"'teacher' decodes with the teacher's own params; teacher={self.teacher!r} has none "
                 "(use judge='policy')")
        _require(self.clip >= 0, self._path("clip"), "must be >= 0 (0: off)")
        _require(self.lam_final >= 0, self._path("lam_final"), "must be >= 0")
        ramp = {"linear_warmup": ("lam_warmup_steps", self.lam_warmup_steps),
                "linear_decay": ("lam_decay_steps", self.lam_decay_steps),
                "cosine_decay": ("lam_decay_steps", self.lam_decay_steps)}.get(self.lam_schedule)
        if ramp:
            _require(ramp[1] >= 1, self._path(ramp[0]), f"must be >= 1 with lam_schedule={self.lam_schedule!r}")
        _require(self.placebo_diagnostic_every >= 0, self._path("placebo_diagnostic_every"), "must be >= 0")
        shaped = {"center": self.center, "clip": self.clip, "placebo": self.placebo,
                  "hint_only_failed": self.hint_only_failed, "placebo_diagnostic_every": self.placebo_diagnostic_every,
                  "lam_schedule": self.lam_schedule != "constant", "teacher": lagged or self.teacher == "policy"}
        for key, value in shaped.items():
            _require(self.mode != "none" or not value, self._path(key), "has no effect with hybrid.mode='none'")
        for key in ("placebo", "hint_only_failed", "placebo_diagnostic_every"):
            _require(self.judge != "none" or not getattr(self, key), self._path(key),
                     "needs hints: set hybrid.judge")
