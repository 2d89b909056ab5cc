"""ShareGPT chats as token ids, turn by turn, for the context-overflow benchmarks (issue 20).

A chat is rendered with the model's own chat template (``tokenizer_config.json``'s
``chat_template``, through ``transformers``) one message at a time, then tokenized per message,
so every turn's prompt is an exact token prefix of the next turn's (the history carries the
dataset's answers: teacher forcing)::

    prompt(t) = system ‖ (user(i) ‖ header ‖ answer(i) for i < t) ‖ user(t) ‖ header
    input(t)  = prompt(t) ‖ answer(t)

``header`` is the template's generation prompt (``<|im_start|>assistant\\n``); ``answer(t)`` is
the dataset's assistant text with the template's end of message (``<|im_end|>\\n``).

A chat *overflows* a context of C tokens at the first turn whose input plus one new token does
not fit; the benchmarks measure that turn and every later one (the server cuts them all).

Source of the conversations: ``bench.common.conversations.iter_sharegpt_records`` (file order,
then a seeded sample).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from bench.common.conversations import ROLE_MAP, iter_sharegpt_records

SYSTEM_PROMPT = ("You are a helpful, careful assistant. Answer the user's questions clearly and completely, "
                 "explain your reasoning step by step, and give short examples where they help.")


@dataclass(frozen=True)
class Turn:
    """One turn: the prompt sent (ends with the assistant header) and the dataset's answer."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def input_ids(self) -> list[int]:
        """``prompt ‖ answer`` (what the quality benchmark sends). Shape: (num_tokens,)."""
        return list(self.prompt_ids) + list(self.answer_ids)


@dataclass(frozen=True)
class Chat:
    """A conversation as token ids.

    Attributes:
        chat_id: ``sharegpt:<id>``.
        system_tokens: tokens of the rendered system message (the shared head).
        turns: every turn, in order.
    """

    chat_id: str
    system_tokens: int
    turns: tuple[Turn, ...]

    def first_overflow(self, context_tokens: int) -> Optional[int]:
        """Index of the first turn whose input + 1 new token exceeds ``context_tokens``, or None."""
        for t, turn in enumerate(self.turns):
            if len(turn.prompt_ids) + len(turn.answer_ids) + 1 > context_tokens:
                return t
        return None


class ChatRenderer:
    """Renders messages with a model directory's tokenizer and chat template.

    Raises:
        OSError: the model directory lacks the tokenizer files.
    """

    def __init__(self, model_path: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        header_and_user = self._render([{"role": "user", "content": "x"}], generation_prompt=True)
        user = self._render([{"role": "user", "content": "x"}])
        if not header_and_user.startswith(user):
            raise ValueError("the chat template's generation prompt does not follow the rendered message")
        self.header_text = header_and_user[len(user):]
        self.header_ids = self.encode(self.header_text)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def message_ids(self, role: str, content: str) -> list[int]:
        """Token ids of one rendered message (an assistant message without its header)."""
        text = self._render([{"role": role, "content": content}])
        if role == "assistant":
            if not text.startswith(self.header_text):
                raise ValueError("an assistant message does not start with the generation prompt")
            text = text[len(self.header_text):]
        return self.encode(text)

    def chat(self, chat_id: str, pairs: Sequence[tuple[str, str]], system_prompt: str = SYSTEM_PROMPT) -> Chat:
        """A :class:`Chat` from ``(user text, assistant text)`` pairs."""
        history = self.message_ids("system", system_prompt)
        system_tokens = len(history)
        turns = []
        for user, answer in pairs:
            prompt = history + self.message_ids("user", user) + self.header_ids
            answer_ids = self.message_ids("assistant", answer)
            turns.append(Turn(tuple(prompt), tuple(answer_ids)))
            history = prompt + answer_ids
        return Chat(chat_id, system_tokens, tuple(turns))


def sharegpt_pairs(record: dict, max_message_chars: int) -> list[tuple[str, str]]:
    """The record's leading strictly alternating (user, assistant) pairs, each text cut to
    ``max_message_chars``; stops at the first empty message or break in alternation."""
    raw = [m for m in (record.get("conversations") or [])]
    start = next((i for i, m in enumerate(raw) if m.get("from") == "human"), len(raw))
    pairs = []
    for i in range(start, len(raw) - 1, 2):
        user, answer = raw[i], raw[i + 1]
        texts = [(m.get("value") or "").strip()[:max_message_chars] for m in (user, answer)]
        roles = (ROLE_MAP.get(user.get("from")), ROLE_MAP.get(answer.get("from")))
        if roles != ("user", "assistant") or not all(texts):
            break
        pairs.append((texts[0], texts[1]))
    return pairs


def overflowing_chats(renderer: ChatRenderer, num_chats: int, context_tokens: int, max_total_tokens: int,
                      max_message_chars: int = 1500, max_answer_tokens: int = 320, max_turns: int = 8,
                      seed: int = 0, scan_records: int = 6000) -> list[Chat]:
    """``num_chats`` ShareGPT chats that overflow ``context_tokens`` and go on for at least one
    more turn, with every input within ``max_total_tokens`` (the uncut reference's context) and
    every answer at most ``max_answer_tokens`` (so a cut never reaches into it).

    The first ``scan_records`` records are scanned in file order; ``random.Random(seed)``
    samples among those that qualify. Chats are cut after ``max_turns`` turns.

    Raises:
        ValueError: fewer than ``num_chats`` qualify.
    """
    eligible = []
    for n, record in enumerate(iter_sharegpt_records()):
        if n >= scan_records:
            break
        pairs = sharegpt_pairs(record, max_message_chars)[:max_turns]
        if len(pairs) < 2:
            continue
        chat = renderer.chat(f"sharegpt:{record.get('id', n)}", pairs)
        first = chat.first_overflow(context_tokens)
        if first is None or first + 1 >= len(chat.turns):
            continue
        if any(len(t.answer_ids) > max_answer_tokens for t in chat.turns[first:]):
            continue
        if len(chat.turns[-1].input_ids) + 1 > max_total_tokens:
            continue
        eligible.append(chat)
    if len(eligible) < num_chats:
        raise ValueError(f"only {len(eligible)} chats of the first {scan_records} ShareGPT records qualify")
    return random.Random(seed).sample(eligible, num_chats)


def keep_tokens_for(chats: Sequence[Chat], page_size: int) -> int:
    """``--hiradix-keep-tokens``: the system message's tokens rounded down to whole pages.

    Raises:
        ValueError: the chats disagree on the system message's length.
    """
    lengths = {c.system_tokens for c in chats}
    if len(lengths) != 1:
        raise ValueError(f"chats have different system message lengths {sorted(lengths)}")
    return lengths.pop() // page_size * page_size
