"""hiradix-standin: sgl_kernel (pure PyTorch, CPU only). Installed by hiradix patches/apply.py.

SGLang 0.5.23's CPU path (SGLANG_USE_CPU_ENGINE=1) imports a few helpers from
`sgl_kernel` at module level; the sgl-kernel wheels on PyPI are CUDA-only. This
package provides those names and nothing else:

- `assign_req_to_token_pool_cpu` and `copy_all_layer_kv_cache_cpu`: implemented here
  with plain tensor indexing, same arguments and in-place effect as SGLang's Triton
  kernels they stand in for (`sglang/srt/mem_cache/allocation.py`,
  `sglang/kernels/ops/kvcache/cache_move.py`).
- `kvcacheio.transfer_kv_direct`: the row copy behind HiCache's
  `--hicache-io-backend direct` (see `kvcacheio.py`).
- the speculative-decoding helpers that `sglang/kernels/ops/speculative/*` imports
  at module level: importable, but they raise NotImplementedError when called
  (speculative decoding is not supported with this stand-in).

It registers no torch ops (`torch.ops.sgl_kernel` stays empty), so SGLang's
`cpu_has_amx_support()` stays False and its torch-native CPU paths run.
"""

from __future__ import annotations

import ctypes

import torch

HIRADIX_STANDIN = True

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV slots into the request-to-token table, in place.

    For request i of the batch (shapes `(batch,)`), row `req_pool_indices[i]` of
    `req_to_token` (shape `(num_reqs, pool_len)`) gets, at columns
    `[start_offset[i], end_offset[i])`, the next `end_offset[i] - start_offset[i]`
    entries of `out_cache_loc`; request i's entries follow those of requests 0..i-1.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"req_to_token must be (num_reqs, pool_len={pool_len}); got {tuple(req_to_token.shape)}"
        )
    lens = (end_offset - start_offset).to(torch.int64)
    total = int(lens.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    seg_first = torch.cumsum(lens, 0) - lens  # index in out_cache_loc of each request's first slot
    pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(seg_first, lens)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lens) + pos
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _rows_view(base_ptr: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A `(num_rows, row_bytes)` uint8 tensor over the memory at `base_ptr` (no copy)."""
    array = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(base_ptr)
    return torch.frombuffer(array, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV slots `src_loc` onto slots `tgt_loc` in every buffer, in place.

    `data_ptrs[b]` is the address of buffer b (a KV pool buffer, one per layer
    and per K/V) and `strides[b]` its slot size in bytes (shapes `(num_buffers,)`).
    `tgt_loc` and `src_loc` (shape `(n,)`) are slot indices. All source slots are
    read before any target slot is written, so the ranges may overlap.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} slots, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _rows_view(int(ptr), int(row_bytes), num_rows)
        rows[tgt] = rows[src]  # rows[src] is a copy: gather first, then scatter


def _speculative_unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not available with hiradix's "
            "pure-PyTorch sgl_kernel stand-in (install a real sgl-kernel CPU build)"
        )

    op.__name__ = op.__qualname__ = name
    return op


# Imported at module level by sglang/kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py.
assign_draft_cache_locs_contiguous_cpu = _speculative_unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _speculative_unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _speculative_unsupported("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _speculative_unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _speculative_unsupported("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _speculative_unsupported("verify_tree_greedy_cpu")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'sgl_kernel' has no attribute {name!r}: this sgl_kernel is hiradix's CPU "
        "stand-in and provides only what SGLang 0.5.23's CPU server path imports"
    )
