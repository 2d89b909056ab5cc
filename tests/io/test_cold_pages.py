"""Compressed pages in the cold tiers (issue 21): the I/O worker encodes on the way down and
decodes on the way up (hiradix.io.cold_pages); a page of another format is a miss, never misread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hiradix.dataplane.kv_codec import PageCodec
from hiradix.io.client import IOWorkerClient
from hiradix.io.cold_pages import ColdPages
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import NvmeStore
from tests.helpers.io import LAYOUT, NUM_DRAM_PAGES, NUM_NVME_SLOTS, WAIT_S, fill, wait_for


def make_worker(base_dir, pool, fmt: str, monkeypatch) -> IOWorkerClient:
    """A worker whose NVMe tier holds ``fmt`` pages (its slot file sized for them)."""
    from hiradix.io.protocol import WorkerSpec

    codec = PageCodec(LAYOUT, fmt)
    nvme = base_dir / f"nvme-{fmt}"
    NvmeStore.create(nvme, codec.encoded_bytes, NUM_NVME_SLOTS, backend="posix", threads=2, keep=True).close()
    spec = WorkerSpec(
        dram_path=str(pool.path), layout=LAYOUT.to_json(), num_dram_pages=NUM_DRAM_PAGES, nvme_dir=str(nvme),
        num_nvme_slots=NUM_NVME_SLOTS, page_bytes=LAYOUT.page_bytes, io_backend="posix",
        socket_dir=str(base_dir / f"sock-{fmt}"), threads=2, parent_pid=os.getpid(),
        cold_format=fmt, cold_tiers=("nvme",),
    )
    monkeypatch.setenv("HIRADIX_FAULTS", "")
    client = IOWorkerClient(spec, ready_timeout_s=WAIT_S)
    client.start()
    return client


def pages_of(pool: DramPool, ids) -> torch.Tensor:
    return torch.stack([pool.tensor[p].clone() for p in ids]).float()


@pytest.mark.parametrize("fmt, bound", [("fp8", 2**-4), ("int4", 0.15)])
def test_nvme_round_trip_through_the_worker_in_a_compressed_format(base_dir, pool, fmt, bound, monkeypatch):
    fill(pool, range(8), seed=1)
    before = pages_of(pool, range(8))
    client = make_worker(base_dir, pool, fmt, monkeypatch)
    try:
        client.submit_store(1, list(range(8)), list(range(8)))
        assert wait_for(client, {1})[1].ok == [True] * 8
        client.submit_load(2, list(range(8)), list(range(8, 16)))
        assert wait_for(client, {2})[2].ok == [True] * 8
        assert "libtorch" in Path(f"/proc/{client.pid}/maps").read_text()  # the codec's (only) import of torch
    finally:
        client.close()
    after = pages_of(pool, range(8, 16))
    scale = before.abs().amax()
    err = (after - before).abs().max() / scale
    assert 0 < err <= bound, (fmt, float(err))  # lossy, within the format's bound
    # the slot file holds the encoded pages: fewer bytes than the DRAM pages
    file_bytes = (base_dir / f"nvme-{fmt}" / "nvme.kv").stat().st_size
    assert PageCodec(LAYOUT, fmt).encoded_bytes < LAYOUT.page_bytes and file_bytes > 0


def test_a_page_of_another_format_is_a_miss(base_dir, pool, monkeypatch):
    """Slots written as int4 read by a codec of fp8 (the same slot size is forced here): every
    header is checked, every page is a miss, DRAM is not written with misread values."""
    fp8, int4 = PageCodec(LAYOUT, "fp8"), PageCodec(LAYOUT, "int4")
    fill(pool, range(4), seed=2)
    slots: dict[int, bytes] = {}

    def put(ids, views):
        for i, v in zip(ids, views):
            slots[i] = bytes(v)
        return [True] * len(ids)

    def get(ids, views):
        for i, v in zip(ids, views):
            data = slots[i][: len(v)].ljust(len(v), b"\0")
            torch.frombuffer(v, dtype=torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return [True] * len(ids)

    views = [pool.page_view(p) for p in range(4)]
    assert ColdPages(int4, 2, 1).write(put, list(range(4)), views) == [True] * 4
    fill(pool, range(4, 8), seed=3)
    target = [pool.page_view(p) for p in range(4, 8)]
    untouched = [bytes(v) for v in target]
    assert ColdPages(fp8, 2, 1).read(get, list(range(4)), target) == [False] * 4
    assert [bytes(v) for v in target] == untouched
    assert ColdPages(int4, 3, 1).read(get, list(range(4)), target) == [True] * 4  # chunks of 3: 3 + 1


def test_exact_keeps_todays_bytes_and_fingerprints():
    """``exact`` (the default) moves the DRAM bytes as they are: no codec in the worker spec, the
    same NVMe slot size and the same fingerprint and store keys as before the flag existed."""
    from hiradix.config import HiRadixConfig
    from hiradix.persistence.fingerprint import kv_fingerprint, store_key_prefix
    from hiradix.runtime.assembly import cold_tiers_of, tier_page_bytes

    exact = HiRadixConfig()
    assert cold_tiers_of(exact) == () and tier_page_bytes(exact, LAYOUT, "nvme") == LAYOUT.page_bytes
    fp8 = HiRadixConfig.from_flags(cold_format="fp8", cold_tiers="nvme")
    assert cold_tiers_of(fp8) == ("nvme",)
    assert tier_page_bytes(fp8, LAYOUT, "nvme") == PageCodec(LAYOUT, "fp8").encoded_bytes
    assert tier_page_bytes(fp8, LAYOUT, "store") == LAYOUT.page_bytes
    base = kv_fingerprint("m", "float16", LAYOUT, 0, 1, 4096)
    assert "page_format" not in base
    assert kv_fingerprint("m", "float16", LAYOUT, 0, 1, 4096, page_format="fp8") != base
    assert store_key_prefix("m", "float16", LAYOUT, 0, 1) != store_key_prefix("m", "float16", LAYOUT, 0, 1, page_format="fp8")
    assert store_key_prefix("m", "float16", LAYOUT, 0, 1, page_format="fp8") != \
        store_key_prefix("m", "float16", LAYOUT, 0, 1, page_format="int4")


def test_an_encoded_dram_pool_moves_as_it_is_and_a_read_checks_each_header(base_dir, monkeypatch):
    """DRAM as a cold tier: the worker attaches a pool of encoded pages, writes them to NVMe byte
    for byte and reads them back; a page whose header is not the format's reads as a miss."""
    from hiradix.io.protocol import WorkerSpec

    codec = PageCodec(LAYOUT, "fp8")
    pool = DramPool.create(LAYOUT, NUM_DRAM_PAGES, base_dir / "dram-enc", page_bytes=codec.encoded_bytes)
    nvme = base_dir / "nvme-enc"
    NvmeStore.create(nvme, codec.encoded_bytes, NUM_NVME_SLOTS, backend="posix", threads=2).close()
    gen = torch.Generator().manual_seed(5)
    exact = torch.randn((4, LAYOUT.page_bytes // 2), generator=gen).bfloat16().view(torch.uint8)
    pool.tensor[:4] = codec.encode_pages(exact)
    pool.tensor[3, :4] = torch.tensor(list(b"XXXX"), dtype=torch.uint8)  # not a KV page header
    written = pool.tensor[:4].clone()
    spec = WorkerSpec(
        dram_path=str(pool.path), layout=LAYOUT.to_json(), num_dram_pages=NUM_DRAM_PAGES, nvme_dir=str(nvme),
        num_nvme_slots=NUM_NVME_SLOTS, page_bytes=codec.encoded_bytes, io_backend="posix",
        socket_dir=str(base_dir / "sock-enc"), threads=2, parent_pid=os.getpid(),
        cold_format="fp8", cold_tiers=("dram", "nvme", "store"),
    )
    monkeypatch.setenv("HIRADIX_FAULTS", "")
    client = IOWorkerClient(spec, ready_timeout_s=WAIT_S)
    client.start()
    try:
        client.submit_store(1, [0, 1, 2, 3], [0, 1, 2, 3])
        assert wait_for(client, {1})[1].ok == [True] * 4
        client.submit_load(2, [0, 1, 2, 3], [4, 5, 6, 7])
        assert wait_for(client, {2})[2].ok == [True, True, True, False]
        assert torch.equal(pool.tensor[4:7], written[:3])  # byte for byte: no codec in the worker
        assert (nvme / "nvme.kv").stat().st_size >= 4 * codec.encoded_bytes
    finally:
        client.close()
        pool.close()


def test_a_spec_whose_page_bytes_do_not_match_the_encoded_dram_page_is_refused(base_dir, pool, monkeypatch):
    from hiradix.io.protocol import WorkerSpec
    from hiradix.io.worker import Worker

    spec = WorkerSpec(
        dram_path=str(pool.path), layout=LAYOUT.to_json(), num_dram_pages=NUM_DRAM_PAGES, nvme_dir="",
        num_nvme_slots=0, page_bytes=LAYOUT.page_bytes, socket_dir=str(base_dir / "sock-x"), parent_pid=os.getpid(),
        cold_format="fp8", cold_tiers=("dram", "nvme", "store"),
    )
    monkeypatch.setenv("HIRADIX_FAULTS", "")
    with pytest.raises(ValueError, match="DRAM page"):
        Worker(spec, "ipc:///nonexistent", None)


def test_the_tier_plan_carries_each_tiers_format_and_bytes():
    """``tier_plan`` resolves page bytes, formats and reserved bytes once: a compressed NVMe tier
    holds encoded pages in smaller slots; a rank that maps the owner's copy reserves nothing."""
    from types import SimpleNamespace

    from hiradix.config import HiRadixConfig
    from hiradix.runtime.assembly import tier_plan
    from hiradix.tiers.nvme import slot_bytes_for

    fp8 = HiRadixConfig.from_flags(cold_format="fp8", cold_tiers="nvme,store")
    dram = SimpleNamespace(num_pages=10, page_bytes=LAYOUT.page_bytes, dram_bytes=10 * LAYOUT.page_bytes)
    plan = tier_plan(fp8, LAYOUT, dram, nvme_slots=4, key_prefix="fp/", owner=True)
    encoded = PageCodec(LAYOUT, "fp8").encoded_bytes
    assert plan.page_bytes_by_tier == (LAYOUT.page_bytes, LAYOUT.page_bytes, encoded, encoded)
    assert (plan.dram.page_format, plan.nvme.page_format, plan.store.page_format) == ("exact", "fp8", "fp8")
    assert plan.reserved_bytes == (10 * LAYOUT.page_bytes, 4 * slot_bytes_for(encoded))
    assert encoded < LAYOUT.page_bytes and plan.store_key_prefix == "fp/"
    mapped = tier_plan(HiRadixConfig(), LAYOUT, dram, nvme_slots=4, key_prefix=None, owner=False)
    assert mapped.reserved_bytes == (0, 0) and mapped.store is None and mapped.nvme.page_bytes == LAYOUT.page_bytes
