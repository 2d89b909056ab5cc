"""SGLang HiCache L3 reads through the generic page path on CPU (what `--hicache-storage-backend file` needs).

What it changes, in the installed sglang 0.5.23: `get_dummy_flat_data_page` of the MHA and MLA
host pools (`srt/mem_cache/pool_host/mha.py`, `pool_host/mla.py`) asks for pinned memory only
when torch has an accelerator (`torch.accelerator.is_available()`); stock asks whenever the
host pool is pinned (`pin_memory=True`, its default).

Why: a storage backend without zero-copy (`file`, the L3 every HiCache user has) prefetches
into these dummy pages (`managers/cache_controller.py`, `_generic_page_get`; and
`hicache_storage.py`'s `get`). On a CPU-only torch, `torch.zeros(..., pin_memory=True)` raises
"pin_memory=True requires a CUDA or other accelerator backend", so every prefetch from L3
failed with a traceback ("HiCache prefetch transfer failed") and HiCache recomputed every
history it had written to L3: the baseline hiradix is measured against was broken, not slow.
Pinning is a DMA optimisation for a GPU; a CPU-only process has nothing to pin for. The
CUDA/HIP/XPU paths are unchanged (an accelerator is available there).
"""

from __future__ import annotations

from _patchlib import Edit, edit_files, installed_file, require_sglang_version

NAME = "hicache-file-prefetch-cpu"
MARKER = "hiradix-patch: hicache-file-prefetch-cpu"

MHA_ANCHOR = """    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        ).flatten()
"""
MLA_ANCHOR = """    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (
                self.layer_num,
                self.page_size,
                1,
                self.kv_cache_dim,
            ),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        ).flatten()
"""
PINNED = "            pin_memory=self.pin_memory,\n"
PINNED_WITH_ACCELERATOR = "            pin_memory=self.pin_memory and torch.accelerator.is_available(),\n"
HEAD = "    def get_dummy_flat_data_page(self) -> torch.Tensor:\n"
COMMENT = (f"        # {MARKER} (hiradix patches/p11_hicache_file_prefetch_cpu.py):\n"
           "        # pinned memory needs an accelerator; a CPU-only torch has no pinned allocator.\n")


def _replacement(anchor: str) -> str:
    """The anchor (a whole ``get_dummy_flat_data_page``) with the marker and the accelerator test."""
    return anchor.replace(HEAD, HEAD + COMMENT).replace(PINNED, PINNED_WITH_ACCELERATOR)


MHA_REPLACEMENT = _replacement(MHA_ANCHOR)
MLA_REPLACEMENT = _replacement(MLA_ANCHOR)


def apply() -> tuple[str, str]:
    require_sglang_version()
    targets = [
        (installed_file("sglang", "sglang/srt/mem_cache/pool_host/mha.py"), [Edit(MHA_ANCHOR, MHA_REPLACEMENT)]),
        (installed_file("sglang", "sglang/srt/mem_cache/pool_host/mla.py"), [Edit(MLA_ANCHOR, MLA_REPLACEMENT)]),
    ]
    return edit_files(targets, MARKER)
