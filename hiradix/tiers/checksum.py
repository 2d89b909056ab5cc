"""The checksum trailer of an NVMe slot: what makes a slot read verifiable (pure bytes, no I/O).

``| payload (page_bytes) | trailer (TRAILER.size bytes) |``: a magic, the format version, the
payload length, the slot id and ``xxhash.xxh3_64`` of the payload, little-endian. A slot whose
trailer does not check out is a miss, never KV (:mod:`hiradix.tiers.nvme`).
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

TRAILER_MAGIC = b"HIRADIX\x00"
FORMAT_VERSION = 1
# magic (8 s), format version (u32), reserved (u32, 0), payload bytes (u64), slot id (u64), xxh3_64 (u64)
TRAILER = struct.Struct("<8sIIQQQ")


def pack_trailer(payload: np.ndarray, slot_id: int) -> bytes:
    """Trailer for ``payload`` (uint8 array) written to ``slot_id``."""
    digest = xxhash.xxh3_64_intdigest(payload)
    return TRAILER.pack(TRAILER_MAGIC, FORMAT_VERSION, 0, payload.nbytes, slot_id, digest)


def verify_slot(slot: np.ndarray, page_bytes: int, slot_id: int) -> str | None:
    """Check a slot image read from the file.

    Args:
        slot: uint8 ``(slot_bytes,)``, the slot as read.
        page_bytes: the payload length this store expects.
        slot_id: the slot it was read from.

    Returns:
        ``None`` if it verifies, else the reason (for the log).
    """
    magic, version, _, payload_bytes, stored_slot, digest = TRAILER.unpack_from(slot, page_bytes)
    if magic != TRAILER_MAGIC:
        return "bad magic (never written, or overwritten)"
    if version != FORMAT_VERSION:
        return f"format version {version} != {FORMAT_VERSION}"
    if payload_bytes != page_bytes:
        return f"payload length {payload_bytes} != {page_bytes}"
    if stored_slot != slot_id:
        return f"trailer names slot {stored_slot}"
    if xxhash.xxh3_64_intdigest(slot[:page_bytes]) != digest:
        return "checksum mismatch"
    return None
