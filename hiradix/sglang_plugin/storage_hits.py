"""Which of a request's cached tokens came from NVMe or the cluster store (SGLang's ``storage``)."""

from __future__ import annotations

from typing import Any, Optional

from hiradix.core.node import Tier


def note_storage_hits(req: Any, back: Any, store_backend: Optional[str], start: Optional[int] = None) -> None:
    """Record on ``req`` the tokens of a promotion (``back``, a :class:`~hiradix.core.prefix_cache.LoadBack`)
    whose DRAM copy was read up from NVMe or the cluster store for this request, whether the
    look-ahead window read them early or the request waited. SGLang splits the cached prefix into
    device, host and storage by these (``split_cached_prefix_by_tier``), and the
    ``cached_tokens_details`` hook labels them by source (``nvme=160,mooncake=320``).

    A history larger than DRAM is promoted in parts while its request waits
    (:mod:`hiradix.core.dram_stream`; ``start``: the part's first token): those parts are kept on
    the request and added up, from the first part's start.
    """
    store = store_backend or "store"
    streamed = getattr(req, "hiradix_streamed", None)
    counts = dict(streamed[1]) if streamed is not None else {"nvme": 0, store: 0}
    counts["nvme"] += back.read_from[Tier.NVME]
    counts[store] += back.read_from[Tier.STORE]
    if start is not None:
        streamed = req.hiradix_streamed = (streamed[0] if streamed is not None else start, counts)
    req.storage_hit_length = sum(counts.values())
    req.storage_hit_start = streamed[0] if streamed is not None else None
    req.hiradix_storage_backend = ",".join(f"{name}={n}" for name, n in counts.items() if n) or None
