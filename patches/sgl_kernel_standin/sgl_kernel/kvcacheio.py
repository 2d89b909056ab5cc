"""hiradix-standin: sgl_kernel.kvcacheio, the `--hicache-io-backend direct` copies (pure PyTorch).

SGLang's HiCache MHA host pool (`sglang/srt/mem_cache/pool_host/mha.py`) moves KV between
the device pool (per layer, `(slots, H, D)` indexed by token slot) and the host pool with:

- `transfer_kv_direct`: `--hicache-mem-layout layer_first`, both sides token-indexed per layer
  (hiradix patches/p03 makes `pool_host/mha.py` import it on CPU);
- `transfer_kv_all_layer_direct_lf_pf` (device -> host, every layer) and
  `transfer_kv_per_layer_direct_pf_lf` (host -> device, one layer): the `page_first_direct`
  host layout, `(pages, layers, page_size, H, D)` per K and V, which SGLang forces for its
  Mooncake storage backend (hiradix patches/p05 makes `pool_host/mha.py` import them on CPU).

Token slot `t` of the host pool is row `t % page_size` of page `t // page_size`. The CUDA
kernels these stand in for copy whole pages; row by row gives the same bytes for the
page-aligned index runs SGLang passes, and stays right for any others.
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


def _check_pairs(src: list[torch.Tensor], dst: list[torch.Tensor], src_indices, dst_indices, page_size) -> None:
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source buffers, {len(dst)} destination buffers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{src_indices.numel()} source slots, {dst_indices.numel()} destination slots")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"{src_indices.numel()} slots is not a whole number of pages of {page_size}")


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device (layer-first) -> host (page_first_direct), all layers, in place.

    `src_ptrs` are the device buffers, `L` of K then `L` of V, each `(slots, H, D)`;
    `dst_ptrs` are the host `[k_buffer, v_buffer]`, each `(pages, L, page_size, H, D)`.
    For each j: `dst[c][p, l, r] = src[c * L + l][src_indices[j]]` with
    `p, r = divmod(dst_indices[j], page_size)`, for K (c = 0) and V (c = 1).
    """
    if len(dst_ptrs) == 0 or len(src_ptrs) != len(dst_ptrs) * dst_ptrs[0].shape[1]:
        raise ValueError(f"{len(src_ptrs)} device buffers for {len(dst_ptrs)} host buffers of "
                         f"{dst_ptrs[0].shape[1] if dst_ptrs else 0} layers")
    _check_pairs(src_ptrs[: len(dst_ptrs)], dst_ptrs, src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    num_layers = dst_ptrs[0].shape[1]
    for c, host in enumerate(dst_ptrs):
        dst = dst_indices.to(host.device, torch.int64)
        pages, rows = dst // page_size, dst % page_size
        layers = src_ptrs[c * num_layers : (c + 1) * num_layers]
        src = src_indices.to(layers[0].device, torch.int64)
        # (n, L, H, D): token j's rows of every layer, written to its page row across layers
        gathered = torch.stack([layer.index_select(0, src) for layer in layers], dim=1)
        host[pages, :, rows] = gathered.to(host.device, host.dtype)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host (page_first_direct) -> device (layer-first), one layer, in place.

    `src_ptrs` are the host `[k_buffer, v_buffer]`, each `(pages, L, page_size, H, D)`;
    `dst_ptrs` are that layer's device `[k, v]`, each `(slots, H, D)`. For each j:
    `dst[c][dst_indices[j]] = src[c][p, layer_id, r]` with `p, r = divmod(src_indices[j], page_size)`.
    """
    _check_pairs(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    for host, device in zip(src_ptrs, dst_ptrs):
        if not 0 <= layer_id < host.shape[1]:
            raise ValueError(f"layer_id {layer_id} out of range [0, {host.shape[1]})")
        src = src_indices.to(host.device, torch.int64)
        rows = host[src // page_size, layer_id, src % page_size]  # (n, H, D)
        device.index_copy_(0, dst_indices.to(device.device, torch.int64), rows.to(device.device, device.dtype))
