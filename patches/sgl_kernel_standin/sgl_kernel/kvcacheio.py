"""hiradix-standin: sgl_kernel.kvcacheio, only `transfer_kv_direct` (pure PyTorch).

SGLang's HiCache host pool calls `transfer_kv_direct` for `--hicache-io-backend direct`
with `--hicache-mem-layout layer_first`, to move KV rows between the device pool and
the host pool; hiradix patches/p03 makes `pool_host/mha.py` import it on CPU too.
"""

from __future__ import annotations

import torch


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """For each pair (src, dst) of layer buffers, set `dst[dst_indices[j]] = src[src_indices[j]]`.

    Buffers are indexed by token slot along dim 0 (shape `(slots, ...)`, same trailing
    shape and dtype on both sides); `src_indices` and `dst_indices` (shape `(n,)`) are
    token slots, `n` a multiple of `page_size`. Writes `dst_layers` in place.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers, {len(dst_layers)} destination layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{src_indices.numel()} source slots, {dst_indices.numel()} destination slots")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"{src_indices.numel()} slots is not a whole number of pages of {page_size}")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_indices.to(src.device, torch.int64))
        dst.index_copy_(0, dst_indices.to(dst.device, torch.int64), rows.to(dst.device))
