"""Replay multi-turn chat sessions against an OpenAI-compatible server and time every turn.

Each request is a streaming `POST /v1/chat/completions` (`stream=True`,
`stream_options={"include_usage": true}`, `temperature=0`, small `max_tokens`). Turn `t`
of a session is sent only after turn `t-1` finished; sessions run concurrently up to
`max_concurrent_sessions`, optionally arriving as a seeded Poisson process and pausing
`think_time_s` between turns.

Per request (`RequestRecord`): TTFT (to the first non-empty content delta), time per
output token, prompt/completion tokens, `cached_tokens`
(`usage.prompt_tokens_details.cached_tokens`, needs SGLang's `--enable-cache-report`) and,
when the server reports it, the per-tier split.

Where SGLang 0.5.23 reports cached tokens in a streaming chat response:
    * `usage.prompt_tokens_details.cached_tokens` in the final usage chunk (`choices: []`),
      only with `--enable-cache-report` (else `prompt_tokens_details` is null);
    * the per-tier split only when the request sets `"return_cached_tokens_details": true`:
      a separate chunk before the usage chunk, `{"choices": [], "sglext":
      {"cached_tokens_details": {"device": D, "host": H}}}` (plus `"storage"` and
      `"storage_backend"` with an L3 storage backend). The chunk is absent when nothing
      was cached. The generated token ids come in the same chunk as `sglext.output_ids`
      (`[[ids of choice 0]]`) when the request sets `"return_output_ids_in_sglext": true`.
`parse_cached_tokens_details` also accepts the split under `usage` or
`usage.prompt_tokens_details`, for other versions.

Library:
    records = run_workload("http://127.0.0.1:33001", sessions, max_tokens=16)
CLI:
    python -m bench.common.multiturn --base-url http://127.0.0.1:33001 --sessions 8 --turns 4 --out runs/x
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import aiohttp
from tqdm.auto import tqdm

if __package__ in (None, ""):  # run as a file: python bench/common/multiturn.py
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.conversations import Session, load_sessions

logger = logging.getLogger(__name__)

# How long the client keeps an idle connection for reuse, seconds: well under the server's keep-alive
# (SGLang's uvicorn closes idle connections after SGLANG_TIMEOUT_KEEP_ALIVE, 5 s). aiohttp's default
# (15 s) reused connections the server was closing at that very moment: a request sent on one fails
# with "Connection reset by peer" (a paired run's system idles while the others run; a fresh clone's
# scripts/demo lost one request so, and exited 1).
CLIENT_KEEPALIVE_S = 1.0


def http_connector(limit: int) -> aiohttp.TCPConnector:
    """The benchmarks' connection pool: `limit` connections, none reused after CLIENT_KEEPALIVE_S idle."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S)


@dataclass
class RequestRecord:
    """One chat-completion request of a session (times in seconds, sizes in tokens)."""

    system: str  # label of the system under test ("" if not set)
    session_id: str
    session_index: int  # position of the session in the workload
    turn_index: int  # 0-based
    start_s: float = 0.0  # send time, relative to the workload start
    ttft_s: float | None = None  # send -> first non-empty content delta
    first_chunk_s: float | None = None  # send -> first chunk with a choice (SGLang: first token)
    latency_s: float | None = None  # send -> end of stream
    tpot_s: float | None = None  # (latency - ttft) / (completion_tokens - 1)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    cached_device_tokens: int | None = None  # per-tier split, when reported
    cached_host_tokens: int | None = None
    cached_storage_tokens: int | None = None
    cached_storage_backend: str | None = None  # where storage hits came from, e.g. "nvme=32,mooncake=240"
    finish_reason: str | None = None
    output_text: str = ""
    output_token_ids: list[int] | None = None  # sglext.output_ids, when reported
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True if the request finished without error."""
        return self.error is None


@dataclass(frozen=True)
class WorkloadConfig:
    """How to replay sessions (see `run_workload`)."""

    max_tokens: int = 16  # generated tokens per turn
    max_concurrent_sessions: int = 4  # sessions in flight at once
    think_time_s: float = 0.0  # pause between a turn's end and the next turn
    session_rate_per_s: float | None = None  # Poisson session arrivals; None: all at t=0
    seed: int = 0  # seeds the arrival times
    ignore_eos: bool = False  # SGLang extension: always generate max_tokens
    request_timeout_s: float = 600.0
    model: str | None = None  # None: the first id of GET /v1/models
    system: str = ""  # label copied into each record
    sglang_extensions: bool = True  # ask for cached_tokens_details and output ids
    progress: bool = True  # tqdm bar
    extra_body: dict = field(default_factory=dict)  # merged into every request body


def parse_cached_tokens_details(obj: Any) -> dict[str, int] | None:
    """Find a `{device, host[, storage]}` cached-token split in a response chunk.

    Looks (in order) at `sglext.cached_tokens_details`, `usage.cached_tokens_details`,
    `usage.prompt_tokens_details.cached_tokens_details` and a top-level
    `cached_tokens_details`. Missing tiers are left out; values are ints (tokens).

    Args:
        obj: A decoded JSON chunk (any type; non-dicts give None).

    Returns:
        e.g. `{"device": 120, "host": 0}`, or None if the chunk has no split.
    """
    for details in _details_candidates(obj):
        split = {k: int(details[k]) for k in ("device", "host", "storage") if isinstance(details.get(k), (int, float))}
        if split:
            return split
    return None


def parse_storage_backend(obj: Any) -> str | None:
    """The `storage_backend` label next to a cached-token split (same places as
    `parse_cached_tokens_details`): SGLang HiCache names its L3 backend (`"MooncakeStore"`),
    hiradix gives tokens per source (`"nvme=32,mooncake=240"`). None if absent."""
    for details in _details_candidates(obj):
        if isinstance(details.get("storage_backend"), str) and details["storage_backend"]:
            return details["storage_backend"]
    return None


def _details_candidates(obj: Any) -> list[dict]:
    if not isinstance(obj, dict):
        return []
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    prompt_details = usage.get("prompt_tokens_details")
    candidates = [
        (obj.get("sglext") or {}).get("cached_tokens_details") if isinstance(obj.get("sglext"), dict) else None,
        usage.get("cached_tokens_details"),
        prompt_details.get("cached_tokens_details") if isinstance(prompt_details, dict) else None,
        obj.get("cached_tokens_details"),
    ]
    return [d for d in candidates if isinstance(d, dict)]


def _apply_chunk(record: RequestRecord, chunk: dict, elapsed_s: float, text_parts: list[str]) -> None:
    """Fold one SSE chunk into the record (timing, text, usage, sglext)."""
    for choice in chunk.get("choices") or []:
        if record.first_chunk_s is None:
            record.first_chunk_s = elapsed_s
        content = (choice.get("delta") or {}).get("content")
        if content:
            if record.ttft_s is None:
                record.ttft_s = elapsed_s
            text_parts.append(content)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
        prompt_details = usage.get("prompt_tokens_details")
        if isinstance(prompt_details, dict) and prompt_details.get("cached_tokens") is not None:
            record.cached_tokens = int(prompt_details["cached_tokens"])
    split = parse_cached_tokens_details(chunk)
    if split is not None:
        record.cached_device_tokens = split.get("device")
        record.cached_host_tokens = split.get("host")
        record.cached_storage_tokens = split.get("storage")
        record.cached_storage_backend = parse_storage_backend(chunk)
    sglext = chunk.get("sglext")
    if isinstance(sglext, dict) and isinstance(sglext.get("output_ids"), list) and sglext["output_ids"]:
        first = sglext["output_ids"][0]
        record.output_token_ids = [int(t) for t in first] if isinstance(first, list) else None
    if chunk.get("error") is not None or chunk.get("object") == "error":
        record.error = f"stream error: {json.dumps(chunk)[:500]}"


def _request_body(messages: list[dict], model: str, config: WorkloadConfig) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "max_tokens": config.max_tokens,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.sglang_extensions:
        body["return_cached_tokens_details"] = True
        body["return_output_ids_in_sglext"] = True
    body.update(config.extra_body)
    return body


async def send_chat_request(
    http: aiohttp.ClientSession, base_url: str, messages: list[dict], model: str,
    config: WorkloadConfig, record: RequestRecord,
) -> RequestRecord:
    """Send one streaming chat request and fill `record` in place (errors go to `record.error`).

    Returns:
        The same `record`, with timings (seconds), token counts and text filled in.
    """
    body = _request_body(messages, model, config)
    text_parts: list[str] = []
    t0 = time.perf_counter()
    try:
        async with http.post(base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return record
            async for raw_line in resp.content:
                line = raw_line.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, "event:" lines, comments
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                _apply_chunk(record, json.loads(payload), time.perf_counter() - t0, text_parts)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency_s = time.perf_counter() - t0
    record.output_text = "".join(text_parts)
    if record.ttft_s is None and record.error is None:
        record.ttft_s = record.first_chunk_s if record.first_chunk_s is not None else record.latency_s
    if record.completion_tokens and record.completion_tokens > 1 and record.ttft_s is not None:
        record.tpot_s = (record.latency_s - record.ttft_s) / (record.completion_tokens - 1)
    if record.error is None and record.prompt_tokens is None:
        record.error = "no usage chunk in the stream"
    return record


async def _run_session(
    http: aiohttp.ClientSession, base_url: str, session: Session, session_index: int, model: str,
    config: WorkloadConfig, t_start: float, slots: asyncio.Semaphore, arrival_s: float, bar: tqdm | None,
) -> list[RequestRecord]:
    await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - t_start)))
    records = []
    async with slots:
        for turn_index in range(session.num_turns):
            if turn_index > 0 and config.think_time_s > 0:
                await asyncio.sleep(config.think_time_s)
            record = RequestRecord(config.system, session.session_id, session_index, turn_index)
            record.start_s = time.perf_counter() - t_start
            await send_chat_request(http, base_url, session.prompt_messages(turn_index), model, config, record)
            if record.error:
                logger.warning("%s turn %d failed: %s", session.session_id, turn_index, record.error)
            records.append(record)
            if bar is not None:
                bar.update(1)
    return records


def arrival_times_s(num_sessions: int, session_rate_per_s: float | None, seed: int) -> list[float]:
    """Session arrival offsets in seconds: all 0, or a seeded Poisson process of that rate.

    Raises:
        ValueError: If the rate is not positive.
    """
    if session_rate_per_s is None:
        return [0.0] * num_sessions
    if session_rate_per_s <= 0:
        raise ValueError(f"session_rate_per_s must be > 0, got {session_rate_per_s}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_sessions):
        times.append(t)
        t += rng.expovariate(session_rate_per_s)
    return times


async def fetch_model_id(http: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id listed by `GET /v1/models`.

    Raises:
        RuntimeError: If the server lists no model.
    """
    async with http.get(base_url + "/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


async def run_workload_async(base_url: str, sessions: Sequence[Session], config: WorkloadConfig) -> list[RequestRecord]:
    """Async form of `run_workload`; records sorted by (session_index, turn_index)."""
    base_url = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = http_connector(max(1, config.max_concurrent_sessions) + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model = config.model or await fetch_model_id(http, base_url)
        slots = asyncio.Semaphore(max(1, config.max_concurrent_sessions))
        arrivals_s = arrival_times_s(len(sessions), config.session_rate_per_s, config.seed)
        total = sum(s.num_turns for s in sessions)
        bar = tqdm(total=total, desc=config.system or "requests", unit="req") if config.progress else None
        t_start = time.perf_counter()
        try:
            per_session = await asyncio.gather(*[
                _run_session(http, base_url, s, i, model, config, t_start, slots, arrivals_s[i], bar)
                for i, s in enumerate(sessions)
            ])  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
    return [r for records in per_session for r in records]


def run_workload(base_url: str, sessions: Sequence[Session], config: WorkloadConfig | None = None,
                 **overrides: Any) -> list[RequestRecord]:
    """Replay `sessions` against `base_url` and return one record per request.

    Args:
        base_url: e.g. `http://127.0.0.1:33001` (no `/v1`).
        sessions: From `bench.common.conversations.load_sessions`.
        config: Replay settings; keyword `overrides` replace its fields
            (e.g. `max_tokens=8, system="stock"`).

    Returns:
        Records sorted by (session_index, turn_index); failed requests have `error` set.

    Raises:
        aiohttp.ClientError: If `/v1/models` cannot be read (when `model` is None).
        TypeError: On an unknown override.
    """
    config = dataclasses.replace(config or WorkloadConfig(), **overrides)
    return asyncio.run(run_workload_async(base_url, sessions, config))


CSV_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]


def write_records(records: Iterable[RequestRecord], json_path: str | Path | None = None,
                  csv_path: str | Path | None = None) -> None:
    """Write records as a JSON list and/or a CSV (token id lists as JSON strings).

    The CSV columns are the fields of the records' dataclass (`RequestRecord` or a subclass).
    """
    rows = [dataclasses.asdict(r) for r in records]
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if csv_path is not None:
        Path(csv_path).parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else CSV_FIELDS)
            writer.writeheader()
            for row in rows:
                if row["output_token_ids"] is not None:
                    row["output_token_ids"] = json.dumps(row["output_token_ids"])
                writer.writerow(row)


def read_records(json_path: str | Path, record_type: type = RequestRecord) -> list:
    """Load records written by `write_records` (JSON) as `record_type` (a `RequestRecord` subclass)."""
    return [record_type(**row) for row in json.loads(Path(json_path).read_text())]


def summarize(records: Sequence[RequestRecord]) -> str:
    """A short text summary: per turn index, mean TTFT (ms), mean prompt and cached tokens."""
    lines = [f"{'turn':>4} {'n':>3} {'ttft_ms':>9} {'prompt_tok':>10} {'cached_tok':>10} {'errors':>6}"]
    for turn in sorted({r.turn_index for r in records}):
        rows = [r for r in records if r.turn_index == turn]
        ok = [r for r in rows if r.ok]
        lines.append(f"{turn:>4} {len(rows):>3} {_mean([r.ttft_s for r in ok], 1e3):>9.1f} "
                     f"{_mean([r.prompt_tokens for r in ok]):>10.1f} "
                     f"{_mean([r.cached_tokens for r in ok]):>10.1f} {len(rows) - len(ok):>6}")
    return "\n".join(lines)


def _mean(values: Iterable[float | None], scale: float = 1.0) -> float:
    vals = [v for v in values if v is not None]
    return scale * sum(vals) / len(vals) if vals else float("nan")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Add the workload options shared by this CLI and `bench/ab/run.py`."""
    parser.add_argument("--sessions", type=int, default=8, help="number of sessions")
    parser.add_argument("--turns", type=int, default=4, help="user turns per session")
    parser.add_argument("--seed", type=int, default=0, help="conversation selection and arrival seed")
    parser.add_argument("--max-message-chars", type=int, default=600, help="cut each message to this")
    parser.add_argument("--source", default="auto", choices=["auto", "sharegpt", "synthetic"])
    parser.add_argument("--max-tokens", type=int, default=16, help="generated tokens per turn")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    parser.add_argument("--think-time-s", type=float, default=0.0, help="pause between turns")
    parser.add_argument("--session-rate", type=float, default=None,
                        help="Poisson session arrivals per second (default: all at once)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")


def workload_config_from_args(args: argparse.Namespace, **overrides: Any) -> WorkloadConfig:
    """Build a `WorkloadConfig` from `add_workload_args` options."""
    return dataclasses.replace(
        WorkloadConfig(max_tokens=args.max_tokens, max_concurrent_sessions=args.concurrency,
                       think_time_s=args.think_time_s, session_rate_per_s=args.session_rate,
                       seed=args.seed, ignore_eos=args.ignore_eos),
        **overrides,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Replay multi-turn chat sessions against a server.")
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:33001")
    parser.add_argument("--out", default=None, help="directory for records.json and records.csv")
    parser.add_argument("--label", default="", help="system label stored in each record")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sessions = load_sessions(args.sessions, args.turns, args.seed, args.max_message_chars, args.source)
    records = run_workload(args.base_url, sessions, workload_config_from_args(args, system=args.label))
    print(summarize(records))
    if args.out:
        write_records(records, Path(args.out) / "records.json", Path(args.out) / "records.csv")
        print(f"wrote {args.out}/records.json and records.csv")
    if any(not r.ok for r in records):
        raise SystemExit(f"{sum(not r.ok for r in records)} request(s) failed")


if __name__ == "__main__":
    main()
