"""Supervised cold start on multi-turn tool-use conversations, with the RL masks.

A conversation is laid out exactly like an RL trajectory of the agent loop, so SFT and
RL see the same token boundaries:

    prompt      = chat template of the messages before the first assistant message,
                  with the generation prompt (loss_mask 0)
    assistant   = tokenize(content)                          (loss_mask 1)
    tool / interpreter output = tokenize(content), inline in the same assistant turn
                                                             (loss_mask 0)
    user message after an answer (e.g. a checker's rejection note): the answer's end-of-turn
                  token (loss_mask 1), then the template's text for the message and the next
                  assistant turn, as ``Tokenizer.append_messages`` appends it in an episode
                                                             (loss_mask 0)
    end         = the end-of-turn token                      (loss_mask 1)

A conversation in the native chat layout (an assistant message with ``tool_calls``, or a run
whose environment lists ``tools``) is laid out as the agent loop builds it in that layout
(``Tokenizer.conversation_ids``, docs/chat_formats.md): each assistant turn as its chat
template renders it, with its end-of-turn token (loss_mask 1), and the tool messages with
their role headers and the template's glue in between (loss_mask 0).

The loss is the token-mean negative log-likelihood of the masked tokens: the REINFORCE
loss with advantage 1 on loss tokens, through the same jitted update as RL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.losses import global_normalizer
from agentrl_jax.sharding import under_mesh
from agentrl_jax.train.batch import TokenRecord, build_batch
from agentrl_jax.train.multihost import put_global, to_host
from agentrl_jax.train.packing import segment_bound
from agentrl_jax.train.step import LossSettings, TrainState, update_step

logger = logging.getLogger(__name__)

OBSERVATION_ROLES = ("tool", "interpreter", "ipython", "observation")


def conversation_to_record(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
                           tools: Sequence[Mapping[str, Any]] | None = None) -> TokenRecord:
    """Token ids and loss mask of one conversation (see the module docstring).

    Args:
      tokenizer: an ``agentrl_jax.models.tokenizer.Tokenizer``.
      messages: role/content dicts; at least one assistant message.
      tools: the tool schemas of a native-layout run (the chat template lists them in the prompt).
    Raises:
      ValueError: naming the problem when there is no assistant message or a role is unknown.
    """
    if tools is not None or any(m.get("tool_calls") for m in messages):
        ids, mask = tokenizer.conversation_ids(list(messages), tools=tools)
        return TokenRecord(ids, mask, [0.0] * len(ids), [-1] * len(ids), [float(x) for x in mask])
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("SFT conversation has no assistant message")
    ids = list(tokenizer.apply_chat(list(messages[:first]), add_generation_prompt=True))
    mask = [0] * len(ids)
    for m in messages[first:]:
        role = m["role"]
        if role == "assistant":
            piece, flag = tokenizer.encode(m["content"]), 1
        elif role in OBSERVATION_ROLES:
            piece, flag = tokenizer.encode(m["content"]), 0
        elif role == "user":  # e.g. a critique after an answer: the turn ends, the note comes through the template
            ids.append(tokenizer.eos_token_ids[0])
            mask.append(1)
            piece, flag = tokenizer.append_messages(ids, [m], add_generation_prompt=True)[1], 0
        else:
            raise ValueError(
                f"SFT conversation: role {role!r} after the first assistant message; "
                f"expected assistant, user or one of {OBSERVATION_ROLES}"
            )
        ids += piece
        mask += [flag] * len(piece)
    end = tokenizer.eos_token_ids[0]
    ids.append(end)
    mask.append(1)
    n = len(ids)
    return TokenRecord(ids, mask, [0.0] * n, [-1] * n, [float(x) for x in mask])


def sft_settings(chunk_size: int = 1024, max_segments: int = 0) -> LossSettings:
    """NLL on loss tokens: REINFORCE with advantage 1, token-mean, packed rows.

    ``max_segments``: the batch's segment bound (``train.packing.segment_bound``): > 1 runs
    cuDNN's packed kernel on GPU, 1 the mask-free padded-row path, 0 the segment mask.
    """
    return LossSettings(loss="reinforce", aggregation="token-mean", chunk_size=chunk_size, packed=True,
                        max_segments=max_segments)


def batch_arrays(batch, *, device: bool = True, mesh=None) -> dict[str, Any]:
    """The arrays the update consumes, from a TrainBatch.

    Args:
      device: device arrays (on ``mesh``, replicated, when given: every host passes the same
        batch); False: numpy.
    """
    if device and mesh is not None:
        put = functools.partial(put_global, mesh=mesh)
    elif device:
        put = jnp.asarray
    else:
        put = np.asarray
    arrays = {
        name: put(getattr(batch, name))
        for name in (
            "input_ids",
            "positions",
            "segment_ids",
            "targets",
            "loss_mask",
            "advantages",
            "rollout_logprobs",
            "sequence_ids",
        )
    }
    arrays["old_logprobs"] = put(np.zeros_like(batch.loss_mask))  # SFT: no ratio; RL overwrites it
    return arrays


def run_sft(
    state: TrainState,
    *,
    graphdef: Any,
    optimizer: Any,
    records: Sequence[TokenRecord],
    steps: int,
    batch_size: int,
    row_length: int,
    seed: int,
    metrics_writer: Any = None,
    log_prefix: str = "sft/",
    mesh: Any = None,
    chunk_size: int = 1024,
) -> tuple[TrainState, list[dict[str, float]]]:
    """SFT for ``steps`` updates on shuffled batches of ``batch_size`` conversations.

    Rows are packed to ``row_length`` and the row count is rounded to a power of two so
    the update compiles for few shapes; attention runs on the fused packed path for the
    batch's segment bound (``train.packing.segment_bound``). ``chunk_size``: tokens per
    logprob chunk (``algorithm.logprob_chunk_tokens``).
    """
    if not records:
        raise ValueError("run_sft: no SFT records")
    rng = np.random.default_rng(seed)
    compiled: dict[tuple[int, int], Any] = {}
    history = []
    order = rng.permutation(len(records))
    cursor = 0
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = rng.permutation(len(records)), 0
        chosen = [records[i] for i in order[cursor : cursor + batch_size]]
        cursor += batch_size
        batch = build_batch(chosen, pack=True, row_length=row_length)
        rows = 1 << max(0, (batch.shape[0] - 1).bit_length())
        batch = build_batch(chosen, pack=True, row_length=row_length, row_multiple=rows)
        arrays = batch_arrays(batch, mesh=mesh)
        key = (rows, segment_bound(int(batch.segment_ids.max())))
        if key not in compiled:
            compiled[key] = under_mesh(jax.jit(
                functools.partial(
                    update_step,
                    graphdef=graphdef,
                    optimizer=optimizer,
                    settings=sft_settings(chunk_size, max_segments=key[1]),
                    num_micro_batches=1,
                    num_sequences=len(chosen),
                ),
                donate_argnums=(0,),
            ), mesh)
        normalizer = np.asarray(global_normalizer(batch.loss_mask, "token-mean"))
        normalizer = jnp.asarray(normalizer) if mesh is None else put_global(normalizer, mesh)
        state, metrics = compiled[key](state, arrays, normalizer)
        scalars = {f"{log_prefix}{k}": float(to_host(v)) for k, v in metrics.items()
                   if k in ("loss", "grad_norm", "update_norm", "skipped", "entropy")}
        history.append(scalars)
        if metrics_writer is not None:
            metrics_writer.write(step, scalars)
    return state, history
