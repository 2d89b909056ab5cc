"""hiradix configuration: one table of flags, and the frozen, typed record built from it.

:data:`FLAGS` is the only place a ``--hiradix-*`` flag is spelled: SGLang's parser gets its
arguments from it (``hiradix.sglang_plugin.flags``), :meth:`HiRadixConfig.from_flags` converts
and validates command-line values with it, and every error message names the flag through it.
Policies are validated against the policy registry (:func:`hiradix.core.policy.policy_names`).

The record is made in the launcher, rides to every scheduler process as the bookkeeping
attribute ``server_args._hiradix_config``, and is also exported as JSON in the environment
variable ``HIRADIX_CONFIG`` (fallback).

Units: sizes are in bytes in the record and in decimal gigabytes (1 GB = 1e9 bytes, as
SGLang's ``--hicache-size``) on the command line. Sizes are per scheduler process (one per TP
rank), like ``--hicache-size``: a server with ``--tp-size 2`` uses twice ``dram_bytes`` of host
memory.

Validation raises :class:`HiRadixConfigError` (a ``ValueError``) whose message names the flag
and the value the user gave, e.g. "--hiradix-dram-gb must be > 0, got -1".
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hiradix.core.policy import make_policy, policy_names
from hiradix.core.context_overflow import MODES as OVERFLOW_MODES
from hiradix.core.store_reads import READ_MODES

# The environment variable that carries `HiRadixConfig.to_json()` to child processes.
ENV_VAR = "HIRADIX_CONFIG"

BYTES_PER_GB = 10**9
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back")
DRAM_MODES: tuple[str, ...] = ("cache", "staging")
# MLA under TP: one host copy (DRAM, NVMe) per node, shared by the ranks, or one per rank.
MLA_HOST_COPIES: tuple[str, ...] = ("node", "rank")
PARTIAL_PAGE_MODES: tuple[str, ...] = ("on", "off")
STORE_WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back")  # see hiradix.core.store_tier
COLD_FORMATS: tuple[str, ...] = ("exact", "fp8", "int4")  # hiradix.dataplane.kv_codec.FORMATS
COLD_TIERS: tuple[str, ...] = ("dram", "nvme", "store")  # tiers that may hold compressed pages (top down)
STORE_READ_MODES: tuple[str, ...] = READ_MODES  # auto, always, never: see hiradix.core.store_reads


class HiRadixConfigError(ValueError):
    """A hiradix setting that cannot be served; the message names the flag."""


def _num(value: float) -> str:
    """Format a number as a user would type it: 1000000, 0.25, -1."""
    return f"{value:.12g}"


def _gb(num_bytes: int) -> str:
    """Format a byte count as the GB value a user would have typed."""
    return _num(num_bytes / BYTES_PER_GB)


@dataclass(frozen=True)
class FlagSpec:
    """One ``--hiradix-*`` value flag.

    Attributes:
        name: keyword of :meth:`HiRadixConfig.from_flags`; the flag is ``--hiradix-<name>``
            (underscores as dashes) and the argparse dest ``hiradix_<name>``.
        field: the :class:`HiRadixConfig` attribute it sets.
        type: argparse type of the command-line value.
        default: default, in command-line units.
        help: one line for ``--help`` (the default is appended).
        metavar: argparse metavar, or None (choices are shown instead).
        choices: the accepted values, looked up when asked (e.g. the policy registry).
        convert: command-line value -> record value (e.g. GB -> bytes); may raise
            :class:`HiRadixConfigError` naming the flag.
    """

    name: str
    field: str
    type: type
    default: Any
    help: str
    metavar: Optional[str] = None
    choices: Optional[Callable[[], list[str]]] = None
    convert: Optional[Callable[[str, Any], Any]] = None

    @property
    def flag(self) -> str:
        return "--hiradix-" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return "hiradix_" + self.name

    def to_field(self, value: Any) -> Any:
        """The record value of command-line ``value`` (None: the default)."""
        value = self.default if value is None else value
        return value if self.convert is None else self.convert(self.flag, value)


def _gb_to_bytes(flag: str, gb: float) -> int:
    if not math.isfinite(gb):
        raise HiRadixConfigError(f"{flag} must be a finite number, got {gb}")
    return round(gb * BYTES_PER_GB)


def _store_config_text(flag: str, value: Any) -> str:
    """``--hiradix-store-config``: JSON text, or the path of a JSON file; kept as canonical JSON.

    Raises:
        HiRadixConfigError: unreadable, not JSON, or a key the store config does not have or
            with a bad value (``hiradix.tiers.store.StoreConfig``), naming the flag and the key.
    """
    if value is None:
        return ""
    from hiradix.tiers.store import StoreConfig, StoreConfigError

    try:
        return StoreConfig.parse(str(value), flag).to_json()
    except StoreConfigError as e:
        raise HiRadixConfigError(str(e)) from None


def _store_backends() -> list[str]:
    from hiradix.tiers.store import backend_names

    return backend_names()


def _resolve_path(flag: str, path: Any) -> Optional[Path]:
    if path is None:
        return None
    if str(path).strip() == "":
        raise HiRadixConfigError(f"{flag} must not be empty")
    return Path(path).expanduser().resolve()


def _ratio(flag: str, ratio: Any) -> float:
    if ratio is None:
        return 0.0
    if not math.isfinite(ratio) or ratio <= 0:
        raise HiRadixConfigError(f"{flag} must be a finite number > 0 (x the device KV pool), got {ratio}")
    return float(ratio)


def _cold_tiers(flag: str, value: Any) -> tuple[str, ...]:
    tiers = tuple(t.strip() for t in str(value).split(",") if t.strip())
    unknown = [t for t in tiers if t not in COLD_TIERS]
    if unknown or not tiers or len(set(tiers)) != len(tiers):
        raise HiRadixConfigError(f"{flag} must be a comma-separated subset of {list(COLD_TIERS)}, got {value!r}")
    if "dram" in tiers:  # NVMe and the store get DRAM's bytes as they are: encoded too
        return COLD_TIERS
    return tuple(t for t in COLD_TIERS if t in tiers)


FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec("dram_gb", "dram_bytes", float, 4.0, ("DRAM tier per scheduler process (TP rank), in GB (1e9 bytes); an MLA model under TP: per node, "
             "one copy its ranks share. Every page to or from NVMe and the store passes through it: a history "
             "larger than DRAM comes back in parts, each promoted to HBM before the next is read; one turn larger "
             "than DRAM is not written down (size DRAM at several times your longest turn)."),
             "GB", convert=_gb_to_bytes),
    FlagSpec("dram_ratio", "dram_ratio", float, None,
             "DRAM tier as a multiple of the device KV pool's bytes (like --hicache-ratio); "
             "instead of --hiradix-dram-gb.", "RATIO", convert=_ratio),
    FlagSpec("dram_mode", "dram_mode", str, "cache",
             "cache: DRAM keeps copies (DRAM hits); staging: DRAM only carries pages in flight between "
             "HBM and NVMe (needs an NVMe tier; like --hicache-host-memory-mode buffer_only).",
             choices=lambda: list(DRAM_MODES)),
    FlagSpec("nvme_path", "nvme_path", str, None,
             "Directory for the NVMe tier's files (must exist; a private hiradix-rank<r>/ is made inside, r = the TP "
             "rank; one for a shared MLA copy).",
             "DIR", convert=_resolve_path),
    FlagSpec("nvme_gb", "nvme_bytes", float, 0.0, ("NVMe tier per TP rank, in GB (an MLA model under TP: per node, one copy its ranks share); "
             "0 = no NVMe tier."), "GB",
             convert=_gb_to_bytes),
    FlagSpec("policy", "policy", str, "lookahead",
             ("Eviction/promotion policy: lookahead (queue-aware, CachedAttention §3.3), predictive (the queue, "
              "then reuse predicted from what the server saw; reads predicted returns ahead; TP 1 only) or lru (as stock)."),
             choices=policy_names),
    FlagSpec("lookahead_window", "lookahead_window", int, 64,
             "Waiting requests a queue-aware policy (lookahead, predictive) inspects per step.", "REQUESTS"),
    FlagSpec("write_policy", "write_policy", str, "write_through",
             "When KV is copied from HBM to DRAM: write_through (at insert, async) or write_back (at eviction).",
             choices=lambda: list(WRITE_POLICIES)),
    FlagSpec("load_timeout_s", "load_timeout_s", float, 2.0,
             "How long a request may wait at admission for its NVMe or store pages; then it runs with "
             "the pages that are ready and recomputes the rest.", "SECONDS",
             convert=lambda flag, v: float(v)),
    FlagSpec("stop_timeout_s", "stop_timeout_s", float, 10.0,
             "How long a stopping server (SIGTERM, also to its whole process group) waits for the NVMe and store "
             "writes in flight to land, recording what landed in the durable NVMe index once; then what has not "
             "landed is lost (counted in the log). 0 = stop at once.", "SECONDS",
             convert=lambda flag, v: float(v)),
    FlagSpec("store", "store_backend", str, None,
             "Cluster store shared by the servers (the tier below NVMe); none by default.", choices=_store_backends),
    FlagSpec("store_config", "store_config", str, None,
             "The store's settings: a JSON object or the path of a JSON file (master address, protocol, "
             "metadata server, local hostname, sizes, timeouts).", "JSON|FILE", convert=_store_config_text),
    FlagSpec("store_write_policy", "store_write_policy", str, "write_through",
             "When KV is put into the store: write_through (once in DRAM) or write_back (once it left HBM).",
             choices=lambda: list(STORE_WRITE_POLICIES)),
    FlagSpec("store_read", "store_read", str, "always",
             "Which store hits are read: always, auto (a hit is read only while reading it is faster than "
             "prefilling it again, by this server's measured store bandwidth and prefill rate; opt-in: its "
             "bandwidth estimate reads low on small GETs), or never (recompute; the store is still written).",
             choices=lambda: list(STORE_READ_MODES)),
    FlagSpec("context_overflow", "context_overflow", str, "off",
             "A prompt whose length plus its new tokens exceeds the context: off (SGLang's behaviour: refused), "
             "shift (keep the head, drop the oldest part of the rest, reuse the kept tail's cached KV re-rotated to "
             "its new positions: AttentionStore §3.4; approximate beyond the first layer), recompute (the same cut, "
             "the kept tail prefilled again), noshift (a diagnostic: the kept tail's KV at its old positions).",
             choices=lambda: list(OVERFLOW_MODES)),
    FlagSpec("keep_tokens", "keep_tokens", int, -1,
             "With --hiradix-context-overflow: leading tokens kept in place; -1 = the leading part the tree "
             "shows shared with other conversations (a system prompt, tools, few-shot; never a fork of one "
             "conversation's own history), else the first page.", "TOKENS"),
    FlagSpec("drop_ratio", "drop_ratio", float, 0.5,
             "With --hiradix-context-overflow: share of the tokens after the kept head that is dropped "
             "(at least the overflow; whole pages).", "RATIO"),
    FlagSpec("cold_format", "cold_format", str, "exact",
             "Page format of the tiers named by --hiradix-cold-tiers: exact (the model's bytes), fp8 (e4m3, one "
             "scale per page, layer and KV head) or int4 (KIVI groups: keys per channel, values per token); fp8 "
             "and int4 change outputs (measured in bench/RESULTS.md). HBM keeps SGLang's dtype.",
             choices=lambda: list(COLD_FORMATS)),
    FlagSpec("cold_tiers", "cold_tiers", str, "nvme,store",
             "Comma-separated tiers that hold pages in --hiradix-cold-format: dram, nvme, store. dram implies "
             "nvme and store (they get DRAM's encoded bytes): pages are encoded and decoded on the KV device "
             "(on CUDA after the PCIe copy), DRAM holds 2-4x the tokens.", "TIERS",
             convert=_cold_tiers),
    FlagSpec("mla_host_copy", "mla_host_copy", str, "node",
             "MLA model under TP (every rank holds the same latent): node = one DRAM pool and NVMe tier per "
             "attention-TP group on a node, written by its rank 0 and read by every rank ((TP-1)/TP of the host bytes "
             "saved; TP across hosts: one per rank); rank = one per rank.",
             choices=lambda: list(MLA_HOST_COPIES)),
    FlagSpec("partial_page", "partial_page", str, "on",
             "With --page-size > 1: on = a finished request's partly filled last page stays in HBM for the next "
             "request that continues it (the next turn computes only its new tokens, as at page size 1; HBM only, "
             "evicted first); off = whole pages only, as stock RadixAttention.",
             choices=lambda: list(PARTIAL_PAGE_MODES)),
)  # fmt: skip
FLAG_BY_NAME: dict[str, FlagSpec] = {f.name: f for f in FLAGS}
FLAG_OF_FIELD: dict[str, str] = {f.field: f.flag for f in FLAGS}  # for error messages
VALUE_FLAGS: dict[str, str] = {f.dest: f.flag for f in FLAGS}  # argparse dest -> flag


def _default(name: str) -> Any:
    return FLAG_BY_NAME[name].to_field(None)


@dataclass(frozen=True, slots=True)
class HiRadixConfig:
    """What the tiered cache needs to know, validated on construction.

    Attributes:
        dram_bytes: DRAM (host memory) tier capacity per scheduler process, in bytes; 0
            when the size is a ratio of the device pool (`dram_ratio`). Flag `--hiradix-dram-gb` (GB).
        dram_ratio: DRAM tier capacity as a multiple of the device KV pool's bytes (resolved
            in the scheduler, :meth:`dram_bytes_for`), or 0.0 when `dram_bytes` gives it.
            Flag `--hiradix-dram-ratio`.
        dram_mode: "cache" (DRAM keeps copies: DRAM hits) or "staging" (a DRAM copy is dropped
            as soon as NVMe or HBM also holds it; needs an NVMe tier). Flag `--hiradix-dram-mode`.
        nvme_path: Absolute, resolved directory holding the NVMe tier's files, or
            None when there is no NVMe tier. Flag `--hiradix-nvme-path`.
        nvme_bytes: NVMe tier capacity per scheduler process, in bytes; 0 means no
            NVMe tier. > 0 requires `nvme_path`. Flag `--hiradix-nvme-gb` (GB).
        policy: Eviction/promotion policy, a registered name (`lru`, `lookahead`, ...).
            Flag `--hiradix-policy`.
        lookahead_window: How many waiting requests a queue-aware policy inspects each
            scheduler step, in requests (>= 1). Flag `--hiradix-lookahead-window`.
        write_policy: When KV is copied down a tier: "write_through" (on insert) or
            "write_back" (on eviction). Flag `--hiradix-write-policy`.
        load_timeout_s: How long a request may wait at admission for its pages to be read
            from NVMe or the cluster store, in seconds (> 0); then it runs with what is ready
            and recomputes the rest. Flag `--hiradix-load-timeout-s`.
        stop_timeout_s: How long a stopping server waits for the NVMe and store writes in flight
            to land, in seconds (>= 0; 0: it stops at once, losing them). Flag `--hiradix-stop-timeout-s`.
        store_backend: Cluster-store backend name (`mooncake`), or None: no cluster tier.
            Flag `--hiradix-store`.
        store_config: The store's settings as canonical JSON text ("" without a store).
            Flag `--hiradix-store-config`.
        store_write_policy: When KV is put into the store (`hiradix.core.store_tier`).
            Flag `--hiradix-store-write-policy`.
        store_read: Which store hits are read: "auto" (only while faster than recomputing them,
            `hiradix.core.store_reads`), "always" or "never". Flag `--hiradix-store-read`.
        cold_format: Page format of the cold tiers (``exact``, ``fp8``, ``int4``;
            :mod:`hiradix.dataplane.kv_codec`). Flag `--hiradix-cold-format`.
        cold_tiers: Tiers holding pages in ``cold_format`` (``dram``, ``nvme``, ``store``; ``dram`` implies the
            other two), top down. Flag `--hiradix-cold-tiers`.
        context_overflow: What happens to a prompt that overflows the context (``off``, ``shift``,
            ``recompute``, ``noshift``; :mod:`hiradix.core.context_overflow`). Flag `--hiradix-context-overflow`.
        keep_tokens: Leading tokens a cut keeps (-1: the tree's shared head). Flag `--hiradix-keep-tokens`.
        drop_ratio: Share of the rest a cut drops, in (0, 1]. Flag `--hiradix-drop-ratio`.
        mla_host_copy: MLA under TP: "node" (one host copy the ranks of a node share,
            `hiradix.runtime.shared_host_copy`) or "rank" (one per rank). Flag `--hiradix-mla-host-copy`.
        partial_page: "on": keep finished requests' partly filled last pages in HBM
            (`hiradix.core.partial_pages`); "off": whole pages only. Flag `--hiradix-partial-page`.
    """

    dram_bytes: int = _default("dram_gb")
    dram_ratio: float = 0.0
    dram_mode: str = _default("dram_mode")
    nvme_path: Path | None = None
    nvme_bytes: int = _default("nvme_gb")
    policy: str = _default("policy")
    lookahead_window: int = _default("lookahead_window")
    write_policy: str = _default("write_policy")
    load_timeout_s: float = _default("load_timeout_s")
    stop_timeout_s: float = _default("stop_timeout_s")
    store_backend: Optional[str] = None
    store_config: str = ""
    store_write_policy: str = _default("store_write_policy")
    store_read: str = _default("store_read")
    cold_format: str = _default("cold_format")
    cold_tiers: tuple[str, ...] = _default("cold_tiers")
    context_overflow: str = _default("context_overflow")
    keep_tokens: int = _default("keep_tokens")
    drop_ratio: float = _default("drop_ratio")
    mla_host_copy: str = _default("mla_host_copy")
    partial_page: str = _default("partial_page")

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        flag = FLAG_OF_FIELD
        for name in ("dram_bytes", "nvme_bytes", "lookahead_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise HiRadixConfigError(f"{flag[name]}: {name} must be an int, got {value!r}")
        self._validate_dram()
        if self.nvme_bytes < 0:
            raise HiRadixConfigError(f"{flag['nvme_bytes']} must be >= 0, got {_gb(self.nvme_bytes)}")
        self._validate_nvme_path()
        if self.policy not in policy_names():
            raise HiRadixConfigError(f"{flag['policy']} must be one of {policy_names()}, got {self.policy!r}")
        if self.lookahead_window < 1:
            raise HiRadixConfigError(
                f"{flag['lookahead_window']} must be >= 1 (requests), got {self.lookahead_window}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise HiRadixConfigError(
                f"{flag['write_policy']} must be one of {list(WRITE_POLICIES)}, got {self.write_policy!r}"
            )
        self._validate_store()
        self._validate_overflow()
        if self.cold_format not in COLD_FORMATS:
            raise HiRadixConfigError(f"{flag['cold_format']} must be one of {list(COLD_FORMATS)}, got {self.cold_format!r}")
        if not isinstance(self.cold_tiers, tuple) or not set(self.cold_tiers) <= set(COLD_TIERS):
            raise HiRadixConfigError(f"{flag['cold_tiers']} must be a subset of {list(COLD_TIERS)}, got {self.cold_tiers!r}")
        if "dram" in self.cold_tiers and set(self.cold_tiers) != set(COLD_TIERS):
            raise HiRadixConfigError(f"{flag['cold_tiers']}: dram implies nvme and store (they get DRAM's encoded "
                                     f"bytes), got {self.cold_tiers!r}")
        timeout = self.load_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise HiRadixConfigError(
                f"{flag['load_timeout_s']} must be a finite number > 0 (seconds), got {timeout!r}"
            )
        stop = self.stop_timeout_s
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not math.isfinite(stop) or stop < 0:
            raise HiRadixConfigError(f"{flag['stop_timeout_s']} must be a finite number >= 0 (seconds), got {stop!r}")

    def _validate_dram(self) -> None:
        flag = FLAG_OF_FIELD
        ratio = self.dram_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio < 0:
            raise HiRadixConfigError(f"{flag['dram_ratio']} must be a finite number > 0, got {ratio!r}")
        if ratio > 0 and self.dram_bytes > 0:
            raise HiRadixConfigError(f"{flag['dram_ratio']} and {flag['dram_bytes']} both size the DRAM tier; give one")
        if ratio == 0 and self.dram_bytes < 0:
            raise HiRadixConfigError(f"{flag['dram_bytes']} must be > 0, got {_gb(self.dram_bytes)}")
        if ratio == 0 and self.dram_bytes == 0:
            raise HiRadixConfigError(
                f"{flag['dram_bytes']} must be > 0, got {_gb(self.dram_bytes)}: the I/O worker reads and writes "
                f"NVMe pages through DRAM, so some DRAM is needed; for DRAM used only by pages in flight "
                f"between HBM and NVMe give a small {flag['dram_bytes']} with {flag['dram_mode']} staging"
            )
        if self.mla_host_copy not in MLA_HOST_COPIES:
            raise HiRadixConfigError(
                f"{flag['mla_host_copy']} must be one of {list(MLA_HOST_COPIES)}, got {self.mla_host_copy!r}")
        if self.partial_page not in PARTIAL_PAGE_MODES:
            raise HiRadixConfigError(
                f"{flag['partial_page']} must be one of {list(PARTIAL_PAGE_MODES)}, got {self.partial_page!r}")
        if self.dram_mode not in DRAM_MODES:
            raise HiRadixConfigError(f"{flag['dram_mode']} must be one of {list(DRAM_MODES)}, got {self.dram_mode!r}")
        if self.dram_mode == "staging" and self.nvme_bytes == 0:
            raise HiRadixConfigError(
                f"{flag['dram_mode']} staging needs an NVMe tier ({flag['nvme_bytes']} > 0): without one, "
                "DRAM pages have nowhere to be staged to"
            )

    def _validate_overflow(self) -> None:
        flag = FLAG_OF_FIELD
        if self.context_overflow not in OVERFLOW_MODES:
            raise HiRadixConfigError(
                f"{flag['context_overflow']} must be one of {list(OVERFLOW_MODES)}, got {self.context_overflow!r}")
        keep = self.keep_tokens
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
            raise HiRadixConfigError(f"{flag['keep_tokens']} must be an int >= 0 (tokens) or -1 (auto), got {keep!r}")
        ratio = self.drop_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise HiRadixConfigError(f"{flag['drop_ratio']} must be a number in (0, 1], got {ratio!r}")

    def dram_bytes_for(self, device_pool_bytes: int) -> int:
        """DRAM tier capacity in bytes, given the device KV pool's size in bytes (all layers, K+V)."""
        return self.dram_bytes if self.dram_ratio == 0 else int(self.dram_ratio * device_pool_bytes)

    def _validate_nvme_path(self) -> None:
        flag = FLAG_OF_FIELD
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, Path) or not self.nvme_path.is_absolute():
                raise HiRadixConfigError(f"{flag['nvme_path']} must be an absolute path, got {self.nvme_path!r}")
            if self.nvme_bytes == 0:
                raise HiRadixConfigError(
                    f"{flag['nvme_path']} {self.nvme_path} is given but {flag['nvme_bytes']} is 0 "
                    f"(no NVMe tier); give {flag['nvme_bytes']} > 0 or drop {flag['nvme_path']}"
                )
        if self.nvme_bytes > 0 and self.nvme_path is None:
            raise HiRadixConfigError(f"{flag['nvme_bytes']} {_gb(self.nvme_bytes)} needs {flag['nvme_path']}")

    def _validate_store(self) -> None:
        flag = FLAG_OF_FIELD
        if self.store_backend is None:
            if self.store_config:
                raise HiRadixConfigError(f"{flag['store_config']} is given but {flag['store_backend']} is not")
            return
        if self.store_backend not in _store_backends():
            raise HiRadixConfigError(
                f"{flag['store_backend']} must be one of {_store_backends()}, got {self.store_backend!r}")
        if not self.store_config:
            raise HiRadixConfigError(f"{flag['store_backend']} {self.store_backend} needs {flag['store_config']}")
        if self.store_read not in STORE_READ_MODES:
            raise HiRadixConfigError(f"{flag['store_read']} must be one of {list(STORE_READ_MODES)}, got {self.store_read!r}")
        if self.store_write_policy not in STORE_WRITE_POLICIES:
            raise HiRadixConfigError(f"{flag['store_write_policy']} must be one of {list(STORE_WRITE_POLICIES)}, "
                                     f"got {self.store_write_policy!r}")

    @property
    def has_store_tier(self) -> bool:
        """Whether a cluster store is configured (`--hiradix-store`)."""
        return self.store_backend is not None

    @property
    def has_nvme_tier(self) -> bool:
        """Whether the NVMe tier is configured (`nvme_bytes > 0`)."""
        return self.nvme_bytes > 0

    @classmethod
    def from_flags(cls, **values: Any) -> HiRadixConfig:
        """Build from command-line values, keyed by :attr:`FlagSpec.name`; None = not given.

        Example: ``HiRadixConfig.from_flags(dram_gb=1.5, nvme_path="/mnt/nvme", nvme_gb=2)``.
        Paths are made absolute and resolved (symlinks); GB become bytes.

        Raises:
            HiRadixConfigError: a value is out of range or the combination is invalid.
            TypeError: a keyword that names no flag.
        """
        unknown = sorted(set(values) - set(FLAG_BY_NAME))
        if unknown:
            raise TypeError(f"from_flags() got unknown flags {unknown}; known: {sorted(FLAG_BY_NAME)}")
        policy, window = values.get("policy"), values.get("lookahead_window")
        if window is not None and policy in policy_names() and not make_policy(policy).uses_queue:
            queue_aware = ", ".join(n for n in policy_names() if make_policy(n).uses_queue)
            raise HiRadixConfigError(
                f"{FLAG_BY_NAME['lookahead_window'].flag} applies only to {FLAG_BY_NAME['policy'].flag} "
                f"{queue_aware}, but {FLAG_BY_NAME['policy'].flag} is {policy}"
            )
        if values.get("store_read") is not None and values.get("store") is None:
            raise HiRadixConfigError(f"{FLAG_BY_NAME['store_read'].flag} applies only with {FLAG_BY_NAME['store'].flag}")
        if values.get("cold_tiers") is not None and values.get("cold_format") in (None, "exact"):
            raise HiRadixConfigError(f"{FLAG_BY_NAME['cold_tiers'].flag} applies only with "
                                     f"{FLAG_BY_NAME['cold_format'].flag} fp8 or int4")
        for name in ("keep_tokens", "drop_ratio"):
            if values.get(name) is not None and values.get("context_overflow") in (None, "off"):
                raise HiRadixConfigError(f"{FLAG_BY_NAME[name].flag} applies only with "
                                         f"{FLAG_BY_NAME['context_overflow'].flag} shift, recompute or noshift")
        if values.get("dram_ratio") is not None:
            if values.get("dram_gb") is not None:
                raise HiRadixConfigError(
                    f"{FLAG_BY_NAME['dram_ratio'].flag} and {FLAG_BY_NAME['dram_gb'].flag} both size the DRAM tier; give one"
                )
            values = {**values, "dram_gb": 0.0}
        return cls(**{spec.field: spec.to_field(values.get(spec.name)) for spec in FLAGS})

    def to_json(self) -> str:
        """Serialize to one line of JSON (sizes in bytes, path as a string or null)."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["nvme_path"] = None if self.nvme_path is None else str(self.nvme_path)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HiRadixConfig:
        """Parse `to_json()` output (e.g. the `HIRADIX_CONFIG` variable) and validate it.

        Raises:
            HiRadixConfigError: not a JSON object, or unknown/missing keys, or invalid values.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HiRadixConfigError(f"{ENV_VAR} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise HiRadixConfigError(f"{ENV_VAR} must be a JSON object, got {text!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data))
        if unknown:
            raise HiRadixConfigError(f"{ENV_VAR} has unknown keys {unknown}")
        if missing:
            raise HiRadixConfigError(f"{ENV_VAR} lacks keys {missing}")
        if data["nvme_path"] is not None:
            data["nvme_path"] = Path(data["nvme_path"])
        if isinstance(data.get("cold_tiers"), list):
            data["cold_tiers"] = tuple(data["cold_tiers"])
        return cls(**data)

    def summary(self) -> str:
        """One-line description for the server log."""
        nvme = f"{self.nvme_path} ({self.nvme_bytes} bytes)" if self.has_nvme_tier else "off"
        dram = f"dram_ratio={self.dram_ratio:g}" if self.dram_ratio else f"dram_bytes={self.dram_bytes}"
        window = f", lookahead_window={self.lookahead_window}" if make_policy(self.policy).uses_queue else ""
        store = (f"{self.store_backend} ({self.store_write_policy}, read {self.store_read})"
                 if self.has_store_tier else "off")
        cold = "" if self.cold_format == "exact" else f", cold_format={self.cold_format} ({','.join(self.cold_tiers)})"
        overflow = cold + ("" if self.context_overflow == "off" else (
            f", context_overflow={self.context_overflow} (keep_tokens={self.keep_tokens}, drop_ratio={self.drop_ratio:g})"))
        return (
            f"policy={self.policy}{window}, write_policy={self.write_policy}, "
            f"{dram}, dram_mode={self.dram_mode}, nvme={nvme}, store={store}, "
            f"load_timeout_s={self.load_timeout_s:g}, partial_page={self.partial_page}{overflow}"
        )


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def _is_writable_dir(path: Path) -> bool:
    """Probe by creating and deleting a file (works for root and read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".hiradix-probe-"):
            return True
    except OSError:
        return False


NVME_SLOT_FILES = "hiradix-rank*/nvme.kv"  # the NVMe tier's slot files under --hiradix-nvme-path (tiers.nvme)


def existing_slot_file_bytes(nvme_path: Path) -> int:
    """Disk bytes the NVMe slot files of an earlier run already take under ``nvme_path``.

    A server reuses (same fingerprint) or replaces its rank's slot file at start, so these bytes
    are free for it: a restart with the same sizes must not be refused for the space its own
    pre-allocated files hold.
    """
    total = 0
    for slot_file in nvme_path.glob(NVME_SLOT_FILES):
        try:
            total += slot_file.stat().st_blocks * 512
        except OSError:
            continue
    return total


def check_machine(config: HiRadixConfig, *, ranks_on_this_node: int = 1) -> None:
    """Check that this machine can hold the configured tiers. Reads, creates nothing.

    The DRAM tier must fit in the available RAM (psutil), the NVMe directory must be an
    existing writable directory, and the NVMe tier must fit
    in the free space of its file system. Both sizes are multiplied by the number of
    scheduler processes on this node.

    Args:
        config: the validated configuration.
        ranks_on_this_node: copies of the tiers on this node: one per scheduler process (TP
            ranks x DP replicas), one per attention-TP group for an MLA model's shared copy.

    Raises:
        HiRadixConfigError: naming the flag that asks for too much.
    """
    import psutil

    ranks = max(1, ranks_on_this_node)
    times = f" x {ranks} ranks" if ranks > 1 else ""
    dram_needed = config.dram_bytes * ranks  # 0 with --hiradix-dram-ratio: checked in the scheduler
    dram_available = psutil.virtual_memory().available
    if dram_needed > dram_available:
        raise HiRadixConfigError(
            f"{FLAG_OF_FIELD['dram_bytes']} {_gb(config.dram_bytes)}{times} needs "
            f"{dram_needed / BYTES_PER_GB:.2f} GB of RAM but only "
            f"{dram_available / BYTES_PER_GB:.2f} GB is available"
        )
    if config.nvme_path is None:
        return
    path = config.nvme_path
    if path.exists():
        if not path.is_dir():
            raise HiRadixConfigError(
                f"{FLAG_OF_FIELD['nvme_path']} {path} exists but is not a directory"
            )
        if not _is_writable_dir(path):
            raise HiRadixConfigError(f"{FLAG_OF_FIELD['nvme_path']} {path} is not writable")
        base = path
    else:
        # A typo must not silently create directories (and fill a disk) somewhere else.
        raise HiRadixConfigError(
            f"{FLAG_OF_FIELD['nvme_path']} {path} does not exist; create the directory first "
            f"(nearest existing parent: {_nearest_existing(path)})"
        )
    nvme_needed = config.nvme_bytes * ranks
    # The slot files of an earlier run are reused (or replaced) at start: their bytes count as free.
    nvme_free = shutil.disk_usage(base).free + existing_slot_file_bytes(base)
    if nvme_needed > nvme_free:
        raise HiRadixConfigError(
            f"{FLAG_OF_FIELD['nvme_bytes']} {_gb(config.nvme_bytes)}{times} needs "
            f"{nvme_needed / BYTES_PER_GB:.2f} GB but the file system of "
            f"{FLAG_OF_FIELD['nvme_path']} {path} has {nvme_free / BYTES_PER_GB:.2f} GB free"
        )
