"""What a request's ``cached_tokens_details`` says came from storage, when its history larger than
DRAM was promoted in parts while it waited (:mod:`hiradix.core.dram_stream`), then the last part at
admission: every part counts, from the first part's start, so SGLang's split
(``split_cached_prefix_by_tier``) reports them all as storage."""

from __future__ import annotations

import types

from sglang.srt.managers.schedule_batch import split_cached_prefix_by_tier

from hiradix.core.node import Tier
from hiradix.sglang_plugin.storage_hits import note_storage_hits


def back(nvme: int = 0, store: int = 0):
    return types.SimpleNamespace(read_from={Tier.NVME: nvme, Tier.STORE: store})


def test_parts_promoted_while_waiting_and_the_last_at_admission_all_count_as_storage():
    req = types.SimpleNamespace()
    note_storage_hits(req, back(nvme=320), "mooncake", start=32)  # tokens 32..352 promoted while waiting
    note_storage_hits(req, back(nvme=128, store=64), "mooncake", start=352)  # 352..544
    note_storage_hits(req, back(nvme=96), "mooncake")  # admission: 544..640 from DRAM, read from NVMe
    assert (req.storage_hit_start, req.storage_hit_length) == (32, 608)
    assert req.hiradix_storage_backend == "nvme=544,mooncake=64"
    # prefix 640 tokens, of which the admission's load-back (host hit) was the last 96
    assert split_cached_prefix_by_tier(640, 96, req.storage_hit_length, req.storage_hit_start) == (32, 0, 608)


def test_a_load_back_alone_is_split_from_the_host_hit_as_before():
    req = types.SimpleNamespace()
    note_storage_hits(req, back(nvme=48), None)
    assert (req.storage_hit_start, req.storage_hit_length, req.hiradix_storage_backend) == (None, 48, "nvme=48")
    assert split_cached_prefix_by_tier(200, 80, req.storage_hit_length, req.storage_hit_start) == (120, 32, 48)
    req = types.SimpleNamespace()
    note_storage_hits(req, back(), None)  # a DRAM hit: nothing from storage
    assert (req.storage_hit_length, req.hiradix_storage_backend) == (0, None)
