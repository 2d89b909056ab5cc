"""What one store object is: a page's bytes followed by the NVMe tier's checksum trailer.

``| payload (page_bytes) | trailer (TRAILER.size = 40 bytes) |``; the trailer
(:mod:`hiradix.tiers.checksum`) holds a magic, the format version, the payload length,
an id and ``xxh3_64`` of the payload. In a store the id is ``xxh3_64`` of the object's key,
so an object read under the wrong key (another key's bytes, a hash collision of a caller's
key scheme, a store that mixed objects up) fails its check like a corrupted or truncated one:
a miss, never KV. Pure bytes, no I/O; every backend uses it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import xxhash

from hiradix.tiers.checksum import TRAILER, pack_trailer, verify_trailer

MAX_KEY_CHARS = 256
OBJECT_OVERHEAD_BYTES = TRAILER.size  # bytes an object holds beyond its page


def key_id(key: str) -> int:
    """The trailer id of ``key``: ``xxh3_64`` of its UTF-8 bytes (u64)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


def check_keys(keys: list[str], num_pages: int) -> None:
    """Validate a batch's keys against its pages.

    Raises:
        ValueError: ``len(keys) != num_pages``, or a key that is not a str of
            1..:data:`MAX_KEY_CHARS` characters.
    """
    if len(keys) != num_pages:
        raise ValueError(f"{len(keys)} keys for {num_pages} pages")
    for key in keys:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise ValueError(f"a store key must be a str of 1..{MAX_KEY_CHARS} characters, got {key!r:.80}")


def pack_object_trailer(payload: np.ndarray, key: str) -> bytes:
    """The trailer that follows ``payload`` (uint8 ``(page_bytes,)``) in the object of ``key``."""
    return pack_trailer(payload, key_id(key))


def verify_object(payload: np.ndarray, trailer: np.ndarray, key: str) -> Optional[str]:
    """Check an object read under ``key`` (payload and trailer as two uint8 buffers).

    Returns:
        ``None`` if it verifies, else the reason (for the log).
    """
    reason = verify_trailer(payload, trailer, key_id(key))
    if reason is not None and reason.startswith("trailer names slot"):
        return "object of another key"
    return reason
