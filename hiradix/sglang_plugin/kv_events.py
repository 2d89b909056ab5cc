"""KV events for every tier, in SGLang's own terms: its page hash, its event types, its media.

With ``--kv-events-config`` set, SGLang builds the cache with ``enable_kv_cache_events`` (on the
scheduler of each DP rank that publishes: pp, attention-TP and attention-CP rank 0) and, after
each batch and when idle, publishes ``tree_cache.take_events()`` through its own publisher
(``disaggregation/kv_events.py``: ZMQ PUB, sequence numbers, a replay buffer; per DP rank on its
own port). The pure record (:mod:`hiradix.core.kv_events`) says which page entered or left which
tier; this module names the pages and builds the events exactly as SGLang 0.5.23's
``mem_cache/events.py::KVCacheEventRecorder`` does for its radix and HiCache trees:

* page keys: ``mem_cache/utils.py::get_hash_str`` (SHA-256 chained over the pages, SGLang's
  native hash), the chain of a salted prefix seeded as ``compute_node_event_hash_values`` seeds
  it; published as ``hash_str_to_int64``, through ``namespaced_block_hash`` with the namespace
  seed SGLang uses (``extra_key`` only when it names a LoRA adapter, or ``extra_key`` and
  ``cache_salt`` in the ``dynamo`` format);
* ``BlockStored`` with ``parent_block_hash``, ``token_ids``, ``block_size`` = the page size,
  ``lora_id`` None, ``cache_salt``, ``lora_name``; ``BlockRemoved``; ``AllBlocksCleared``;
* media: HBM -> ``GPU``, DRAM -> ``CPU_PINNED``, NVMe -> ``DISK``, the cluster store ->
  ``EXTERNAL`` (stock HiCache publishes GPU and CPU_PINNED only; its L3 storage none).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Hashable, Optional, Sequence

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
    kv_event_namespace_seed,
    namespaced_block_hash,
)
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

from hiradix.core.kv_events import DEFAULT_MAX_PENDING_PAGES, PagesRemoved, PagesStored, TierEvent, TierEvents
from hiradix.core.node import Tier
from hiradix.core.tree import TieredRadixTree

MAX_PENDING_PAGES_ENV = "HIRADIX_KV_EVENTS_MAX_PAGES"  # page changes per step before the re-sync (int)

MEDIUM = {
    Tier.HBM: StorageMedium.GPU,
    Tier.DRAM: StorageMedium.CPU,
    Tier.NVME: StorageMedium.DISK,
    Tier.STORE: StorageMedium.EXTERNAL,
}


class SGLangPageKeys:
    """SGLang's page hash chain (hex SHA-256 per page), as its event recorder computes it."""

    def __init__(self, page_size: int):
        self.page_size = page_size

    def chain(self, prior: Optional[Hashable], namespace: Optional[tuple], tokens: Sequence[int]) -> list[str]:
        if prior is None and namespace is not None and namespace[1] is not None:
            # compute_node_event_hash_values: a salted prefix's chain starts from the salt's seed
            prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + namespace[1].encode("utf-8")).hexdigest()
        return get_hash_str(tokens, prior, page_size=self.page_size)


class SGLangEvents:
    """Turns the core's tier events into SGLang's event objects (one scheduler, one DP rank).

    Args:
        page_size: tokens per page (``block_size``).
        dynamo_format: ``--kv-events-config`` ``"format": "dynamo"``.
        lora_names: SGLang's table of LoRA adapter names (``CacheInitParams.kv_event_lora_names``).
    """

    def __init__(self, page_size: int, dynamo_format: bool = False, lora_names: Optional[KvEventLoraNames] = None):
        self.page_size = page_size
        self.dynamo_format = dynamo_format
        self.lora_names = lora_names if lora_names is not None else KvEventLoraNames()
        self._seeds: dict[Optional[tuple], Optional[bytes]] = {None: None}

    def convert(self, events: Sequence[TierEvent]) -> list[Any]:
        """SGLang events for a batch of the core's, in order."""
        out: list[Any] = []
        for e in events:
            if isinstance(e, PagesStored):
                out.append(self._stored(e))
            elif isinstance(e, PagesRemoved):
                seed = self._seed(e.namespace)
                out.append(BlockRemoved(block_hashes=[self._hash(k, seed) for k in e.keys], medium=MEDIUM[e.tier]))
            else:
                out.append(AllBlocksCleared())
        return out

    def _stored(self, e: PagesStored) -> BlockStored:
        seed = self._seed(e.namespace)
        extra_key, salt = e.namespace if e.namespace is not None else (None, None)
        names = self.lora_names
        return BlockStored(
            block_hashes=[self._hash(k, seed) for k in e.keys],
            parent_block_hash=None if e.parent_key is None else self._hash(e.parent_key, seed),
            token_ids=list(e.tokens),
            block_size=self.page_size,
            lora_id=None,
            medium=MEDIUM[e.tier],
            cache_salt=salt,
            lora_name=names.resolve(extra_key) if self.dynamo_format else names.get(extra_key),
        )

    @staticmethod
    def _hash(key: str, seed: Optional[bytes]) -> int:
        return namespaced_block_hash(hash_str_to_int64(key), namespace_seed=seed)

    def _seed(self, namespace: Optional[tuple]) -> Optional[bytes]:
        """SGLang's ``KVCacheEventRecorder._namespace_seed`` for a node of ``namespace``."""
        if namespace in self._seeds:
            return self._seeds[namespace]
        extra_key, salt = namespace
        if self.dynamo_format:
            seed = kv_event_namespace_seed(extra_key=extra_key, cache_salt=salt)
        else:
            named = self.lora_names.get(extra_key) is not None
            seed = kv_event_namespace_seed(extra_key=extra_key if named else None, cache_salt=None)
            if not named:
                return seed  # an adapter may be named later: not cached
        self._seeds[namespace] = seed
        return seed


def attach_events(tree: TieredRadixTree, params: Any) -> Optional[SGLangEvents]:
    """Record ``tree``'s tier changes when SGLang built the cache with KV events on; None otherwise
    (nothing recorded, no page hashed). Call before the NVMe index is restored into the tree, so
    the re-indexed pages are published as stored."""
    if not getattr(params, "enable_kv_cache_events", False):
        return None
    bound = int(os.environ.get(MAX_PENDING_PAGES_ENV, DEFAULT_MAX_PENDING_PAGES))
    keys = SGLangPageKeys(tree.page_size)
    keys.chain(None, None, [0] * tree.page_size)  # builds SGLang's native hash now (at start), not in a step
    tree.events = TierEvents(tree, keys, bound)
    return SGLangEvents(tree.page_size, bool(getattr(params, "dynamo_kv_event_format", False)),
                        getattr(params, "kv_event_lora_names", None))
