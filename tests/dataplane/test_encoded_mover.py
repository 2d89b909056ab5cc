"""EncodedHostMover on the CPU (DRAM as a cold tier, issue 21): real K/V buffers, a real encoded
DramPool, the real codec. A backup writes each page encoded (its header, the codec's size); a
promote decodes into the token slots, layer by layer, within the format's bound; an MLA pool too.
"""

from __future__ import annotations

import types
from functools import partial

import pytest
import torch

from hiradix.dataplane.encoded_mover import LOAD_PATH, EncodedHostMover
from hiradix.dataplane.kv_codec import HEADER_BYTES, PageCodec
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.layout import KVLayout
from hiradix.tiers.dram import DramPool
from tests.helpers import transfers

NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 3, 8, 2, 32
DEVICE_PAGES, DRAM_PAGES = 12, 6
ROWS = DEVICE_PAGES * PAGE_SIZE
page_slots = partial(transfers.page_slots, PAGE_SIZE)
backup_op = partial(transfers.backup_op, page_size=PAGE_SIZE)
promote_op = partial(transfers.promote_op, page_size=PAGE_SIZE)
BOUND = {"fp8": 0.07, "int4": 0.25}  # max |x - x'| / max |x| per page, loose bounds of each format


def make(tmp_path, layout: KVLayout, fmt: str, buffers: dict[str, list[torch.Tensor]]):
    codec = PageCodec(layout, fmt)
    pool = DramPool.create(layout, DRAM_PAGES, tmp_path / "dram", page_bytes=codec.encoded_bytes)
    kv = types.SimpleNamespace(**buffers)
    mover = EncodedHostMover(kv, pool, LayerwiseLoader(layout.num_layers, torch.device("cpu")), codec)
    return codec, pool, mover


def mha_buffers(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (ROWS, HEADS, HEAD_DIM)
    return {"k_buffer": [torch.randn(shape, generator=gen).bfloat16() for _ in range(NUM_LAYERS)],
            "v_buffer": [torch.randn(shape, generator=gen).bfloat16() for _ in range(NUM_LAYERS)]}


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_backup_encodes_and_promote_decodes_into_other_slots_within_the_format_bound(tmp_path, fmt):
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    buffers = mha_buffers()
    codec, pool, mover = make(tmp_path, layout, fmt, buffers)
    try:
        assert pool.encoded and pool.tensor.shape == (DRAM_PAGES, codec.encoded_bytes) and mover.load_path == LOAD_PATH
        assert codec.encoded_bytes < layout.page_bytes / 1.9
        mover.backup(backup_op(1, [page_slots(0, 1), page_slots(4)], [3, 0, 5]))
        assert mover.finished() == [1]  # CPU: copied at the reap
        for page in (3, 0, 5):
            assert bytes(pool.tensor[page, :HEADER_BYTES].tolist()) == bytes(codec.header.tolist())
        assert not pool.tensor[[1, 2, 4]].any()  # untouched pages
        # promote DRAM pages 5, 3 (device pages 4, 0) into device pages 8, 9
        dst = page_slots(8, 9)
        mover.promote(promote_op(2, [5, 3], dst))
        mover.start_loading()
        assert mover.finished() == []  # no layer asked for yet
        mover.loader.wait_until(NUM_LAYERS - 1)
        assert mover.finished() == [2]
        for name in ("k_buffer", "v_buffer"):
            for layer in range(NUM_LAYERS):
                buf = buffers[name][layer].float()
                for src, out in ((4, 8), (0, 9)):
                    x, y = buf[page_slots(src)], buf[page_slots(out)]
                    assert not torch.equal(x, y)  # lossy, but close
                    assert (x - y).abs().max() <= BOUND[fmt] * x.abs().max(), (name, layer, fmt)
    finally:
        pool.close()
        pool.unlink()


def test_a_rank_that_does_not_write_leaves_the_shared_pool_alone(tmp_path):
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    codec = PageCodec(layout, "fp8")
    pool = DramPool.create(layout, DRAM_PAGES, tmp_path / "dram", page_bytes=codec.encoded_bytes)
    kv = types.SimpleNamespace(**mha_buffers())
    mover = EncodedHostMover(kv, pool, LayerwiseLoader(NUM_LAYERS, torch.device("cpu")), codec, writes_dram=False)
    try:
        mover.backup(backup_op(1, [page_slots(0)], [2]))
        assert mover.flush() == [1] and not pool.tensor.any()
    finally:
        pool.close()
        pool.unlink()


def test_mla_latent_pages_round_trip(tmp_path):
    layout = KVLayout(2, PAGE_SIZE, 1, 72, torch.bfloat16, rope_dim=8)  # kv_lora_rank 64 + rope 8
    gen = torch.Generator().manual_seed(3)
    buffers = {"kv_buffer": [torch.randn((ROWS, 1, 72), generator=gen).bfloat16() for _ in range(2)]}
    codec, pool, mover = make(tmp_path, layout, "fp8", buffers)
    try:
        mover.backup(backup_op(1, [page_slots(2)], [1]))
        assert mover.flush() == [1]  # a page is promoted only once its backup landed (the ledger's rule)
        mover.promote(promote_op(2, [1], page_slots(7)))
        assert mover.flush() == [2]
        for layer in range(2):
            x, y = buffers["kv_buffer"][layer][page_slots(2)].float(), buffers["kv_buffer"][layer][page_slots(7)].float()
            assert (x - y).abs().max() <= BOUND["fp8"] * x.abs().max()
    finally:
        pool.close()
        pool.unlink()


def test_a_pool_of_another_page_size_is_refused(tmp_path):
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    pool = DramPool.create(layout, 2, tmp_path / "dram")  # exact pages
    try:
        with pytest.raises(ValueError, match="encoded DRAM pool"):
            EncodedHostMover(types.SimpleNamespace(**mha_buffers()), pool,
                             LayerwiseLoader(NUM_LAYERS, torch.device("cpu")), PageCodec(layout, "fp8"))
    finally:
        pool.close()
        pool.unlink()
