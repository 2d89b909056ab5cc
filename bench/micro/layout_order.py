"""Measure page-major vs layer-major DRAM page order for the copies hiradix makes.

For each model shape, and each order, times (minimum of ``--repeats``, interleaved, after one warm-up):

  (a) store:  HBM -> DRAM, ``store_pages`` of N pages, all layers (with ``--device cpu`` the
              device pool is a CPU tensor, so this is the gather/scatter work, not PCIe);
  (b) load:   DRAM -> HBM, ``load_layer`` once per layer for the same N pages (the layer-wise
              promotion path), total over the layers;
  (c) nvme-w: DRAM -> NVMe, ``NvmeStore.write_slots`` of the N pages (page-major: one extent
              per page; layer-major: the page's L extents gathered into a staging buffer first);
  (d) nvme-r: NVMe -> DRAM, ``read_slots`` (layer-major: read into staging, scatter L extents).

DRAM page ids and device slots are random (a pool after churn), device slots in page-aligned
groups as in SGLang. Reproduce (about a minute on 2 cores)::

    .venv/bin/python bench/micro/layout_order.py --repeats 7 --nvme-dir /tmp

On a GPU machine add ``--device cuda`` for real HBM <-> DRAM copies (pageable DRAM, as the
pool is today). Prints a table: milliseconds per operation and GB/s for each order, and layer/page time ratio.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hiradix.dataplane.layout import KVLayout, load_layer, store_pages
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import NvmeStore


@dataclass(frozen=True)
class Shape:
    """One model shape to measure, with the number of pages per operation."""

    label: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    num_pages: int  # pages per operation (N)


SHAPES = (
    Shape("llama3-8b ps16", 32, 8, 128, 16, 64),
    Shape("qwen2-0.5b ps16", 24, 2, 64, 16, 256),
    Shape("llama3-8b ps1", 32, 8, 128, 1, 512),
)


def best_s(fns: dict[bool, Callable[[], None]], repeats: int) -> dict[bool, float]:
    """Minimum wall time in seconds of each function, calls interleaved, after one warm-up each.

    The minimum (not the median) and the interleaving make the comparison robust to other
    processes sharing the CPU: interference only ever adds time.
    """
    for fn in fns.values():
        fn()
    best = {key: float("inf") for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


class Case:
    """One shape in one order: buffers, a DRAM pool and an NVMe store, and the four operations."""

    def __init__(self, shape: Shape, page_major: bool, shm_dir: Path, nvme_dir: Path, device: str):
        layout = KVLayout(shape.num_layers, shape.page_size, shape.num_kv_heads, shape.head_dim, torch.bfloat16, page_major)
        self.layout, self.shape = layout, shape
        n, ps, L = shape.num_pages, shape.page_size, shape.num_layers
        gen = torch.Generator().manual_seed(0)
        device_pages = 2 * n + 1  # page 0 is SGLang's padding page
        rows = device_pages * ps
        buf_shape = (rows, shape.num_kv_heads, shape.head_dim)
        self.k_buffers = [torch.randn(buf_shape, generator=gen).bfloat16().to(device) for _ in range(L)]
        self.v_buffers = [torch.randn(buf_shape, generator=gen).bfloat16().to(device) for _ in range(L)]
        dev_pages = torch.randperm(device_pages - 1, generator=gen)[:n] + 1
        self.token_slots = (dev_pages[:, None] * ps + torch.arange(ps)).reshape(-1).to(device)
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        tag = "pm" if page_major else "lm"
        self.pool = DramPool.create(layout, 2 * n, shm_dir / tag)
        self.page_ids = torch.randperm(2 * n, generator=gen)[:n].tolist()
        self.store = NvmeStore.create(nvme_dir / tag, layout.page_bytes, n, backend="posix", threads=4)
        self.slots = list(range(n))
        self.staging = np.empty((n, layout.page_bytes), dtype=np.uint8)
        self.nbytes = n * layout.page_bytes

    def store_op(self) -> None:
        store_pages(self.k_buffers, self.v_buffers, self.token_slots, self.pool.tensor, self.page_ids, self.layout)

    def load_op(self) -> None:
        for layer in range(self.layout.num_layers):
            load_layer(self.k_buffers[layer], self.v_buffers[layer], layer, self.pool.tensor, self.page_ids, self.token_slots, self.layout)
        self.sync()  # the last scatter into device memory is asynchronous on CUDA

    def nvme_write_op(self) -> None:
        if self.layout.page_major:
            self._check(self.store.write_slots(self.slots, [self.pool.page_view(p) for p in self.page_ids]))
            return
        lpb = self.layout.layer_page_bytes
        for i, p in enumerate(self.page_ids):  # gather the page's L extents
            for layer in range(self.layout.num_layers):
                self.staging[i, layer * lpb : (layer + 1) * lpb] = np.frombuffer(self.pool.layer_page_view(layer, p), np.uint8)
        self._check(self.store.write_slots(self.slots, [memoryview(row) for row in self.staging]))

    def nvme_read_op(self) -> None:
        if self.layout.page_major:
            self._check(self.store.read_slots(self.slots, [self.pool.page_view(p) for p in self.page_ids]))
            return
        self._check(self.store.read_slots(self.slots, [memoryview(row) for row in self.staging]))
        lpb = self.layout.layer_page_bytes
        for i, p in enumerate(self.page_ids):  # scatter the page's L extents
            for layer in range(self.layout.num_layers):
                np.frombuffer(self.pool.layer_page_view(layer, p), np.uint8)[:] = self.staging[i, layer * lpb : (layer + 1) * lpb]

    @staticmethod
    def _check(ok: list[bool]) -> None:
        assert all(ok), "NVMe I/O failed"

    def close(self) -> None:
        self.store.close()
        self.pool.close()
        self.pool.unlink()


OPS = {"store": Case.store_op, "load": Case.load_op, "nvme-w": Case.nvme_write_op, "nvme-r": Case.nvme_read_op}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="where the stand-in device pool lives: cpu, or cuda for real HBM<->DRAM copies")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads (1: per-core cost, steadier on a shared machine)")
    parser.add_argument("--nvme-dir", type=Path, default=None, help="parent directory on the disk to test (default: the temp dir, /tmp)")
    parser.add_argument("--shm-dir", type=Path, default=None, help="tmpfs parent directory for the DRAM pool (default: /dev/shm)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    nvme_root = Path(tempfile.mkdtemp(prefix="hiradix-bench-", dir=args.nvme_dir))
    shm_root = Path(tempfile.mkdtemp(prefix="hiradix-bench-", dir=args.shm_dir or "/dev/shm"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device pool on {args.device}; DRAM in {shm_root}, NVMe file in {nvme_root}")
    header = f"{'shape':<17}{'N':>5}{'MiB':>6} {'op':<7}{'page-major ms':>14}{'GB/s':>6}{'layer-major ms':>16}{'GB/s':>6}{'lm/pm':>7}"
    print(header)
    print("-" * len(header))
    try:
        for shape in SHAPES:
            cases = {pm: Case(shape, pm, shm_root, nvme_root, args.device) for pm in (True, False)}
            try:
                for op, method in OPS.items():
                    t = best_s({pm: (lambda c=case: method(c)) for pm, case in cases.items()}, args.repeats)
                    nbytes = cases[True].nbytes
                    print(
                        f"{shape.label:<17}{shape.num_pages:>5}{nbytes / 2**20:>6.0f} {op:<7}"
                        f"{t[True] * 1e3:>14.2f}{nbytes / t[True] / 1e9:>6.2f}"
                        f"{t[False] * 1e3:>16.2f}{nbytes / t[False] / 1e9:>6.2f}{t[False] / t[True]:>7.2f}",
                        flush=True,
                    )
            finally:
                for case in cases.values():
                    case.close()
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)


if __name__ == "__main__":
    main()
