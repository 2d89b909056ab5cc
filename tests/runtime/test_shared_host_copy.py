"""One MLA host copy per node under TP: two real processes over a gloo group (as SGLang's CPU group)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import torch

from hiradix.core.outcomes import LOOKUP_FAILED, found_of, outcome_of
from hiradix.core.ports import OK
from hiradix.dataplane.layout import KVLayout
from hiradix.runtime.shared_host_copy import (ReplicaIOClient, ReplicaJournal, share_persisted_pages,
                                              shared_dram_pool, wants_shared_copy)

MLA = KVLayout(num_layers=2, page_size=4, num_kv_heads=1, head_dim=24, dtype=torch.bfloat16, rope_dim=8)
DENSE = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGES = 6


def _rank_main(rank: int, init_file: str, out: "mp.Queue", mode: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = torch.distributed.group.WORLD
    try:
        dense = wants_shared_copy(DENSE, group)  # no collective for a dense layout
        shared = wants_shared_copy(MLA, group, mode)
        if not shared:
            out.put((rank, dense, shared, None, None, None, None))
            return
        pool, mapped = shared_dram_pool(MLA, PAGES, rank, group)
        if rank == 0:  # the owner writes page 3; the replica sees it after the barrier
            pool.tensor[3].copy_(torch.arange(pool.tensor[3].numel(), dtype=torch.float32).view_as(pool.tensor[3]))
        torch.distributed.barrier(group)
        checksum = float(pool.tensor[3].float().sum())
        inode = os.stat(pool.path).st_ino
        pages = share_persisted_pages(["page-a", "page-b"] if rank == 0 else ["ignored"], rank, group)
        torch.distributed.barrier(group)  # the owner keeps its memfd open until the replica is done
        out.put((rank, dense, shared, mapped, checksum, inode, pages))
        pool.close()
    finally:
        torch.distributed.destroy_process_group()


def _two_ranks(tmp_path: Path, mode: str = "node") -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "init"), out, mode)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, *rest = out.get(timeout=120)
            results[rank] = rest
        return results
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_mla_ranks_map_one_pool_the_owner_writes(tmp_path: Path):
    results = _two_ranks(tmp_path)
    expected = float(sum(range(MLA.page_bytes // 2)))  # page 3 as written by rank 0 (192 values, bf16-exact)
    inodes = set()
    for rank in (0, 1):
        dense, shared, mapped, checksum, inode, pages = results[rank]
        assert dense is False and shared is True and mapped is True
        assert checksum == expected
        assert pages == ["page-a", "page-b"]  # the owner's re-indexed pages reach every rank
        inodes.add(inode)
    assert len(inodes) == 1  # one memory file for both ranks: one host copy


def test_per_rank_copies_when_asked(tmp_path: Path):
    results = _two_ranks(tmp_path, mode="rank")
    assert [results[r][1] for r in (0, 1)] == [False, False]  # no pool made, no collective waited for


def test_replica_client_completes_every_job_ok_so_the_owner_outcome_wins():
    client = ReplicaIOClient()
    client.submit_store(1, [0, 1], [5, 6])
    client.submit_load(2, [5], [0])
    client.submit_put(3, [0, 1, 2], ["a", "b", "c"])
    client.submit_get(4, ["a"], [7])
    client.submit_exists(5, ["a", "b", "c", "d"])
    done = {r.job_id: r for r in client.poll()}
    assert sorted(done) == [1, 2, 3, 4, 5] and client.poll() == []
    assert all(outcome_of(done[j]) == OK for j in (1, 2, 3, 4))
    # a lookup: "all 4 found" here, so MIN over ranks is the owner's leading run (2 + found), and
    # the owner's failed lookup (LOOKUP_FAILED) is every rank's
    assert found_of(done[5]) == 2 + 4 and min(found_of(done[5]), 2 + 1) == 3
    assert min(found_of(done[5]), LOOKUP_FAILED) == LOOKUP_FAILED
    assert client.check_alive() and not client.disabled


def test_replica_journal_keeps_landed_nodes_and_writes_nothing():
    journal = ReplicaJournal()
    journal.invalidate([1, 2])
    journal.stored("node", [1, 2])
    journal.sync()
    assert journal.landed == ["node"]
