"""The systems `bench.ab.run` compares: names, server flags, equal tier sizes, the ideal's pool.

A system is a name plus extra server flags (and, for `ideal`, its own device pool). Built-in
names (`BUILTIN_SYSTEMS`; the default set is `DEFAULT_SYSTEMS`): `stock` (RadixAttention), `ideal` (stock RadixAttention whose device
pool holds the run's whole working set: the limit any prefix cache of whole 16-token pages, hiradix's
default page size, can reach; its `--max-total-tokens` is `ideal_pool_tokens`), `ideal-token` (the same at
page size 1: it also caches a prompt's partly filled last page, as hiradix does by default), `hicache` (stock SGLang HiCache with its `file`
storage backend), `lru` and `lookahead` (hiradix with that policy), `hiradix` (hiradix
defaults), `hiradix-fp8` (hiradix defaults with `--hiradix-cold-format fp8`). A built-in name followed by digits is a duplicate (`stock2` = `stock`): the A/A
control. HiCache and hiradix get the same DRAM size (`with_tier_sizes`).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from bench.common.conversations import Session

BUILTIN_SYSTEMS: dict[str, tuple[str, ...]] = {
    "stock": (),
    # Stock SGLang HiCache: host DRAM pool plus its `file` storage backend (one file per page), the
    # NVMe-like tier a HiCache user adds; pages of 16 tokens like hiradix's (SGLang's default of 1
    # would make every token a storage object).
    "hicache": ("--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "file",
                "--page-size", "16"),
    "lru": ("--enable-hiradix", "--hiradix-policy", "lru"),
    "lookahead": ("--enable-hiradix", "--hiradix-policy", "lookahead"),
    "hiradix": ("--enable-hiradix",),  # the defaults (policy lookahead)
    # hiradix defaults with fp8 pages on NVMe and in the store (issue 21): the same --hiradix-nvme-gb holds
    # 2x (16-bit) / 4x (fp32) the tokens; outputs may differ from stock.
    "hiradix-fp8": ("--enable-hiradix", "--hiradix-cold-format", "fp8"),
    # Stock RadixAttention at hiradix's page size (16: pages are its unit of transfer), so it caches
    # the same whole pages a tiered cache can; its pool is sized to the working set (`ideal_pool_tokens`).
    "ideal": ("--page-size", "16"),
    # The same at page size 1 (stock's default): it also caches a prompt's partly filled last page,
    # as hiradix's partial last pages do (--hiradix-partial-page on).
    "ideal-token": ("--page-size", "1"),
}  # fmt: skip
IDEAL = "ideal"
IDEAL_TOKEN = "ideal-token"  # the ideal at page size 1
HICACHE = "hicache"  # stock SGLang HiCache: hiradix systems are also compared with it
# SGLang 0.5.23 leaves this much host RAM free when it sizes HiCache's host pool
# (HICACHE_HOST_MEMORY_RESERVE_BYTES, mem_cache/pool_host/base.py): with less available, the
# HiCache server dies at start ("Not enough host memory available").
HICACHE_RESERVE_BYTES = 10 * (1 << 30)


def hicache_memory_problem(systems: Sequence[str], available_bytes: int) -> Optional[str]:
    """Why the HiCache systems among ``systems`` cannot start here, or None (checked before any
    server starts, so the run stops with this message instead of a dead server's traceback)."""
    names = [name for name in systems if name.rstrip("0123456789") == HICACHE]
    if not names or available_bytes > HICACHE_RESERVE_BYTES:
        return None
    return (f"system {names[0]!r} (stock SGLang HiCache) needs more than {HICACHE_RESERVE_BYTES / (1 << 30):.0f} GiB "
            f"of free RAM (SGLang's HICACHE_HOST_MEMORY_RESERVE_BYTES) but {available_bytes / (1 << 30):.1f} GiB is "
            f"available; free memory, or leave it out: --systems stock,ideal,hiradix,ideal2")
DEFAULT_SYSTEMS = "stock,ideal,hiradix,hicache,ideal2"
TEMPLATE_TOKENS_PER_MESSAGE = 16  # chat-template tokens around a message (upper bound, local models)
@dataclass(frozen=True)
class System:
    """A system under test: a label and the server flags added for it."""

    name: str
    server_args: tuple[str, ...]
    max_total_tokens: Optional[int] = None  # device pool in tokens; None: the run's --max-total-tokens

    duplicate_of: Optional[str] = None  # `stock2` -> "stock": an A/A control of that system


def resolve_systems(names: str, custom: Sequence[str], hiradix_args: Sequence[str],
                    common_args: Sequence[str]) -> list[System]:
    """Turn `--systems a,b`, `--system NAME="FLAGS"` and pass-through flags into `System`s.

    Raises:
        ValueError: On an unknown or repeated name, or a malformed `--system`.
    """
    defined = dict(BUILTIN_SYSTEMS)
    for item in custom:
        name, sep, flags = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f'--system wants NAME="FLAGS", got {item!r}')
        defined[name] = tuple(shlex.split(flags))
    systems = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        base = name if name in defined else re.sub(r"\d+$", "", name)
        if base not in defined:
            raise ValueError(f"unknown system {name!r}; known: {', '.join(sorted(defined))}")
        args = list(defined[base]) + list(common_args)
        if "--enable-hiradix" in args:
            args += list(hiradix_args)
        systems.append(System(name, tuple(args), None, None if base == name else base))
    if len({s.name for s in systems}) != len(systems) or not systems:
        raise ValueError(f"--systems needs distinct names, got {names!r}")
    if hiradix_args and not any("--enable-hiradix" in s.server_args for s in systems):
        raise ValueError(f"{' '.join(hiradix_args)} given but no system uses --enable-hiradix")
    return systems


def kv_bytes_per_token(model_path: Path, dtype_bytes: int = 4, tp_size: int = 1) -> int:
    """Device KV bytes per token of one TP rank of a model dir (all layers; float32 as `cpu_args`):
    K and V of the rank's heads (`kv_heads // tp_size`), or MLA's one latent row, whole on every rank
    (`hiradix.sglang_plugin.model_check.page_bytes_estimate`).

    Raises:
        OSError, KeyError: `config.json` is missing or lacks the attention sizes.
    """
    from hiradix.sglang_plugin.model_check import page_bytes_estimate

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    per_token = page_bytes_estimate(cfg, 1, tp_size, {4: "float32", 2: "bfloat16"}[dtype_bytes])
    if per_token is None:
        raise KeyError(f"{model_path}/config.json lacks the attention sizes")
    return per_token


def working_set_tokens(sessions: Sequence[Session], max_tokens: int,
                       count_tokens: Callable[[str], int] | None = None, own_answers: bool = False) -> int:
    """An upper bound on the tokens the prefix cache can hold for this run (all systems alike).

    Per session: its last prompt (every message, counted by ``count_tokens``, else one token per
    UTF-8 byte, the most a byte-level BPE gives) plus a chat-template allowance per message and
    the generated answers (``max_tokens`` each). With ``own_answers`` the history carries the
    model's answers, so the dataset's assistant texts are not counted.
    """
    count = count_tokens or (lambda text: len(text.encode()))
    total = 0
    for session in sessions:
        total += sum((0 if own_answers and m["role"] == "assistant" else count(m["content"]))
                     + TEMPLATE_TOKENS_PER_MESSAGE for m in session.messages)
        total += max_tokens * session.num_turns
    return total


def ideal_pool_tokens(working_set: int, page_tokens: int = 1024) -> int:
    """`--max-total-tokens` of the `ideal` system: the working-set bound plus a quarter (room
    for the requests being decoded), rounded up to whole `page_tokens`."""
    return max(page_tokens, math.ceil(working_set * 1.25 / page_tokens) * page_tokens)


def with_ideal_pool(systems: Sequence[System], pool_tokens: int) -> list[System]:
    """Give `ideal`, `ideal-token` (and their duplicates) a device pool of `pool_tokens` tokens."""
    return [System(s.name, s.server_args, pool_tokens, s.duplicate_of)
            if {IDEAL, IDEAL_TOKEN} & {s.name, s.duplicate_of} else s for s in systems]


def token_counter(model_path: Path) -> Callable[[str], int] | None:
    """Token count of a text with the model's own tokenizer (``tokenizer.json``), or None."""
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - no tokenizer file or library: fall back to the byte bound
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def nvme_gb_for_run(nvme_gb: float | None, sessions: Sequence[Session], max_tokens: int, kv_bytes_per_token_: int,
                    dram_bytes: int, count_tokens: Callable[[str], int] | None = None,
                    own_answers: bool = False) -> tuple[float, str]:
    """The hiradix NVMe size of this run in GB, and why (for the log).

    ``nvme_gb`` None ("auto"): no NVMe tier when the run's working set fits in DRAM (it would
    be written but never read), else the working set plus half, at least 1 MB.
    """
    if nvme_gb is not None:
        return nvme_gb, "as given (--nvme-gb)"
    need = working_set_tokens(sessions, max_tokens, count_tokens, own_answers) * kv_bytes_per_token_
    if need <= dram_bytes:
        return 0.0, (f"none: the run's working set (<= {need / 1e6:.1f} MB of KV) fits in DRAM "
                     f"({dram_bytes / 1e6:.1f} MB), so NVMe would never be read")
    gb = max(1e-3, math.ceil(need * 1.5 / 1e6) / 1e3)
    return gb, f"{gb:g} GB: 1.5 x the run's working set (<= {need / 1e6:.1f} MB of KV; DRAM {dram_bytes / 1e6:.1f} MB)"


def remove_tier_files(run_dir: Path, keep_dirs: bool = False) -> int:
    """Remove the NVMe and HiCache file directories of a run (``keep_dirs``: only what they
    hold, so the next repetition's servers start on empty tiers); returns the bytes they held."""
    removed = 0
    for path in sorted(run_dir.glob("nvme-*")) + sorted(run_dir.glob("hicache-*")):
        if path.is_dir() and not path.is_symlink():
            removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
            if keep_dirs:
                path.mkdir(mode=0o700)
    return removed


def with_tier_sizes(systems: Sequence[System], dram_ratio: float, nvme_gb: float, device_bytes: int,
                    run_dir: Path) -> list[System]:
    """Give every tiered system the same DRAM size and its own lower-tier directory.

    DRAM is `dram_ratio` x the device KV pool (`device_bytes`) for HiCache (`--hicache-ratio`)
    and hiradix (`--hiradix-dram-ratio`); hiradix gets `nvme_gb` of NVMe (0: none) under
    `run_dir/nvme-<name>`, HiCache's `file` backend writes under `run_dir/hicache-<name>`.
    Flags a system already sets are kept.
    """
    out = []
    for system in systems:
        args = list(system.server_args)
        if "--enable-hiradix" in args:
            if "--hiradix-dram-gb" not in args and "--hiradix-dram-ratio" not in args:
                args += ["--hiradix-dram-ratio", f"{dram_ratio:g}"]
            if nvme_gb > 0 and "--hiradix-nvme-gb" not in args:
                nvme_dir = run_dir / f"nvme-{system.name}"
                nvme_dir.mkdir(mode=0o700, exist_ok=True)
                args += ["--hiradix-nvme-path", str(nvme_dir), "--hiradix-nvme-gb", str(nvme_gb)]
        if "--enable-hierarchical-cache" in args:
            if "--hicache-ratio" not in args and "--hicache-size" not in args:
                args += ["--hicache-ratio", str(dram_ratio)]
            if "file" in args and "--hicache-storage-backend-extra-config" not in args:
                files = run_dir / f"hicache-{system.name}"
                files.mkdir(mode=0o700, exist_ok=True)
                args += ["--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(files)})]
        out.append(System(system.name, tuple(args), system.max_total_tokens, system.duplicate_of))
    return out


