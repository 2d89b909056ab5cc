"""The open-loop driver of `bench.ab --open-loop RATE`: requests arrive while others run.

`bench.ab`'s paired rounds are closed-loop: a batch goes to one system, which has nothing else to
do while it loads a history from DRAM or NVMe. Real traffic is open-loop: a turn arrives when its
user sends it, while other turns prefill and decode. Here:

* arrivals are a seeded Poisson process of `rate_per_s` requests per second (the same arrival
  times for every system of a repetition);
* at each arrival the session that has waited longest for its next turn (its previous answer
  is back; sessions start ready, in order) sends that turn; if none is ready, or
  `max_in_flight` requests are in flight, the arrival waits for the first that frees (so the
  rate is an offered load, and its client-side wait is recorded: `OpenLoopRecord.arrival_s`);
* each system runs alone on its own server (`bench.ab.run` runs them one after another, in
  mirrored orders over the repetitions), with its own answers in its histories.

Request (repeat, session, turn) is the same prompt on every system (up to the system's own
earlier answers), so ratios can still be paired per request; the load around it differs with the
system's own speed, which is the point of an open-loop run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import aiohttp

from bench.ab.paired import PairedRecord
from bench.ab.servers import figures_since, snapshot, warm_up
from bench.ab.systems import System
from bench.common.conversations import Session
from bench.common.multiturn import WorkloadConfig, arrival_times_s, fetch_model_id, http_connector, send_chat_request
from hiradix.testing.server import ServerProcess

logger = logging.getLogger("bench.ab.open_loop")


@dataclass
class OpenLoopRecord(PairedRecord):
    """A request of an open-loop run; `round_index` is its arrival's index, `start_s` when it was
    sent (seconds since the run's start)."""

    arrival_s: float = 0.0  # its arrival time; start_s - arrival_s is the wait for a free slot or a ready session


@dataclass(frozen=True)
class OpenLoopConfig:
    """How one system's open-loop run is driven (see the module docstring)."""

    workload: WorkloadConfig  # max_tokens, ignore_eos, timeouts, seed
    rate_per_s: float  # Poisson request arrivals per second
    max_in_flight: int = 4  # requests in flight at once
    own_answers: bool = True  # histories carry the model's own answers
    repeat: int = 0


class _Slots:
    """Which session sends the next turn: ready sessions in the order they became ready, at most
    `max_in_flight` requests in flight."""

    def __init__(self, sessions: Sequence[Session], max_in_flight: int):
        self.ready: deque[int] = deque(i for i, s in enumerate(sessions) if s.num_turns > 0)
        self.next_turn = [0] * len(sessions)
        self.in_flight = 0
        self.max_in_flight = max(1, max_in_flight)
        self.changed = asyncio.Condition()

    async def take(self) -> int:
        """Wait for a ready session and a free slot; returns the session."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.ready and self.in_flight < self.max_in_flight)
            self.in_flight += 1
            return self.ready.popleft()

    async def give_back(self, session_index: int, turns: int) -> None:
        """Its request finished: the slot frees, and the session is ready again if turns remain."""
        async with self.changed:
            self.in_flight -= 1
            self.next_turn[session_index] += 1
            if self.next_turn[session_index] < turns:
                self.ready.append(session_index)
            self.changed.notify_all()


async def run_open_loop(url: str, system: str, sessions: Sequence[Session], config: OpenLoopConfig,
                        progress: Optional[Callable[[int], None]] = None) -> list[OpenLoopRecord]:
    """Drive one system's open-loop run; returns its records in arrival order (errors are in the
    records). `progress(requests_done)` is called after each request.

    Raises:
        ValueError: If the rate is not positive.
    """
    wl = config.workload
    total = sum(s.num_turns for s in sessions)
    arrivals = arrival_times_s(total, config.rate_per_s, wl.seed + config.repeat)
    slots = _Slots(sessions, config.max_in_flight)
    answers: list[list[str]] = [[] for _ in sessions]
    records: list[OpenLoopRecord] = []
    timeout = aiohttp.ClientTimeout(total=wl.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=http_connector(slots.max_in_flight + 2)) as http:
        model = wl.model or await fetch_model_id(http, url)
        t_start = time.perf_counter()

        async def send(k: int, i: int) -> None:
            turn = slots.next_turn[i]
            record = OpenLoopRecord(system, sessions[i].session_id, i, turn, repeat=config.repeat, round_index=k,
                                    position=0, arrival_s=arrivals[k])
            records.append(record)
            record.start_s = time.perf_counter() - t_start
            messages = sessions[i].prompt_messages(turn, answers[i] if config.own_answers else None)
            await send_chat_request(http, url, messages, model, wl, record)
            answers[i].append(record.output_text)
            await slots.give_back(i, sessions[i].num_turns)
            if progress is not None:
                progress(sum(slots.next_turn))

        tasks = []
        for k, arrival_s in enumerate(arrivals):
            # asyncio's timers may fire up to the loop's clock resolution early: never send before the arrival
            while (now_s := time.perf_counter() - t_start) < arrival_s:
                await asyncio.sleep(arrival_s - now_s)
            i = await slots.take()
            tasks.append(asyncio.create_task(send(k, i)))
        await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.round_index)


def mirrored_order(names: Sequence[str], repeat: int) -> list[str]:
    """The systems' order in repetition `repeat`: as given, then reversed (ABBA over two)."""
    return list(names) if repeat % 2 == 0 else list(names)[::-1]


def run_open_repeat(servers: dict[str, ServerProcess], systems: Sequence[System], repeat: int,
                    sessions: Sequence[Session], config: OpenLoopConfig) -> tuple[list[OpenLoopRecord], dict]:
    """One repetition: each system alone on its server, one after another in mirrored order, on
    the same sessions; returns the records and, per system, `{startup_s, workload_s, metrics, cpu}`
    (deltas over its own run)."""
    records: list[OpenLoopRecord] = []
    info = {}
    for name in mirrored_order([s.name for s in systems], repeat):
        server = servers[name]
        warm_up(server.base_url, config.workload, config.max_in_flight)
        before = snapshot(server)
        t0 = time.perf_counter()
        total = sum(s.num_turns for s in sessions)

        def progress(done: int) -> None:
            if done % 8 == 0 or done == total:
                logger.info("repeat %d [%s]: %d/%d requests done (%.0f s)", repeat, name, done, total,
                            time.perf_counter() - t0)

        records += asyncio.run(run_open_loop(server.base_url, name, sessions,
                                             dataclasses.replace(config, repeat=repeat), progress))
        info[name] = figures_since(server, before, time.perf_counter() - t0)
    return records, info
