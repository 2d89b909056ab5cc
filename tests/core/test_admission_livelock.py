"""Two queued requests whose histories are on NVMe (each fits DRAM, both do not) must not hold
each other at admission forever. Each admission read makes room by dropping DRAM copies NVMe also
holds, which is what the other request's landed read is, so their reads drop each other's copies
in turn and keep restarting, each with a fresh deadline. Without a bound on a request's whole wait
(``ReadWaits.request_pending``) neither was admitted in 60 s of simulated time.

The loop is SGLang's admission per scheduler step, on the simulated server (NVMe reads 0.5 s per
page, load timeout TIMEOUT_S): ``step``, then per queued request in order ``match`` (starts its
reads), ``should_wait`` with the request's own :class:`QueuedKey` (as the plugin passes it), and
admission when it does not wait.
"""

from __future__ import annotations

import itertools

from hiradix.core.ledger import Kind
from hiradix.core.lookahead import QueuedKey
from hiradix.core.node import Tier
from tests.helpers.sim_server import TIMEOUT_S, SimServer

STEP_S = 0.5


def build(dram_pages: int, turns: dict[str, list[int]], warm: tuple[str, ...]):
    """Histories of ``turns`` (pages per turn, one node each) on NVMe only; the nodes in ``warm``
    (``"a1"``: A's first turn) read back into DRAM. Returns the server, each history's tokens
    and the time reached."""
    s = SimServer(dram_pages=dram_pages, nvme_slots=64, hbm_tokens=256)
    tokens, t = {}, 0.0
    for tag, (name, pages) in enumerate(turns.items(), start=1):
        tokens[name], t = s.history_on_nvme(tag, pages, t)
    nodes = {f"{name.lower()}{k + 1}": node for name, history in tokens.items()
             for k, node in enumerate(s.tree.match(history, split=False, touch=False).nodes)}  # fmt: skip
    assert all(node.tiers() == [Tier.NVME] for node in nodes.values())
    s.tiers.prefetch([nodes[w] for w in warm], TIMEOUT_S, ahead=True)
    t += 10.0
    s.at(t)
    return s, tokens, t


def test_two_requests_whose_reads_drop_each_others_copies_are_admitted_within_the_timeout():
    # DRAM 4 pages; A = a1 (2 pages, already back in DRAM) + a2 (1 page); B = b1 (2 pages)
    s, tokens, t0 = build(4, {"A": [2, 1], "B": [2]}, warm=("a1",))
    keys = {name: QueuedKey(history) for name, history in tokens.items()}
    queue, held_s, admitted_at, reads = ["A", "B"], {"A": 0.0, "B": 0.0}, {}, set()
    for i in itertools.count():
        t = t0 + i * STEP_S
        if not queue or t > t0 + 60.0:
            break
        s.at(t)
        for name in list(queue):
            s.cache.match(tokens[name])
            reads |= {op.op_id for op in s.tiers.books.in_flight(Kind.PREFETCH)}
            if s.cache.should_wait(keys[name]):
                held_s[name] += STEP_S
                continue
            s.serve(tokens[name])
            admitted_at[name] = t - t0
            queue.remove(name)
    assert queue == [], (held_s, admitted_at, len(reads))  # before the bound: neither, 35 reads each
    assert max(held_s.values()) <= TIMEOUT_S + STEP_S, held_s
    assert len(reads) > 2  # the reads did restart: the scenario is the one that looped
    s.check()
