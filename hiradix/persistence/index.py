"""The NVMe tier's durable index: which slot holds which page of which prefix, across restarts.

One append-only journal per TP rank, ``<nvme dir>/index.log`` (mode 0600, next to
``nvme.kv``). Each record is framed as::

    | body length (u32 LE) | xxh3_64 of body (u64 LE) | body (msgpack, msgspec tagged union) |

and is one of:

- :class:`Header` (first record): the fingerprint of everything that makes KV reusable
  (:func:`hiradix.persistence.fingerprint.kv_fingerprint`) and the slot size.
- :class:`Put`: slot ``slot`` holds the page ``tokens`` whose prefix hashes to
  ``parent_hash`` (``b""`` for a prefix's first page) in cache namespace ``namespace``.
- :class:`Free`: these slots hold nothing valid any more.

Write order is what makes the journal safe to trust after a crash: a slot is freed in the
journal (:meth:`NvmeIndex.invalidate`, an ``os.write`` before the store job is even sent)
before new bytes go into it, and put (:meth:`NvmeIndex.record`) only after the write
landed and verified. A crash in between leaves the slot free, never pointing at other bytes.
The journal is also closed under ancestors at every moment: a page whose parent page is not
listed yet (its write landed first) waits in memory, and is put right after its parent, so a
stop or a crash at any point leaves no orphan for the restart to drop (a waiting page is lost).
The slot's own xxh3 trailer (:mod:`hiradix.tiers.nvme`) still guards every read. The journal
is fsynced at :meth:`NvmeIndex.sync` (periodically) and :meth:`close`, so a power loss costs
at most the latest records, never correctness. It is compacted (live records only) at start and,
in a background thread, whenever it has grown to ``COMPACT_GROWTH`` times its compacted size;
records appended meanwhile are replayed onto the compacted file before it replaces the old one.

At start (:meth:`NvmeIndex.open`) a journal with the same fingerprint is replayed (a torn or
corrupt tail is cut off with a warning), compacted into a fresh file, and its pages are
returned as :class:`Page` records for the tree to re-index; a journal with a different
fingerprint (or none) is discarded with one log line naming what changed, and the caller
starts the slot file afresh. Pages are linked by ``page_hash = xxh3_128(parent_hash,
namespace, tokens)`` (:func:`page_hash`).

The role of Mooncake's / LMCache's persisted metadata, for one pre-allocated slot file.
Data movement only (small records); the tree never sees this file, only slot ids and tokens.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import msgspec
import xxhash

logger = logging.getLogger(__name__)

INDEX_FILE_NAME = "index.log"
INDEX_FORMAT_VERSION = 1
FRAME = struct.Struct("<IQ")  # body length, xxh3_64(body)
MAX_BODY_BYTES = 1 << 24  # a longer length field is corruption
# Compact at run time once the journal is this many times its compacted size (and at least
# COMPACT_MIN_BYTES): amortised O(1) bytes per record, in a background thread.
COMPACT_GROWTH = 4
COMPACT_MIN_BYTES = 1 << 20


class Header(msgspec.Struct, tag="header", frozen=True):
    """First record: what the slots were written for."""

    format_version: int
    fingerprint: dict[str, str]
    created_s: float


class Put(msgspec.Struct, tag="put", frozen=True):
    """``slot`` holds one page: ``tokens`` (``page_size`` ids) after the prefix ``parent_hash``."""

    slot: int
    parent_hash: bytes  # 16 bytes; b"" for the first page of a prefix
    tokens: list[int]
    namespace: Optional[list] = None  # [extra_key, cache_salt] or None


class Free(msgspec.Struct, tag="free", frozen=True):
    """These slots no longer hold a valid page."""

    slots: list[int]


from hiradix.core.keys import page_hash  # noqa: E402 - the one chain hash (also the store's keys)

Record = Union[Header, Put, Free]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


@dataclass(frozen=True)
class Page:
    """One re-indexed page: its slot, tokens, namespace and chain hashes."""

    slot: int
    tokens: tuple[int, ...]
    namespace: Optional[tuple]
    parent_hash: bytes
    hash: bytes


def _hash(put: Put) -> bytes:
    """The page hash of a listed ``Put`` (its chain hash: parent, namespace, tokens)."""
    return page_hash(put.parent_hash, tuple(put.namespace) if put.namespace is not None else None, put.tokens)


def _frame(record: Record) -> bytes:
    body = _encoder.encode(record)
    return FRAME.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def _read_records(data: bytes, path: Path) -> tuple[list[Record], int]:
    """Decode frames until the end or the first bad one; returns (records, bytes used)."""
    records: list[Record] = []
    pos = 0
    while pos + FRAME.size <= len(data):
        length, digest = FRAME.unpack_from(data, pos)
        body = data[pos + FRAME.size : pos + FRAME.size + length]
        if length > MAX_BODY_BYTES or len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
            break
        try:
            records.append(_decoder.decode(body))
        except msgspec.DecodeError:
            break
        pos += FRAME.size + length
    if pos != len(data):
        logger.warning("hiradix: %s: %d bytes after record %d are torn or corrupt; ignored",
                       path, len(data) - pos, len(records))
    return records, pos


def _fingerprint_diff(old: dict[str, str], new: dict[str, str]) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k}: {old.get(k, '-')!s} -> {new.get(k, '-')!s}" for k in keys if old.get(k) != new.get(k))


def _replay(records: list[Record], num_slots: int, page_tokens: int) -> dict[int, Put]:
    live: dict[int, Put] = {}
    for record in records[1:]:
        if isinstance(record, Put):
            if 0 <= record.slot < num_slots and len(record.tokens) == page_tokens:
                live[record.slot] = record
        elif isinstance(record, Free):
            for slot in record.slots:
                live.pop(slot, None)
    return live


def _chain(live: dict[int, Put]) -> tuple[list[Page], list[int]]:
    """Keep the pages reachable from a first page, parents before children; others are orphans."""
    by_parent: dict[bytes, list[Page]] = {}
    for slot in sorted(live):
        put = live[slot]
        ns = tuple(put.namespace) if put.namespace is not None else None
        page = Page(slot, tuple(put.tokens), ns, put.parent_hash, page_hash(put.parent_hash, ns, put.tokens))
        by_parent.setdefault(put.parent_hash, []).append(page)
    kept: list[Page] = []
    seen: set[bytes] = set()
    stack = list(reversed(by_parent.get(b"", [])))
    while stack:
        page = stack.pop()
        if page.hash in seen:  # the same page twice (a lost Free): keep the first slot
            continue
        seen.add(page.hash)
        kept.append(page)
        stack.extend(reversed(by_parent.get(page.hash, [])))
    kept_slots = {p.slot for p in kept}
    return kept, sorted(set(live) - kept_slots)


class NvmeIndex:
    """The journal of one NVMe slot file; see the module docstring.

    Build with :meth:`open`. Not thread-safe: one owner (the scheduler's tier controller),
    which calls :meth:`sync` every step. The journal is compacted at open and, in a background
    thread, whenever it grows to ``COMPACT_GROWTH`` times its compacted size. A recorded page
    whose parent page is not listed waits (:attr:`waiting_pages`) until its parent is recorded.

    Attributes:
        path: the journal file.
        reused: whether :meth:`open` found a journal with the same fingerprint.
    """

    def __init__(self, path: Path, fd: int, reused: bool, fingerprint: dict[str, str], live: dict[int, Put],
                 size_bytes: int):
        """Use :meth:`open`."""
        self.path = path
        self._fd = fd
        self.reused = reused
        self._fingerprint = dict(fingerprint)
        self._live = live  # slot -> its Put, as the journal says now
        self._hash_of: dict[int, bytes] = {slot: _hash(put) for slot, put in live.items()}  # listed slot -> page hash
        self._listed: Counter[bytes] = Counter(self._hash_of.values())  # page hash -> listed slots holding it
        self._waiting: dict[int, tuple[bytes, Put]] = {}  # slot -> (page hash, Put) until its parent is listed
        self._waiting_on: dict[bytes, set[int]] = {}  # parent page hash -> waiting slots
        self._dirty = False
        self._last_sync_s = time.monotonic()
        self.size_bytes = size_bytes  # of the journal file
        self._compacted_bytes = size_bytes  # its size right after the last compaction
        self._tail: Optional[list[bytes]] = None  # frames appended while a compaction runs
        self._compactor: Optional[threading.Thread] = None
        self._compacted_tmp: Optional[Path] = None  # set by the compaction thread when it succeeded
        self.compactions = 0

    @classmethod
    def open(
        cls, directory: Path, fingerprint: dict[str, str], num_slots: int, page_tokens: int
    ) -> tuple[NvmeIndex, list[Page]]:
        """Replay and compact ``directory/index.log``, or start a new one.

        Args:
            directory: the rank's private NVMe directory (already checked 0700).
            fingerprint: what the slots must have been written for (str -> str).
            num_slots: slots of the slot file now; pages in slots beyond it are dropped.
            page_tokens: tokens per page; a record of another length is dropped.

        Returns:
            ``(index, pages)``: ``pages`` in parent-before-child order (empty when the
            journal was missing, unreadable or written for another fingerprint).

        Raises:
            OSError: the journal cannot be written.
        """
        path = Path(directory) / INDEX_FILE_NAME
        pages: list[Page] = []
        reused = False
        data = b""
        if path.exists():
            with open(path, "rb") as f:
                data = f.read()
        records, _ = _read_records(data, path) if data else ([], 0)
        header = records[0] if records and isinstance(records[0], Header) else None
        if header is not None and header.format_version == INDEX_FORMAT_VERSION and header.fingerprint == fingerprint:
            every = _replay(records, 1 << 62, page_tokens)
            pages, orphans = _chain({slot: put for slot, put in every.items() if slot < num_slots})
            reused = True
            beyond = sum(slot >= num_slots for slot in every)
            smaller = f"; {beyond} pages beyond the slot file's {num_slots} slots dropped" if beyond else ""
            logger.info("hiradix: NVMe index %s: same fingerprint; re-indexed %d pages (%d orphan pages dropped%s)",
                        path, len(pages), len(orphans), smaller)
        elif header is not None:
            logger.warning("hiradix: NVMe index %s was written for another setup (%s); its pages are not reused",
                           path, _fingerprint_diff(header.fingerprint, fingerprint) or "format version")
        elif data:
            logger.warning("hiradix: NVMe index %s is unreadable; its pages are not reused", path)
        live = {p.slot: Put(p.slot, p.parent_hash, list(p.tokens), list(p.namespace) if p.namespace is not None else None)
                for p in pages}
        tmp = _write_snapshot(path, fingerprint, list(live.values()))
        size = _install(tmp, path, [])
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        return cls(path, fd, reused, fingerprint, live, size), pages

    def _append(self, record: Record) -> None:
        frame = _frame(record)
        os.write(self._fd, frame)
        self.size_bytes += len(frame)
        if self._tail is not None:
            self._tail.append(frame)
        self._dirty = True

    @property
    def num_pages(self) -> int:
        """Pages the journal lists now (a restart re-indexes these)."""
        return len(self._live)

    @property
    def waiting_pages(self) -> int:
        """Pages recorded whose parent page is not listed yet (lost if the server stops now)."""
        return len(self._waiting)

    def listed(self, slots: Sequence[int]) -> int:
        """How many of ``slots`` the journal lists now."""
        return sum(int(s) in self._live for s in slots)

    def invalidate(self, slots: Sequence[int]) -> None:
        """Record that ``slots`` hold nothing valid (before they are rewritten or after a free)."""
        if slots and self._fd >= 0:
            for slot in slots:
                self._forget(int(slot))
            self._append(Free([int(s) for s in slots]))

    def record(self, slots: Sequence[int], parent_hash: bytes, pages: Sequence[Sequence[int]],
               namespace: Optional[Sequence]) -> bytes:
        """Record that ``slots[i]`` holds ``pages[i]``, a chain that follows ``parent_hash``.

        A page is put in the journal once its parent page is listed (a prefix's first page at
        once); until then it waits, and it is put right after its parent is.

        Returns:
            The hash of the last page (the parent of what follows).
        """
        ns = list(namespace) if namespace is not None else None
        for slot, tokens in zip(slots, pages):
            put = Put(int(slot), parent_hash, [int(t) for t in tokens], ns)
            parent_hash = page_hash(parent_hash, ns, tokens)
            if self._fd < 0:
                continue
            self._forget(put.slot)
            if put.parent_hash and not self._listed[put.parent_hash]:
                self._waiting[put.slot] = (parent_hash, put)
                self._waiting_on.setdefault(put.parent_hash, set()).add(put.slot)
            else:
                self._list(put, parent_hash)
        return parent_hash

    def _list(self, put: Put, digest: bytes) -> None:
        """Put ``put`` (page hash ``digest``) in the journal, then the pages that waited for it."""
        todo = [(put, digest)]
        while todo:
            put, digest = todo.pop()
            self._live[put.slot] = put
            self._hash_of[put.slot] = digest
            self._listed[digest] += 1
            self._append(put)
            for slot in sorted(self._waiting_on.pop(digest, ())):
                child_digest, child = self._waiting.pop(slot)
                todo.append((child, child_digest))

    def _forget(self, slot: int) -> None:
        """``slot`` no longer holds its listed or waiting page (in memory; the caller journals it)."""
        self._live.pop(slot, None)
        digest = self._hash_of.pop(slot, None)
        if digest is not None:
            self._listed[digest] -= 1
            if not self._listed[digest]:
                del self._listed[digest]
        waiting = self._waiting.pop(slot, None)
        if waiting is not None:
            siblings = self._waiting_on.get(waiting[1].parent_hash)
            siblings.discard(slot)
            if not siblings:
                del self._waiting_on[waiting[1].parent_hash]

    def sync(self, min_interval_s: float = 1.0) -> None:
        """Per scheduler step: fdatasync the journal if it changed and ``min_interval_s``
        passed since the last sync; start or finish a background compaction."""
        if self._fd < 0:
            return
        now = time.monotonic()
        if self._dirty and now - self._last_sync_s >= min_interval_s:
            os.fdatasync(self._fd)
            self._dirty = False
            self._last_sync_s = now
        if self._compactor is not None:
            if not self._compactor.is_alive():
                self._finish_compaction()
        elif self.size_bytes > COMPACT_GROWTH * max(self._compacted_bytes, COMPACT_MIN_BYTES):
            self._start_compaction()

    def _start_compaction(self) -> None:
        """Write the live records to a new file in a thread; frames appended meanwhile are kept
        in ``_tail`` and replayed onto it (:meth:`_finish_compaction`), so nothing is lost."""
        snapshot = list(self._live.values())
        self._tail, self._compacted_tmp = [], None

        def work() -> None:
            try:
                self._compacted_tmp = _write_snapshot(self.path, self._fingerprint, snapshot)
            except OSError:
                logger.exception("hiradix: compacting %s failed; the journal keeps growing", self.path)

        self._compactor = threading.Thread(target=work, name="hiradix-index-compact", daemon=True)
        self._compactor.start()

    def _finish_compaction(self) -> None:
        tmp, tail = self._compacted_tmp, self._tail or []
        self._tail, self._compactor, self._compacted_tmp = None, None, None
        if tmp is None:  # the writer failed (logged); keep the long journal
            return
        os.fdatasync(self._fd)
        size = _install(tmp, self.path, tail)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.size_bytes = self._compacted_bytes = size
        self._dirty = False
        self.compactions += 1

    def close(self) -> None:
        """Finish a running compaction, sync and close the journal (idempotent)."""
        if self._fd < 0:
            return
        if self._compactor is not None:
            self._compactor.join()
            self._finish_compaction()
        if self._dirty:
            os.fdatasync(self._fd)
        os.close(self._fd)
        self._fd = -1


def _write_snapshot(path: Path, fingerprint: dict[str, str], puts: list[Put]) -> Path:
    """Write a header and ``puts`` to ``<path>.tmp`` (0600) and fsync it; returns that path."""
    tmp = path.with_name(path.name + ".tmp")
    header = Header(INDEX_FORMAT_VERSION, dict(fingerprint), time.time())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, _frame(header) + b"".join(_frame(p) for p in puts))
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _install(tmp: Path, path: Path, tail: list[bytes]) -> int:
    """Append ``tail`` to ``tmp``, fsync, rename it over ``path`` and fsync the directory.

    Returns:
        The new journal's size in bytes.
    """
    fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if tail:
            os.write(fd, b"".join(tail))
            os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size
