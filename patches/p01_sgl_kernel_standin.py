"""sgl_kernel: install a pure-PyTorch stand-in when no real sgl_kernel is importable.

What it changes: copies `patches/sgl_kernel_standin/sgl_kernel/` into this
interpreter's site-packages, with a small `.dist-info` (distribution
`hiradix-sgl-kernel-standin`) so that pip lists it and `pip uninstall
hiradix-sgl-kernel-standin` removes it. Nothing of SGLang is edited.

Why: with SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports `sgl_kernel` helpers at module
level (`assign_req_to_token_pool_cpu` in srt/mem_cache/allocation.py,
`copy_all_layer_kv_cache_cpu` in kernels/ops/kvcache/cache_move.py, and six
speculative-decoding helpers in kernels/ops/speculative/), so the server cannot start
without them, and the sgl-kernel wheels on PyPI are CUDA-only. The stand-in registers
no torch ops, so SGLang's AMX checks stay false and its torch-native CPU paths run.
See the package docstring for what each name does.

Skipped when a real `sgl_kernel` imports. Refuses (error) when a non-stand-in
`sgl_kernel` is installed but does not import: that one is not ours to overwrite.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from _patchlib import (
    ALREADY,
    APPLIED,
    SKIPPED,
    PatchError,
    python_ok,
    require_sglang_version,
    site_packages,
    write_atomic,
)

NAME = "sgl-kernel-standin"
MARKER = "hiradix-standin: sgl_kernel"
DIST_NAME = "hiradix-sgl-kernel-standin"
DIST_VERSION = "0.1.0"
SOURCE = Path(__file__).resolve().parent / "sgl_kernel_standin" / "sgl_kernel"


def _sources() -> dict[str, str]:
    files = {p.name: p.read_text(encoding="utf-8") for p in sorted(SOURCE.glob("*.py"))}
    if MARKER not in files.get("__init__.py", ""):
        raise PatchError(f"{SOURCE / '__init__.py'}: stand-in source lacks the marker {MARKER!r}")
    return files


def _is_standin(pkg: Path) -> bool:
    init = pkg / "__init__.py"
    return init.is_file() and MARKER in init.read_text(encoding="utf-8", errors="replace")


def _record_line(relpath: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{relpath},sha256={digest},{len(data)}"


def _write_dist_info(sp: Path, files: dict[str, str]) -> None:
    dist_info = sp / f"{DIST_NAME.replace('-', '_')}-{DIST_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    meta = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {DIST_VERSION}\n"
            "Summary: hiradix's pure-PyTorch CPU stand-in for the sgl_kernel helpers SGLang 0.5.23 "
            "imports on its CPU path (installed by hiradix patches/apply.py)\n"
        ),
        "INSTALLER": "hiradix-patches\n",
        "top_level.txt": "sgl_kernel\n",
    }
    lines = [_record_line(f"sgl_kernel/{name}", text.encode()) for name, text in files.items()]
    for name, text in meta.items():
        (dist_info / name).write_text(text, encoding="utf-8")
        lines.append(_record_line(f"{dist_info.name}/{name}", text.encode()))
    lines.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n", encoding="utf-8")


def apply() -> tuple[str, str]:
    require_sglang_version()
    sp = site_packages()
    pkg = sp / "sgl_kernel"
    files = _sources()
    if _is_standin(pkg):
        stale = [n for n, t in files.items()
                 if not (pkg / n).is_file() or (pkg / n).read_text(encoding="utf-8") != t]
        if not stale:
            return ALREADY, str(pkg)
        for name in stale:  # an older stand-in: bring it up to date
            write_atomic(pkg / name, files[name])
        _write_dist_info(sp, files)
        return APPLIED, f"{pkg} (updated {', '.join(stale)})"
    ok, last = python_ok("import sgl_kernel")
    if ok:
        return SKIPPED, "not needed: a real sgl_kernel imports"
    if "No module named 'sgl_kernel'" not in last:
        raise PatchError(
            f"{pkg}: an sgl_kernel is installed but does not import ({last}); the stand-in is only "
            "installed where there is none (pip uninstall sgl-kernel, then re-run)"
        )
    tmp = Path(tempfile.mkdtemp(prefix=".sgl_kernel.", dir=sp))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        os.rename(tmp, pkg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_dist_info(sp, files)
    ok, last = python_ok("import sgl_kernel, torch; assert sgl_kernel.HIRADIX_STANDIN; "
                         "assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')")
    if not ok:
        raise PatchError(f"{pkg}: installed, but the stand-in does not import: {last}")
    return APPLIED, str(pkg)
