"""hiradix configuration: one frozen, typed record built from the `--hiradix-*` flags.

The record is made in the launcher (`HiRadixConfig.from_flags`), rides to every
scheduler process as the bookkeeping attribute `server_args._hiradix_config`, and is
also exported as JSON in the environment variable `HIRADIX_CONFIG` (fallback).

Units: sizes are in bytes in the record and in decimal gigabytes (1 GB = 1e9 bytes,
as SGLang's `--hicache-size`) on the command line. Sizes are per scheduler process
(one per TP rank), like `--hicache-size`: a server with `--tp-size 2` uses twice
`dram_bytes` of host memory.

Validation raises `HiRadixConfigError` (a `ValueError`) whose message names the flag
and the value the user gave, e.g. "--hiradix-dram-gb must be > 0, got -1".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

# The environment variable that carries `HiRadixConfig.to_json()` to child processes.
ENV_VAR = "HIRADIX_CONFIG"

BYTES_PER_GB = 10**9

Policy = Literal["lru", "lookahead"]
WritePolicy = Literal["write_through", "write_back"]
POLICIES: tuple[str, ...] = get_args(Policy)
WRITE_POLICIES: tuple[str, ...] = get_args(WritePolicy)

# Defaults, in the units of the command line.
DEFAULT_DRAM_GB = 4.0
DEFAULT_NVME_GB = 0.0
DEFAULT_POLICY: Policy = "lookahead"
DEFAULT_LOOKAHEAD_WINDOW = 64
DEFAULT_WRITE_POLICY: WritePolicy = "write_through"
DEFAULT_LOAD_TIMEOUT_S = 2.0

# The command-line flag of each field, for error messages.
FLAG_OF_FIELD: dict[str, str] = {
    "dram_bytes": "--hiradix-dram-gb",
    "nvme_path": "--hiradix-nvme-path",
    "nvme_bytes": "--hiradix-nvme-gb",
    "policy": "--hiradix-policy",
    "lookahead_window": "--hiradix-lookahead-window",
    "write_policy": "--hiradix-write-policy",
    "load_timeout_s": "--hiradix-load-timeout-s",
}


class HiRadixConfigError(ValueError):
    """A hiradix setting that cannot be served; the message names the flag."""


def _num(value: float) -> str:
    """Format a number as a user would type it: 1000000, 0.25, -1."""
    return f"{value:.12g}"


def _gb(num_bytes: int) -> str:
    """Format a byte count as the GB value a user would have typed."""
    return _num(num_bytes / BYTES_PER_GB)


@dataclass(frozen=True, slots=True)
class HiRadixConfig:
    """What the three-tier cache needs to know, validated on construction.

    Attributes:
        dram_bytes: DRAM (host memory) tier capacity per scheduler process, in bytes.
            Must be > 0. Flag `--hiradix-dram-gb` (GB).
        nvme_path: Absolute, resolved directory holding the NVMe tier's files, or
            None when there is no NVMe tier. Flag `--hiradix-nvme-path`.
        nvme_bytes: NVMe tier capacity per scheduler process, in bytes; 0 means no
            NVMe tier. > 0 requires `nvme_path`. Flag `--hiradix-nvme-gb` (GB).
        policy: Eviction/promotion policy: "lru" or "lookahead" (scheduler-aware,
            CachedAttention §3.3). Flag `--hiradix-policy`.
        lookahead_window: How many waiting requests the look-ahead policy inspects
            each scheduler step, in requests (>= 1). Flag `--hiradix-lookahead-window`.
        write_policy: When KV is copied down a tier: "write_through" (on insert) or
            "write_back" (on eviction). Flag `--hiradix-write-policy`.
        load_timeout_s: How long a request may wait for its KV to be loaded from a
            lower tier before the load is abandoned and the prefix recomputed, in
            seconds (> 0). Flag `--hiradix-load-timeout-s`.
    """

    dram_bytes: int = round(DEFAULT_DRAM_GB * BYTES_PER_GB)
    nvme_path: Path | None = None
    nvme_bytes: int = 0
    policy: Policy = DEFAULT_POLICY
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    write_policy: WritePolicy = DEFAULT_WRITE_POLICY
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        flag = FLAG_OF_FIELD
        for name in ("dram_bytes", "nvme_bytes", "lookahead_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise HiRadixConfigError(
                    f"{flag[name]}: {name} must be an int, got {value!r}"
                )
        if self.dram_bytes <= 0:
            raise HiRadixConfigError(
                f"{flag['dram_bytes']} must be > 0, got {_gb(self.dram_bytes)}"
            )
        if self.nvme_bytes < 0:
            raise HiRadixConfigError(
                f"{flag['nvme_bytes']} must be >= 0, got {_gb(self.nvme_bytes)}"
            )
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, Path) or not self.nvme_path.is_absolute():
                raise HiRadixConfigError(
                    f"{flag['nvme_path']} must be an absolute path, got {self.nvme_path!r}"
                )
            if self.nvme_bytes == 0:
                raise HiRadixConfigError(
                    f"{flag['nvme_path']} {self.nvme_path} is given but "
                    f"{flag['nvme_bytes']} is 0 (no NVMe tier); give "
                    f"{flag['nvme_bytes']} > 0 or drop {flag['nvme_path']}"
                )
        if self.nvme_bytes > 0 and self.nvme_path is None:
            raise HiRadixConfigError(
                f"{flag['nvme_bytes']} {_gb(self.nvme_bytes)} needs {flag['nvme_path']}"
            )
        if self.policy not in POLICIES:
            raise HiRadixConfigError(
                f"{flag['policy']} must be one of {list(POLICIES)}, got {self.policy!r}"
            )
        if self.lookahead_window < 1:
            raise HiRadixConfigError(
                f"{flag['lookahead_window']} must be >= 1 (requests), "
                f"got {self.lookahead_window}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise HiRadixConfigError(
                f"{flag['write_policy']} must be one of {list(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        timeout = self.load_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise HiRadixConfigError(
                f"{flag['load_timeout_s']} must be a finite number > 0 (seconds), "
                f"got {timeout!r}"
            )

    @property
    def has_nvme_tier(self) -> bool:
        """Whether the NVMe tier is configured (`nvme_bytes > 0`)."""
        return self.nvme_bytes > 0

    @classmethod
    def from_flags(
        cls,
        *,
        dram_gb: float | None = None,
        nvme_path: str | os.PathLike[str] | None = None,
        nvme_gb: float | None = None,
        policy: str | None = None,
        lookahead_window: int | None = None,
        write_policy: str | None = None,
        load_timeout_s: float | None = None,
    ) -> HiRadixConfig:
        """Build from command-line values; None means "flag not given" (use the default).

        Args:
            dram_gb: `--hiradix-dram-gb`, in GB (1e9 bytes).
            nvme_path: `--hiradix-nvme-path`; made absolute and resolved (symlinks).
            nvme_gb: `--hiradix-nvme-gb`, in GB; 0 = no NVMe tier.
            policy: `--hiradix-policy`.
            lookahead_window: `--hiradix-lookahead-window`, in requests.
            write_policy: `--hiradix-write-policy`.
            load_timeout_s: `--hiradix-load-timeout-s`, in seconds.

        Raises:
            HiRadixConfigError: a value is out of range or the combination is invalid.
        """
        dram_gb = DEFAULT_DRAM_GB if dram_gb is None else dram_gb
        nvme_gb = DEFAULT_NVME_GB if nvme_gb is None else nvme_gb
        for flag, gb in (("--hiradix-dram-gb", dram_gb), ("--hiradix-nvme-gb", nvme_gb)):
            if not math.isfinite(gb):
                raise HiRadixConfigError(f"{flag} must be a finite number, got {gb}")
        if dram_gb <= 0:
            raise HiRadixConfigError(f"--hiradix-dram-gb must be > 0, got {_num(dram_gb)}")
        if nvme_gb < 0:
            raise HiRadixConfigError(f"--hiradix-nvme-gb must be >= 0, got {_num(nvme_gb)}")
        if policy == "lru" and lookahead_window is not None:
            raise HiRadixConfigError(
                "--hiradix-lookahead-window applies only to --hiradix-policy lookahead, "
                "but --hiradix-policy is lru"
            )
        resolved_path = None
        if nvme_path is not None:
            if str(nvme_path).strip() == "":
                raise HiRadixConfigError("--hiradix-nvme-path must not be empty")
            resolved_path = Path(nvme_path).expanduser().resolve()
        return cls(
            dram_bytes=round(dram_gb * BYTES_PER_GB),
            nvme_path=resolved_path,
            nvme_bytes=round(nvme_gb * BYTES_PER_GB),
            policy=DEFAULT_POLICY if policy is None else policy,  # type: ignore[arg-type]
            lookahead_window=(
                DEFAULT_LOOKAHEAD_WINDOW if lookahead_window is None else lookahead_window
            ),
            write_policy=(
                DEFAULT_WRITE_POLICY if write_policy is None else write_policy  # type: ignore[arg-type]
            ),
            load_timeout_s=(
                DEFAULT_LOAD_TIMEOUT_S if load_timeout_s is None else float(load_timeout_s)
            ),
        )

    def to_json(self) -> str:
        """Serialize to one line of JSON (sizes in bytes, path as a string or null)."""
        data: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
        }
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
        return cls(**data)

    def summary(self) -> str:
        """One-line description for the server log."""
        nvme = (
            f"{self.nvme_path} ({self.nvme_bytes} bytes)" if self.has_nvme_tier else "off"
        )
        window = (
            f", lookahead_window={self.lookahead_window}"
            if self.policy == "lookahead"
            else ""
        )
        return (
            f"policy={self.policy}{window}, write_policy={self.write_policy}, "
            f"dram_bytes={self.dram_bytes}, nvme={nvme}, "
            f"load_timeout_s={self.load_timeout_s:g}"
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


def check_machine(config: HiRadixConfig, *, ranks_on_this_node: int = 1) -> None:
    """Check that this machine can hold the configured tiers. Reads, creates nothing.

    The DRAM tier must fit in the available RAM (psutil), the NVMe directory must be an
    existing writable directory, and the NVMe tier must fit
    in the free space of its file system. Both sizes are multiplied by the number of
    scheduler processes on this node.

    Args:
        config: the validated configuration.
        ranks_on_this_node: scheduler processes on this node (TP ranks x DP replicas).

    Raises:
        HiRadixConfigError: naming the flag that asks for too much.
    """
    import psutil

    ranks = max(1, ranks_on_this_node)
    times = f" x {ranks} ranks" if ranks > 1 else ""
    dram_needed = config.dram_bytes * ranks
    dram_available = psutil.virtual_memory().available
    if dram_needed > dram_available:
        raise HiRadixConfigError(
            f"--hiradix-dram-gb {_gb(config.dram_bytes)}{times} needs "
            f"{dram_needed / BYTES_PER_GB:.2f} GB of RAM but only "
            f"{dram_available / BYTES_PER_GB:.2f} GB is available"
        )
    if config.nvme_path is None:
        return
    path = config.nvme_path
    if path.exists():
        if not path.is_dir():
            raise HiRadixConfigError(
                f"--hiradix-nvme-path {path} exists but is not a directory"
            )
        if not _is_writable_dir(path):
            raise HiRadixConfigError(f"--hiradix-nvme-path {path} is not writable")
        base = path
    else:
        # A typo must not silently create directories (and fill a disk) somewhere else.
        raise HiRadixConfigError(
            f"--hiradix-nvme-path {path} does not exist; create the directory first "
            f"(nearest existing parent: {_nearest_existing(path)})"
        )
    nvme_needed = config.nvme_bytes * ranks
    nvme_free = shutil.disk_usage(base).free
    if nvme_needed > nvme_free:
        raise HiRadixConfigError(
            f"--hiradix-nvme-gb {_gb(config.nvme_bytes)}{times} needs "
            f"{nvme_needed / BYTES_PER_GB:.2f} GB but the file system of "
            f"--hiradix-nvme-path {path} has {nvme_free / BYTES_PER_GB:.2f} GB free"
        )
