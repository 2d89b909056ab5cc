"""Wire protocol between the cache (scheduler process) and its NVMe I/O worker process.

Everything that crosses the process boundary is defined here, once: the spawn spec, the
messages, their msgpack codec, the socket names and the validation of a job.

Sockets (one pair per worker incarnation, both ``ipc://`` inside ``WorkerSpec.socket_dir``):

    client  PUSH --connect-->  <jobs endpoint>  <--bind-- PULL  worker     (WorkerRequest)
    client  PULL --bind---->   <acks endpoint>  <--connect PUSH worker     (WorkerReply)

Each side connects its PUSH to the other's bound PULL, so a message sent before the TCP-like
handshake finishes is queued, never dropped. A PUSH/PULL pipe with one peer keeps order: a
``Pong(seq)`` proves that every message sent before ``Ping(seq)`` has reached the worker's loop.
A respawned worker gets fresh endpoint names (``generation`` + 1), so a job queued for a dead
worker can never reach its successor.

Only ids cross the sockets: DRAM page ids, NVMe slot ids and job ids. Page data moves through
the shared DRAM file and the NVMe file.

Example:
    >>> buf = encode(StorePages(job_id=7, dram_pages=[0, 1], nvme_slots=[4, 5]))
    >>> decode_request(buf)
    StorePages(job_id=7, dram_pages=[0, 1], nvme_slots=[4, 5])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, Union

import msgspec
import zmq

from hiradix.core.ports import READ_AT_ADMISSION, READ_BACKGROUND, READ_QUEUED

# Longest path a Unix domain socket accepts (sun_path is 108 bytes with its NUL).
MAX_IPC_PATH_BYTES = 107
# The worker's exit status after a store call ran past its limit (a wedged store client): the
# store's failure, not the worker's; the client respawns without counting it as a crash.
WEDGED_STORE_EXIT_CODE = 3

# Priorities of NVMe jobs in the worker, most urgent first (the core's READ_* of hiradix.core.ports).
PRIORITY_ADMISSION, PRIORITY_QUEUED, PRIORITY_BACKGROUND = READ_AT_ADMISSION, READ_QUEUED, READ_BACKGROUND


class ProtocolError(ValueError):
    """Raised when bytes received on a socket are not a valid message of the expected union."""


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Base of every message: tagged by class name, encoded as a msgpack array."""


# ---- client -> worker -------------------------------------------------------------------------


class StorePages(_Msg, frozen=True, tag=True):
    """Copy DRAM pages down to NVMe slots: ``dram_pages[i]`` -> ``nvme_slots[i]``.

    Attributes:
        job_id: Caller-chosen id, unique among the caller's in-flight jobs, >= 0.
        dram_pages: DRAM page ids to read, in [0, num_dram_pages), no duplicates.
        nvme_slots: NVMe slot ids to write, in [0, num_nvme_slots), no duplicates, same length.
    """

    job_id: int
    dram_pages: list[int]
    nvme_slots: list[int]


class LoadPages(_Msg, frozen=True, tag=True):
    """Copy NVMe slots up into DRAM pages: ``nvme_slots[i]`` -> ``dram_pages[i]``.

    A page is written only if its slot's checksum verifies; otherwise its ``ok`` is False.

    Attributes:
        job_id: Caller-chosen id, unique among the caller's in-flight jobs, >= 0.
        nvme_slots: NVMe slot ids to read, in [0, num_nvme_slots), no duplicates.
        dram_pages: DRAM page ids to write, in [0, num_dram_pages), no duplicates, same length.
        priority: ``PRIORITY_ADMISSION`` (a request waits for it), ``PRIORITY_QUEUED`` (a queued
            request will) or ``PRIORITY_BACKGROUND`` (a predicted return); the worker runs
            waiting jobs in this order, and every ``StorePages`` as ``PRIORITY_BACKGROUND``.
    """

    job_id: int
    nvme_slots: list[int]
    dram_pages: list[int]
    priority: int = 0


class PutStore(_Msg, frozen=True, tag=True):
    """Copy DRAM pages into the cluster store: ``dram_pages[i]`` -> object ``keys[i]``.

    Attributes:
        job_id: Caller-chosen id, unique among the caller's in-flight jobs, >= 0.
        dram_pages: DRAM page ids to read, in [0, num_dram_pages), no duplicates.
        keys: Store keys to write, same length, no duplicates.
    """

    job_id: int
    dram_pages: list[int]
    keys: list[str]


class GetStore(_Msg, frozen=True, tag=True):
    """Copy store objects into DRAM pages: object ``keys[i]`` -> ``dram_pages[i]``; a page is
    ``ok`` only if its object was found and its checksum verified.

    Attributes:
        job_id: Caller-chosen id, unique among the caller's in-flight jobs, >= 0.
        keys: Store keys to read, no duplicates.
        dram_pages: DRAM page ids to write, in [0, num_dram_pages), no duplicates, same length.
        priority: as ``LoadPages.priority``; the worker's store pool runs waiting lookups
            (``QueryStore``) first, then GETs in this order, then PUTs.
    """

    job_id: int
    keys: list[str]
    dram_pages: list[int]
    priority: int = 0


class QueryStore(_Msg, frozen=True, tag=True):
    """Which of ``keys`` the store holds; ``ok[i]`` = found (a hint: a later GET may still miss).

    Attributes:
        job_id: Caller-chosen id, unique among the caller's in-flight jobs, >= 0.
        keys: Store keys, no duplicates.
    """

    job_id: int
    keys: list[str]


class Ping(_Msg, frozen=True, tag=True):
    """Liveness probe; answered by ``Pong(seq)`` after every earlier message was taken in."""

    seq: int


class Shutdown(_Msg, frozen=True, tag=True):
    """Stop taking jobs, finish the running ones (queued ones fail), then exit 0."""


# ---- worker -> client -------------------------------------------------------------------------


class Ready(_Msg, frozen=True, tag=True):
    """The worker attached both tiers and bound its jobs socket."""

    pid: int


class StartFailed(_Msg, frozen=True, tag=True):
    """The worker could not start (bad spec, missing files, bad fault switch); it exits 1."""

    reason: str


class JobDone(_Msg, frozen=True, tag=True):
    """Outcome of one job, one flag per page in the job's order.

    Attributes:
        job_id: The job's id.
        ok: ``ok[i]`` is True iff page i was copied (and, on a load, its checksum verified).
        error: Empty on a normal completion; otherwise why the job failed as a whole.
        duration_s: Wall time the worker spent on the job, in seconds (0 if synthesized).
    """

    job_id: int
    ok: list[bool]
    error: str = ""
    duration_s: float = 0.0


class Pong(_Msg, frozen=True, tag=True):
    """Answer to ``Ping(seq)``."""

    seq: int


class Rejected(_Msg, frozen=True, tag=True):
    """A message the worker refused without running it.

    Attributes:
        job_id: The job's id, or -1 when the bytes did not decode to a job.
        reason: Human-readable cause.
    """

    job_id: int
    reason: str


Job = Union[StorePages, LoadPages, PutStore, GetStore, QueryStore]
StoreJob = Union[PutStore, GetStore, QueryStore]  # run against the cluster store
WorkerRequest = Union[StorePages, LoadPages, PutStore, GetStore, QueryStore, Ping, Shutdown]
WorkerReply = Union[Ready, StartFailed, JobDone, Pong, Rejected]
Msg = Union[WorkerRequest, WorkerReply]

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(WorkerRequest)
_REPLY_DECODER = msgspec.msgpack.Decoder(WorkerReply)


def encode(msg: Msg) -> bytes:
    """Serialize one message to msgpack bytes.

    Raises:
        TypeError: ``msg`` is not one of this module's message types.
    """
    if not isinstance(msg, _Msg):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, buf: bytes, direction: str) -> Any:
    try:
        return decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {direction} ({len(buf)} bytes): {exc}") from exc


def decode_request(buf: bytes) -> WorkerRequest:
    """Decode a client -> worker message.

    Raises:
        ProtocolError: ``buf`` is not msgpack, has an unknown tag or a reply's tag, or fields
            of the wrong type.
    """
    return _decode(_REQUEST_DECODER, buf, "request")


def decode_reply(buf: bytes) -> WorkerReply:
    """Decode a worker -> client message.

    Raises:
        ProtocolError: ``buf`` is not msgpack, has an unknown tag or a request's tag, or fields
            of the wrong type.
    """
    return _decode(_REPLY_DECODER, buf, "reply")


def job_pages(job: Job) -> int:
    """Number of pages (or keys) a job covers (the length of its ``ok`` list)."""
    return len(job.keys) if isinstance(job, QueryStore) else len(job.dram_pages)


MAX_KEY_CHARS = 256  # longest store key accepted


def validate_job(job: Job, num_dram_pages: int, num_nvme_slots: int, has_store: bool = False) -> str:
    """Check a job against the tiers' sizes.

    Args:
        job: The job as decoded.
        num_dram_pages: DRAM pool size, in pages.
        num_nvme_slots: NVMe store size, in slots.
        has_store: whether this worker has a cluster store (store jobs need one).

    Returns:
        An empty string if the job is valid, else the reason it is not.
    """
    if job.job_id < 0:
        return f"job_id must be >= 0, got {job.job_id}"
    if isinstance(job, (PutStore, GetStore, QueryStore)):
        return _validate_store_job(job, num_dram_pages, has_store)
    if len(job.dram_pages) != len(job.nvme_slots):
        return f"{len(job.dram_pages)} dram_pages but {len(job.nvme_slots)} nvme_slots"
    if isinstance(job, LoadPages) and not PRIORITY_ADMISSION <= job.priority <= PRIORITY_BACKGROUND:
        return f"priority must be in [{PRIORITY_ADMISSION}, {PRIORITY_BACKGROUND}], got {job.priority}"
    return _check_ids(("dram_pages", job.dram_pages, num_dram_pages), ("nvme_slots", job.nvme_slots, num_nvme_slots))


def _validate_store_job(job: StoreJob, num_dram_pages: int, has_store: bool) -> str:
    if not has_store:
        return "this worker has no cluster store"
    if len(set(job.keys)) != len(job.keys):
        return "keys has duplicates"
    if any(not k or len(k) > MAX_KEY_CHARS for k in job.keys):
        return f"keys must be 1..{MAX_KEY_CHARS} characters"
    if isinstance(job, QueryStore):
        return ""
    if len(job.dram_pages) != len(job.keys):
        return f"{len(job.dram_pages)} dram_pages but {len(job.keys)} keys"
    if isinstance(job, GetStore) and not PRIORITY_ADMISSION <= job.priority <= PRIORITY_BACKGROUND:
        return f"priority must be in [{PRIORITY_ADMISSION}, {PRIORITY_BACKGROUND}], got {job.priority}"
    return _check_ids(("dram_pages", job.dram_pages, num_dram_pages))


def _check_ids(*checks: tuple[str, list[int], int]) -> str:
    for name, ids, bound in checks:
        bad = [i for i in ids if not 0 <= i < bound]
        if bad:
            return f"{name} out of range [0, {bound}): {bad[:8]}"
        if len(set(ids)) != len(ids):
            return f"{name} has duplicates"
    return ""


# ---- spawn spec and socket names --------------------------------------------------------------


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker process needs to attach to the two tiers; JSON-serializable.

    Attributes:
        dram_path: The DRAM pool's shared-memory file (``DramPool.path``).
        layout: ``KVLayout.to_json()`` of the pages.
        num_dram_pages: DRAM pool size, in pages.
        nvme_dir: Directory of the NVMe store (as given to ``NvmeStore.create``).
        num_nvme_slots: NVMe store size, in slots.
        page_bytes: Bytes per DRAM page: the layout's ``page_bytes``, or the encoded page's when
            ``"dram"`` is one of ``cold_tiers``.
        io_backend: NVMe backend name passed to the store ("auto", "posix", "kvikio", ...).
        socket_dir: Private directory (mode 0700) for the ipc socket files.
        threads: Jobs run concurrently, >= 1 (reads and writes overlap).
        parent_pid: Process the worker serves; it exits when that process is gone.
        store_backend: Cluster-store backend name (``hiradix.tiers.store``), "" for none.
        store_config: The backend's config as JSON text (``--hiradix-store-config``).
        store_threads: Store jobs run concurrently, on their own threads (a slow store never
            delays NVMe jobs).
        store_call_limit_s: A store backend call running longer than this, in seconds, means
            a wedged store client: the worker exits (exit status ``WEDGED_STORE_EXIT_CODE``)
            so its client fails the jobs and respawns it. 0 (the
            default): the config's ``call_limit_s``, else ``max(10 s, 4 x`` its ``call_deadline_s``).
        tp_rank: The TP rank this worker serves (names it in logs; test faults may target one).
        store_writer: False: PUTs report success without writing (another rank writes the same
            bytes under the same keys: MLA under TP, ``fingerprint.is_store_writer``); GETs and
            lookups run as usual.
        cold_format: The page format of the cold tiers (``hiradix.dataplane.kv_codec.FORMATS``).
        cold_tiers: The tiers holding pages in ``cold_format`` (``"dram"``, ``"nvme"``, ``"store"``);
            empty: every tier holds the DRAM page's bytes as they are. With ``"dram"`` the DRAM
            pages are encoded already and move as they are (:mod:`hiradix.io.cold_pages`).
        stop_timeout_s: ``--hiradix-stop-timeout-s``: > 0, a SIGTERM does not stop the worker: it
            goes on serving (its scheduler drains the writes in flight, then sends Shutdown) and
            exits ``STOP_MARGIN_S`` past this many seconds without one; 0, SIGTERM ends it at once.
    """

    dram_path: str
    layout: dict[str, Any]
    num_dram_pages: int
    nvme_dir: str
    num_nvme_slots: int
    page_bytes: int
    io_backend: str = "auto"
    socket_dir: str
    threads: int = 4
    parent_pid: int
    store_backend: str = ""
    store_config: str = ""
    store_threads: int = 2
    store_call_limit_s: float = 0.0
    tp_rank: int = 0
    store_writer: bool = True
    cold_format: str = "exact"
    cold_tiers: tuple[str, ...] = ()
    stop_timeout_s: float = 0.0

    def to_json(self) -> str:
        """Serialize to a JSON string (the worker's ``--spec`` argument)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerSpec:
        """Parse a JSON spec.

        Raises:
            ProtocolError: ``text`` is not a valid spec.
        """
        try:
            return msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"bad worker spec: {exc}") from exc


class Endpoints(msgspec.Struct, frozen=True):
    """The two ipc endpoints of one worker incarnation.

    Attributes:
        jobs: ``ipc://`` address the worker binds (requests).
        acks: ``ipc://`` address the client binds (replies).
    """

    jobs: str
    acks: str

    def paths(self) -> list[Path]:
        """The socket files behind both endpoints."""
        return [Path(addr.removeprefix("ipc://")) for addr in (self.jobs, self.acks)]


def make_endpoints(socket_dir: str | Path, instance: str, generation: int) -> Endpoints:
    """Name the sockets of one worker incarnation.

    Args:
        socket_dir: The private socket directory.
        instance: Token unique to one client (several clients may share a directory).
        generation: Incarnation number, +1 on every respawn.

    Raises:
        ValueError: A socket path is longer than ``MAX_IPC_PATH_BYTES``.
    """
    base = Path(socket_dir) / f"{instance}-{generation}"
    jobs, acks = f"{base}.jobs", f"{base}.acks"
    for path in (jobs, acks):
        if len(path.encode()) > MAX_IPC_PATH_BYTES:
            raise ValueError(
                f"ipc socket path is {len(path.encode())} bytes, over {MAX_IPC_PATH_BYTES}: "
                f"{path}; use a shorter socket_dir"
            )
    return Endpoints(jobs=f"ipc://{jobs}", acks=f"ipc://{acks}")


# ---- typed queues over ZMQ sockets ------------------------------------------------------------

M = TypeVar("M")


class PushQueue(Generic[M]):
    """Sending end: a ZMQ PUSH socket that connects, so messages queue until the peer binds.

    ``put`` is thread-safe (one lock around the socket) and never blocks: the send queue is
    unbounded (the cache bounds the pages in flight, so the queue is bounded by that).
    """

    def __init__(self, ctx: zmq.Context, addr: str):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)
        self._lock = threading.Lock()

    def put(self, msg: M) -> None:
        """Queue one message for sending.

        Raises:
            zmq.ZMQError: The socket is closed.
        """
        buf = encode(msg)  # type: ignore[arg-type]
        with self._lock:
            self._sock.send(buf, zmq.NOBLOCK, copy=False)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket, waiting up to ``linger_s`` seconds for queued messages to leave."""
        with self._lock:
            self._sock.close(linger=int(linger_s * 1000))


class PullQueue(Generic[M]):
    """Receiving end: a ZMQ PULL socket bound at an ipc address, decoding one union."""

    def __init__(self, ctx: zmq.Context, addr: str, decode: Callable[[bytes], M]):
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._decode = decode

    @property
    def socket(self) -> zmq.Socket:
        """The underlying socket, to register with a ``zmq.Poller``."""
        return self._sock

    def get_nowait(self) -> M | None:
        """Receive one message if one is waiting.

        Returns:
            The message, or None if none is queued.

        Raises:
            ProtocolError: The frame did not decode; the frame is consumed.
        """
        try:
            buf = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._decode(buf)

    def close(self) -> None:
        """Close the socket (libzmq removes the socket file it bound)."""
        self._sock.close(linger=0)
