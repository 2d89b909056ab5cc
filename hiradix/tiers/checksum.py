"""The checksum trailer of an NVMe slot: what makes a slot read verifiable (pure bytes, no I/O).

``| payload (page_bytes) | trailer (TRAILER.size bytes) |``: a magic, the format version, the
payload length, the slot id and ``xxhash.xxh3_64`` of the payload, little-endian. A slot whose
trailer does not check out is a miss, never KV (:mod:`hiradix.tiers.nvme`). A cluster-store
object is the same payload + trailer, with a hash of its key as the slot id
(:mod:`hiradix.tiers.store.framing`).
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
    return verify_trailer(slot[:page_bytes], slot[page_bytes : page_bytes + TRAILER.size], slot_id)


def verify_trailer(payload: np.ndarray, trailer: np.ndarray, slot_id: int) -> str | None:
    """Check a payload against its trailer when the two are separate buffers (a store object).

    Args:
        payload: uint8 ``(page_bytes,)``, the payload as read.
        trailer: uint8 ``(TRAILER.size,)``, the trailer as read.
        slot_id: the id the trailer must name (an NVMe slot, or a store key's hash).

    Returns:
        ``None`` if it verifies, else the reason (for the log).
    """
    if trailer.nbytes != TRAILER.size:
        return f"trailer length {trailer.nbytes} != {TRAILER.size}"
    magic, version, _, payload_bytes, stored_slot, digest = TRAILER.unpack_from(trailer, 0)
    if magic != TRAILER_MAGIC:
        return "bad magic (never written, or overwritten)"
    if version != FORMAT_VERSION:
        return f"format version {version} != {FORMAT_VERSION}"
    if payload_bytes != payload.nbytes:
        return f"payload length {payload_bytes} != {payload.nbytes}"
    if stored_slot != slot_id:
        return f"trailer names slot {stored_slot}"
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return "checksum mismatch"
    return None
