"""SGLang HiCache `page_first_direct` host layout on CPU (what `--hicache-storage-backend mooncake` needs).

What it changes, in the installed sglang 0.5.23: `srt/mem_cache/pool_host/mha.py` also imports
`transfer_kv_all_layer_direct_lf_pf` and `transfer_kv_per_layer_direct_pf_lf` from
`sgl_kernel.kvcacheio` on the CPU engine (SGLANG_USE_CPU_ENGINE=1); stock SGLang imports them
only on CUDA/HIP (and binds them on XPU). On CPU they come from hiradix's sgl_kernel stand-in
(patch p01; pure-PyTorch row copies, `patches/sgl_kernel_standin/sgl_kernel/kvcacheio.py`); if
no sgl_kernel provides them, SGLang's own `unavailable_stub` takes their place and fails only
when called.

Why: with `--hicache-storage-backend mooncake`, SGLang switches the host pool to the
`page_first_direct` layout (`arg_groups/hicache_hook.py`, `resolve_storage_layout_compatibility`,
with `--hicache-io-backend direct`), whose device <-> host copies are those two functions; on
CPU the names are undefined and the server crashes at its first write-back. Stock HiCache +
Mooncake is the baseline hiradix's cluster tier is compared with. On CPU also set
`SGLANG_HICACHE_MOONCAKE_REUSE_TE=0`: SGLang otherwise builds its shared Mooncake transfer
engine for a GPU id. The CUDA/HIP/XPU paths are unchanged.
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "hicache-page-first-direct-cpu"
MARKER = "hiradix-patch: hicache-page-first-direct-cpu"

ANCHOR = """logger = logging.getLogger(__name__)


def prepare_mha_write_back_staging(
"""
REPLACEMENT = f"""# {MARKER} (hiradix patches/p05_hicache_page_first_direct_cpu.py):
# the CPU engine needs the page_first_direct copies for --hicache-storage-backend mooncake.
from sglang.srt.utils import is_cpu as _hiradix_p05_is_cpu

if _hiradix_p05_is_cpu():
    try:
        from sgl_kernel.kvcacheio import (
            transfer_kv_all_layer_direct_lf_pf,
            transfer_kv_per_layer_direct_pf_lf,
        )
    except ImportError as _hiradix_p05_err:
        from sglang.srt.mem_cache.pool_host._kvcacheio import unavailable_stub

        transfer_kv_all_layer_direct_lf_pf = unavailable_stub(
            "transfer_kv_all_layer_direct_lf_pf", str(_hiradix_p05_err)
        )
        transfer_kv_per_layer_direct_pf_lf = unavailable_stub(
            "transfer_kv_per_layer_direct_pf_lf", str(_hiradix_p05_err)
        )

{ANCHOR}"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/mem_cache/pool_host/mha.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
