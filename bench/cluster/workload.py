"""The skewed multi-turn workload of `bench.cluster.run` and the `ideal` it is measured against.

Skew (where placement matters): a few *hot* sessions (many turns, long messages: long histories
that a policy must keep together or move) among many *cold* ones (few turns, short messages).
Both are real ShareGPT conversations (`bench.common.conversations.load_sessions`; synthetic ones
when the dataset is missing), hot ones with `hot_turns` user turns of up to `hot_chars` characters
per message, cold ones with `cold_turns` of up to `cold_chars`; no conversation is used twice. The
order of the sessions (so their places in the Poisson arrival stream of `bench.ab.paired`) is a
seeded shuffle.

`ideal` (computed, not run): one infinite cache shared by every server. Per request: the longest
prefix its prompt (token ids from a server's `/v1/tokenize`, the chat template applied) shares with
any earlier request of the same repetition (prompt + generated ids), capped below its last token, in whole pages.
"""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Callable, Optional, Sequence

from bench.common.conversations import Session, load_sessions

PAGE_TOKENS = 16


def skewed_sessions(hot: int, hot_turns: int, hot_chars: int, cold: int, cold_turns: int, cold_chars: int,
                    seed: int, source: str = "auto", repeats: int = 1) -> list[list[Session]]:
    """Per repetition, `hot + cold` sessions (distinct across all repetitions) in a seeded random order
    (see the module docstring).

    Raises:
        ValueError: As `load_sessions`.
    """
    hot_all = load_sessions(hot * repeats, hot_turns, seed, hot_chars, source) if hot else []
    taken = {s.session_id for s in hot_all}
    cold_all = []
    if cold:  # ask for extra in case some are hot ones (a long conversation also has few turns)
        extra = load_sessions((cold + hot) * repeats, cold_turns, seed + 1, cold_chars, source)
        cold_all = [s for s in extra if s.session_id not in taken][: cold * repeats]
    out = []
    for r in range(repeats):
        sessions = hot_all[r * hot:(r + 1) * hot] + cold_all[r * cold:(r + 1) * cold]
        random.Random(f"order:{seed}:{r}").shuffle(sessions)
        out.append(sessions)
    return out


def tokenize_chat(base_url: str, model: str, messages: list[dict], timeout_s: float = 60.0) -> list[int]:
    """Token ids of a chat prompt as the server builds it (`POST /v1/tokenize` with `messages`)."""
    body = {"model": model, "messages": messages}
    req = urllib.request.Request(base_url + "/v1/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return [int(x) for x in json.loads(resp.read())["tokens"]]


def ideal_cached_tokens(prompts: dict, order: Sequence, page_tokens: int = PAGE_TOKENS,
                        outputs: Optional[dict] = None) -> dict:
    """Per request key, what one infinite cache shared by all servers would hit: the longest prefix
    shared with any earlier request in `order` (its prompt followed by its generated ids, `outputs[key]`,
    as a server caches a finished request), capped below the last token, in whole pages."""
    ideal, seen = {}, []
    for key in order:
        ids = prompts[key]
        best = 0
        for earlier in seen:
            n = 0
            for a, b in zip(ids, earlier):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        ideal[key] = min(best, len(ids) - 1) // page_tokens * page_tokens
        seen.append(list(ids) + list((outputs or {}).get(key) or []))
    return ideal


def check_fits(longest_prompt_tokens: int, max_total_tokens: int, max_tokens: int) -> None:
    """Refuse a workload whose longest prompt cannot run in the HBM pool at all (SGLang would keep
    it waiting forever).

    Raises:
        ValueError: naming `--max-total-tokens` and `--hot-chars` / `--hot-turns`.
    """
    need = longest_prompt_tokens + max_tokens + PAGE_TOKENS
    if need > max_total_tokens:
        raise ValueError(f"the longest prompt has ~{longest_prompt_tokens} tokens: with {max_tokens} new tokens and a "
                         f"page it needs {need} > --max-total-tokens {max_total_tokens}; raise the pool or lower "
                         "--hot-chars / --hot-turns")  # fmt: skip


def longest_prompt_bound(sessions: Sequence[Session], count_tokens: Optional[Callable[[str], int]] = None,
                         template_tokens_per_message: int = 16, answer_tokens: int = 16) -> int:
    """An upper estimate of the longest prompt in tokens, before any server is up: the dataset's user
    texts (`count_tokens`: the model's tokenizer, `bench.ab.systems.token_counter`; None: one token per
    UTF-8 byte) plus a template allowance per message and `answer_tokens` per earlier answer."""
    count = count_tokens or (lambda text: len(text.encode()))
    best = 0
    for s in sessions:
        users = [m["content"] for m in s.messages if m["role"] == "user"]
        n = sum(count(u) + template_tokens_per_message for u in users)
        best = max(best, n + (len(users) - 1) * (answer_tokens + template_tokens_per_message))
    return best
