"""NVMe slots read into device memory (NVMe -> HBM), each slot verified before it is used.

Two paths, chosen by :func:`choose_device_read_path`:

- ``kvikio``: KvikIO ``CuFile.pread`` into a device bounce buffer. Chosen only where GPUDirect
  Storage is present (KvikIO not in its compatibility mode), so the NVMe DMA lands in HBM
  without passing through host memory.
- ``posix``: the store's own verified :meth:`NvmeStore.read_slots` into page-locked host pages,
  then one host-to-device copy per chunk. The fallback wherever GDS is not.

A slot's checksum (``xxh3_64``, :mod:`hiradix.tiers.checksum`) is computed on the host, so the
``kvikio`` path copies each chunk's slot images back to pinned host memory (D2H, the other PCIe
direction) and verifies them there; only verified payloads are then copied into place
(device to device). A slot that fails is a miss and its destination row is left untouched.

Not wired into serving: the server reads NVMe into DRAM in the I/O worker process (which has no
CUDA context) and streams DRAM -> HBM layer by layer. Reading NVMe straight into HBM would need
the scheduler process to do the I/O and an NVMe -> HBM transfer kind in the core's ledger,
which this module does not add. ``scripts/gpu_check`` measures it against raw reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

from hiradix.tiers.checksum import verify_slot

if TYPE_CHECKING:
    from hiradix.tiers.nvme import NvmeStore

logger = logging.getLogger(__name__)

DEVICE_READ_PATHS = ("kvikio", "posix")
DEVICE_READ_CHUNK_BYTES = 256 << 20  # slot images read (and verified) per round, at most


def gds_status() -> tuple[Optional[str], Optional[bool]]:
    """``(why kvikio is unusable or None, whether KvikIO prefers its compatibility mode)``.

    The second value is ``kvikio.defaults.is_compat_mode_preferred()`` (True: no GDS), None
    when KvikIO is unusable or could not be asked.
    """
    from hiradix.tiers.nvme import kvikio_unusable_reason  # noqa: PLC0415 - nvme imports this module lazily

    reason = kvikio_unusable_reason()
    if reason is not None:
        return reason, None
    try:
        import kvikio  # noqa: PLC0415

        return None, bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:
        logger.info("cannot ask KvikIO whether it prefers compatibility mode: %s", exc)
        return None, None


def choose_device_read_path(kvikio_reason: Optional[str], compat_preferred: Optional[bool]) -> tuple[str, str]:
    """Which NVMe -> HBM path to use, and why (see :func:`gds_status` for the arguments).

    Returns:
        ``(path, reason)``, path one of :data:`DEVICE_READ_PATHS`.
    """
    if kvikio_reason is not None:
        return "posix", f"kvikio not usable: {kvikio_reason}"
    if compat_preferred is None:
        return "posix", "cannot tell whether GPUDirect Storage is present"
    if compat_preferred:
        return "posix", "no GPUDirect Storage (KvikIO would run in compatibility mode)"
    return "kvikio", "GPUDirect Storage present"


def _chunks(slot_ids: Sequence[int], chunk_slots: int) -> list[list[tuple[int, int, int]]]:
    """Runs ``(index, first_slot, length)`` of consecutive slot ids, grouped into rounds of at
    most ``chunk_slots`` slots (a run longer than that is split)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(int(s) for s in slot_ids):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][2] < chunk_slots:
            index, first, length = runs[-1]
            runs[-1] = (index, first, length + 1)
        else:
            runs.append((i, slot, 1))
    rounds: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for run in runs:
        if used + run[2] > chunk_slots:
            rounds.append([])
            used = 0
        rounds[-1].append(run)
        used += run[2]
    return [r for r in rounds if r]


def _device_array(t: torch.Tensor):
    """A device tensor as KvikIO's surest buffer type: a CuPy view (CuPy comes with KvikIO)."""
    try:
        import cupy  # noqa: PLC0415

        return cupy.asarray(t)
    except ImportError:
        return t  # torch's __cuda_array_interface__


class DeviceSlotReader:
    """Reads NVMe slots of one store into rows of a device tensor.

    Args:
        store: the slot file (its ``path``, ``page_bytes``, ``slot_bytes``, ``read_slots``).
        device: where the destination rows live (CUDA; a CPU device runs the ``posix`` path,
            for tests).
        path: force ``"kvikio"`` or ``"posix"``; None chooses with :func:`choose_device_read_path`.

    Raises:
        ValueError: an unknown path.
        RuntimeError: ``"kvikio"`` forced where KvikIO cannot be imported or opened.
    """

    def __init__(self, store: NvmeStore, device: torch.device, path: Optional[str] = None):
        if path is None:
            path, self.reason = choose_device_read_path(*gds_status())
        elif path not in DEVICE_READ_PATHS:
            raise ValueError(f"unknown device read path {path!r}; choose one of {DEVICE_READ_PATHS}")
        else:
            self.reason = "forced"
        self.store, self.device, self.path = store, torch.device(device), path
        self.chunk_slots = max(1, DEVICE_READ_CHUNK_BYTES // store.slot_bytes)
        self._file = None
        if path == "kvikio":
            try:
                import kvikio  # noqa: PLC0415

                self._file = kvikio.CuFile(store.path, "r")
            except Exception as exc:
                raise RuntimeError(f"kvikio device reads are not usable here: {exc}") from exc
        self._host: Optional[torch.Tensor] = None  # pinned (CUDA) slot images / pages, grown on demand
        self._dev: Optional[torch.Tensor] = None  # device bounce of the same size
        logger.info("NVMe -> device reads of %s: %s (%s)", store.path, path, self.reason)

    def _buffers(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and device bounce buffers of at least ``slots * slot_bytes`` bytes."""
        need = slots * self.store.slot_bytes
        if self._host is None or self._host.numel() < need:
            self._host = self._dev = None
            pin = self.device.type == "cuda"
            self._host = torch.empty(need, dtype=torch.uint8, pin_memory=pin)
            self._dev = torch.empty(need, dtype=torch.uint8, device=self.device)
        assert self._dev is not None
        return self._host, self._dev

    def read(self, slot_ids: Sequence[int], dst: torch.Tensor) -> list[bool]:
        """Read slot ``slot_ids[i]`` into ``dst[i]`` once it verifies.

        Args:
            slot_ids: slot ids in ``[0, store.num_slots)``.
            dst: uint8 ``(len(slot_ids), page_bytes)`` on ``device``, rows contiguous.

        Returns:
            Per slot, True when ``dst[i]`` now holds the slot's payload; False (a miss, logged)
            when the read failed or did not verify, and ``dst[i]`` is unchanged.

        Raises:
            ValueError: a slot out of range, or ``dst`` of the wrong shape, dtype or device.
        """
        pb = self.store.page_bytes
        ids = [int(s) for s in slot_ids]
        if dst.dtype != torch.uint8 or tuple(dst.shape) != (len(ids), pb) or dst.device != self.device:
            raise ValueError(f"dst must be uint8 ({len(ids)}, {pb}) on {self.device}, got "
                             f"{dst.dtype} {tuple(dst.shape)} on {dst.device}")
        if dst.stride(-1) != 1 or (len(ids) > 1 and dst.stride(0) != pb):
            raise ValueError("dst rows must be contiguous")
        bad = [s for s in ids if not 0 <= s < self.store.num_slots]
        if bad:
            raise ValueError(f"slots {bad[:8]} out of range [0, {self.store.num_slots})")
        ok = [False] * len(ids)
        read_round = self._round_kvikio if self.path == "kvikio" else self._round_posix
        for runs in _chunks(ids, self.chunk_slots):
            read_round(runs, dst, ok)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return ok

    def _round_posix(self, runs: list[tuple[int, int, int]], dst: torch.Tensor, ok: list[bool]) -> None:
        """One round: verified reads into pinned host pages, one H2D copy, verified rows into place."""
        pb = self.store.page_bytes
        count = sum(length for _, _, length in runs)
        host, dev = self._buffers(count)
        pages = host[: count * pb].view(count, pb)
        order = [(index + k, first + k) for index, first, length in runs for k in range(length)]
        flags = self.store.read_slots([slot for _, slot in order], [memoryview(pages[j].numpy()) for j in range(count)])
        staged = dev[: count * pb].view(count, pb)
        staged.copy_(pages, non_blocking=True)
        self._place(staged, [j for j, good in enumerate(flags) if good], [order[j][0] for j in range(count)], dst, ok)
        if self.device.type == "cuda":  # the next round rewrites the pinned pages
            torch.cuda.current_stream(self.device).synchronize()

    def _round_kvikio(self, runs: list[tuple[int, int, int]], dst: torch.Tensor, ok: list[bool]) -> None:
        """One round: ``CuFile.pread`` per run into the device bounce, D2H, verify, place."""
        sb, pb = self.store.slot_bytes, self.store.page_bytes
        count = sum(length for _, _, length in runs)
        host, dev = self._buffers(count)
        futures, offset = [], 0
        for _, first, length in runs:
            target = _device_array(dev[offset * sb : (offset + length) * sb])
            futures.append((offset, length, self._file.pread(target, length * sb, first * sb)))
            offset += length
        got = {}
        for offset, length, future in futures:
            try:
                got[offset] = int(future.get())
            except Exception as exc:  # an I/O error fails the run's slots
                logger.warning("NVMe device read of %d slots in %s failed: %s", length, self.store.path, exc)
                got[offset] = 0
        host[: count * sb].copy_(dev[: count * sb])
        images = host[: count * sb].numpy().reshape(count, sb)
        good, where, failed = [], [], []
        for (index, first, length), (offset, _, _) in zip(runs, futures):
            for k in range(length):
                j = len(where)
                reason = "short read" if got[offset] < (k + 1) * sb else verify_slot(images[j], pb, first + k)
                if reason:
                    failed.append(f"slot {first + k}: {reason}")
                else:
                    good.append(j)
                where.append(index + k)
        if failed:
            logger.warning("NVMe device read: %d of %d slots failed in %s: %s", len(failed), count, self.store.path,
                           "; ".join(failed[:8]))
        staged = dev[: count * sb].view(count, sb)[:, :pb]
        self._place(staged, good, where, dst, ok)

    def _place(self, staged: torch.Tensor, good: list[int], where: list[int], dst: torch.Tensor,
               ok: list[bool]) -> None:
        """Copy verified staged rows ``good`` into ``dst`` rows ``where[j]`` (one kernel)."""
        if not good:
            return
        rows = torch.as_tensor([where[j] for j in good], dtype=torch.int64).to(self.device)
        src = torch.as_tensor(good, dtype=torch.int64).to(self.device)
        dst.index_copy_(0, rows, staged.index_select(0, src))
        for j in good:
            ok[where[j]] = True

    def close(self) -> None:
        """Close the KvikIO file handle and drop the bounce buffers; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._host = self._dev = None
