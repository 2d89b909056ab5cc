"""DeferredBackups on its own: order, the limit, and what it forgets (pure bookkeeping)."""

from __future__ import annotations

from hiradix.core.deferred_backups import DeferredBackups
from hiradix.core.node import Tier
from hiradix.core.tree import TieredRadixTree
from tests.helpers.core import FakeClock, SlotPool


def hbm_nodes(count: int):
    """``count`` sibling nodes of 2 tokens each, in HBM only."""
    tree, pool = TieredRadixTree(1, clock=FakeClock()), SlotPool(64)
    nodes = []
    for i in range(count):
        _, node, _ = tree.insert([100 + i, 1], pool.alloc(2))
        nodes.append(node)
    return tree, nodes


def test_opens_oldest_first_until_one_finds_no_room():
    _, nodes = hbm_nodes(4)
    owed = DeferredBackups()
    owed.defer(nodes[:2])
    owed.defer(nodes[1:])  # a node deferred again keeps its place
    room = [2]
    opened = []

    def open_backup(batch):
        if room[0] == 0:
            return False
        room[0] -= 1
        opened.extend(batch)
        return True

    assert owed.retry(open_backup) == 2 and opened == nodes[:2] and len(owed) == 2
    room[0] = 5
    assert owed.retry(open_backup) == 2 and opened == nodes and len(owed) == 0
    assert (owed.deferred_nodes, owed.opened_nodes) == (4, 4)


def test_forgets_what_needs_no_backup_and_waits_for_a_node_in_transfer():
    tree, nodes = hbm_nodes(3)
    owed = DeferredBackups()
    owed.defer(nodes)
    tree.attach(nodes[0], Tier.DRAM, [7, 8])  # written back at eviction meanwhile
    nodes[1].ops.add(99)  # a transfer of it is in flight
    opened = []
    assert owed.retry(lambda batch: opened.extend(batch) or True) == 1
    assert opened == [nodes[2]] and len(owed) == 1  # nodes[0] forgotten, nodes[1] still owed
    nodes[1].ops.clear()
    assert owed.retry(lambda batch: opened.extend(batch) or True) == 1 and len(owed) == 0


def test_remembers_at_most_its_limit_oldest_forgotten():
    _, nodes = hbm_nodes(5)
    owed = DeferredBackups(limit=3)
    owed.defer(nodes)
    opened = []
    owed.retry(lambda batch: opened.extend(batch) or True)
    assert opened == nodes[2:]
