"""The paired scheduler of `bench.ab.run`: every request goes to every system, back to back.

Design (issue 13, "an equivalent design that gives every system the same machine conditions"):
all systems' servers are up at once (`--sleep-on-idle`: an idle one does not spin a core). The
workload advances in *rounds*. A round is a batch of up to `concurrency` ready requests (the
next turn of that many sessions); the batch is sent to one system (its requests concurrently:
the same concurrency for every system), and when that system has answered all of them, the
same batch goes to the next system, and so on. Systems are never served at the same time: on
this 2-core machine concurrent systems would steal each other's cores. The order of the
systems changes every round (`rotation`: a Williams design and its mirror), so over
`2 * len(systems)` rounds each system takes each position twice, follows each other system
equally often, and each pair of systems meets in both orders at the same distances: a slowdown
tied to a position (the first after a pause, the last after the others warmed a cache) or left
behind by the system before lands on all systems, and on both sides of every pair, alike.

Sessions arrive as a seeded Poisson process (`session_rate_per_s`; None: all at the start) on
the wall clock; after a round, each of its sessions is ready again after a think time drawn
from an exponential of mean `think_time_s` (seeded per session and turn). A ready session
waits for the round in progress to end. Arrivals and think times are thus the same for every
system of a repetition, as are the batches: request (repeat, session, turn) is paired across
systems.

History: with `own_answers` (the default of `bench.ab.run`) each system's session history carries
that system's own previous answers (what a chat client sends back), else the dataset's.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import aiohttp

from bench.common.conversations import Session
from bench.common.multiturn import (RequestRecord, WorkloadConfig, arrival_times_s, fetch_model_id, http_connector,
                                    send_chat_request)


@dataclass
class PairedRecord(RequestRecord):
    """A `RequestRecord` with its place in the paired schedule."""

    repeat: int = 0  # repetition (fresh servers)
    round_index: int = -1  # the round it was sent in
    position: int = -1  # its system's place in that round's order (0 = first)


@dataclass(frozen=True)
class PairedConfig:
    """How a repetition is driven (see the module docstring)."""

    workload: WorkloadConfig  # max_tokens, ignore_eos, timeouts, session_rate_per_s, think_time_s, seed
    concurrency: int = 4  # requests per round (sessions in flight per system)
    own_answers: bool = True  # history carries the model's own answers
    repeat: int = 0


@dataclass
class _SessionState:
    next_turn: int = 0
    ready_at_s: float = 0.0
    answers: dict = field(default_factory=dict)  # system -> [answer text per turn]


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order of the systems in round `round_index`: row `round_index` (cyclic) of a Williams
    design on `names` and its mirror image (`2 * len(names)` rows).

    Over `2 * len(names)` rounds every system takes every position twice, follows every other
    system equally often (so work a system leaves running, such as write-backs, lands after every
    system alike), and for every pair of systems A, B each offset `position(B) - position(A)`
    occurs as often as its negative. A plain rotation balances positions but keeps each pair's
    offset and each system's predecessor fixed: with a position effect (here the first system
    after a pause was ~1.7x slower than the fourth) that biased every pair's ratio, the A/A
    pair's included (two identical ideal servers caching the very same tokens: 1.03x [1.02, 1.04]).
    """
    n = len(names)
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference once (Williams 1949)
    for i in range(1, n):
        if i % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    row = round_index % (2 * n)
    order = [names[(x + row % n) % n] for x in first]
    return order[::-1] if row >= n else order


def think_time_s(mean_s: float, seed: int, session_index: int, turn_index: int) -> float:
    """Seeded exponential think time of mean `mean_s` before turn `turn_index` (0 if mean is 0)."""
    if mean_s <= 0:
        return 0.0
    return random.Random(f"{seed}:{session_index}:{turn_index}").expovariate(1.0 / mean_s)


def next_batch(states: Sequence[_SessionState], sessions: Sequence[Session], now_s: float,
               concurrency: int) -> list[int]:
    """Sessions of the next round: ready (`ready_at_s <= now_s`), unfinished, earliest first."""
    ready = [i for i, st in enumerate(states) if st.next_turn < sessions[i].num_turns and st.ready_at_s <= now_s]
    ready.sort(key=lambda i: (states[i].ready_at_s, i))
    return ready[: max(1, concurrency)]


async def _send(http: aiohttp.ClientSession, url: str, model: str, system: str, session: Session,
                session_index: int, state: _SessionState, config: PairedConfig, round_index: int,
                position: int, t_start: float) -> PairedRecord:
    turn = state.next_turn
    answers = state.answers.setdefault(system, [])
    record = PairedRecord(system, session.session_id, session_index, turn, repeat=config.repeat,
                          round_index=round_index, position=position)
    record.start_s = time.perf_counter() - t_start
    messages = session.prompt_messages(turn, answers if config.own_answers else None)
    await send_chat_request(http, url, messages, model, config.workload, record)
    answers.append(record.output_text)
    return record


async def run_paired(urls: dict[str, str], sessions: Sequence[Session], config: PairedConfig,
                     progress: Optional[Callable[[int, int], None]] = None) -> list[PairedRecord]:
    """Drive one repetition: every request to every system (`urls`: system name -> base URL,
    in the order of round 0). Returns all records, in send order; errors are in the records.
    `progress(round_index, requests_done_per_system)` is called after each round."""
    names = list(urls)
    wl = config.workload
    timeout = aiohttp.ClientTimeout(total=wl.request_timeout_s)
    arrivals = arrival_times_s(len(sessions), wl.session_rate_per_s, wl.seed + config.repeat)
    states = [_SessionState(ready_at_s=a) for a in arrivals]
    records: list[PairedRecord] = []
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=http_connector(config.concurrency + 2)) as http:
        models = {n: wl.model or await fetch_model_id(http, urls[n]) for n in names}
        t_start = time.perf_counter()
        round_index = 0
        while any(st.next_turn < s.num_turns for st, s in zip(states, sessions)):
            now = time.perf_counter() - t_start
            batch = next_batch(states, sessions, now, config.concurrency)
            if not batch:
                pending = [st.ready_at_s for st, s in zip(states, sessions) if st.next_turn < s.num_turns]
                await asyncio.sleep(max(0.0, min(pending) - now))
                continue
            for position, name in enumerate(rotation(names, round_index)):
                records += await asyncio.gather(*[
                    _send(http, urls[name], models[name], name, sessions[i], i, states[i], config, round_index,
                          position, t_start) for i in batch])  # fmt: skip
            end = time.perf_counter() - t_start
            for i in batch:
                states[i].next_turn += 1
                states[i].ready_at_s = end + think_time_s(wl.think_time_s, wl.seed, i, states[i].next_turn)
            if progress is not None:
                progress(round_index, sum(st.next_turn for st in states))
            round_index += 1
    return records
