"""The cost of one scheduler step's hiradix work, with a big tree and a long queue (issue 13, item 6).

Builds the server's own prefix cache (:class:`hiradix.core.prefix_cache.TieredPrefixCache`,
``lookahead``, page 16, DRAM and NVMe tiers over the data-less ports of
:mod:`hiradix.testing.sim_ports`) holding ``--cached-tokens`` tokens (conversations of
``--conversation-tokens`` each, in HBM and backed up in DRAM), queues ``--window`` requests of
``--request-tokens`` tokens (each extends one cached conversation), and times what the
scheduler hook does every step: ``observe_queue`` (the look-ahead window) + ``step`` (reap,
store, persist). Two ways of passing the queue:

* ``memo``: each request's :class:`hiradix.core.lookahead.QueuedKey` is built once and passed
  again every step (what the SGLang seam does: the key is cached on the request, and the last
  peek is revalidated in O(path nodes));
* ``rebuild``: ``(tokens, namespace)`` tuples every step (the previous behaviour: every queued
  token is matched again).

Prints the median and a 95% bootstrap interval of the per-step time over ``--steps`` steps
(after one warm-up step, which builds the peeks), and writes JSON. Target: <= 1 ms per step.

``--nodes 10000,100000`` (issue 31 item 2) times each part of hiradix's per-step and
per-admission work separately on trees of that many nodes (conversations of
``--conversation-tokens``), with the queue of ``--window`` requests: the look-ahead window, the
controller's step, the Prometheus update (``TierMetrics.update``), admission (``should_wait`` and
``match`` for every queued request, as SGLang's adder asks each step) and one HBM eviction of a
page (``evict``: the victims' heap over every HBM candidate).

    .venv/bin/python bench/micro/step_cost.py                 # 1M cached tokens, W = 64 x 32k tokens
    .venv/bin/python bench/micro/step_cost.py --nodes 10000,100000 --conversation-tokens 64 --request-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `hiradix` and `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hiradix.core.lookahead import QueuedKey  # noqa: E402
from hiradix.core.policy import make_policy  # noqa: E402
from hiradix.core.prefix_cache import TieredPrefixCache  # noqa: E402
from hiradix.core.tree import TieredRadixTree  # noqa: E402
from hiradix.testing.sim_ports import SimClock, SimDevicePool, simulated_controller  # noqa: E402

PAGE = 16


def build(cached_tokens: int, conversation_tokens: int, seed: int = 0) -> tuple[TieredPrefixCache, list[list[int]]]:
    """A cache holding ``cached_tokens`` tokens of distinct conversations; returns it and them."""
    clock = SimClock()
    tree = TieredRadixTree(PAGE, make_policy("lookahead"), clock=clock)
    pages = cached_tokens // PAGE
    tiers = simulated_controller(tree, dram_pages=pages + 1024, nvme_slots=4 * pages, page_bytes=1, write_through=True, clock=clock)
    device = SimDevicePool(cached_tokens + 64 * PAGE, PAGE)
    cache = TieredPrefixCache(tree, device, tiers)
    rng = random.Random(seed)
    conversations = []
    for c in range(cached_tokens // conversation_tokens):
        tokens = [c * 1_000_003 + rng.randrange(1 << 30) for _ in range(conversation_tokens)]
        slots = device.alloc(len(tokens))
        _, last = cache.checkpoint(tokens, None, slots, 0)
        conversations.append(tokens)
        if c % 64 == 63:
            cache.step()  # backups land
    cache.step()
    return cache, conversations


def queue(conversations: Sequence[list[int]], window: int, request_tokens: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(window):
        base = conversations[i % len(conversations)]
        out.append(base + [rng.randrange(1 << 30) for _ in range(request_tokens - len(base))])
    return out


def time_steps(cache: TieredPrefixCache, keys: list, steps: int, memo: bool) -> list[float]:
    """Per-step seconds of observe_queue + step, after one warm-up step."""
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        cache.observe_queue(keys if memo else [(k.tokens, None) for k in keys])
        cache.step()
        if i:
            times.append(time.perf_counter() - start)
    return times


def time_parts(cache: TieredPrefixCache, keys: list, steps: int) -> dict[str, list[float]]:
    """Per-step seconds of each part of hiradix's scheduler work (after one warm-up step)."""
    from prometheus_client import CollectorRegistry

    from hiradix.runtime.metrics import TierMetrics

    tiers, tree = cache.tiers, cache.tree
    metrics = TierMetrics({"model_name": "bench"}, PAGE, 1, (cache.device.capacity_tokens // PAGE, tiers.books.dram.capacity,
                          tiers.books.nvme.capacity, 0), registry=CollectorRegistry())  # fmt: skip
    parts: dict[str, Callable[[], object]] = {
        "lookahead": lambda: cache.observe_queue(keys),
        "step": cache.step,
        "metrics": lambda: metrics.update(tiers.stats, tiers.books, tree.tier_tokens, cache.last_view, store=tiers.store),
        "admission_should_wait": lambda: [cache.should_wait(k) for k in keys],
        "admission_match": lambda: [cache.match(k.tokens) for k in keys],
        "evict_one_page": lambda: cache.evict(PAGE),
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    for i in range(steps + 1):
        for name, part in parts.items():
            start = time.perf_counter()
            part()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def report_nodes(args: argparse.Namespace, nodes: int) -> dict:
    """Build a tree of ``nodes`` conversations and time each part of the per-step work."""
    cache, conversations = build(nodes * args.conversation_tokens, args.conversation_tokens)
    keys = [QueuedKey(tokens) for tokens in queue(conversations, args.window, args.request_tokens)]
    out = {"tree_nodes": sum(1 for _ in cache.tree.iter_nodes()), "window": args.window}
    for name, times in time_parts(cache, keys, args.steps).items():
        low, high = bootstrap_ci(times)
        out[name] = {"median_ms": 1000 * statistics.median(times), "ci95_ms": [1000 * low, 1000 * high]}
        print(f"{out['tree_nodes']:>7} nodes  {name:<22} {out[name]['median_ms']:9.3f} ms [{1000 * low:.3f}, "
              f"{1000 * high:.3f}]")
    return out


def bootstrap_ci(values: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cached-tokens", type=lambda s: int(float(s)), default=1 << 20)
    p.add_argument("--conversation-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--request-tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nodes", default="", help="comma-separated tree sizes: time each part of the per-step work")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default runs/step-cost-<time>.json)")
    args = p.parse_args(argv)
    if args.nodes:
        result = {"parts": {n: report_nodes(args, int(float(n))) for n in args.nodes.split(",")},
                  "conversation_tokens": args.conversation_tokens, "request_tokens": args.request_tokens,
                  "steps": args.steps}
        out = args.out or Path("runs") / time.strftime("step-cost-parts-%Y%m%d-%H%M%S.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        return 0
    t0 = time.perf_counter()
    cache, conversations = build(args.cached_tokens, args.conversation_tokens)
    built_s = time.perf_counter() - t0
    prompts = queue(conversations, args.window, args.request_tokens)
    result = {"cached_tokens": cache.tree.tier_tokens[0], "window": args.window, "request_tokens": args.request_tokens,
              "tree_nodes": sum(1 for _ in cache.tree.iter_nodes()), "build_s": built_s}
    for name, memo in (("memo", True), ("rebuild", False)):
        keys = [QueuedKey(tokens) for tokens in prompts]
        times = time_steps(cache, keys, args.steps if memo else max(5, args.steps // 10), memo)
        low, high = bootstrap_ci(times)
        result[name] = {"median_ms": 1000 * statistics.median(times), "ci95_ms": [1000 * low, 1000 * high],
                        "steps": len(times)}
        print(f"{name:<8} per step: {result[name]['median_ms']:.3f} ms [{1000 * low:.3f}, {1000 * high:.3f}] "
              f"over {len(times)} steps")
    print(f"tree: {result['cached_tokens']} tokens in HBM, {result['tree_nodes']} nodes; window {args.window} x "
          f"{args.request_tokens} tokens; target <= 1 ms per step: "
          f"{'met' if result['memo']['median_ms'] <= 1.0 else 'missed'}")
    out = args.out or Path("runs") / time.strftime("step-cost-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
