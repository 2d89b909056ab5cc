"""Assembly of one scheduler process's tiers: media, I/O worker, movers, locks, rank agreement.

:func:`build_tiers` makes the real :class:`hiradix.core.controller.TierController` of one TP
rank: an anonymous shared-memory DRAM pool (pinned for CUDA when the device pool is on a GPU),
an NVMe slot file served by a spawned I/O worker (with its durable index, re-indexed into the
tree at start), the in-process host mover and the layer-wise loader, and the TP agreement over
SGLang's CPU group. Process-level setup happens here and only here: removing socket directories
of dead schedulers (and this one's at exit), locking the NVMe directory against a second server,
spawning the worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hiradix.core.controller import TierController
from hiradix.core.ledger import TierBooks
from hiradix.core.node import Tier
from hiradix.core.plan import EXACT, TierPlan, TierSpec
from hiradix.core.store_tier import STORE_RETRY_S
from hiradix.core.tree import TieredRadixTree
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.layout import KVLayout, device_buffers
from hiradix.dataplane.movers import HostMover
from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import WorkerSpec
from hiradix.persistence.fingerprint import is_store_writer, kv_fingerprint, store_key_prefix
from hiradix.persistence.index import INDEX_FILE_NAME, NvmeIndex
from hiradix.persistence.journal import IndexJournal, restore
from hiradix.runtime.rank_sync import RankSync
from hiradix.runtime.shared_host_copy import (OWNER_RANK, ReplicaIOClient, ReplicaJournal, share_persisted_pages,
                                              shared_dram_pool, wants_shared_copy)
from hiradix.tiers.dram import DramPool, num_pages_for_bytes
from hiradix.tiers.files import default_shm_dir, ensure_private_dir, lock_dir, remove_stale_dirs
from hiradix.tiers.nvme import NVME_FILE_NAME, NvmeStore, slot_bytes_for

logger = logging.getLogger(__name__)


def cold_tiers_of(config: Any) -> tuple[str, ...]:
    """The tiers that hold compressed pages (none when the format is ``exact``)."""
    fmt = getattr(config, "cold_format", "exact")
    return () if fmt == "exact" else tuple(getattr(config, "cold_tiers", ()))


def page_format_in(config: Any, tier: str) -> str:
    """The page format of ``tier``: the cold codec's name in a compressed tier, else ``exact``."""
    return config.cold_format if tier in cold_tiers_of(config) else EXACT


def tier_page_bytes(config: Any, layout: KVLayout, tier: str) -> int:
    """Bytes of one page in ``tier`` (``"dram"``, ``"nvme"``, ``"store"``): the codec's encoded size
    in a compressed tier (:mod:`hiradix.dataplane.kv_codec`), else the layout's ``page_bytes``."""
    if tier not in cold_tiers_of(config):
        return layout.page_bytes
    from hiradix.dataplane.kv_codec import PageCodec

    return PageCodec(layout, config.cold_format).encoded_bytes


def start_worker(dram: DramPool, nvme_dir: Optional[Path], nvme_slots: int, shm_dir: Path, io_backend: str,
                 keep: bool = False, store_backend: str = "", store_config: str = "", tp_rank: int = 0,
                 store_writer: bool = True, config: Any = None) -> IOWorkerClient:
    """Create (``keep``: reuse) the NVMe slot file and spawn this rank's I/O worker over it and
    over the cluster store (``store_backend``), either of which may be absent.

    Raises:
        OSError: the slot file cannot be created.
        hiradix.io.client.WorkerStartError: the worker did not start (e.g. the store is unreachable).
    """
    backend = io_backend
    if nvme_slots > 0:
        nvme_page_bytes = tier_page_bytes(config, dram.layout, "nvme")
        store = NvmeStore.create(nvme_dir, nvme_page_bytes, nvme_slots, backend=io_backend, keep=keep)
        backend = store.backend
        store.close()  # the worker owns NVMe I/O; this process only created the file
    spec = WorkerSpec(
        dram_path=str(dram.path),
        layout=dram.layout.to_json(),
        num_dram_pages=dram.num_pages,
        nvme_dir=str(nvme_dir or ""),
        num_nvme_slots=nvme_slots,
        page_bytes=dram.page_bytes,
        io_backend=backend,
        socket_dir=str(shm_dir / "sock"),
        parent_pid=os.getpid(),
        store_backend=store_backend,
        store_config=store_config,
        tp_rank=tp_rank,
        store_writer=store_writer,
        cold_format=getattr(config, "cold_format", "exact"),
        # an exact pool under a DRAM cold tier (the PD decode side's staging): the worker encodes
        cold_tiers=tuple(t for t in cold_tiers_of(config) if t != "dram" or dram.encoded),
        stop_timeout_s=float(getattr(config, "stop_timeout_s", 0.0)),
    )
    client = IOWorkerClient(spec)
    client.start()
    return client


def _open_index(nvme_dir: Path, identity: dict, layout: KVLayout, tp_rank: int, nvme_slots: int,
                page_size: int, shared: bool = False, config: Any = None) -> tuple[NvmeIndex, list]:
    """The durable index of this rank's NVMe directory (``shared``: the node's one copy) and its
    persisted pages."""
    fingerprint = kv_fingerprint(identity["model_id"], identity["model_dtype"], layout, tp_rank,
                                 identity["tp_size"], slot_bytes_for(tier_page_bytes(config, layout, "nvme")),
                                 attn_dp_size=identity.get("attn_dp_size", 1), shared_host_copy=shared,
                                 page_format=page_format_in(config, "nvme"), weights_stamp=identity.get("weights_stamp"))
    if not (nvme_dir / NVME_FILE_NAME).exists() and (nvme_dir / INDEX_FILE_NAME).exists():
        logger.warning("hiradix: %s has an NVMe index but no slot file; starting empty", nvme_dir)
        (nvme_dir / INDEX_FILE_NAME).unlink()
    return NvmeIndex.open(nvme_dir, fingerprint, nvme_slots, page_size)


def remove_on_exit(path: Path) -> None:
    """Remove ``path`` (this scheduler's private shared-memory directory) when the process ends.

    A graceful SGLang shutdown (SIGTERM to the launcher) closes the tiers, which removes it;
    this also covers the other ways a server is stopped: normal interpreter exit (``atexit``),
    and SIGTERM or SIGINT to the whole process group (Ctrl-C, systemd). The signal handlers
    remove the directory and then do what was there before (SGLang installs none in the
    scheduler: SIGTERM then terminates, SIGINT raises ``KeyboardInterrupt``), so SGLang's
    shutdown is unchanged. SIGKILL cannot be caught: the next server removes what is left
    (:func:`hiradix.tiers.files.remove_stale_dirs`).
    """
    def remove() -> None:
        shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: Any, previous: Any = previous) -> None:
            remove()
            if callable(previous):
                previous(sig, frame)
            elif previous != signal.SIG_IGN:  # SIG_DFL (or unknown): die of the signal, as before
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


def private_shm_dir(tp_rank: int) -> Path:
    """This scheduler's private shared-memory directory (0700; it holds the I/O worker's socket
    directory): stale ones of dead schedulers removed first, this one removed at exit."""
    shm_dir = Path(f"{default_shm_dir()}-rank{tp_rank}")
    remove_stale_dirs(shm_dir)
    ensure_private_dir(shm_dir)
    remove_on_exit(shm_dir)
    return shm_dir


def dram_bytes_of(config: Any, layout: KVLayout, device_pages: int) -> int:
    """The DRAM tier's bytes: ``--hiradix-dram-gb``, or ``--hiradix-dram-ratio`` x the device pool.

    Args:
        config: hiradix settings (``dram_bytes`` / ``dram_ratio``).
        layout: the KV page layout (``page_bytes``: one page, all layers, K and V).
        device_pages: pages of the device KV pool (SGLang's ``kv_pool.size // page_size``).

    Raises:
        hiradix.config.HiRadixConfigError: the ratio gives less than one page, or more than the
            available RAM (known only here, once the device pool is sized).
    """
    import psutil

    from hiradix.config import FLAG_OF_FIELD, HiRadixConfigError

    device_bytes = device_pages * layout.page_bytes
    dram_bytes = config.dram_bytes_for(device_bytes)
    if config.dram_ratio:
        flag = f"{FLAG_OF_FIELD['dram_ratio']} {config.dram_ratio:g}"
        if dram_bytes < layout.page_bytes:
            raise HiRadixConfigError(f"{flag} x the device pool ({device_bytes} bytes) holds no KV page ({layout.page_bytes} bytes)")
        available = psutil.virtual_memory().available
        if dram_bytes > available:
            raise HiRadixConfigError(
                f"{flag} x the device pool ({device_bytes} bytes) needs {dram_bytes / 1e9:.2f} GB of RAM "
                f"but only {available / 1e9:.2f} GB is available"
            )
        logger.info("hiradix: DRAM tier %s x the device pool (%d bytes) = %d bytes", flag, device_bytes, dram_bytes)
    return dram_bytes
def _host_mover(config: Any, kv_pool: Any, dram: DramPool, loader: LayerwiseLoader, **kwargs: Any) -> HostMover:
    """The HBM <-> DRAM mover: :class:`EncodedHostMover` (encode/decode on the KV device) when DRAM
    holds encoded pages, else :class:`HostMover`."""
    if not dram.encoded:
        return HostMover(kv_pool, dram, loader, **kwargs)
    from hiradix.dataplane.encoded_mover import EncodedHostMover
    from hiradix.dataplane.kv_codec import PageCodec

    return EncodedHostMover(kv_pool, dram, loader, PageCodec(dram.layout, config.cold_format), **kwargs)


def _nvme_slots(config: Any, layout: KVLayout) -> int:
    """NVMe slots of ``--hiradix-nvme-gb`` (0: no NVMe tier)."""
    return max(0, config.nvme_bytes) // slot_bytes_for(tier_page_bytes(config, layout, "nvme"))


def _nvme_tier(config: Any, layout: KVLayout, tp_rank: int, page_size: int, identity: Optional[dict],
               shared: bool = False):
    """``(dir, slots, lock fd, index, persisted pages)`` of this rank's NVMe tier (0 slots: none;
    ``shared``: the node's one MLA copy, rank 0's)."""
    if config.nvme_bytes <= 0:
        return None, 0, -1, None, []
    nvme_slots = _nvme_slots(config, layout)
    nvme_dir = Path(config.nvme_path) / f"hiradix-rank{tp_rank}"
    lock_fd = lock_dir(nvme_dir)  # also makes it private (0700)
    index, pages = None, []
    if identity is not None:
        index, pages = _open_index(nvme_dir, identity, layout, tp_rank, nvme_slots, page_size, shared, config)
    return nvme_dir, nvme_slots, lock_fd, index, pages


def _dram_pool(config: Any, layout: KVLayout, dram_pages: int, dram_page_bytes: int, group_rank: int,
               tp_group: Optional[Any]) -> tuple[DramPool, bool]:
    """This rank's DRAM pool, and whether it is the node's one shared copy (MLA under TP)."""
    if wants_shared_copy(layout, tp_group, config.mla_host_copy):
        return shared_dram_pool(layout, dram_pages, group_rank, tp_group, page_bytes=dram_page_bytes)
    return DramPool.create_anonymous(layout, dram_pages, page_bytes=dram_page_bytes), False


def _store_prefix(config: Any, layout: KVLayout, identity: Optional[dict], group_rank: int) -> Optional[str]:
    """The cluster store's key prefix (the KV fingerprint of this rank's shard); None: no store."""
    if not config.has_store_tier:
        return None
    if identity is None:
        raise ValueError("the cluster store needs the model identity for its keys")
    return store_key_prefix(identity["model_id"], identity["model_dtype"], layout, group_rank, identity["tp_size"],
                            attn_dp_size=identity.get("attn_dp_size", 1), page_format=page_format_in(config, "store"))


def tier_plan(config: Any, layout: KVLayout, dram: DramPool, nvme_slots: int,
              key_prefix: Optional[str], owner: bool, store_retry_s: float = STORE_RETRY_S) -> TierPlan:
    """The :class:`~hiradix.core.plan.TierPlan` of one rank, resolved once: each tier's pages,
    page bytes and format, the host bytes this process reserves (0 on a rank that maps the
    ``owner``'s copy), the store's key prefix and the policies of ``config``."""
    nvme_page_bytes = tier_page_bytes(config, layout, "nvme")
    nvme_reserved = nvme_slots * slot_bytes_for(nvme_page_bytes) if owner else 0
    return TierPlan(
        hbm_page_bytes=layout.page_bytes,
        dram=TierSpec(Tier.DRAM, dram.num_pages, dram.page_bytes, page_format_in(config, "dram"),
                      reserved_bytes=dram.dram_bytes if owner else 0),
        nvme=TierSpec(Tier.NVME, nvme_slots, nvme_page_bytes, page_format_in(config, "nvme"),
                      reserved_bytes=nvme_reserved) if nvme_slots else None,
        store=TierSpec(Tier.STORE, 0, tier_page_bytes(config, layout, "store"), page_format_in(config, "store"),
                       key_prefix=key_prefix) if key_prefix is not None else None,
        write_through=config.write_policy == "write_through", dram_staging=config.dram_mode == "staging",
        store_write_policy=config.store_write_policy, store_read=config.store_read, store_retry_s=store_retry_s,
        stop_timeout_s=float(getattr(config, "stop_timeout_s", 0.0)))  # fmt: skip


def build_tiers(
    tree: TieredRadixTree,
    config: Any,
    kv_pool: Any,
    page_size: int,
    tp_rank: int = 0,
    io_backend: str = "auto",
    tp_group: Optional[Any] = None,
    identity: Optional[dict] = None,
    counter_factory: Optional[Callable[[int], Any]] = None,
    store_retry_s: float = STORE_RETRY_S,
) -> tuple[TierController, LayerwiseLoader]:
    """The real tiers of one scheduler process, and the layer-wise loader to register.

    Args:
        tree: the tree whose nodes move.
        config: hiradix settings (``dram_bytes``/``dram_ratio``, ``dram_mode``, ``nvme_path``,
            ``nvme_bytes``, ``write_policy``).
        kv_pool: SGLang's device ``MHATokenToKVPool`` of this rank.
        page_size: tokens per page.
        tp_rank: this rank (names the private directories).
        io_backend: NVMe backend for the worker ("auto", "posix", "kvikio").
        tp_group: TP CPU process group (None for one rank); completions are agreed over it.
        identity: ``model_id``, ``model_dtype`` and ``tp_size`` for the NVMe index's
            fingerprint and the cluster store's keys (:mod:`hiradix.persistence.fingerprint`);
            None: the NVMe tier starts empty and is not persisted (a store needs it).
        counter_factory: CUDA only: SGLang's ``LayerDoneCounter`` (see ``LayerwiseLoader``).
        store_retry_s: first wait before a switched-off cluster store is tried again.

    Raises:
        OSError, PermissionError: a tier's files cannot be created.
        RuntimeError: another server holds this NVMe directory.
        hiradix.io.client.WorkerStartError: the I/O worker did not start.
    """
    layout = KVLayout.from_device_pool(kv_pool, page_size)
    dram_page_bytes = tier_page_bytes(config, layout, "dram")  # encoded pages when DRAM is a cold tier
    dram_pages = num_pages_for_bytes(dram_bytes_of(config, layout, kv_pool.size // page_size), layout, dram_page_bytes)
    shm_dir = private_shm_dir(tp_rank)
    multi_rank = tp_group is not None and torch.distributed.get_world_size(tp_group) > 1
    # This rank in the group that shares a batch (the attention-TP group under DP attention): it
    # picks the KV shard of the store keys, the store writer and the owner of a shared host copy.
    group_rank = torch.distributed.get_rank(group=tp_group) if multi_rank else 0
    dram, shared = _dram_pool(config, layout, dram_pages, dram_page_bytes, group_rank, tp_group)
    owner = not shared or group_rank == OWNER_RANK  # moves the pages below HBM (all of them, when shared)
    device = device_buffers(kv_pool, layout)[0][0].device
    if device.type == "cuda":
        dram.pin_for_cuda()  # False (one warning): the pool stays pageable and copies stay correct
    below = _below_dram(config, layout, dram, shm_dir, (tp_rank, group_rank, tp_group), page_size, identity, shared,
                        io_backend)
    nvme_slots, lock_fd, index, pages, key_prefix, client = below
    books = TierBooks(tree, dram_pages, nvme_slots)
    loader = LayerwiseLoader(layout.num_layers, device, counter_factory)
    barrier = (lambda: torch.distributed.barrier(group=tp_group)) if shared else None
    mover = _host_mover(config, kv_pool, dram, loader, writes_dram=owner, flush_barrier=barrier)
    journal = IndexJournal(index, tree) if index is not None else None
    if not owner and nvme_slots > 0 and identity is not None:
        journal = ReplicaJournal()  # the owner persists; this rank keeps the same books
    plan = tier_plan(config, layout, dram, nvme_slots, key_prefix, owner, store_retry_s)
    tiers = TierController(tree, books, mover, client, plan, sync=RankSync(tp_group) if multi_rank else None,
                           journal=journal)
    for release in (dram.close, lambda: shutil.rmtree(shm_dir, ignore_errors=True),
                    index.close if index is not None else None, (lambda: os.close(lock_fd)) if lock_fd >= 0 else None):
        if release is not None:
            tiers.on_close(release)
    if index is not None or not owner:  # a rank that maps the owner's copy restores the owner's pages
        tiers.stats.restored_pages = restore(tree, books, pages)
    _log_tiers(plan, config, dram.path, key_prefix, shared, owner)
    return tiers, loader


def _below_dram(config: Any, layout: KVLayout, dram: DramPool, shm_dir: Path, ranks: tuple, page_size: int,
                identity: Optional[dict], shared: bool, io_backend: str) -> tuple:
    """The NVMe tier (its slots, lock, durable index and persisted pages), the store's key prefix
    and the I/O client of one rank (``ranks``: TP rank, rank in the group, the group); on a rank
    that maps the owner's host copy, the owner's NVMe books without a directory, and no worker."""
    tp_rank, group_rank, tp_group = ranks
    owner = not shared or group_rank == OWNER_RANK
    if owner:
        nvme_dir, nvme_slots, lock_fd, index, pages = _nvme_tier(config, layout, tp_rank, page_size, identity, shared)
    else:  # the owner's NVMe tier: same slots in the books, no directory here
        nvme_dir, nvme_slots, lock_fd, index, pages = None, _nvme_slots(config, layout), -1, None, []
    if shared:
        pages = share_persisted_pages(pages, group_rank, tp_group)
    key_prefix = _store_prefix(config, layout, identity, group_rank)
    client = None
    if (nvme_slots > 0 or key_prefix is not None) and not owner:
        client = ReplicaIOClient()  # rank 0's worker moves this rank's pages too
    elif nvme_slots > 0 or key_prefix is not None:
        client = start_worker(dram, nvme_dir, nvme_slots, shm_dir, io_backend, keep=index is not None and index.reused,
                              store_backend=config.store_backend or "", store_config=config.store_config,
                              tp_rank=tp_rank, store_writer=is_store_writer(layout, group_rank), config=config)
    return nvme_slots, lock_fd, index, pages, key_prefix, client


def _log_tiers(plan: Any, config: Any, dram_path: str, key_prefix: Optional[str], shared: bool, owner: bool) -> None:
    """One log line of what :func:`build_tiers` made."""
    cold = cold_tiers_of(config)
    logger.info("hiradix tiers: DRAM %d pages (%d B each) at %s; NVMe %d slots (%d B pages); cluster store %s%s%s",
                plan.dram.capacity_pages, plan.dram.page_bytes, dram_path, plan.nvme_slots,
                plan.page_bytes_by_tier[Tier.NVME],
                f"{config.store_backend} (keys {key_prefix}*)" if key_prefix else "off",
                "" if not shared else f"; one host copy per node, {'owned' if owner else 'mapped'} by this rank",
                f"; {config.cold_format} pages in {', '.join(cold)}" if cold else "")
