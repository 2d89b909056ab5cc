"""The simulated NVMe tier in a compressed page format (``--cold-format``; issue 21, hiradix ``--hiradix-cold-format``).

hiradix's I/O worker encodes a page on its way down to NVMe and decodes it on the way up
(:mod:`hiradix.dataplane.kv_codec`); NVMe slots are sized for the encoded page, so the same NVMe
bytes hold ``1 / ratio`` times the tokens (``ratio`` = encoded bytes / source bytes of a page:
~0.5 for ``fp8`` of a 16-bit page, ~0.27 for ``int4`` at page size 512), and a read or write moves
``ratio`` times the bytes. HBM and DRAM keep the model's dtype. In the simulator:

* capacity: ``SimConfig.nvme_tokens`` is the NVMe tier's size in tokens *of the model's dtype*
  (its bytes over ``kv_bytes_per_token``); it holds ``nvme_tokens / ratio`` tokens in whole pages;
* time per page read (written): encoded bytes over ``nvme_read_bytes_per_s`` (``..._write_...``)
  plus source bytes over ``cold_decode_bytes_per_s`` (``cold_encode_bytes_per_s``), serial, as one
  I/O worker thread reads then decodes; ``inf`` (the default) = a free codec;
* cost model: NVMe runs are read at the effective source rate ``1 / (ratio / nvme + 1 / decode)``.

``exact`` is ratio 1 with no codec time: the figures of the simulator without this module. The
cluster store's pages (``bench/sim/cluster.py``) are not compressed here.

Ratio: ``cold_bytes_ratio`` when > 0, else the codec's encoded page (header included) over the
source page for the simulator's default model shape, Llama-3-8B in 16-bit (32 layers, 8 KV heads
x 128; :data:`DEFAULT_SHAPE`, which matches ``kv_bytes_per_token`` = 128 KiB) at ``page_size``.
"""

from __future__ import annotations

import functools
import math

from hiradix.config import COLD_FORMATS

DEFAULT_SHAPE = (32, 8, 128)  # layers, KV heads, head dim: Llama-3-8B (SimConfig.kv_bytes_per_token = 131072 at 16 bits)


def check_cold_format(fmt: str, ratio: float, decode_bytes_per_s: float, encode_bytes_per_s: float) -> None:
    """Raises ValueError for an unknown format (listing :data:`COLD_FORMATS`), a ratio outside
    ``[0, 1]`` (0 = from the codec) or a non-positive codec rate."""
    if fmt not in COLD_FORMATS:
        raise ValueError(f"cold_format must be one of {', '.join(COLD_FORMATS)}; got {fmt!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"cold_bytes_ratio must be in [0, 1] (0 = the codec's), got {ratio}")
    if decode_bytes_per_s <= 0 or encode_bytes_per_s <= 0:
        raise ValueError(f"cold codec rates must be > 0 (inf = free), got {decode_bytes_per_s}, {encode_bytes_per_s}")


@functools.lru_cache(maxsize=None)
def codec_bytes_ratio(fmt: str, page_size: int) -> float:
    """Encoded / source bytes of one page of :data:`DEFAULT_SHAPE` (16-bit) in ``fmt``; 1.0 for ``exact``.

    Source: :class:`hiradix.dataplane.kv_codec.PageCodec` ``encoded_bytes`` (imports torch).
    """
    if fmt == "exact":
        return 1.0
    import torch

    from hiradix.dataplane.kv_codec import PageCodec
    from hiradix.dataplane.layout import KVLayout

    layers, heads, head_dim = DEFAULT_SHAPE
    layout = KVLayout(layers, page_size, heads, head_dim, torch.float16)
    return PageCodec(layout, fmt).encoded_bytes / layout.page_bytes


def bytes_ratio(cfg) -> float:
    """Encoded / source bytes of an NVMe page under ``cfg`` (a :class:`bench.sim.simulate.SimConfig`)."""
    if cfg.cold_format == "exact":
        return 1.0
    return cfg.cold_bytes_ratio if cfg.cold_bytes_ratio > 0 else codec_bytes_ratio(cfg.cold_format, cfg.page_size)


def nvme_page_bytes(cfg) -> int:
    """Bytes one NVMe page takes: the source page for ``exact``, else ``ceil(page_bytes x ratio)``."""
    return cfg.page_bytes if cfg.cold_format == "exact" else math.ceil(cfg.page_bytes * bytes_ratio(cfg))


def nvme_slots(cfg) -> int:
    """Pages the NVMe tier holds: its bytes (``nvme_tokens`` whole source pages) over :func:`nvme_page_bytes`."""
    return (cfg.nvme_tokens // cfg.page_size) * cfg.page_bytes // nvme_page_bytes(cfg)


def _codec_s(cfg, rate: float) -> float:
    return 0.0 if cfg.cold_format == "exact" or math.isinf(rate) else cfg.page_bytes / rate


def nvme_read_s(cfg, num_pages: int) -> float:
    """Seconds to read ``num_pages`` pages up from NVMe and decode them, one after another."""
    return num_pages * nvme_page_bytes(cfg) / cfg.nvme_read_bytes_per_s + num_pages * _codec_s(cfg, cfg.cold_decode_bytes_per_s)


def nvme_read_s_per_page(cfg) -> float:
    """Seconds to read one page up from NVMe and decode it."""
    return nvme_read_s(cfg, 1)


def nvme_write_s_per_page(cfg) -> float:
    """Seconds to encode one page and write it to NVMe."""
    return nvme_page_bytes(cfg) / cfg.nvme_write_bytes_per_s + _codec_s(cfg, cfg.cold_encode_bytes_per_s)


def nvme_source_read_bytes_per_s(cfg) -> float:
    """NVMe -> DRAM rate in source (model dtype) bytes per second, codec included (the cost model's)."""
    if cfg.cold_format == "exact":
        return cfg.nvme_read_bytes_per_s
    return cfg.page_bytes / nvme_read_s_per_page(cfg)
