"""TieredRadixCache as SGLang's scheduler drives it, over real SGLang CPU pools and real tiers.

The device side is SGLang's own ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator`` and
``ReqToTokenPool`` on the CPU; the lower tiers are built by ``build_tiers`` (an anonymous
shared-memory DRAM pool, write-through, no NVMe). A ``Req`` is a namespace with the
attributes the seam reads. After every step the tree, the DRAM books and the HBM slot count
(allocator used == tree + what requests still own) are checked.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix.config import HiRadixConfig
from hiradix.core.node import Tier
from hiradix.dataplane.layout import KVLayout
from hiradix.sglang_plugin.cache import TieredRadixCache

PS, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 8
DEVICE_TOKENS = 16 * PS  # 16 device pages (SGLang adds padding page 0)
DRAM_PAGES = 8


class Seam:
    """The cache with its SGLang pools; ``new_req`` plays the scheduler's prefill."""

    def __init__(self) -> None:
        self.kv = memory_pool.MHATokenToKVPool(
            size=DEVICE_TOKENS, page_size=PS, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )
        self.alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PS, torch.bfloat16, "cpu", self.kv, need_sort=False)
        self.rows = memory_pool.ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
        params = types.SimpleNamespace(req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
                                       page_size=PS, tp_cache_group=None, enable_metrics=False)
        page_bytes = KVLayout.from_device_pool(self.kv, PS).page_bytes
        self.cache = TieredRadixCache(params, HiRadixConfig(dram_bytes=DRAM_PAGES * page_bytes, policy="lru"), kv_pool=self.kv)
        self.gen = torch.Generator().manual_seed(0)

    def used(self) -> int:
        return DEVICE_TOKENS - self.alloc.available_size()

    def check(self, request_tokens: int) -> None:
        self.cache.check_integrity()
        self.cache.core.check_integrity(request_tokens=request_tokens, used_tokens=self.used())

    def new_req(self, tokens: list[int], extra_key=None, cache_salt=None) -> types.SimpleNamespace:
        """A request that computed all its KV: a row, whole pages of slots, random K/V in them."""
        idx = self.rows.alloc_rows(1)[0]
        slots = self.alloc.alloc(-(-len(tokens) // PS) * PS)
        self.rows.write((idx, slice(0, len(tokens))), slots[: len(tokens)])
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            shape = (len(slots), HEADS, HEAD_DIM)
            buf[slots] = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=self.gen).view(torch.bfloat16)
        kv = types.SimpleNamespace(req_pool_idx=idx, cache_protected_len=0, cache_inserted_len=0)
        return types.SimpleNamespace(
            full_untruncated_fill_ids=list(tokens), origin_input_ids=list(tokens), output_ids=[],
            extra_key=extra_key, cache_salt=cache_salt, kv=kv, lock=None, last_node=self.cache.root_node,
            storage_hit_length=0, storage_hit_start=None, slots=slots, session=None,
        )

    def row(self, req, n: int) -> list[int]:
        return self.rows.req_to_token[req.kv.req_pool_idx, :n].tolist()

    def match(self, tokens, extra_key=None, cache_salt=None):
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra_key, cache_salt=cache_salt)))

    def bytes_at(self, slots) -> list[torch.Tensor]:
        return [b[slots].view(torch.int16).clone() for b in (*self.kv.k_buffer, *self.kv.v_buffer)]


@pytest.fixture
def s():
    seam = Seam()
    try:
        yield seam
    finally:
        seam.cache.release_host_resources()


A = list(range(1000, 1014))  # 14 tokens: 3 whole pages + 2
B = A[:8] + list(range(2000, 2008))  # shares A's first 2 pages


def assert_dram_holds(s: Seam, node, want: list[torch.Tensor]) -> None:
    """``node``'s DRAM pages hold ``want`` (``Seam.bytes_at`` of its tokens), per page and layer."""
    dram = s.cache.tiers.mover.dram.tensor  # page-major (the default layout)
    for i, page in enumerate(node.dram_pages):
        rows = slice(i * PS, (i + 1) * PS)
        for layer in range(LAYERS):
            blk = dram[page, layer].view(torch.int16)
            assert torch.equal(blk[0], want[layer][rows]), (page, layer, "K")
            assert torch.equal(blk[1], want[LAYERS + layer][rows]), (page, layer, "V")


def release(s: Seam, req) -> int:
    """What SGLang's ``release_kv_cache`` does: free the slots past the tree's, drop the lock.

    Returns the lock's evictable-token delta."""
    n = req.kv.cache_protected_len
    s.alloc.free_segment(req.slots[n:], start_pos=n)
    delta = s.cache.dec_lock_ref(req.lock.node).delta
    req.lock = None
    return delta


def evict_a(s: Seam):
    """Checkpoint, release and evict A; returns its node and its K/V bytes (``Seam.bytes_at``)."""
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    want = s.bytes_at(a.slots[:12])
    assert release(s, a) == 12
    assert (s.cache.evictable_size(), s.cache.protected_size()) == (12, 0)
    assert s.alloc.available_size() == DEVICE_TOKENS - 12
    s.check(request_tokens=0)
    assert s.cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 12  # whole node
    assert s.alloc.available_size() == DEVICE_TOKENS
    assert (s.cache.evictable_size(), s.cache.protected_size()) == (0, 0)
    s.check(request_tokens=0)
    return a.last_node, want


def test_checkpoint_hands_whole_pages_to_the_tree(s):
    a = s.new_req(A)
    assert s.alloc.available_size() == DEVICE_TOKENS - 16
    s.cache.checkpoint(a, up_to=len(A))
    assert s.alloc.available_size() == DEVICE_TOKENS - 16  # nothing was a duplicate
    assert a.kv.cache_protected_len == a.kv.cache_inserted_len == 12
    node = a.last_node
    assert node.parent is s.cache.root_node and node.num_tokens == 12
    assert a.lock.node is node and node.lock_ref == 1
    assert s.cache.path_device_indices(node).tolist() == a.slots[:12].tolist() == s.row(a, 12)
    assert (s.cache.protected_size(), s.cache.evictable_size(), s.cache.total_size()) == (12, 0, 12)
    s.check(request_tokens=4)  # the last, partial page stays the request's


def test_checkpoint_frees_duplicates_and_repoints_the_row(s):
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    b = s.new_req(B)
    assert s.alloc.available_size() == DEVICE_TOKENS - 32
    s.cache.checkpoint(b, up_to=len(B))
    assert s.alloc.available_size() == DEVICE_TOKENS - 24  # b's copy of the shared 8 tokens went back
    free_pages = set(s.alloc.free_pages.tolist())
    assert {int(x) // PS for x in b.slots[:8]} <= free_pages
    assert s.row(b, 16) == a.slots[:8].tolist() + b.slots[8:16].tolist()
    upper = b.last_node.parent
    assert upper.num_tokens == 8 and upper.parent is s.cache.root_node and a.last_node.parent is upper
    assert b.lock.node is b.last_node and b.kv.cache_protected_len == 16
    assert upper.lock_ref == 2 and a.last_node.lock_ref == b.last_node.lock_ref == 1
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (20, 0)
    s.check(request_tokens=4)
    # a decodes 2 more tokens into its last page and checkpoints again: the lock moves down.
    a.full_untruncated_fill_ids = A + [1014, 1015]
    s.rows.write((a.kv.req_pool_idx, slice(14, 16)), a.slots[14:16])
    old = a.last_node
    s.cache.checkpoint(a, up_to=16)
    assert s.alloc.available_size() == DEVICE_TOKENS - 24  # the first 12 were a's own already
    assert a.last_node.parent is old and a.last_node.num_tokens == 4 and a.lock.node is a.last_node
    assert old.lock_ref == 1 and upper.lock_ref == 2  # the old lock was released
    assert a.kv.cache_protected_len == 16 and s.row(a, 16) == a.slots.tolist()
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (24, 0)
    s.check(request_tokens=0)


def test_match_prefix_lengths_and_nodes(s):
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    m = s.match(A[:12] + [7, 7, 7, 7, 7])
    assert (m.device_prefix_len, m.host_hit_length, m.full_kv_hit_length) == (12, 0, 12)
    assert m.last_device_node is a.last_node and m.best_match_node is a.last_node
    m = s.match(A[:9] + [3, 3, 3, 3])  # ends inside a's node, inside its third page
    assert (m.device_prefix_len, m.host_hit_length) == (8, 0)
    assert m.last_device_node.num_tokens == 8 and a.last_node.parent is m.last_device_node
    assert s.cache.path_device_indices(m.last_device_node).tolist() == a.slots[:8].tolist()
    for key in (A[:3], [5] * 12):
        m = s.match(key)
        assert m.device_prefix_len == 0 and m.last_device_node is s.cache.root_node
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (12, 0)  # a split moves no token
    s.check(request_tokens=4)


def test_extra_key_and_cache_salt_never_match_each_other(s):
    spaces = [(None, None), ("lora-1", None), (None, "salt"), ("lora-1", "salt")]
    reqs = []
    for extra_key, salt in spaces:
        r = s.new_req(A[:8], extra_key=extra_key, cache_salt=salt)
        s.cache.checkpoint(r, up_to=8)
        reqs.append(r)
        assert s.alloc.available_size() == DEVICE_TOKENS - 8 * len(reqs)  # never a duplicate
    assert len({id(r.last_node) for r in reqs}) == 4
    for (extra_key, salt), r in zip(spaces, reqs):
        m = s.match(A[:8], extra_key, salt)
        assert m.device_prefix_len == 8 and m.last_device_node is r.last_node
        assert s.cache.path_device_indices(m.last_device_node).tolist() == r.slots.tolist()
    for extra_key, salt in (("lora-2", None), (None, "other"), ("lora-2", "salt")):
        m = s.match(A[:8], extra_key, salt)
        assert m.device_prefix_len == 0 and m.last_device_node is s.cache.root_node
    assert s.cache.protected_size() == 32
    s.check(request_tokens=0)


def test_write_through_backup_lands_at_the_next_step(s):
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    (op,) = s.cache.tiers.books.in_flight()
    assert op.kind.name == "BACKUP" and len(op.dst_ids) == 3 and a.last_node.dram_pages is None
    assert not s.cache.tiers.mover.dram.tensor.view(torch.int16).any()  # CPU: copied at the step
    s.check(request_tokens=4)
    s.cache.check_hicache_events()
    assert s.cache.tiers.books.in_flight() == [] and a.last_node.dram_pages == op.dst_ids
    assert s.cache.tree.tier_tokens == [12, 12, 0, 0]
    assert_dram_holds(s, a.last_node, s.bytes_at(a.slots[:12]))
    assert s.alloc.available_size() == DEVICE_TOKENS - 16  # a backup frees no device slot
    s.check(request_tokens=4)


def test_backup_in_flight_follows_a_split(s):
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    want = s.bytes_at(a.slots[:12])
    upper = s.match(A[:8] + [3, 3, 3, 3]).last_device_node  # splits a's node before its backup ran
    s.check(request_tokens=4)
    s.cache.check_hicache_events()
    assert len(upper.dram_pages) == 2 and len(a.last_node.dram_pages) == 1
    assert_dram_holds(s, upper, [w[:8] for w in want])
    assert_dram_holds(s, a.last_node, [w[8:] for w in want])
    s.check(request_tokens=4)


def test_evict_frees_slots_and_keeps_kv_in_dram(s):
    node, want = evict_a(s)
    assert node.alive and node.hbm_slots is None and len(node.dram_pages) == 3
    assert s.cache.tree.tier_tokens[Tier.HBM] == 0 and s.cache.tree.tier_tokens[Tier.DRAM] == 12
    assert_dram_holds(s, node, want)
    m = s.match(A + [9, 9])
    assert (m.device_prefix_len, m.host_hit_length, m.full_kv_hit_length) == (0, 12, 12)
    assert m.last_device_node is s.cache.root_node and m.best_match_node is node
    assert s.cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 0  # nothing left in HBM
    s.check(request_tokens=0)


def test_init_load_back_restores_the_bytes_layer_by_layer(s):
    node, want = evict_a(s)
    for buf in (*s.kv.k_buffer, *s.kv.v_buffer):
        buf.zero_()  # the freed slots were reused: the load must bring the bytes back
    m = s.match(A[:12] + [9, 9, 9, 9])
    r = types.SimpleNamespace(last_node=m.last_device_node, storage_hit_length=-1, storage_hit_start=0)
    loaded, last = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=r))
    assert (loaded, last) == (12, node) and (r.storage_hit_length, r.storage_hit_start) == (0, None)
    assert s.alloc.available_size() == DEVICE_TOKENS - 12
    new_slots = s.cache.path_device_indices(node)
    assert len(new_slots) == 12 and (s.cache.evictable_size(), s.cache.protected_size()) == (12, 0)
    assert s.cache.inc_lock_ref(node).delta == -12  # the scheduler locks the new last node
    s.check(request_tokens=0)
    assert s.cache.ready_to_load_host_cache() == 0
    assert not any(t.any() for t in s.bytes_at(new_slots))  # CPU: copies wait for the forward
    s.cache.loader.wait_until(0)
    got = s.bytes_at(new_slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[LAYERS], want[LAYERS])  # layer 0: K, V
    assert not got[1].any() and not got[LAYERS + 1].any()  # layer 1 not yet
    s.cache.loader.wait_until(LAYERS - 1)
    assert all(torch.equal(g, w) for g, w in zip(s.bytes_at(new_slots), want))
    s.cache.check_hicache_events()  # the promotion completes: HBM and DRAM both hold it
    assert s.cache.tree.tier_tokens[Tier.HBM] == s.cache.tree.tier_tokens[Tier.DRAM] == 12
    m = s.match(A + [9, 9])
    assert (m.device_prefix_len, m.host_hit_length) == (12, 0) and m.last_device_node is node
    assert s.cache.dec_lock_ref(node).delta == 12
    s.check(request_tokens=0)


def test_load_back_lands_with_a_flush(s):
    node, want = evict_a(s)
    for buf in (*s.kv.k_buffer, *s.kv.v_buffer):
        buf.zero_()
    m = s.match(A)
    r = types.SimpleNamespace(last_node=m.last_device_node, storage_hit_length=-1, storage_hit_start=0)
    assert s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=r)) == (12, node)
    (op,) = s.cache.tiers.books.in_flight()
    assert op.kind.name == "PROMOTE" and s.cache.tiers.mover.flush() == [op.op_id]
    assert all(torch.equal(g, w) for g, w in zip(s.bytes_at(s.cache.path_device_indices(node)), want))
    s.check(request_tokens=0)


def test_load_back_refused_for_a_stale_length(s):
    node, _ = evict_a(s)
    r = types.SimpleNamespace(last_node=s.cache.root_node, storage_hit_length=-1, storage_hit_start=0)
    params = InitLoadBackParams(node, 8, req=r)  # a stale length: not what the match reported
    assert s.cache.init_load_back(params) == (0, s.cache.root_node)
    assert r.storage_hit_length == -1 and s.alloc.available_size() == DEVICE_TOKENS
    s.check(request_tokens=0)


def test_lock_ref_deltas_and_sizes(s):
    a = s.new_req(A)
    s.cache.checkpoint(a, up_to=len(A))
    b = s.new_req(B)
    s.cache.checkpoint(b, up_to=len(B))
    assert release(s, a) == 4  # the shared 8 stay locked by b
    assert release(s, b) == 16
    upper = b.last_node.parent
    assert (s.cache.evictable_size(), s.cache.protected_size(), s.cache.total_size()) == (20, 0, 20)
    assert s.cache.inc_lock_ref(a.last_node).delta == -12  # a's 4 + the shared 8
    assert s.cache.inc_lock_ref(upper).delta == 0  # already locked through a's node
    assert s.cache.inc_lock_ref(b.last_node).delta == -8
    assert (s.cache.evictable_size(), s.cache.protected_size()) == (0, 20)
    s.check(request_tokens=0)
    assert s.cache.dec_lock_ref(a.last_node).delta == 4
    assert s.cache.dec_lock_ref(upper).delta == 0
    assert (s.cache.evictable_size(), s.cache.protected_size()) == (4, 16)
    assert s.cache.dec_lock_ref(b.last_node).delta == 16
    assert (s.cache.evictable_size(), s.cache.protected_size()) == (20, 0)
    with pytest.raises(ValueError, match="unbalanced"):
        s.cache.dec_lock_ref(upper)
    s.check(request_tokens=0)
