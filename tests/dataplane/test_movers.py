"""HostMover on the CPU with real K/V buffers and a real DramPool: when bytes move, byte-exact.

Transfers are built by hand as the ledger builds them (``tests/helpers/transfers.py``): a BACKUP
has one slot tensor per node in ``hbm_parts``; a PROMOTE has the one allocated slot tensor.
K/V hold random bit patterns (NaNs included), so comparisons are on int16 views.
"""

from __future__ import annotations

import types
from functools import partial

import pytest
import torch

from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.layout import KVLayout
from hiradix.dataplane.movers import HostMover
from hiradix.tiers.dram import DramPool
from tests.helpers import transfers

NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 24
DEVICE_PAGES, DRAM_PAGES = 12, 6
ROWS = DEVICE_PAGES * PAGE_SIZE
page_slots = partial(transfers.page_slots, PAGE_SIZE)
backup_op = partial(transfers.backup_op, page_size=PAGE_SIZE)
promote_op = partial(transfers.promote_op, page_size=PAGE_SIZE)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def random_bits(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


@pytest.fixture(params=[True, False], ids=["page_major", "layer_major"])
def layout(request) -> KVLayout:
    return KVLayout(NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM, torch.bfloat16, page_major=request.param)


@pytest.fixture
def pool(tmp_path, layout):
    pool = DramPool.create(layout, DRAM_PAGES, tmp_path / "dram")
    yield pool
    pool.close()
    pool.unlink()


@pytest.fixture
def kv():
    gen = torch.Generator().manual_seed(1)
    shape = (ROWS, HEADS, HEAD_DIM)
    return types.SimpleNamespace(
        k_buffer=[random_bits(shape, gen) for _ in range(NUM_LAYERS)],
        v_buffer=[random_bits(shape, gen) for _ in range(NUM_LAYERS)],
    )


@pytest.fixture
def mover(kv, pool) -> HostMover:
    return HostMover(kv, pool, LayerwiseLoader(NUM_LAYERS, torch.device("cpu")))


def block(pool: DramPool, page: int, layer: int) -> torch.Tensor:
    """``[2, ps, H, D]`` of one DRAM page of one layer (K then V)."""
    return pool.tensor[page, layer] if pool.layout.page_major else pool.tensor[layer, page]


def assert_dram_holds(pool, kv, dram_pages, slots) -> None:
    for i, page in enumerate(dram_pages):
        rows = slots[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        for layer in range(NUM_LAYERS):
            assert torch.equal(bits(block(pool, page, layer)[0]), bits(kv.k_buffer[layer][rows])), (page, layer)
            assert torch.equal(bits(block(pool, page, layer)[1]), bits(kv.v_buffer[layer][rows])), (page, layer)


def fill_dram(pool: DramPool, seed: int) -> torch.Tensor:
    """Random bits in every DRAM page; returns a copy to compare against."""
    pool.tensor.copy_(random_bits(pool.tensor.shape, torch.Generator().manual_seed(seed)))
    return pool.tensor.clone()


def zero(kv) -> None:
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf.zero_()


def test_backup_copies_at_finished_byte_exact(mover, pool, kv):
    parts = [page_slots(5, 2), page_slots(9)]  # two nodes, three pages
    pages = [3, 0, 5]
    mover.backup(backup_op(11, parts, pages))
    assert not bits(pool.tensor).any()  # CPU: queued, nothing copied yet
    assert mover.finished() == [11]
    assert_dram_holds(pool, kv, pages, torch.cat(parts))
    for page in (1, 2, 4):  # pages not named stay untouched
        for layer in range(NUM_LAYERS):
            assert not bits(block(pool, page, layer)).any(), (page, layer)


def test_backup_reported_and_copied_once(mover, pool, kv):
    slots = page_slots(7)
    mover.backup(backup_op(3, [slots], [4]))
    assert mover.finished() == [3]
    snapshot = pool.tensor.clone()
    for buf in kv.k_buffer:
        buf.fill_(1.0)  # a second copy would carry these into DRAM
    assert mover.finished() == []
    assert mover.flush() == []
    assert torch.equal(bits(pool.tensor), bits(snapshot))


def test_flush_lands_backups(mover, pool, kv):
    slots = page_slots(1, 10)
    mover.backup(backup_op(4, [slots], [2, 1]))
    assert mover.flush() == [4]
    assert_dram_holds(pool, kv, [2, 1], slots)
    assert mover.finished() == []


def test_promote_is_copied_layer_by_layer(mover, pool, kv):
    expected = fill_dram(pool, seed=2)
    zero(kv)
    slots = page_slots(8, 3)
    pages = [4, 1]
    mover.promote(promote_op(21, pages, slots))
    assert not any(bits(b).any() for b in (*kv.k_buffer, *kv.v_buffer))  # only queued
    assert mover.start_loading() == 0
    assert not any(bits(b).any() for b in (*kv.k_buffer, *kv.v_buffer))  # CPU: lazy until wait_until
    mover.loader.wait_until(0)
    for i, page in enumerate(pages):
        rows = slots[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        src = expected[page, 0] if pool.layout.page_major else expected[0, page]
        assert torch.equal(bits(kv.k_buffer[0][rows]), bits(src[0]))
        assert torch.equal(bits(kv.v_buffer[0][rows]), bits(src[1]))
    for layer in (1, 2):
        assert not bits(kv.k_buffer[layer]).any() and not bits(kv.v_buffer[layer]).any(), layer
    assert mover.finished() == []  # layers 1 and 2 have not landed
    mover.loader.wait_until(1)
    assert bits(kv.k_buffer[1][slots]).any() and not bits(kv.k_buffer[2]).any()
    assert mover.flush() == [21]
    assert mover.flush() == []
    assert_dram_holds(pool, kv, pages, slots)  # device slots now equal the DRAM pages, all layers
    others = torch.ones(ROWS, dtype=torch.bool)
    others[slots] = False
    for layer in range(NUM_LAYERS):
        assert not bits(kv.k_buffer[layer][others]).any() and not bits(kv.v_buffer[layer][others]).any()
    assert torch.equal(bits(pool.tensor), bits(expected))  # a promotion never writes DRAM


def test_flush_starts_unstarted_promotions(mover, pool, kv):
    fill_dram(pool, seed=3)
    zero(kv)
    slots = page_slots(6)
    mover.promote(promote_op(5, [2], slots))
    assert mover.flush() == [5]  # never started by start_loading: flush starts it
    assert_dram_holds(pool, kv, [2], slots)


def test_flush_reports_backups_then_promotions(mover, pool, kv):
    fill_dram(pool, seed=4)
    backup_slots = page_slots(0, 11)
    mover.backup(backup_op(9, [backup_slots[:PAGE_SIZE], backup_slots[PAGE_SIZE:]], [5, 3]))
    mover.promote(promote_op(8, [1], page_slots(4)))
    mover.start_loading()
    assert mover.flush() == [9, 8]
    assert_dram_holds(pool, kv, [5, 3], backup_slots)
    assert_dram_holds(pool, kv, [1], page_slots(4))
    assert mover.finished() == [] and mover.flush() == []


def test_drop_pending_forgets_copies(mover, pool, kv):
    expected_dram = fill_dram(pool, seed=5)
    device = [b.clone() for b in (*kv.k_buffer, *kv.v_buffer)]
    mover.backup(backup_op(1, [page_slots(2)], [0]))
    mover.promote(promote_op(2, [3], page_slots(9)))  # started, no layer landed
    mover.start_loading()
    mover.promote(promote_op(3, [4], page_slots(10)))  # queued, not started
    mover.drop_pending()
    assert mover.finished() == []
    assert mover.flush() == []
    assert mover.start_loading() == -1
    assert torch.equal(bits(pool.tensor), bits(expected_dram))  # no backup ran
    for now, before in zip((*kv.k_buffer, *kv.v_buffer), device):
        assert torch.equal(bits(now), bits(before))  # no promotion ran

