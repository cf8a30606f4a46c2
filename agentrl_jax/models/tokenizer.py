"""Tokenizer and chat-template wrapper over a local HF tokenizer directory.

The invariant it serves: token ids pass straight through. A conversation is tokenized once,
turn by turn: :meth:`Tokenizer.append_message` renders only the part of the chat template
that a new message adds (plus the glue the template puts after a generated end-of-turn
token) and tokenizes only that, leaving the previous ids untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]

# A fixed two-turn conversation to render template deltas against.
_ANCHOR: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "anchor question"},
    {"role": "assistant", "content": "anchor answer"},
)


class Tokenizer:
    """Text <-> ids and chat rendering for one HF tokenizer.

    Args:
      path: a local directory with tokenizer files (and optionally generation_config.json,
        whose eos ids are added to :attr:`eos_token_ids`).
      extra_eos_tokens: more stop tokens, given as strings.
    """

    def __init__(self, path: str | os.PathLike, *, extra_eos_tokens: Sequence[str] = ()):
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

    def render_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for ``messages``."""
        return self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def apply_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation, as ``apply_chat_template(tokenize=True)`` gives.

        transformers 4.x returns a list of ids, 5.x a ``BatchEncoding``; both are handled.
        """
        out = self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        out = list(out)
        if out and isinstance(out[0], (list, tuple)):
            if len(out) != 1:
                raise ValueError(f"Tokenizer.apply_chat: expected one conversation, got {len(out)}")
            out = list(out[0])
        return [int(i) for i in out]

    def message_delta(self, message: Message, *, add_generation_prompt: bool) -> tuple[str, str]:
        """``(turn_tail, delta)``: the template text that ``message`` adds after a finished turn.

        ``delta`` is the text the template renders for ``message`` (plus the generation
        prompt when asked) after a conversation that ends with an assistant turn.
        ``turn_tail`` is what the template writes after that turn's eos token (ChatML: a
        newline); it is needed when the previous ids end with a generated eos.
        """
        before = self.render_chat(_ANCHOR, add_generation_prompt=False)
        after = self.render_chat(
            [*_ANCHOR, dict(message)], add_generation_prompt=add_generation_prompt
        )
        if not after.startswith(before):
            raise ValueError(
                "Tokenizer.append_message: the chat template re-renders earlier turns when a "
                "message is appended, so the delta is not a suffix; this template is not supported"
            )
        eos_text = self.hf.decode([self._eos[0]])
        cut = before.rfind(eos_text)
        turn_tail = before[cut + len(eos_text) :] if cut >= 0 else ""
        return turn_tail, after[len(before) :]

    def append_message(
        self, ids: Sequence[int], message: Message, *, add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int]]:
        """Append one message (e.g. a tool observation) to an existing token sequence.

        The previous ids are kept as they are; only the new template text is tokenized. If
        ``ids`` ends with an eos id (a generated assistant turn), the template's text after
        the end-of-turn token is added first.

        Args:
          ids: the conversation so far (prompt + generated tokens).
          message: ``{"role": ..., "content": ...}``.
          add_generation_prompt: also open the next assistant turn.

        Returns:
          ``(new_ids, appended_ids)`` with ``new_ids == list(ids) + appended_ids``.
        """
        turn_tail, delta = self.message_delta(message, add_generation_prompt=add_generation_prompt)
        text = delta
        if ids and int(ids[-1]) in self._eos:
            text = turn_tail + delta
        appended = self.encode(text)
        return [int(i) for i in ids] + appended, appended
