"""SGLang HiCache host pool on CPU: skip CUDA host registration, import the direct copy.

What it changes, in the installed sglang 0.5.23:
- `srt/mem_cache/pool_host/common.py`, `_cuda_host_register`: returns at once (recording
  that nothing was registered) when CUDA is not available, instead of calling
  `torch.cuda.cudart()`, which raises on a CPU build of torch.
- `srt/mem_cache/pool_host/mha.py`: also imports `transfer_kv_direct` from
  `sgl_kernel.kvcacheio` on the CPU engine (SGLANG_USE_CPU_ENGINE=1); stock SGLang
  imports it only on CUDA/HIP/XPU. On CPU it comes from hiradix's sgl_kernel stand-in
  (patch p01); if no sgl_kernel provides it, SGLang's own `unavailable_stub` takes
  its place and fails only when called.

Why: these two are all that keep stock HiCache (the baseline hiradix is measured
against) from running on a CPU-only machine with
`--enable-hierarchical-cache --hicache-io-backend direct --hicache-mem-layout layer_first`.
Both edits leave the CUDA/HIP/XPU paths unchanged.
"""

from __future__ import annotations

from _patchlib import Edit, edit_files, installed_file, require_sglang_version

NAME = "hicache-host-pool-cpu"
MARKER = "hiradix-patch: hicache-host-pool-cpu"

COMMON_ANCHOR = """    # Avoid oversized cudaHostRegister calls on large host pools.
    cudart = torch.cuda.cudart()
"""
COMMON_REPLACEMENT = f"""    # {MARKER} (hiradix patches/p03_hicache_host_pool_cpu.py):
    # without CUDA there is nothing to register the host pool with.
    if not torch.cuda.is_available():
        setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, [])
        return
{COMMON_ANCHOR}"""

MHA_ANCHOR = """if _is_npu:
    from sgl_kernel_npu.kvcacheio import TransferDirection, transfer_kv_dim_exchange
"""
MHA_REPLACEMENT = f"""# {MARKER} (hiradix patches/p03_hicache_host_pool_cpu.py):
# the CPU engine needs transfer_kv_direct for --hicache-io-backend direct too.
from sglang.srt.utils import is_cpu as _hiradix_is_cpu

if _hiradix_is_cpu():
    try:
        from sgl_kernel.kvcacheio import transfer_kv_direct
    except ImportError as _hiradix_err:
        from sglang.srt.mem_cache.pool_host._kvcacheio import unavailable_stub

        transfer_kv_direct = unavailable_stub("transfer_kv_direct", str(_hiradix_err))
{MHA_ANCHOR}"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    targets = [
        (installed_file("sglang", "sglang/srt/mem_cache/pool_host/common.py"),
         [Edit(COMMON_ANCHOR, COMMON_REPLACEMENT)]),
        (installed_file("sglang", "sglang/srt/mem_cache/pool_host/mha.py"),
         [Edit(MHA_ANCHOR, MHA_REPLACEMENT)]),
    ]
    return edit_files(targets, MARKER)
