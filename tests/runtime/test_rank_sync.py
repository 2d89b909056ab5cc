"""TP agreement on completions and votes: two real processes over a gloo group (as SGLang's CPU group)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import torch

from hiradix.runtime.rank_sync import ABORTED, FAILED, OK, RankSync, StepVotes

# Per rank: (ops finished here -> ok, ops whose deadline passed here, votes: rank 0's I/O client
# gave up, only rank 1's store wait is over)
LOCAL = {
    0: ({1: OK, 2: OK, 3: FAILED, 5: OK, 6: ABORTED, 7: FAILED}, {4}, StepVotes(io_gave_up=True)),
    1: ({1: OK, 2: FAILED, 4: OK, 5: OK, 6: OK, 7: ABORTED}, set(), StepVotes(store_retry_due=True)),
}
IN_FLIGHT = [1, 2, 3, 4, 5, 6, 7, 8]


def _rank_main(rank: int, init_file: str, out: "mp.Queue") -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sync = RankSync(torch.distributed.group.WORLD)
        local, expired, votes = LOCAL[rank]
        finished, late, agreed = sync.agree(IN_FLIGHT, local, expired, votes)
        # nothing in flight: one collective; the retry is agreed once every rank's wait is over
        idle = sync.agree([], {}, set(), StepVotes(store_retry_due=True))
        mismatch = None
        try:  # a rank with a different in-flight list must be detected, not hang
            sync.agree(IN_FLIGHT[: 8 - rank], {}, set())
        except RuntimeError as exc:
            mismatch = str(exc)
        out.put((rank, finished, late, agreed, idle, sync.calls, mismatch))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_apply_the_same_outcomes(tmp_path: Path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "init"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, *result = out.get(timeout=120)
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    # op 1: ok on both; 2: failed on rank 1 -> failed; 3: finished on rank 0 only -> not yet;
    # 4: finished on rank 1 only -> not yet (but rank 0's deadline passed -> expired everywhere);
    # 5: ok on both; 6: aborted on rank 0 -> aborted (the source stays); 7: a verification
    # failure wins over an abort; 8: nowhere.
    for rank in (0, 1):
        finished, late, agreed, idle, calls, mismatch = results[rank]
        assert finished == {1: OK, 2: FAILED, 5: OK, 6: ABORTED, 7: FAILED}
        assert late == {4}
        # any rank's gave-up switches NVMe off everywhere; rank 0's store wait is not over: no retry
        assert agreed == StepVotes(io_gave_up=True, store_retry_due=False)
        assert idle == ({}, set(), StepVotes(store_retry_due=True))
        assert calls == 4  # 2 for the agreement, 1 when idle, 1 for the refused mismatch: equal on every rank
        assert mismatch is not None and "disagree" in mismatch


def test_single_rank_is_the_identity_and_makes_no_call():
    sync = RankSync(None)
    votes = StepVotes(io_gave_up=True, store_retry_due=True)
    finished, late, agreed = sync.agree([1, 2, 3], {1: OK, 3: FAILED}, {2}, votes)
    assert finished == {1: OK, 3: FAILED} and late == {2} and agreed == votes and sync.calls == 0
