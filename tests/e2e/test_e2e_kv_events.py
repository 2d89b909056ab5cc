"""End to end: KV events of every tier through SGLang's own publisher (issue 34, item 1).

A server (tiny model, HBM 2,048 tokens, DRAM 0.006 GB, an NVMe tier, page size 16) runs with
``--kv-events-config`` (SGLang's ZMQ publisher, a replay endpoint, a send high-water mark of 2
batches per subscriber). Two ZMQ SUB sockets in the test subscribe before it starts: a consumer
that reads all the time, and a slow one that reads nothing while 8 sessions x 3 turns push the
histories HBM -> DRAM -> NVMe and back. Each consumer decodes the batches with SGLang's own
msgspec types and replays them in sequence order; a gap (a batch the publisher dropped for a
subscriber whose queue was full) is filled from SGLang's replay endpoint, as a consumer built for
SGLang does. Once no transfer is in flight, each consumer's view holds, per medium, exactly as
many pages as the tree holds tokens in that tier (``sglang:hiradix_tier_used_tokens``: GPU =
HBM, CPU_PINNED = DRAM, DISK = NVMe; EXTERNAL empty without a store), the GPU pages are closed
under their parents (HBM is), and no event stores a page the view holds or removes one it lacks.
The scheduler is not held up by the slow subscriber: requests while it reads nothing take about
as long as after it caught up.

The server is stopped (its NVMe writes land) and started again on the same NVMe directory and
the same endpoints, its events bounded to 100 page changes per step (fewer than it re-indexes):
its first batch clears the view and then lists the re-indexed NVMe pages as stored on DISK (the
overflow's re-sync), the same page hashes the first server published there. After
``/flush_cache`` the view is empty.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from hiradix.sglang_plugin.kv_events import MAX_PENDING_PAGES_ENV
from hiradix.testing.server import pick_free_port
from tests.helpers.e2e import chat, flush_tiers, metric, run_sessions, settle_transfers, start

pytestmark = pytest.mark.e2e

PS = 16
SESSIONS, TURNS, WORDS = 12, 4, 25
MEDIA = {"GPU": "HBM", "CPU_PINNED": "DRAM", "DISK": "NVMe", "EXTERNAL": "store"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Consumer:
    """A KV-event consumer as one built for SGLang works: SUB to the publisher, batches by sequence
    number, gaps filled from the replay endpoint; ``view()`` replays them (per medium, the hashes)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, slow: bool = False):
        self.ctx, self.replay_endpoint = ctx, replay
        self.sub = ctx.socket(zmq.SUB)
        if slow:  # queue as little as possible on this side: the publisher's own bound decides
            self.sub.setsockopt(zmq.RCVHWM, 1)
            self.sub.setsockopt(zmq.RCVBUF, 4096)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: dict[int, KVEventBatch] = {}
        self.replayed = 0  # batches filled from the replay endpoint
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def drain(self, timeout_ms: int = 0) -> None:
        """Read what arrived."""
        while self.sub.poll(timeout_ms):
            _topic, seq, payload = self.sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
            timeout_ms = 0

    def fill_gaps(self, tries: int = 5) -> None:
        """Ask the replay endpoint for the batches from the first one missing (or the next one:
        a dropped tail leaves no gap) on, until none before the last is missing."""
        for _ in range(tries):
            last = max(self.batches, default=-1)
            start = next((s for s in range(last + 1) if s not in self.batches), last + 1)
            self._replay_from(start)
            if all(s in self.batches for s in range(max(self.batches, default=-1) + 1)):
                return
        raise AssertionError("the replay endpoint lacks batches")

    def _replay_from(self, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(10_000):
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                s = int.from_bytes(seq, "big")
                if s not in self.batches:
                    self.batches[s] = self.decoder.decode(payload)
                    self.replayed += 1
        finally:
            dealer.close(linger=0)

    def view(self) -> dict[str, dict[int, BlockStored]]:
        """Per medium, each page's hash -> the BlockStored that brought it (parent links)."""
        self.drain()
        self.fill_gaps()
        view: dict[str, dict[int, tuple]] = {m: {} for m in MEDIA}
        for seq in sorted(self.batches):
            for e in self.batches[seq].events:
                if isinstance(e, AllBlocksCleared):
                    for pages in view.values():
                        pages.clear()
                elif isinstance(e, BlockRemoved):
                    pages = view[e.medium]
                    assert all(h in pages for h in e.block_hashes), f"seq {seq}: {e.medium} removes a page it lacks"
                    for h in e.block_hashes:
                        del pages[h]
                else:
                    pages = view[e.medium]
                    assert not any(h in pages for h in e.block_hashes), f"seq {seq}: {e.medium} stores a page twice"
                    assert e.block_size == PS and len(e.token_ids) == PS * len(e.block_hashes)
                    parent = e.parent_block_hash
                    for h in e.block_hashes:
                        pages[h] = parent
                        parent = h
        return view

    def close(self) -> None:
        self.sub.close(linger=0)


def keep_reading(consumer: Consumer, stop: threading.Event) -> None:
    while not stop.is_set():
        consumer.drain(100)


def tier_tokens(base_url: str) -> dict[str, int]:
    return {m: int(metric(base_url, "sglang:hiradix_tier_used_tokens", tier=t)) for m, t in MEDIA.items()}


def matches(consumer: Consumer, base_url: str, timeout_s: float = 30.0) -> dict:
    """The consumer's view once its page counts equal the tiers' gauges (the idle scheduler
    publishes and updates the gauges about once a second); asserts they do within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        view, tokens = consumer.view(), tier_tokens(base_url)
        counts = {m: len(pages) * PS for m, pages in view.items()}
        if counts == tokens or time.monotonic() > deadline:
            assert counts == tokens, f"events say {counts}, the tiers hold {tokens}"
            return view
        time.sleep(0.5)


def ping_s(base_url: str, n: int = 5) -> float:
    """Median seconds of ``n`` one-token requests."""
    return statistics.median(chat(base_url, [{"role": "user", "content": f"ping {i}"}], max_tokens=1)["latency_s"]
                             for i in range(n))


def flags(nvme_dir: Path, port: int, replay_port: int) -> list[str]:
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
              "hwm": 2}
    return ["--max-running-requests", "2", "--page-size", str(PS), "--enable-hiradix",
            "--hiradix-dram-gb", "0.006", "--hiradix-write-policy", "write_back",
            "--hiradix-nvme-path", str(nvme_dir), "--hiradix-nvme-gb", "0.2",
            "--kv-events-config", json.dumps(config)]  # fmt: skip


def test_events_of_every_tier_replay_to_the_tiers_through_churn_a_slow_subscriber_a_restart_and_a_flush(
        tiny_model: Path, tmp_path: Path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    port, replay_port = pick_free_port(), pick_free_port()
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    ctx = zmq.Context()
    consumers: list[Consumer] = []
    stop = threading.Event()
    try:
        fast, slow = Consumer(ctx, endpoint, replay), Consumer(ctx, endpoint, replay, slow=True)
        consumers += [fast, slow]
        with start(tiny_model, tmp_path / "s1.log", 2048, flags(nvme_dir, port, replay_port)) as s1:
            reader = threading.Thread(target=keep_reading, args=(fast, stop), daemon=True)
            reader.start()
            stalled_s = ping_s(s1.base_url)  # the slow subscriber reads nothing until it catches up below
            results = run_sessions(s1.base_url, SESSIONS, TURNS, WORDS, parallel=2)
            stalled_s = max(stalled_s, ping_s(s1.base_url))
            settle_transfers(s1.base_url)
            stop.set()
            reader.join()
            served_from = {t: sum(r["details"].get(t, 0) or 0 for s in results for r in s[1:]) for t in ("host", "storage")}
            assert served_from["host"] > 0 and served_from["storage"] > 0, served_from  # DRAM and NVMe hits
            view = matches(fast, s1.base_url)
            assert view["CPU_PINNED"] and view["DISK"] and not view["EXTERNAL"], {m: len(p) for m, p in view.items()}
            gpu = view["GPU"]
            assert all(parent is None or parent in gpu for parent in gpu.values())  # HBM is prefix-closed
            assert matches(slow, s1.base_url) == view  # the slow one, caught up (replay fills its gaps)
            caught_up_s = ping_s(s1.base_url)
            assert stalled_s < 3 * caught_up_s + 0.5, (stalled_s, caught_up_s)  # not held up by it
            on_disk = set(view["DISK"])
        print(f"batches: fast {len(fast.batches)} ({fast.replayed} replayed), slow {len(slow.batches)} "
              f"({slow.replayed} replayed); pages per medium {({m: len(p) for m, p in view.items()})}")

        restarted = Consumer(ctx, endpoint, replay)
        consumers.append(restarted)
        bound = {MAX_PENDING_PAGES_ENV: "100"}  # fewer than the pages re-indexed: the overflow's re-sync
        with start(tiny_model, tmp_path / "s2.log", 2048, flags(nvme_dir, port, replay_port), env=bound) as s2:
            restored = metric(s2.base_url, "sglang:hiradix_nvme_restored_pages")
            view = matches(restarted, s2.base_url)
            first = restarted.batches[0].events
            assert isinstance(first[0], AllBlocksCleared)
            assert {e.medium for e in first[1:]} == {"DISK"}
            assert restored > 100 and set(view["DISK"]) == on_disk and len(on_disk) == restored
            assert "hiradix: KV events: over 100 page changes in one step" in s2.log_text()
            flush_tiers(s2.base_url)
            view = matches(restarted, s2.base_url)
            assert not any(view.values())
            assert isinstance(restarted.batches[max(restarted.batches)].events[-1], AllBlocksCleared)
    finally:
        stop.set()
        for c in consumers:
            c.close()
        ctx.term()
