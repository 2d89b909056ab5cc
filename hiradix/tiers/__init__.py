"""Off-device tiers: the DRAM page pool (shared memory), the NVMe slot store, and their allocator.

Bookkeeping (:class:`PageAllocator`, pure Python) is kept apart from data movement
(:class:`DramPool`, :class:`NvmeStore`); only page and slot ids pass between them.
"""

from hiradix.tiers.allocator import PageAllocator
from hiradix.tiers.dram import DramPool, default_shm_dir, num_pages_for_bytes
from hiradix.tiers.nvme import SLOT_ALIGN, NvmeIO, NvmeStore

__all__ = [
    "SLOT_ALIGN",
    "DramPool",
    "NvmeIO",
    "NvmeStore",
    "PageAllocator",
    "default_shm_dir",
    "num_pages_for_bytes",
]
