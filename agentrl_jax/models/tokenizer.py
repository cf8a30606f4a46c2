"""Tokenizer and chat-template wrapper over a local HF tokenizer directory.

The invariant it serves: token ids pass straight through. A conversation is tokenized once,
turn by turn: :meth:`Tokenizer.append_messages` renders only the part of the chat template
that new messages add (plus the glue the template puts after a generated end-of-turn
token) and tokenizes only that, leaving the previous ids untouched. For the Qwen2.5, Qwen3
and Llama 3.1 formats the result equals a render of the whole conversation at once, except
where the template rewrites history (docs/chat_formats.md).

Template options pass through: ``tools=[...]`` (JSON schemas) and any template variable
(``enable_thinking=False``), per call or as the tokenizer's ``chat_template_kwargs``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]

class Tokenizer:
    """Text <-> ids and chat rendering for one HF tokenizer.

    Args:
      path: a local directory with tokenizer files (and optionally generation_config.json,
        whose eos ids are added to :attr:`eos_token_ids`).
      extra_eos_tokens: more stop tokens, given as strings.
      chat_template_kwargs: template variables every render gets unless a call overrides
        them (``model.chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3).
    """

    def __init__(self, path: str | os.PathLike, *, extra_eos_tokens: Sequence[str] = (),
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        from transformers import AutoTokenizer

        self.path = os.fspath(path)
        self.hf = AutoTokenizer.from_pretrained(self.path)
        eos: list[int] = []
        if self.hf.eos_token_id is not None:
            eos.append(int(self.hf.eos_token_id))
        gen_path = os.path.join(self.path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            if gen_eos is not None:
                eos += [int(e) for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos])]
        for token in extra_eos_tokens:
            token_id = self.hf.convert_tokens_to_ids(token)
            if token_id is None or token_id == self.hf.unk_token_id:
                raise ValueError(f"Tokenizer: extra eos token {token!r} is not in the vocabulary")
            eos.append(int(token_id))
        if not eos:
            raise ValueError(f"Tokenizer: {self.path} defines no eos token; pass extra_eos_tokens")
        self._eos = tuple(dict.fromkeys(eos))
        self._eos_texts = tuple(dict.fromkeys(self.hf.decode([e]) for e in self._eos))
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation (the tokenizer's eos first)."""
        return self._eos

    @property
    def pad_token_id(self) -> int:
        """The pad id (the first eos id when the tokenizer defines none)."""
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self._eos[0]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without added BOS/EOS (special-token strings are parsed)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template_kwargs(self, tools, template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        kwargs = {**self.chat_template_kwargs, **template_kwargs}
        if tools is not None:
            kwargs["tools"] = [dict(t) for t in tools]
        return kwargs

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for ``messages`` (arguments as :meth:`apply_chat`)."""
        return self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
            **self._template_kwargs(tools, template_kwargs))

    def apply_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation, as ``apply_chat_template(tokenize=True)`` gives.

        Args:
          messages: role/content dicts; assistant messages may carry ``tool_calls``
            (``[{"type": "function", "function": {"name", "arguments"}}]``) and, for Qwen3,
            ``reasoning_content``.
          tools: JSON-schema tool descriptions the template shows the model
            (``[{"type": "function", "function": {"name", "description", "parameters"}}]``).
          add_generation_prompt: end with the header that opens the assistant's turn.
          **template_kwargs: template variables (e.g. Qwen3's ``enable_thinking=False``); they
            override the ``chat_template_kwargs`` this tokenizer was built with.

        transformers 4.x returns a list of ids, 5.x a ``BatchEncoding``; both are handled.
        """
        out = self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt,
            **self._template_kwargs(tools, template_kwargs))
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        out = list(out)
        if out and isinstance(out[0], (list, tuple)):
            if len(out) != 1:
                raise ValueError(f"Tokenizer.apply_chat: expected one conversation, got {len(out)}")
            out = list(out[0])
        return [int(i) for i in out]

    def _end_of_turn(self, text: str, start: int) -> tuple[int, str]:
        """(position, text) of the first end-of-turn (eos) token in ``text`` at or after ``start``."""
        found = [(text.find(e, start), e) for e in self._eos_texts if text.find(e, start) >= 0]
        if not found:
            raise ValueError("Tokenizer: the chat template closes an assistant turn with none of the eos tokens "
                             f"{list(self._eos_texts)}; pass the template's end-of-turn token as extra_eos_tokens")
        return min(found)

    def messages_delta(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[str, str, str]:
        """``(end_of_turn, turn_tail, delta)``: the template text that ``messages`` add after an assistant turn.

        The template renders a fixed conversation (a user question, an assistant turn that
        calls a tool when ``messages`` hold a tool result) followed by ``messages``; the
        text after that assistant turn's end-of-turn token is ``turn_tail + delta``.
        ``end_of_turn`` is the token's text (ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``),
        ``turn_tail`` what the template writes right after it (ChatML: a newline; Llama 3:
        nothing), ``delta`` the new messages (plus the generation prompt when asked).

        Only the text *after* the anchor turn is used, so a template that rewrites earlier
        turns when more follow (Qwen3 drops the ``<think>`` block of a turn that is no
        longer the last) still gives the right delta: the trainer keeps the earlier turns
        as they were sampled (docs/chat_formats.md).
        """
        kwargs = dict(tools=tools, **template_kwargs)
        anchor = _anchor(any(m.get("role") == "tool" for m in messages))
        question = self.render_chat(anchor[:1], add_generation_prompt=False, **kwargs)
        before = self.render_chat(anchor, add_generation_prompt=False, **kwargs)
        after = self.render_chat([*anchor, *messages], add_generation_prompt=add_generation_prompt, **kwargs)
        if not (before.startswith(question) and after.startswith(question)):
            raise ValueError("Tokenizer.append_messages: the chat template renders the first user message "
                             "differently when more messages follow; this template is not supported")
        cut, end_of_turn = self._end_of_turn(before, len(question))
        turn_tail = before[cut + len(end_of_turn):]
        cut_after, end_after = self._end_of_turn(after, len(question))
        rest = after[cut_after + len(end_after):]
        if end_after != end_of_turn or not rest.startswith(turn_tail):
            raise ValueError("Tokenizer.append_messages: the chat template ends an assistant turn differently "
                             "when messages follow it; this template is not supported")
        return end_of_turn, turn_tail, rest[len(turn_tail):]

    def append_messages(
        self,
        ids: Sequence[int],
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        close_turn: bool = False,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """Append messages (e.g. the tool results of one turn) to an existing token sequence.

        The previous ids are kept as they are; only the new template text is tokenized, so
        ``ids + appended`` equals the ids of rendering the whole conversation at once
        (except where a template rewrites earlier turns, see :meth:`messages_delta`). If
        ``ids`` ends with an eos id (a generated assistant turn), the template's text after
        the end-of-turn token comes first.

        Args:
          ids: the conversation so far (prompt + generated tokens).
          messages: the new messages, e.g. ``[{"role": "tool", "content": ...}, ...]``.
          tools: the tool schemas the conversation was rendered with.
          add_generation_prompt: also open the next assistant turn.
          close_turn: ``ids`` end in an assistant turn the policy did not close with an eos
            (cut by its token budget or a stop string): the end-of-turn token is added too.
          **template_kwargs: as :meth:`apply_chat`.

        Returns:
          ``(new_ids, appended_ids)`` with ``new_ids == list(ids) + appended_ids``.
        """
        end_of_turn, turn_tail, delta = self.messages_delta(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        text = delta
        if ids and int(ids[-1]) in self._eos:
            text = turn_tail + delta
        elif close_turn:
            text = end_of_turn + turn_tail + delta
        appended = self.encode(text)
        return [int(i) for i in ids] + appended, appended

    def append_message(
        self, ids: Sequence[int], message: Message, *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """:meth:`append_messages` for one message."""
        return self.append_messages(ids, [message], add_generation_prompt=add_generation_prompt, **kwargs)

    def conversation_ids(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a whole conversation as the agent loop would have built it.

        For SFT on multi-turn tool conversations in the native layout: the prompt (the
        messages before the first assistant turn, with the generation prompt), then each
        assistant turn as the template renders it after its generation prompt, with its
        end-of-turn token (loss_mask 1), and the other messages appended with
        :meth:`append_messages` (loss_mask 0). Equal to the ids of an episode that sampled
        exactly these turns.

        Raises:
          ValueError: no assistant message, or a template that renders an assistant turn
            not as a continuation of its generation prompt.
        """
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            raise ValueError("Tokenizer.conversation_ids: the conversation has no assistant message")
        kwargs = dict(tools=tools, **template_kwargs)
        ids = self.apply_chat(messages[:first], add_generation_prompt=True, **kwargs)
        mask = [0] * len(ids)
        i = first
        while i < len(messages):
            if messages[i].get("role") == "assistant":
                turn = self._assistant_turn_ids(messages[:i], messages[i], kwargs)
                ids, mask, i = ids + turn, mask + [1] * len(turn), i + 1
                continue
            j = next((k for k in range(i, len(messages)) if messages[k].get("role") == "assistant"), len(messages))
            ids, glue = self.append_messages(ids, messages[i:j], add_generation_prompt=j < len(messages), **kwargs)
            mask, i = mask + [0] * len(glue), j
        return ids, mask

    def _assistant_turn_ids(self, history: Sequence[Message], message: Message, kwargs: dict[str, Any]) -> list[int]:
        """The ids a policy samples for ``message`` after ``history``: its rendered text and eos."""
        prefix = self.render_chat(history, add_generation_prompt=True, **kwargs)
        full = self.render_chat([*history, message], add_generation_prompt=False, **kwargs)
        if not full.startswith(prefix):
            raise ValueError("Tokenizer.conversation_ids: the chat template does not render an assistant turn as "
                             "a continuation of its generation prompt; this template is not supported")
        end, end_of_turn = self._end_of_turn(full, len(prefix))
        return self.encode(full[len(prefix):end]) + [int(self.hf.convert_tokens_to_ids(end_of_turn))]


def _anchor(calls_tool: bool) -> list[dict[str, Any]]:
    """The fixed conversation deltas are rendered after: a question and an assistant turn
    (which calls a tool when the new messages hold a tool result, as templates expect)."""
    assistant: dict[str, Any] = {"role": "assistant", "content": "anchor answer"}
    if calls_tool:
        assistant["tool_calls"] = [{"type": "function", "function": {"name": "anchor_tool", "arguments": {}}}]
    return [{"role": "user", "content": "anchor question"}, assistant]
