"""The fingerprint of everything that makes persisted KV reusable by this server.

KV bytes are only valid for the exact model weights, KV layout and tensor-parallel shard that
wrote them. :func:`kv_fingerprint` names all of it as a flat ``str -> str`` dict, stored in the
NVMe index header (:mod:`hiradix.persistence.index`); any difference after a restart means the
slots are not reused.

The model's identity (:func:`model_identity`) is a content hash, not a path: a fine-tune with
the same architecture in the same directory must not match. Hashing every weight byte of a
large model at each start would take minutes, so it hashes ``config.json`` in full and, for
every weight file, its name, size and 18 samples of 64 KiB (first and last MiB plus 16 evenly
spaced), which differ for any retrained or re-quantised checkpoint. A hub id (no local
directory) is identified by id and revision. The NVMe index, which only this machine reads, also
records :func:`weights_stamp` (each weight file's name, size and modification time): a weight
file changed in place, even where no sample falls (one patched tensor), discards the pages. The
store's keys leave it out: every node's copy of a model has its own modification times.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Optional

import xxhash

import hiradix
from hiradix.core.keys import HASH_NAME
from hiradix.dataplane.layout import KVLayout

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 * 1024
EDGE_BYTES = 1024 * 1024
NUM_SAMPLES = 16


def _hash_weight_file(h: xxhash.xxh3_128, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        for i in range(NUM_SAMPLES):
            f.seek(size * (i + 1) // (NUM_SAMPLES + 1))
            h.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - EDGE_BYTES))
        h.update(f.read(EDGE_BYTES))


def model_identity(model_path: str, revision: Optional[str] = None) -> str:
    """A content hash of a local model directory (hex), or ``hub:<id>@<revision>``.

    Raises:
        OSError: a file of the directory cannot be read.
    """
    root = Path(model_path)
    if not root.is_dir():
        return f"hub:{model_path}@{revision or 'default'}"
    h = xxhash.xxh3_128()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        _hash_weight_file(h, path)
    return h.hexdigest()


def weights_stamp(model_path: str) -> Optional[str]:
    """Names, sizes and modification times (ns) of a local model's weight files, hashed (hex);
    None for a hub id. Any rewrite of a weight file changes it.

    Raises:
        OSError: a file of the directory cannot be read.
    """
    root = Path(model_path)
    if not root.is_dir():
        return None
    h = xxhash.xxh3_128()
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def kv_fingerprint(
    model_id: str, model_dtype: str, layout: KVLayout, tp_rank: int, tp_size: int, slot_bytes: int,
    attn_dp_size: int = 1, shared_host_copy: bool = False, page_format: str = "exact",
    weights_stamp: Optional[str] = None,
) -> dict[str, str]:
    """Everything persisted KV depends on, as strings.

    Args:
        model_id: :func:`model_identity` of the served model.
        model_dtype: SGLang's ``--dtype`` after resolution (activations change KV values).
        layout: the KV layout of this rank's pages (layers, page size, KV heads, head dim, dtype).
        tp_rank, tp_size: this rank's tensor-parallel shard.
        slot_bytes: bytes per NVMe slot (payload + trailer + padding).
        attn_dp_size: DP attention ranks (``--attn-dp-size``; each computes its own batches'
            KV, with other collectives than plain TP); recorded only when > 1.
        shared_host_copy: the directory is the one copy the TP ranks of a node share (MLA,
            ``hiradix.runtime.shared_host_copy``): a restart with one copy per rank (or the
            other way round) must not re-index it on one rank only; recorded only when True.
        page_format: the tier's page format (``--hiradix-cold-format``,
            :mod:`hiradix.dataplane.kv_codec`); recorded only when not ``exact``, so exact tiers
            keep today's fingerprint.
        weights_stamp: :func:`weights_stamp` of the model (the NVMe index only); recorded when given.
    """
    return {
        "model": model_id,
        "model_dtype": str(model_dtype),
        "kv_dtype": str(layout.dtype),
        "page_size": str(layout.page_size),
        "num_layers": str(layout.num_layers),
        "num_kv_heads": str(layout.num_kv_heads),
        "head_dim": str(layout.head_dim),
        "page_major": str(layout.page_major),
        **({"mla_rope_dim": str(layout.rope_dim)} if layout.is_mla else {}),
        "tp_rank": str(tp_rank),
        "tp_size": str(tp_size),
        **({"attn_dp_size": str(attn_dp_size)} if attn_dp_size > 1 else {}),
        **({"host_copy": "node"} if shared_host_copy else {}),
        **({"page_format": page_format} if page_format != "exact" else {}),
        **({"weights_stamp": weights_stamp} if weights_stamp else {}),
        "slot_bytes": str(slot_bytes),
        "hiradix_version": hiradix.__version__,
        "page_hash": HASH_NAME,
        "byte_order": sys.byteorder,
    }


STORE_FORMAT = "hiradix-store-v1"  # object layout in the cluster store: page payload + checksum trailer


def is_store_writer(layout: KVLayout, tp_rank: int) -> bool:
    """Whether this rank PUTs its pages into the cluster store: every rank for per-head K/V (each
    holds its own heads), rank 0 only for MLA (the ranks' latents are identical)."""
    return not layout.is_mla or tp_rank == 0


def store_key_prefix(model_id: str, model_dtype: str, layout: KVLayout, tp_rank: int, tp_size: int,
                     attn_dp_size: int = 1, page_format: str = "exact") -> str:
    """The cluster store's key prefix for this rank's KV: ``hiradix/<digest>/``.

    The digest (16 hex digits of SHA-256) covers what :func:`kv_fingerprint` covers except the
    NVMe slot size and the hiradix version (servers of other versions share KV when the object
    format is the same, ``STORE_FORMAT``), so a different model, dtype, page size, layout or TP
    shard never reads another's objects (nor a page of another format, ``page_format``). MLA (``layout.is_mla``): every TP rank holds the same
    latent, so the key has no TP rank (one object per page, written by one rank, read by all;
    HiCache's MLA keys do the same, ``mem_cache/hicache_storage.py``); the TP size stays in it.
    With DP attention (``attn_dp_size`` > 1) ``tp_rank`` is the rank in the attention-TP group,
    so the DP ranks of a server (and of other servers of the same shape) share their objects.
    """
    fp = kv_fingerprint(model_id, model_dtype, layout, 0 if layout.is_mla else tp_rank, tp_size, slot_bytes=0,
                        attn_dp_size=attn_dp_size, page_format=page_format)
    del fp["slot_bytes"], fp["hiradix_version"]
    if layout.is_mla:
        fp["tp_rank"] = "replicated"
    fp["store_format"] = STORE_FORMAT
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return f"hiradix/{digest}/"
