"""On-policy distillation on the policy's own tokens: the teacher's sequences, its logprobs
aligned to the student's batch, and the OPD / hybrid advantages (the ``Teacher`` role: ``teacher.py``).

On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025, "On-Policy
Distillation") needs log pi_teacher(y_t | context) for every token y_t the policy sampled.
In the hindsight variant of the Retool-RL recipe ("Agentic RL (Part III): Architecture Analysis of
Verl and SkyRL to Retool-RL Case Practice", sec. 4.4) the teacher's
context differs from the student's: a bridge thought is inserted before the response,

    student: [prompt        ][response]        token j of the response at index P + j
    teacher: [prompt' (+hint)][response]        the same token at index P' + j

so the teacher's per-token arrays are shifted by ``P' - P`` against the student's. This
module builds the teacher sequences and maps the teacher's logprobs back onto the
student's batch layout (``train/batch.py``: index t holds the logprob of ``targets[t]``,
i.e. of token t + 1), exactly, token for token.

Two placements of the hint (config ``hybrid.hint_placement``):
- ``user_message``: the hint is appended to the last user message and the prompt is
  re-templated (the seed's "appending this bridge thought to the reference model's prompt");
- ``assistant_prefix``: the hint's tokens follow the generation prompt, as if the model
  had thought them before answering.
The response tokens are always the sampled ids; nothing of the response is re-tokenized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from agentrl_jax.envs.base import Trajectory
from agentrl_jax.train.batch import TokenRecord, build_batch

PLACEMENTS = ("user_message", "assistant_prefix")


@dataclasses.dataclass(frozen=True)
class TeacherContext:
    """The teacher's sequence for one trajectory.

    Attributes:
      token_ids: teacher prompt + the trajectory's response ids (as sampled / appended).
      loss_mask: 0 on the teacher prompt, the trajectory's loss mask on the response.
      prompt_length: P', tokens before the response in ``token_ids``.
      shift: P' - P, the offset of a response token in the teacher's sequence.
    """

    token_ids: list[int]
    loss_mask: list[int]
    prompt_length: int
    shift: int


def initial_messages(trajectory: Trajectory) -> list[dict[str, str]]:
    """The chat messages that produced the prompt: every turn before the first assistant turn."""
    out = []
    for turn in trajectory.turns:
        if turn.get("role") == "assistant":
            break
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def teacher_context(
    trajectory: Trajectory,
    hint: str | None,
    tokenizer: Any,
    *,
    placement: str = "user_message",
    hint_format: str = "\n\nHint: {hint}",
) -> TeacherContext:
    """[prompt (+ hint) + response] for the teacher; without a hint, the student's own sequence.

    Args:
      trajectory: a finished episode (``prompt_token_ids`` is a prefix of ``token_ids``).
      hint: the bridge thought, or None.
      tokenizer: ``agentrl_jax.models.tokenizer.Tokenizer`` (``apply_chat``, ``encode``).
      placement: "user_message" or "assistant_prefix" (module docstring).
      hint_format: text inserted for the hint, containing ``{hint}``.
    """
    prompt = [int(i) for i in trajectory.prompt_token_ids]
    response_ids = [int(i) for i in trajectory.token_ids[len(prompt):]]
    response_mask = [int(m) for m in trajectory.loss_mask[len(prompt):]]
    if hint is None:
        teacher_prompt = prompt
    elif placement == "assistant_prefix":
        teacher_prompt = prompt + tokenizer.encode(hint_format.format(hint=hint))
    elif placement == "user_message":
        messages = initial_messages(trajectory)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError("teacher_context: placement 'user_message' needs a user message in trajectory.turns")
        last = users[-1]
        messages[last] = {"role": "user", "content": messages[last]["content"] + hint_format.format(hint=hint)}
        teacher_prompt = tokenizer.apply_chat(messages, tools=trajectory.tools, add_generation_prompt=True)
    else:
        raise ValueError(f"teacher_context: placement must be one of {PLACEMENTS}, got {placement!r}")
    return TeacherContext(
        token_ids=list(teacher_prompt) + response_ids,
        loss_mask=[0] * len(teacher_prompt) + response_mask,
        prompt_length=len(teacher_prompt),
        shift=len(teacher_prompt) - len(prompt),
    )


def align_to_student(
    teacher_logp: np.ndarray,
    shifts: Sequence[int],
    prompt_lengths: Sequence[int],
    lengths: Sequence[int],
    student_shape: tuple[int, int],
) -> np.ndarray:
    """Move per-token teacher arrays onto the student's target layout.

    Row i of ``teacher_logp`` holds trajectory i's teacher sequence; student index t
    (predicting token t + 1) for t in [P_i - 1, n_i - 1) reads teacher index t + shift_i.
    Prompt positions and padding get 0.

    Args:
      teacher_logp: [N, T'] teacher logprobs (target layout of the teacher rows).
      shifts, prompt_lengths, lengths: per trajectory, shift = P' - P, P and n.
      student_shape: (R, T) of the student's batch, R >= N (one trajectory per row).
    Returns:
      [R, T] float32.
    """
    rows, width = student_shape
    out = np.zeros((rows, width), np.float32)
    for i, (shift, start, n) in enumerate(zip(shifts, prompt_lengths, lengths)):
        t = np.arange(start - 1, n - 1)
        out[i, t] = teacher_logp[i, t + shift]
    return out


def teacher_logprobs(
    logprob_fn: Callable[[dict[str, Any]], Any],
    trajectories: Sequence[Trajectory],
    contexts: Sequence[TeacherContext | None],
    student_shape: tuple[int, int],
    *,
    row_multiple: int = 1,
    pad_token_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher logprobs of the sampled tokens, aligned with the student's padded batch.

    Only trajectories with a context are run through the teacher (one row each, rows
    rounded up to ``row_multiple`` so the jitted forward sees few shapes).

    Args:
      logprob_fn: batch arrays (``input_ids``, ``positions``, ``segment_ids``,
        ``targets`` [R', T']) -> [R', T'] logprobs, e.g. the trainer's chunked,
        micro-batched forward with the teacher params.
      trajectories: the batch's trajectories, row i of the student batch = trajectory i.
      contexts: per trajectory a ``TeacherContext`` or None (no teacher signal).
      student_shape: (R, T) of the student batch.
    Returns:
      (teacher_logp [R, T] float32, 0 where there is no context; has_teacher [R] bool).
    """
    rows = student_shape[0]
    has_teacher = np.zeros(rows, bool)
    chosen = [i for i, c in enumerate(contexts) if c is not None]
    if not chosen:
        return np.zeros(student_shape, np.float32), has_teacher
    has_teacher[chosen] = True
    records = [
        TokenRecord(contexts[i].token_ids, contexts[i].loss_mask, [0.0] * len(contexts[i].token_ids),
                    [-1] * len(contexts[i].token_ids))
        for i in chosen
    ]
    batch = build_batch(records, row_multiple=row_multiple, pad_token_id=pad_token_id)
    arrays = {k: jnp.asarray(getattr(batch, k)) for k in ("input_ids", "positions", "segment_ids", "targets")}
    logp = np.asarray(logprob_fn(arrays), np.float32)
    aligned = align_to_student(
        logp[: len(chosen)],
        [contexts[i].shift for i in chosen],
        [len(trajectories[i].prompt_token_ids) for i in chosen],
        [len(trajectories[i].token_ids) for i in chosen],
        (len(chosen), student_shape[1]),
    )
    out = np.zeros(student_shape, np.float32)
    out[chosen] = aligned
    return out, has_teacher


def kl_on_sampled(teacher_logp: np.ndarray, logp: np.ndarray, loss_mask: np.ndarray) -> float:
    """k1 estimate of KL(student || teacher) on the sampled tokens: mean of logp - teacher_logp."""
    n = float(loss_mask.sum())
    return float(((logp - teacher_logp) * loss_mask).sum() / n) if n else 0.0


def hindsight_contexts(
    trajectories: Sequence[Trajectory],
    hints: Sequence[str | None] | None,
    tokenizer: Any,
    *,
    mode: str,
    placement: str,
    hint_format: str,
) -> list[TeacherContext | None]:
    """Which trajectories get a teacher signal, and under which context.

    mode "opd": every trajectory (with its hint in the context when it has one).
    mode "hybrid": with a judge (``hints`` given), only trajectories with a hint; without
    a judge, every trajectory under the student's own context (plain OPD mixed with GRPO).
    """
    if mode not in ("opd", "hybrid"):
        raise ValueError(f"hindsight_contexts: mode must be 'opd' or 'hybrid', got {mode!r}")
    out: list[TeacherContext | None] = []
    for i, t in enumerate(trajectories):
        hint = hints[i] if hints is not None else None
        if mode == "hybrid" and hints is not None and hint is None:
            out.append(None)
        else:
            out.append(teacher_context(t, hint, tokenizer, placement=placement, hint_format=hint_format))
    return out


def teacher_advantages(
    mode: str,
    group_advantages: np.ndarray,
    teacher_logp: np.ndarray,
    logp: np.ndarray,
    loss_mask: np.ndarray,
    has_teacher: np.ndarray,
    *,
    lam: float,
    center: bool = False,
    clip: float = 0.0,
) -> tuple[np.ndarray, dict[str, float]]:
    """Advantages [R, T] with the teacher's signal, and their metrics.

    With d_t = tea_t - logp_t and shape() the optional per-trajectory centering and per-token
    clip of ``losses.shaped_opd_term``:

    mode "opd":    A_t = shape(d)_t                                  (every row with a teacher)
    mode "hybrid": A_t = A_group_t + lam * has_teacher * shape(d)_t
    (without shaping: ``agentrl_jax.losses.opd_advantages`` / ``hybrid_advantages``); ``logp``
    is the policy's logprob of the sampled token before the update (stop-gradient).

    Args: group_advantages, teacher_logp, logp, loss_mask [R, T]; has_teacher [R] bool;
      lam the OPD weight of this step (``losses.opd_lambda``); center, clip as
      ``losses.shaped_opd_term``.
    Returns: (advantages [R, T] float32, metrics over the tokens with a teacher signal:
      opd/advantage_mean and opd/kl_student_teacher of the raw d).
    """
    from agentrl_jax.losses import hindsight_advantages, shaped_opd_term

    args = [jnp.asarray(x, jnp.float32) for x in (teacher_logp, logp, loss_mask)]
    taught_rows = jnp.asarray(has_teacher, bool)
    if mode == "opd":
        adv = shaped_opd_term(*args, taught_rows, center=center, clip=clip)
    elif mode == "hybrid":
        adv = hindsight_advantages(jnp.asarray(group_advantages, jnp.float32), *args, taught_rows, lam=lam,
                                   center=center, clip=clip)
    else:
        raise ValueError(f"teacher_advantages: mode must be 'opd' or 'hybrid', got {mode!r}")
    taught = loss_mask * np.asarray(has_teacher, np.float32)[:, None]
    n = max(float(taught.sum()), 1.0)
    metrics = {
        "opd/advantage_mean": float(((teacher_logp - logp) * taught).sum() / n),
        "opd/kl_student_teacher": kl_on_sampled(teacher_logp, logp, taught),
    }
    return np.asarray(adv, np.float32), metrics

