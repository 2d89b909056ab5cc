"""The NVMe directories already there: will the server reuse their pages, or discard them, and why.

At start each rank opens ``<nvme path>/hiradix-rank<r>/index.log`` (:mod:`hiradix.persistence.index`)
and reuses its pages only when its header's fingerprint equals the one the rank computes
(:func:`hiradix.persistence.fingerprint.kv_fingerprint`, via
``hiradix.runtime.assembly``); otherwise it logs what changed and starts the slot file afresh.
This check computes that fingerprint the same way from the launch plan, compares it with each
header, and names the fields that differ. Fields it cannot know before the model loads (the
KV layout, when the model's config could not be read; dtypes SGLang resolves differently) are
left out of the comparison and named.

It also reports what stops a start outright: a directory another server holds (its lock), or
one that is not private (0700, owned by this user).
"""

from __future__ import annotations

import fcntl
import os
import re
from collections import defaultdict
from pathlib import Path

from hiradix.doctor.plan import LaunchPlan
from hiradix.doctor.report import Check, error, ok, warning

RANK_DIR = re.compile(r"^hiradix-rank(\d+)$")
LAYOUT_KEYS = frozenset({"model_dtype", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "page_major",
                         "mla_rope_dim", "slot_bytes"})  # fmt: skip


def expected_fingerprint(plan: LaunchPlan, tp_rank: int, identity: dict) -> tuple[dict[str, str], frozenset[str]]:
    """The fingerprint rank ``tp_rank`` will compute at start, and the keys not to compare (unknown).

    Args:
        plan: the launch.
        tp_rank: the rank whose directory it is.
        identity: ``model_id`` and ``weights_stamp`` of the model (``hiradix.persistence.fingerprint``).
    """
    import torch

    from hiradix.dataplane.layout import KVLayout
    from hiradix.persistence.fingerprint import kv_fingerprint
    from hiradix.runtime.assembly import page_format_in, tier_page_bytes
    from hiradix.tiers.nvme import slot_bytes_for

    kv, unknown = plan.kv, set()
    if kv is None:
        layout, unknown = KVLayout(1, plan.page_size, 1, 1, torch.uint8), set(LAYOUT_KEYS)
    else:
        dtype = getattr(torch, kv.kv_dtype, None) if kv.kv_dtype else None
        if not isinstance(dtype, torch.dtype):
            dtype, unknown = torch.uint8, {"kv_dtype", "slot_bytes"}
        layout = KVLayout(kv.num_layers, plan.page_size, kv.num_kv_heads, kv.head_dim, dtype, rope_dim=kv.rope_dim)
        if kv.model_dtype is None:
            unknown.add("model_dtype")
    model_dtype = kv.model_dtype if kv is not None and kv.model_dtype else "?"
    slot_bytes = slot_bytes_for(tier_page_bytes(plan.config, layout, "nvme"))
    fingerprint = kv_fingerprint(identity["model_id"], model_dtype, layout, tp_rank, plan.tp_size, slot_bytes,
                                 attn_dp_size=plan.attn_dp_size, shared_host_copy=plan.shared_host_copy,
                                 page_format=page_format_in(plan.config, "nvme"),
                                 weights_stamp=identity.get("weights_stamp"))
    return fingerprint, frozenset(unknown)


def _identity(plan: LaunchPlan) -> dict:
    from hiradix.persistence.fingerprint import model_identity, weights_stamp

    return {"model_id": model_identity(plan.model_path, plan.revision), "weights_stamp": weights_stamp(plan.model_path)}


def _lock_or_privacy_problem(directory: Path) -> str | None:
    """Why the server could not take ``directory`` (another holds its lock; not private), or None."""
    from hiradix.tiers.files import ensure_private_dir

    try:
        ensure_private_dir(directory)  # it exists: this only checks
    except PermissionError as exc:
        return str(exc)
    lock = directory / "lock"
    if not lock.exists():
        return None
    fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"{directory} is in use by a running server (it holds {lock})"
    finally:
        os.close(fd)  # also drops the lock taken just now
    return None


def compare_index(directory: Path, expected: dict[str, str], unknown: frozenset[str],
                  page_size: int) -> tuple[str, str, int]:
    """What the server will do with ``directory``'s index: ``(outcome, why, pages)``, outcome one of
    ``empty`` (nothing persisted), ``reuse`` (``pages`` listed) or ``discard`` (``why`` names the
    fields that differ, ``old -> new``)."""
    from hiradix.persistence.index import (
        INDEX_FILE_NAME,
        INDEX_FORMAT_VERSION,
        Header,
        _fingerprint_diff,
        _read_records,
        _replay,
    )
    from hiradix.tiers.nvme import NVME_FILE_NAME

    path = directory / INDEX_FILE_NAME
    if not path.exists():
        return "empty", "no index", 0
    if not (directory / NVME_FILE_NAME).exists():
        return "discard", f"an index but no slot file {NVME_FILE_NAME}", 0
    records, _ = _read_records(path.read_bytes(), path)
    header = records[0] if records and isinstance(records[0], Header) else None
    if header is None:
        return "discard", "the index is unreadable", 0
    if header.format_version != INDEX_FORMAT_VERSION:
        return "discard", f"index format {header.format_version}, this hiradix reads {INDEX_FORMAT_VERSION}", 0
    keys = (set(header.fingerprint) | set(expected)) - unknown
    diff = _fingerprint_diff({k: header.fingerprint[k] for k in keys if k in header.fingerprint},
                             {k: expected[k] for k in keys if k in expected})
    if diff:
        return "discard", f"written for another setup ({diff})", 0
    return "reuse", "", len(_replay(records, 1 << 62, page_size))


def _rank_dirs(path: Path) -> dict[int, Path]:
    found = {}
    for child in path.iterdir() if path.is_dir() else ():
        match = RANK_DIR.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found[int(match.group(1))] = child
    return found


def _names(dirs: list[Path]) -> str:
    return ", ".join(d.name for d in dirs[:4]) + (f" and {len(dirs) - 4} more" if len(dirs) > 4 else "")


def index_checks(plan: LaunchPlan) -> list[Check]:
    """One line per outcome over this node's NVMe rank directories (grouped: ranks that fare alike
    share a line), plus one per directory the server could not take."""
    config = plan.config
    if not config.has_nvme_tier or not config.nvme_path.is_dir():
        return []
    try:
        identity = _identity(plan)
    except OSError as exc:
        return [warning("nvme-index", f"cannot read the model's files to fingerprint it: {exc}",
                        "make --model-path readable by this user")]
    checks, outcomes, pages = [], defaultdict(list), 0
    on_disk = _rank_dirs(config.nvme_path)
    for rank in plan.nvme_ranks:
        directory = config.nvme_path / f"hiradix-rank{rank}"
        if rank not in on_disk:
            outcomes[("empty", "no directory yet")].append(directory)
            continue
        problem = _lock_or_privacy_problem(directory)
        if problem:
            checks.append(error("nvme-dir", problem, "stop the server that holds it, or give this one another "
                                "--hiradix-nvme-path" if "in use" in problem else f"chmod 700 {directory} (as its owner)"))
        expected, unknown = expected_fingerprint(plan, rank, identity)
        kind, why, listed = compare_index(directory, expected, unknown, plan.page_size)
        outcomes[(kind, why)].append(directory)
        pages += listed
    checks.extend(_outcome_line(kind, why, dirs, plan, pages) for (kind, why), dirs in outcomes.items())
    unused = sorted(set(on_disk) - set(plan.nvme_ranks))
    if unused:
        dirs = [on_disk[r] for r in unused]
        checks.append(warning("nvme-index", f"{_names(dirs)}: not used with these flags (ranks {unused}); left as they are",
                              "delete them if no other launch of this machine uses them"))
    return checks


def _outcome_line(kind: str, why: str, dirs: list[Path], plan: LaunchPlan, pages: int) -> Check:
    not_compared = "" if plan.kv is not None else "; the KV layout fields were not compared (no model config)"
    if kind == "empty":
        return ok("nvme-index", f"{_names(dirs)}: {why}: the NVMe tier starts empty")
    if kind == "reuse":
        return ok("nvme-index", f"{_names(dirs)}: the fingerprint matches these flags: the server re-indexes "
                  f"{pages} persisted page{'' if pages == 1 else 's'}{not_compared}")
    return warning("nvme-index", f"{_names(dirs)}: {why}: its pages will be discarded at start{not_compared}",
                   "start with the flags and model that wrote them to keep them, or accept starting empty")
