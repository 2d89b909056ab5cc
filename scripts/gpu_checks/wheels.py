"""``scripts/gpu_check --prepare-wheels``: what the GPU machine lacks, downloaded where PyPI is
reachable, FlashInfer trimmed to what its attention JIT needs (the device run carries 64 MiB).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path


# What the H200 image lacks (it has torch 2.11+cu130, cupy-cuda13x, cuda-pathfinder, nvidia-cufile,
# numpy, xxhash, jinja2, nvidia-ml-py, ninja, typing-extensions): Requires-Dist checked by hand.
WHEEL_PINS = (
    "kvikio-cu13==26.10.0",  # needs cupy-cuda13x, libkvikio-cu13, numpy, packaging
    "libkvikio-cu13==26.10.0",  # needs cuda-pathfinder, cuda-toolkit[cufile]==13.*, rapids-logger==0.3.*
    "rapids-logger==0.3.0",
    "flashinfer-python==0.7.2.post1",  # needs apache-tvm-ffi; its other Requires-Dist are not imported here
    "apache-tvm-ffi==0.1.15.post2",
)
PIP_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64"]
_TRIM_EXT = (".cu", ".cuh", ".cubin", ".so", ".h", ".hpp", ".cpp", ".cc", ".ptx", ".jinja")


def _keep_flashinfer_member(name: str) -> bool:
    """Which files of the FlashInfer wheel the paged decode/prefill JIT needs (all Python is kept).

    Dropped: ``flashinfer/data/csrc/<subdir>/`` (kernels of other features; the attention
    sources are the top-level files) and compiled/CUDA sources outside ``flashinfer/data``.
    Kept: headers (data/include, cutlass, cccl, spdlog) and the top-level csrc files.
    """
    parts = name.split("/")
    if not (name.startswith("flashinfer/") or parts[0].endswith(".dist-info")):
        return False  # the wheel's build helpers (b12x/, build_backend.py) that pip does not install either
    if name.startswith("flashinfer/data/"):
        return not (len(parts) > 4 and parts[2] == "csrc")
    return not name.endswith(_TRIM_EXT)


def prepare_wheels(dest: str) -> int:
    """Download the wheels (PyPI, on a machine with network) and trim FlashInfer into a tar.xz.

    The 62 MB FlashInfer wheel (426 MB unpacked) would not fit the 64 MiB the device run can
    carry; trimmed and xz-compressed it is ~13 MB, and the whole folder ~20 MB.
    """
    import zipfile

    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PIP_PLATFORM, "-d", str(d), *WHEEL_PINS]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    for whl in sorted(d.glob("flashinfer_python-*.whl")):
        out = d / (whl.name.split("-py3-")[0] + "-trimmed.tar.xz")
        kept = dropped = 0
        with zipfile.ZipFile(whl) as zf, tarfile.open(out, "w:xz") as tf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                if not _keep_flashinfer_member(info.filename):
                    dropped += 1
                    continue
                data = zf.read(info)
                ti = tarfile.TarInfo(info.filename)
                ti.size = len(data)
                ti.mode = 0o644
                tf.addfile(ti, io.BytesIO(data))
                kept += 1
        whl.unlink()
        print(f"{out.name}: {kept} files kept, {dropped} dropped, {out.stat().st_size / 2**20:.1f} MiB", flush=True)
    total = sum(f.stat().st_size for f in d.iterdir())
    print(f"{d}: {total / 2**20:.1f} MiB in all (the device run carries at most 64 MiB with the tree)", flush=True)
    return 0
