"""Transfers built by hand as the ledger builds them (``hiradix/core/ledger.py``), for mover tests:
a BACKUP has one slot tensor per node in ``hbm_parts``; a PROMOTE has the one allocated slot tensor."""

from __future__ import annotations

import torch

from hiradix.core.ledger import Kind, Transfer


def page_slots(page_size: int, *device_pages: int) -> torch.Tensor:
    """The token slots of whole device pages, in order (int64)."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in device_pages])


def backup_op(op_id: int, parts: list[torch.Tensor], dram_pages: list[int], page_size: int) -> Transfer:
    """HBM slot tensors ``parts`` (whole pages) -> DRAM pages ``dram_pages``."""
    src = [int(s) for p in parts for s in p[::page_size]]
    return Transfer(op_id, Kind.BACKUP, [], src, dram_pages, hbm_parts=parts, dst_of=dict(zip(src, dram_pages)))


def promote_op(op_id: int, dram_pages: list[int], slots: torch.Tensor, page_size: int) -> Transfer:
    """DRAM pages ``dram_pages`` -> the allocated HBM ``slots`` (whole pages)."""
    dst = slots[::page_size].tolist()
    return Transfer(op_id, Kind.PROMOTE, [], dram_pages, dst, hbm_parts=[slots], dst_of=dict(zip(dram_pages, dst)))
