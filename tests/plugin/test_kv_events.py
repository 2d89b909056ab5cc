"""hiradix's KV events name pages as stock SGLang does (hiradix.sglang_plugin.kv_events).

The same inserts into stock SGLang 0.5.23's ``RadixCache`` (with its own ``KVCacheEventRecorder``)
and into hiradix's tree give the same ``BlockStored`` pages: block hashes, parent hashes, token
ids, block size, salt and LoRA name, plain, salted and LoRA-named prefixes, both formats (so a
consumer built for SGLang matches hiradix's events without change). The media map to SGLang's
``StorageMedium``; a removal names the pages a store named; a flush is ``AllBlocksCleared``. Off,
the cache builds no record. The events go through SGLang's msgpack encoding and back.
"""

from __future__ import annotations

import types

import msgspec
import pytest
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from hiradix.core.node import Tier
from hiradix.core.tree import TieredRadixTree
from hiradix.sglang_plugin.kv_events import MEDIUM, attach_events

PS = 4
LORA_ID = "a" * 32
LORA_KEY = "prefix-" + LORA_ID  # SGLang appends the adapter id to extra_key


def names() -> KvEventLoraNames:
    table = KvEventLoraNames()
    table.register(types.SimpleNamespace(lora_id=LORA_ID, extra_key=LORA_KEY), "adapter-a")
    return table


# (tokens, extra_key, cache_salt): a prefix, a branch inside it (a split), a longer path, salted
# twice (one chain seeded by the salt), LoRA-named, an unnamed extra_key.
INSERTS = [
    (list(range(1, 13)), None, None),
    (list(range(1, 9)) + [50, 51, 52, 53], None, None),
    (list(range(1, 17)), None, None),
    (list(range(1, 9)), None, "salt-1"),
    (list(range(1, 13)), None, "salt-1"),
    (list(range(1, 9)), LORA_KEY, None),
    (list(range(1, 9)), "other", "salt-2"),
]


def medium(e) -> str:
    return getattr(e.medium, "value", e.medium)


def pages(events) -> list[tuple]:
    """Each stored page as ``(hash, parent hash, tokens, block size, medium, salt, LoRA name)``."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                out.append((h, parent, tuple(e.token_ids[i * PS : (i + 1) * PS]), e.block_size, medium(e),
                            e.cache_salt, e.lora_name))
                parent = h
    return out


def hiradix_events(dynamo: bool):
    params = types.SimpleNamespace(enable_kv_cache_events=True, dynamo_kv_event_format=dynamo,
                                   kv_event_lora_names=names())
    tree = TieredRadixTree(PS)
    out = attach_events(tree, params)
    return tree, out


@pytest.mark.parametrize("dynamo", [False, True])
def test_stored_pages_are_stock_sglangs_pages(dynamo):
    stock = RadixCache.create_simulated(page_size=PS, enable_kv_cache_events=True, dynamo_kv_event_format=dynamo,
                                        kv_event_lora_names=names())
    tree, out = hiradix_events(dynamo)
    out.convert(tree.events.take())  # the record's first batch: AllBlocksCleared
    expected, got = [], []
    for tokens, extra_key, salt in INSERTS:
        stock.insert(InsertParams(key=RadixKey(tokens, extra_key, cache_salt=salt)))
        expected += pages(stock.take_events())
        namespace = None if extra_key is None and salt is None else (extra_key, salt)
        tree.insert(tokens, list(range(len(tokens))), namespace)
        got += pages(out.convert(tree.events.take()))
    assert got == expected
    assert {p[4] for p in got} == {"GPU"} and len(got) == 3 + 1 + 1 + 2 + 1 + 2 + 2


def test_media_removals_and_the_flush():
    tree, out = hiradix_events(False)
    first = out.convert(tree.events.take())
    assert first == [AllBlocksCleared()]
    _, node, _ = tree.insert(list(range(1, 9)), list(range(8)))
    for tier in (Tier.DRAM, Tier.NVME, Tier.STORE):
        tree.attach(node, tier, ["k1", "k2"] if tier == Tier.STORE else [0, 1])
    stored = out.convert(tree.events.take())
    assert [medium(e) for e in stored] == ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]
    assert {tuple(e.block_hashes) for e in stored} == {tuple(stored[0].block_hashes)}
    assert {t: m.value for t, m in MEDIUM.items()} == {Tier.HBM: "GPU", Tier.DRAM: "CPU_PINNED", Tier.NVME: "DISK",
                                                       Tier.STORE: "EXTERNAL"}
    tree.detach(node, Tier.HBM)
    tree.detach(node, Tier.NVME)
    removed = out.convert(tree.events.take())
    assert [(type(e), medium(e), e.block_hashes) for e in removed] == [
        (BlockRemoved, "GPU", stored[0].block_hashes), (BlockRemoved, "DISK", stored[0].block_hashes)]
    tree.reset()
    assert out.convert(tree.events.take()) == [AllBlocksCleared()]
    # SGLang's publisher encodes a batch with msgpack; a consumer decodes it with SGLang's types
    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=stored + removed))
    back = msgspec.msgpack.decode(wire, type=KVEventBatch)
    assert [(type(e), e.medium, e.block_hashes) for e in back.events] == [
        (type(e), medium(e), e.block_hashes) for e in stored + removed]


def test_off_no_record():
    tree = TieredRadixTree(PS)
    assert attach_events(tree, types.SimpleNamespace(enable_kv_cache_events=False)) is None
    assert tree.events is None
