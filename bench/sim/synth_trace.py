"""A synthetic Mooncake-format conversation trace whose returns are predictable (for ``simulate.py``).

Conversations start as a Poisson process (``--rate`` per second) behind one shared system-prompt
block. A share ``--one-shot`` of them is a single short prompt (``--one-shot-blocks`` blocks) that
never comes back; the others are longer (``--blocks`` blocks) and come back ``--turns`` - 1 times,
each ``--think-s`` seconds (+- ``--jitter-s``, uniform) after the previous turn, adding
``--turn-blocks`` blocks each time. Block ids follow the trace's rule: equal ids = equal content,
an id stands for its whole prefix. Seeded: the same arguments write the same file.

    .venv/bin/python -m bench.sim.synth_trace --out runs/synth.jsonl
    .venv/bin/python bench/sim/simulate.py --trace runs/synth.jsonl --sweep
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from pathlib import Path
from typing import Optional, Sequence

BLOCK_TOKENS = 512


def generate(duration_s: float, rate: float, one_shot: float, blocks: int, one_shot_blocks: int, turns: int,
             turn_blocks: int, think_s: float, jitter_s: float, seed: int) -> list[dict]:
    """The trace's lines, sorted by timestamp (ms)."""
    rng = random.Random(seed)
    next_id = 1  # block 0 is the shared system prompt
    events: list[tuple[float, int, list[int], int]] = []  # (time s, seq, hash ids, turns left)
    seq = 0
    t = rng.expovariate(rate)
    while t < duration_s:
        single = rng.random() < one_shot
        n = one_shot_blocks if single else blocks
        ids = [0] + list(range(next_id, next_id + n))
        next_id += n
        heapq.heappush(events, (t, seq, ids, 0 if single else turns - 1))
        seq += 1
        t += rng.expovariate(rate)
    out = []
    while events:
        t, _, ids, left = heapq.heappop(events)
        out.append({"timestamp": int(1000 * t), "input_length": BLOCK_TOKENS * len(ids) - rng.randrange(1, BLOCK_TOKENS),
                    "output_length": rng.randrange(50, 500), "hash_ids": ids})
        if left > 0:
            grown = ids[:-1] + list(range(next_id, next_id + turn_blocks + 1))  # the last block was partial
            next_id += turn_blocks + 1
            back_s = t + think_s + rng.uniform(-jitter_s, jitter_s)
            heapq.heappush(events, (back_s, seq, grown, left - 1))
            seq += 1
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--duration-s", type=float, default=3600.0, help="conversations start within this time")
    p.add_argument("--rate", type=float, default=2.0, help="new conversations per second")
    p.add_argument("--one-shot", type=float, default=0.6, help="share of single short prompts that never return")
    p.add_argument("--blocks", type=int, default=16, help="blocks of a returning conversation's first turn")
    p.add_argument("--one-shot-blocks", type=int, default=4, help="blocks of a one-shot prompt")
    p.add_argument("--turns", type=int, default=4, help="turns of a returning conversation")
    p.add_argument("--turn-blocks", type=int, default=2, help="blocks each later turn adds")
    p.add_argument("--think-s", type=float, default=60.0, help="time between a conversation's turns")
    p.add_argument("--jitter-s", type=float, default=5.0, help="+- uniform jitter of the think time")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rows = generate(a.duration_s, a.rate, a.one_shot, a.blocks, a.one_shot_blocks, a.turns, a.turn_blocks,
                    a.think_s, a.jitter_s, a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} requests to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
