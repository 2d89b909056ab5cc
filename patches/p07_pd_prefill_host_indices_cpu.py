"""SGLang PD disaggregation, prefill side: KV page indices on the CPU engine without CUDA calls.

What it changes, in the installed sglang 0.5.23: `srt/disaggregation/prefill.py`,
`_send_kv_chunk` takes its pinned host-index branch only when the KV indices are on a CUDA
device (`and kv_indices.is_cuda`); otherwise it takes the branch every other sender already uses
(`kv_to_page_indices`, synchronous).

Why: with a sender that supports host tensor indices (`mooncake_tcp`), the branch allocates the
page indices with `pin_memory=True` and records a `torch.cuda.Event()` so the D2H copy can finish
on the transfer worker. On the CPU engine the indices are already host tensors and neither call
exists: the prefill scheduler dies at its first KV send ("pin_memory=True requires a CUDA or other
accelerator backend"), and the decode server answers HTTP 500 (KVTransferError, lost connection).
The CUDA path is unchanged.
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "pd-prefill-host-indices-cpu"
MARKER = "hiradix-patch: pd-prefill-host-indices-cpu"

ANCHOR = """            if getattr(sender, "supports_host_tensor_indices", False) and not (
                sender.kv_mgr.enable_all_cp_ranks_for_transfer
                and not get_parallel().enable_dsa_cache_layer_split
            ):
"""
REPLACEMENT = f"""            # {MARKER} (hiradix patches/p07_pd_prefill_host_indices_cpu.py):
            # the pinned-copy + CUDA-event branch only for CUDA indices (CPU engine: plain path).
            if getattr(sender, "supports_host_tensor_indices", False) and kv_indices.is_cuda and not (
                sender.kv_mgr.enable_all_cp_ranks_for_transfer
                and not get_parallel().enable_dsa_cache_layer_split
            ):
"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/disaggregation/prefill.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
