"""Restart persistence without a server: the NVMe index journal, re-indexing, the fingerprint.

Real files in ``tmp_path``; the tree and books are driven as the tier controller drives them
(``tests.helpers.core.Harness``), with ``check_integrity`` after every step.
"""

from __future__ import annotations

import logging
import os
import stat

import torch

from hiradix.persistence.fingerprint import kv_fingerprint, model_identity, weights_stamp
from hiradix.dataplane.layout import KVLayout
from hiradix.persistence.journal import IndexJournal, restore
from hiradix.tiers.nvme import NvmeStore
from hiradix.persistence.index import INDEX_FILE_NAME, NvmeIndex, Put, _read_records, page_hash
from hiradix.core.node import Tier
from tests.helpers.core import PS, Harness

FP = {"model": "m1", "page_size": str(PS)}


def persist(h: Harness, journal: IndexJournal, node) -> None:
    """HBM -> DRAM backup, HBM eviction, DRAM -> NVMe demotion, each acked OK."""
    if not node.in_tier(Tier.DRAM):
        h.complete(h.backup([node]).op_id, True)
    op = h.demote(node)
    h.complete(op.op_id, True)
    h.check()


def fresh(tmp_path, fp=FP, nvme_slots=32):
    index, pages = NvmeIndex.open(tmp_path, fp, nvme_slots, PS)
    h = Harness(dram_pages=32, nvme_slots=nvme_slots)
    restored = restore(h.tree, h.books, pages)
    journal = IndexJournal(index, h.tree)
    h.books.nvme_journal = journal
    h.check()
    return h, journal, index, restored


def test_pages_on_nvme_come_back_after_reopen(tmp_path):
    h, journal, index, restored = fresh(tmp_path)
    assert restored == 0 and not index.reused
    a, _ = h.insert([1, 2, 3, 4, 5, 6])  # 3 pages
    b, _ = h.insert([1, 2, 3, 4, 7, 8, 9, 10])  # shares 2 pages, then 2 of its own
    for node in h.tree.iter_nodes():
        persist(h, journal, node)
    slots = {tuple(n.tokens): list(n.nvme_slots) for n in h.tree.iter_nodes()}
    index.close()
    assert stat.S_IMODE(os.stat(tmp_path / INDEX_FILE_NAME).st_mode) == 0o600

    h2, _, index2, restored = fresh(tmp_path)
    assert index2.reused and restored == 5
    assert {tuple(n.tokens): list(n.nvme_slots) for n in h2.tree.iter_nodes()} == slots
    m = h2.tree.match([1, 2, 3, 4, 7, 8, 9, 10, 11])
    assert (m.hbm_len, m.dram_len, m.nvme_len) == (0, 0, 8)
    assert all(n.ids_in(Tier.NVME) is not None and n.ids_in(Tier.HBM) is None for n in m.nodes)
    assert h2.books.nvme.num_used == 5


def test_freed_and_reused_slots_are_not_reindexed(tmp_path):
    h, journal, index, _ = fresh(tmp_path, nvme_slots=2)
    a, _ = h.insert([1, 2, 3, 4])  # 2 pages fill NVMe
    persist(h, journal, a)
    h.evict_hbm(4)
    assert a.tiers() == [Tier.NVME] and a.nvme_slots == [0, 1]
    b, _ = h.insert([5, 6])
    h.complete(h.backup([b]).op_id, True)
    op = h.demote(b)  # NVMe full: a's last copy is dropped (journal: Free), slot reused
    assert not a.alive and op.dst_ids[0] in (0, 1)
    index.close()  # crash here: the write to the reused slot never landed
    h2, _, _, restored = fresh(tmp_path, nvme_slots=2)
    assert restored == 0 and list(h2.tree.iter_nodes()) == []


def test_other_fingerprint_is_not_reused_and_says_why(tmp_path, caplog):
    h, journal, index, _ = fresh(tmp_path)
    node, _ = h.insert([1, 2])
    persist(h, journal, node)
    index.close()
    with caplog.at_level(logging.WARNING):
        _, _, index2, restored = fresh(tmp_path, fp={"model": "m2", "page_size": str(PS)})
    assert restored == 0 and not index2.reused
    assert "model: m1 -> m2" in caplog.text
    index2.close()
    _, _, index3, restored = fresh(tmp_path)  # the journal now belongs to m2
    assert restored == 0 and not index3.reused


def test_torn_tail_and_orphans_are_dropped(tmp_path, caplog):
    h, journal, index, _ = fresh(tmp_path)
    a, _ = h.insert([1, 2, 3, 4])
    persist(h, journal, a)
    # A child whose parent page was never persisted (as an older hiradix wrote it, or a parent
    # freed after it): unreachable after a restart.
    index._append(Put(9, page_hash(b"", None, [40, 41]), [42, 43]))
    index.close()
    with open(tmp_path / INDEX_FILE_NAME, "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")
    with caplog.at_level(logging.WARNING):
        h2, _, _, restored = fresh(tmp_path)
    assert "torn or corrupt" in caplog.text
    assert restored == 2 and not h2.books.nvme.is_used(9)


def test_partial_prefix_is_restored_up_to_the_gap(tmp_path):
    h, journal, index, _ = fresh(tmp_path)
    a, _ = h.insert([1, 2, 3, 4, 5, 6])
    upper = h.tree.match([1, 2]).nodes[0]  # split: [1,2] | [3,4,5,6]
    persist(h, journal, upper)
    index._append(Put(20, page_hash(page_hash(page_hash(b"", None, [1, 2]), None, [3, 4]), None, [5, 6]), [7, 8]))
    index.close()
    h2, _, _, restored = fresh(tmp_path)
    assert restored == 1
    assert h2.tree.match([1, 2, 3, 4, 5, 6]).nvme_len == 2


def test_a_page_is_listed_only_once_its_parent_page_is(tmp_path, caplog):
    """Issue 30: the journal is closed under ancestors at every moment, so a stop (or SIGKILL)
    between a child's landing and its parent's leaves no orphan: the child waits in memory."""
    index, _ = NvmeIndex.open(tmp_path, FP, 32, PS)
    a, b, c = [1, 2], [3, 4], [5, 6]
    h_a = page_hash(b"", None, a)
    h_b = page_hash(h_a, None, b)
    index.record([7], h_b, [c], None)  # c landed first: its parent b is not listed
    index.record([5, 6], h_a, [b, [9, 9]], None)  # b (and a sibling of c) land: a is not listed either
    assert (index.num_pages, index.waiting_pages) == (0, 3)
    index.invalidate([6])  # the sibling's slot is freed before its parent came: it never gets listed
    assert index.record([4], b"", [a], None) == h_a  # a prefix's first page: listed, then b, then c
    assert (index.num_pages, index.waiting_pages, index.listed([4, 5, 6, 7])) == (3, 0, 3)
    index.close()
    records, _ = _read_records((tmp_path / INDEX_FILE_NAME).read_bytes(), tmp_path)
    assert [r.slot for r in records if isinstance(r, Put)] == [4, 5, 7]  # parents before children
    with caplog.at_level(logging.INFO):
        index, pages = NvmeIndex.open(tmp_path, FP, 32, PS)
    assert [p.slot for p in pages] == [4, 5, 7] and "(0 orphan pages dropped)" in caplog.text
    index.record([8], page_hash(h_b, None, c), [[1, 1]], None)  # below a re-indexed page: at once
    assert index.listed([8]) == 1
    index.close()


def test_namespaces_stay_apart(tmp_path):
    h, journal, index, _ = fresh(tmp_path)
    slots = h.hbm.alloc(2)
    _, node, _ = h.tree.insert([1, 2], slots, namespace=("lora-a", None))
    persist(h, journal, node)
    index.close()
    h2, _, _, restored = fresh(tmp_path)
    assert restored == 1
    assert h2.tree.match([1, 2]).nvme_len == 0
    assert h2.tree.match([1, 2], ("lora-a", None)).nvme_len == 2


def test_journal_invalidates_before_a_slot_is_rewritten():
    events = []

    class Recorder:
        def invalidate(self, slots):
            events.append(("free", list(slots)))

        def stored(self, node, slots):
            events.append(("put", list(slots)))

    h = Harness(dram_pages=8, nvme_slots=8)
    h.books.nvme_journal = Recorder()
    node, _ = h.insert([1, 2, 3, 4])
    h.complete(h.backup([node]).op_id, True)
    op = h.demote(node)
    assert events == [("free", op.dst_ids)]  # before the worker is asked to write
    h.complete(op.op_id, True)
    assert events[-1] == ("put", op.dst_ids)
    h.books.reset()
    assert events[-1] == ("free", op.dst_ids)


def test_store_keep_preserves_slots(tmp_path):
    import numpy as np

    page = np.arange(4096, dtype=np.uint8)
    with NvmeStore.create(tmp_path, 4096, 4, backend="posix") as store:
        assert store.write_slots([2], [memoryview(page)]) == [True]
    with NvmeStore.create(tmp_path, 4096, 4, backend="posix", keep=True) as store:
        out = np.zeros(4096, dtype=np.uint8)
        assert store.read_slots([2], [memoryview(out)]) == [True] and (out == page).all()
    with NvmeStore.create(tmp_path, 4096, 4, backend="posix") as store:
        assert store.read_slots([2], [memoryview(out)]) == [False]


def test_model_identity_follows_content_not_path(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(os.urandom(3 << 20))
    (model / "model.safetensors").write_bytes(weights)
    first = model_identity(str(model))
    assert model_identity(str(model)) == first
    weights[len(weights) * 8 // 17 + 10] ^= 0xFF  # a retrained checkpoint differs in every sample
    (model / "model.safetensors").write_bytes(weights)
    assert model_identity(str(model)) != first
    (model / "config.json").write_text('{"hidden_size": 9}')
    assert len({first, model_identity(str(model))}) == 2
    assert model_identity("org/model", "abc") == "hub:org/model@abc"


def test_a_weight_file_rewritten_in_place_changes_the_local_stamp_not_the_content_hash(tmp_path):
    """A break-it review patched one tensor element where no sample falls: the content hash (the
    store's keys) stayed, so a restart re-indexed KV of the old weights. The NVMe index also
    records each weight file's size and modification time (``weights_stamp``)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(os.urandom(3 << 20))
    (model / "model.safetensors").write_bytes(weights)
    identity, stamp = model_identity(str(model)), weights_stamp(str(model))
    assert weights_stamp(str(model)) == stamp
    weights[len(weights) * 6 // 17 + (64 << 10) + 100] ^= 0xFF  # past the first MiB, just after a sample
    (model / "model.safetensors").write_bytes(weights)
    os.utime(model / "model.safetensors", ns=(1, 2))  # whatever the clock says: a new time
    assert model_identity(str(model)) == identity and weights_stamp(str(model)) != stamp
    layout = KVLayout(num_layers=2, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    assert "weights_stamp" not in kv_fingerprint("id", "float32", layout, 0, 1, slot_bytes=8192)
    assert kv_fingerprint("id", "float32", layout, 0, 1, slot_bytes=8192, weights_stamp=stamp)["weights_stamp"] == stamp
    assert weights_stamp("org/model") is None


def test_a_smaller_slot_file_says_how_many_pages_it_dropped(tmp_path, caplog):
    index, _ = NvmeIndex.open(tmp_path, FP, 32, PS)
    h = b""
    for slot in (3, 20, 21):  # a chain of three pages
        h = index.record([slot], h, [[slot, slot]], None)
    index.close()
    with caplog.at_level(logging.INFO):
        index, pages = NvmeIndex.open(tmp_path, FP, 16, PS)
    index.close()
    assert [p.slot for p in pages] == [3]
    assert "re-indexed 1 pages (0 orphan pages dropped; 2 pages beyond the slot file's 16 slots dropped)" in caplog.text


def test_kv_fingerprint_names_every_shape_field():
    layout = KVLayout(num_layers=2, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    fp = kv_fingerprint("id", "float32", layout, tp_rank=1, tp_size=2, slot_bytes=8192)
    for key, value in {"model": "id", "kv_dtype": "torch.float32", "page_size": "16", "num_layers": "2",
                       "num_kv_heads": "4", "head_dim": "64", "tp_rank": "1", "tp_size": "2"}.items():
        assert fp[key] == value
    assert "hiradix_version" in fp and all(isinstance(v, str) for v in fp.values())


def test_journal_is_compacted_while_running_and_loses_nothing(tmp_path, monkeypatch):
    import threading

    from hiradix.persistence import index as nvme_index

    monkeypatch.setattr(nvme_index, "COMPACT_MIN_BYTES", 200)
    index, _ = NvmeIndex.open(tmp_path, FP, 64, PS)
    for round_ in range(200):  # churn: slots rewritten again and again
        index.invalidate([round_ % 8])
        index.record([round_ % 8], b"", [[round_, round_]], None)
        index.sync(min_interval_s=0)
        if index._compactor is not None:
            index._compactor.join()
    compacted = index._compacted_bytes
    assert index.compactions >= 3 and index.size_bytes <= 4 * max(compacted, 200) + 200
    # A compaction that is still writing while records arrive: they reach the new file too.
    release = threading.Event()
    real = nvme_index._write_snapshot

    def slow(*args):
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(nvme_index, "_write_snapshot", slow)
    index._start_compaction()
    index.invalidate([3])
    index.record([3], b"", [[77, 78]], None)
    index.record([20], b"", [[90, 91]], None)
    release.set()
    index.close()
    _, pages = NvmeIndex.open(tmp_path, FP, 64, PS)
    got = {p.slot: p.tokens for p in pages}
    expected = {s: (r, r) for r in range(192, 200) for s in [r % 8]}
    expected.update({3: (77, 78), 20: (90, 91)})
    assert got == expected


def test_cached_chain_hashes_survive_splits(tmp_path):
    """The journal caches each node's prefix hash; a split must not make a later page point
    at the wrong parent: everything stored before and after the split comes back whole."""
    h, journal, index, _ = fresh(tmp_path)
    a, _ = h.insert([1, 2, 3, 4, 5, 6])
    persist(h, journal, a)  # caches a.chain_hash over 3 pages
    b, _ = h.insert([1, 2, 3, 4, 9, 9, 7, 7])  # splits a after 2 pages; new leaf [9, 9, 7, 7]
    upper = b.parent
    assert upper.chain_hash is None and a.chain_hash is not None  # a keeps its last page
    persist(h, journal, b)  # parent hash via upper: hashed afresh from the root
    expected = b""
    for page in ([1, 2], [3, 4]):
        expected = page_hash(expected, None, page)
    assert upper.chain_hash == expected
    index.close()
    h2, _, _, restored = fresh(tmp_path)
    assert restored == 5
    assert h2.tree.match([1, 2, 3, 4, 9, 9, 7, 7]).nvme_len == 8
    assert h2.tree.match([1, 2, 3, 4, 5, 6]).nvme_len == 6


def test_store_key_prefix_names_everything_kv_depends_on():
    from hiradix.persistence.fingerprint import store_key_prefix

    layout = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    base = store_key_prefix("m1", "float16", layout, 0, 1)
    assert base.startswith("hiradix/") and base.endswith("/") and base == store_key_prefix("m1", "float16", layout, 0, 1)
    others = {
        store_key_prefix("m2", "float16", layout, 0, 1),  # another model (content hash)
        store_key_prefix("m1", "bfloat16", layout, 0, 1),  # another activation dtype
        store_key_prefix("m1", "float16", KVLayout(2, 32, 2, 64, torch.float16), 0, 1),  # page size
        store_key_prefix("m1", "float16", KVLayout(2, 16, 2, 64, torch.bfloat16), 0, 1),  # KV dtype
        store_key_prefix("m1", "float16", layout, 1, 2),  # another TP shard
        store_key_prefix("m1", "float16", layout, 0, 2),
    }
    assert len(others) == 6 and base not in others
