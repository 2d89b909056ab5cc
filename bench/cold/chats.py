"""ShareGPT chats that fit the trained model's context, for the cold-tier quality benchmark.

Rendering (chat template, fixed system message, the dataset's answers as history: teacher
forcing) is ``bench.overflow.chats``; here a chat keeps its leading turns whose
``prompt ‖ answer`` plus one new token fit ``max_input_tokens`` (the model was trained on
1,024-token sequences), and only chats with at least ``min_turns`` such turns qualify.
"""

from __future__ import annotations

import random

from bench.common.conversations import iter_sharegpt_records
from bench.overflow.chats import Chat, ChatRenderer, sharegpt_pairs


def fitting_prefix(chat: Chat, max_input_tokens: int) -> Chat:
    """``chat`` cut before its first turn whose input + 1 new token exceeds ``max_input_tokens``."""
    first = chat.first_overflow(max_input_tokens)
    return chat if first is None else Chat(chat.chat_id, chat.system_tokens, chat.turns[:first])


def fitting_chats(renderer: ChatRenderer, num_chats: int, max_input_tokens: int = 1000, min_turns: int = 3,
                  max_turns: int = 6, max_message_chars: int = 1500, seed: int = 0,
                  scan_records: int = 6000) -> list[Chat]:
    """``num_chats`` chats (``random.Random(seed)`` sample of those qualifying among the first
    ``scan_records`` ShareGPT records, file order) with ``min_turns`` .. ``max_turns`` turns, every
    input within ``max_input_tokens`` tokens (1 new token included).

    Raises:
        ValueError: fewer than ``num_chats`` qualify.
    """
    eligible = []
    for n, record in enumerate(iter_sharegpt_records()):
        if n >= scan_records:
            break
        pairs = sharegpt_pairs(record, max_message_chars)[:max_turns]
        if len(pairs) < min_turns:
            continue
        chat = fitting_prefix(renderer.chat(f"sharegpt:{record.get('id', n)}", pairs), max_input_tokens)
        if len(chat.turns) >= min_turns:
            eligible.append(chat)
    if len(eligible) < num_chats:
        raise ValueError(f"only {len(eligible)} chats of the first {scan_records} ShareGPT records qualify")
    return random.Random(seed).sample(eligible, num_chats)
