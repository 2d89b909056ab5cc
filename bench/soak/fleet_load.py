"""The fleet soak's load: skewed multi-turn chat through SGLang's router, every turn checked
against a stock SGLang server.

Skew: `hot_slots` client slots replay long sessions (`hot_turns` user turns each, a new one when
one ends) and `short_slots` slots replay many short ones (`short_turns`). Each turn is sent twice
at once, with the same messages: to the router (which picks a hiradix server) and to the stock
server (the reference, not behind the router). Greedy (temperature 0), so the router's answer must
equal the stock answer: the text, the number of generated tokens and the token ids
(`sglext.output_ids`) when both report them. The history of the next turn carries the stock
answers, so both systems always receive the same prompts.

Failures and what is allowed (counted in `FleetLoadStats`):
    * a routed request that fails (an HTTP status other than 200, a connection error, a stream
      error chunk or a stream without its usage chunk: `RequestRecord.error`) is sent again,
      once, with the same messages. The failure is *allowed* only if the request was in flight
      while a `RetryWindow` was open (a server restart: from its stop until the router lists it
      healthy again plus a grace period); otherwise it is a violation even when the retry
      answers. A retry that fails too is a violation (an unanswered turn) and ends the session.
    * a stock request that fails is a violation (the reference is never disturbed).
    * an answer that differs from the stock answer is a violation (`mismatches`).

`FleetLoad.drain()` pauses the load between turns (no new turn starts) and returns once no
request is in flight; `resume()` lets it go on; `stop` ends it (each slot finishes its turn).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from bench.common.conversations import Session
from bench.common.multiturn import RequestRecord, WorkloadConfig, send_chat_request
from bench.soak.fleet_ttft import TtftSample
from bench.soak.run import LoadStats, SessionFeed

MODEL = "default"  # --served-model-name of every server; the router picks workers by it
MAX_SAMPLES = 10  # error and mismatch examples kept


@dataclass(frozen=True)
class SkewedLoad:
    """The workload's shape (tokens and characters as named)."""

    hot_slots: int = 2  # slots replaying long, hot sessions
    hot_turns: int = 16  # user turns of a hot session
    short_slots: int = 6  # slots replaying short sessions
    short_turns: int = 2  # user turns of a short session
    max_tokens: int = 8  # generated tokens per turn
    max_message_chars: int = 200  # each user message cut to this
    source: str = "synthetic"
    seed: int = 0

    def validate(self) -> None:
        """Raises: ValueError: a count below 1 (names the option)."""
        if min(self.hot_slots + self.short_slots, self.hot_turns, self.short_turns, self.max_tokens,
               self.max_message_chars) < 1:  # fmt: skip
            raise ValueError("--hot-slots + --short-slots, --hot-turns, --short-turns, --max-tokens and "
                             "--max-message-chars must be >= 1")  # fmt: skip


class RetryWindow:
    """Intervals (monotonic seconds) during which a failed routed request is allowed."""

    def __init__(self) -> None:
        self.intervals: list[list[float]] = []  # [opened, closed]; closed = inf while open

    def open(self) -> None:
        self.intervals.append([time.monotonic(), float("inf")])

    def close(self) -> None:
        if self.intervals and self.intervals[-1][1] == float("inf"):
            self.intervals[-1][1] = time.monotonic()

    def overlaps(self, start: float, end: float) -> bool:
        """Whether `[start, end]` (monotonic seconds) meets an open interval."""
        return any(start <= closed and opened <= end for opened, closed in self.intervals)


@dataclass
class FleetLoadStats:
    """Counts of the fleet soak's turns (see the module docstring)."""

    routed: LoadStats = field(default_factory=LoadStats)  # answered routed requests (tokens, hits by tier)
    turns: int = 0  # turns whose routed answer arrived (first try or retry)
    first_try_failures: int = 0
    allowed_failures: int = 0  # first-try failures inside a retry window
    failures_outside_window: int = 0  # first-try failures outside (violations)
    retries_answered: int = 0
    unanswered: int = 0  # the retry failed too (violations)
    stock_failures: int = 0  # violations
    mismatches: int = 0  # violations
    compared_token_ids: int = 0  # turns whose token ids were compared too
    hot_sessions: int = 0
    short_sessions: int = 0
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[str] = field(default_factory=list)

    def note_error(self, text: str) -> None:
        if len(self.error_samples) < MAX_SAMPLES:
            self.error_samples.append(text)

    def violations(self) -> list[str]:
        """The load's violations, one line per kind."""
        found = []
        if self.turns == 0:
            found.append("no turn was answered")
        if self.failures_outside_window:
            found.append(f"{self.failures_outside_window} routed requests failed outside a restart window")
        if self.unanswered:
            found.append(f"{self.unanswered} turns unanswered after one retry")
        if self.stock_failures:
            found.append(f"{self.stock_failures} requests to the stock reference failed")
        if self.mismatches:
            found.append(f"{self.mismatches} routed answers differ from stock: {self.mismatch_samples[:3]}")
        if found and self.error_samples:
            found.append(f"error samples: {self.error_samples[:5]}")
        return found


def same_answer(routed: RequestRecord, stock: RequestRecord) -> bool:
    """Text and generated-token count equal, and token ids when both report them."""
    if routed.output_text != stock.output_text or routed.completion_tokens != stock.completion_tokens:
        return False
    if routed.output_token_ids is not None and stock.output_token_ids is not None:
        return routed.output_token_ids == stock.output_token_ids
    return True


class FleetLoad:
    """The slots of a `SkewedLoad` against `router_url`, checked against `stock_url`."""

    def __init__(self, router_url: str, stock_url: str, load: SkewedLoad, window: RetryWindow):
        self.router_url, self.stock_url, self.load, self.window = router_url, stock_url, load, window
        self.workload = WorkloadConfig(max_tokens=load.max_tokens, model=MODEL, system="fleet", progress=False)
        self.stats = FleetLoadStats()
        self.hot_feed = SessionFeed(load.hot_turns, load.max_message_chars, load.source, load.seed)
        self.short_feed = SessionFeed(load.short_turns, load.max_message_chars, load.source, load.seed + 100_000)
        self.stop = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._inflight = 0
        self._idle = asyncio.Condition()
        self.ttft: list[TtftSample] = []  # every answered turn (bench.soak.fleet_ttft)

    async def run(self, http: aiohttp.ClientSession) -> None:
        """Until `stop`: every slot replays sessions turn by turn."""
        hot = [self._slot(http, i, self.hot_feed) for i in range(self.load.hot_slots)]
        short = [self._slot(http, self.load.hot_slots + i, self.short_feed) for i in range(self.load.short_slots)]
        await asyncio.gather(*hot, *short)

    async def drain(self) -> None:
        """Start no new turn; return once none is in flight."""
        self._gate.clear()
        async with self._idle:
            await self._idle.wait_for(lambda: self._inflight == 0)

    def resume(self) -> None:
        self._gate.set()

    async def _slot(self, http: aiohttp.ClientSession, index: int, feed: SessionFeed) -> None:
        while not self.stop.is_set():
            session = feed.next()
            if feed is self.hot_feed:
                self.stats.hot_sessions += 1
            else:
                self.stats.short_sessions += 1
            answers: list[str] = []
            for turn in range(session.num_turns):
                await self._gate.wait()
                if self.stop.is_set():
                    return
                self._inflight += 1
                try:
                    answer = await self._turn(http, session, index, turn, answers)
                finally:
                    async with self._idle:
                        self._inflight -= 1
                        self._idle.notify_all()
                if answer is None:
                    break  # a violation was counted; the next session starts
                answers.append(answer)

    async def _send(self, http: aiohttp.ClientSession, url: str, messages: list[dict], label: str, session: Session,
                    index: int, turn: int) -> RequestRecord:  # fmt: skip
        record = RequestRecord(label, session.session_id, index, turn)
        record.start_s = time.monotonic()
        return await send_chat_request(http, url, messages, MODEL, self.workload, record)

    async def _turn(self, http: aiohttp.ClientSession, session: Session, index: int, turn: int,
                    answers: list[str]) -> str | None:  # fmt: skip
        """One turn to both systems; the stock answer (the next turn's history), None on a violation."""
        messages = session.prompt_messages(turn, answers)
        s = self.stats
        stock, routed = await asyncio.gather(
            self._send(http, self.stock_url, messages, "stock", session, index, turn),
            self._send(http, self.router_url, messages, "router", session, index, turn),
        )
        if not routed.ok:
            s.first_try_failures += 1
            allowed = self.window.overlaps(routed.start_s, routed.start_s + (routed.latency_s or 0.0))
            s.allowed_failures += allowed
            s.failures_outside_window += not allowed
            s.note_error(f"{session.session_id} turn {turn} ({'allowed' if allowed else 'NOT allowed'}): {routed.error}")
            routed = await self._send(http, self.router_url, messages, "router-retry", session, index, turn)
            if not routed.ok:
                s.unanswered += 1
                s.note_error(f"{session.session_id} turn {turn} retry: {routed.error}")
                return None
            s.retries_answered += 1
        s.turns += 1
        s.routed.add(routed)
        self.ttft.append(TtftSample(routed.start_s, routed.ttft_s, stock.ttft_s if stock.ok else None))
        if not stock.ok:
            s.stock_failures += 1
            s.note_error(f"{session.session_id} turn {turn} stock: {stock.error}")
            return None
        s.compared_token_ids += routed.output_token_ids is not None and stock.output_token_ids is not None
        if not same_answer(routed, stock):
            s.mismatches += 1
            if len(s.mismatch_samples) < MAX_SAMPLES:
                s.mismatch_samples.append(f"{session.session_id} turn {turn}: router {routed.output_text!r} "
                                          f"({routed.output_token_ids}) vs stock {stock.output_text!r} "
                                          f"({stock.output_token_ids})")  # fmt: skip
        return stock.output_text
