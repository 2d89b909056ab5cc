"""Do the DRAM and NVMe tiers fit this machine: free RAM and free disk against what the server reserves.

The server reserves, per copy of the tiers, ``--hiradix-dram-gb`` of anonymous memory and a slot
file of up to ``--hiradix-nvme-gb`` (pre-allocated); a node holds :attr:`LaunchPlan.host_copies`
copies (one per TP rank, or one per node for an MLA model's shared copy). The launcher refuses
what does not fit (``hiradix.config.check_machine``: the whole need against psutil's available
RAM and the file system's free bytes); these checks make the same comparison and print the figures.
Where the check passes with little to spare, a warning says so.

The machine's figures come from a :class:`Machine`, so tests can give other ones.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hiradix.config import BYTES_PER_GB, existing_slot_file_bytes
from hiradix.doctor.plan import LaunchPlan
from hiradix.doctor.report import Check, error, ok, warning

TIGHT_SHARE = 0.8  # a tier that takes more than this share of what is free: warning


def _available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _disk_free(path: Path) -> int:
    return int(shutil.disk_usage(path).free)


def _probe_o_direct(directory: Path) -> str | None:
    from hiradix.doctor.nvme_dir import probe_o_direct

    return probe_o_direct(directory)


@dataclass(frozen=True)
class Machine:
    """Where the doctor reads this machine's figures (replaceable in tests).

    Attributes:
        available_ram: bytes of RAM available now (psutil's ``available``, as the launcher reads it).
        disk_free: bytes free on the file system of a path.
        o_direct: why a directory's file system refuses ``O_DIRECT`` I/O, or None
            (:func:`hiradix.doctor.nvme_dir.probe_o_direct`).
    """

    available_ram: Callable[[], int] = field(default=_available_ram)
    disk_free: Callable[[Path], int] = field(default=_disk_free)
    o_direct: Callable[[Path], str | None] = field(default=_probe_o_direct)


def gb(num_bytes: float) -> str:
    """Bytes as decimal GB, as the flags take them: ``512 GB``, ``0.25 GB``."""
    return f"{num_bytes / BYTES_PER_GB:.4g} GB"


def ram_check(plan: LaunchPlan, machine: Machine) -> Check:
    """The DRAM tiers of this node against the RAM available now."""
    config = plan.config
    if plan.dram_bytes_per_copy is None:
        return warning("ram", f"--hiradix-dram-ratio {config.dram_ratio:g} sizes the DRAM tier from the device KV "
                       "pool, which SGLang sizes when the model loads: the scheduler checks it then",
                       "give --max-total-tokens (or --hiradix-dram-gb) to have it checked here")
    per_copy = plan.dram_bytes_per_copy
    needed = per_copy * plan.host_copies
    available = machine.available_ram()
    given = (f"--hiradix-dram-gb {config.dram_bytes / BYTES_PER_GB:g}" if not config.dram_ratio else
             f"--hiradix-dram-ratio {config.dram_ratio:g} x the device pool = {gb(per_copy)}")
    what = f"{given} {plan.copies_text} = {gb(needed)} of RAM on this node; {gb(available)} available"
    if needed > available:
        most = available // plan.host_copies
        return error("ram", what, f"give at most --hiradix-dram-gb {most / BYTES_PER_GB:.3g} (per copy), "
                     "or free memory: the launcher refuses this")
    if needed > TIGHT_SHARE * available:
        return warning("ram", what + f" (leaves {gb(available - needed)} for SGLang and everything else)",
                       f"keep the DRAM tiers under {TIGHT_SHARE:.0%} of the available RAM")
    return ok("ram", what)


def disk_check(plan: LaunchPlan, machine: Machine) -> Check | None:
    """The NVMe tiers of this node against the free space of ``--hiradix-nvme-path``'s file system
    (None without an NVMe tier or without the directory: :func:`nvme_dir.path_check` says why)."""
    config = plan.config
    if not config.has_nvme_tier or not config.nvme_path.is_dir():
        return None
    needed = config.nvme_bytes * plan.host_copies
    held = existing_slot_file_bytes(config.nvme_path)  # reused at start: free for this server, as the launcher counts
    free = machine.disk_free(config.nvme_path) + held
    what = (f"--hiradix-nvme-gb {config.nvme_bytes / BYTES_PER_GB:g} {plan.copies_text} = {gb(needed)} of disk; "
            f"{gb(free)} free on the file system of {config.nvme_path}"
            + (f" (of which {gb(held)} are the slot files of an earlier run)" if held else ""))
    if needed > free:
        most = f"give at most --hiradix-nvme-gb {free // plan.host_copies / BYTES_PER_GB:.3g} (per copy)"
        return error("disk", what, f"{most}, or free disk space: the launcher refuses this")
    if needed > TIGHT_SHARE * free:
        return warning("disk", what + f" (leaves {gb(free - needed)})",
                       f"keep the NVMe tiers under {TIGHT_SHARE:.0%} of the free space")
    return ok("disk", what)
