"""A/B benchmark: stock SGLang (RadixAttention) vs SGLang + hiradix on real multi-turn chats.

For each system, one after the other, start `python -m sglang.launch_server` with the same
model, the same `--max-total-tokens` and the CPU settings of `hiradix.testing.cpu_args`,
plus the system's own flags; replay the same ShareGPT sessions (`bench.multiturn`); stop
the server. Then print, per turn index, mean TTFT and mean cached tokens for each system
and the TTFT ratio to the first (baseline) system, plus the fraction of requests whose
greedy outputs are token-identical to the baseline's.

A system is a name plus extra server flags. Built-in names (`BUILTIN_SYSTEMS`): `stock`
(RadixAttention), `hicache` (stock SGLang HiCache with its `file` storage backend), `lru` and
`lookahead` (hiradix with that policy), `hiradix` (hiradix defaults). The default run is
`stock,hicache,lru,lookahead`; HiCache and hiradix get the same DRAM size (`--dram-ratio` x the
device pool) and hiradix an NVMe tier sized to the run (`--nvme-gb`; none when the run's working
set fits in DRAM), both under the run directory and removed at the end (`--keep-tier-files`). A built-in name followed
by digits is a duplicate (`stock2` = `stock`), handy for an A/A run. Define more with
`--system NAME="FLAGS"`, e.g. `--system lru="--enable-hiradix --hiradix-policy lru"`.
Unknown options starting with `--hiradix-` are passed to every system that has
`--enable-hiradix`; `--server-args "FLAGS"` go to every system.

Outputs under `runs/<timestamp>/` (or `--out-dir`): `config.json`, `records.json` and
`records.csv` (all requests of all systems), `summary.json`, `ttft_by_turn.png`, and one
`<system>.server.log` per system.

    python -m bench.ab                                 # stock, hicache, lru, lookahead; models/small, 8 x 4
    python -m bench.ab --quick --systems stock,stock2  # tiny model, 3 sessions x 3 turns
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import shlex
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a file: python bench/ab.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.conversations import Session, load_sessions
from bench.multiturn import (
    RequestRecord,
    WorkloadConfig,
    add_workload_args,
    run_workload,
    workload_config_from_args,
    write_records,
)
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

logger = logging.getLogger("bench.ab")
REPO_ROOT = Path(__file__).resolve().parent.parent

BUILTIN_SYSTEMS: dict[str, tuple[str, ...]] = {
    "stock": (),
    # Stock SGLang HiCache: host DRAM pool plus its `file` storage backend (one file per page).
    "hicache": ("--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "file"),
    "lru": ("--enable-hiradix", "--hiradix-policy", "lru"),
    "lookahead": ("--enable-hiradix", "--hiradix-policy", "lookahead"),
    "hiradix": ("--enable-hiradix",),  # the defaults (policy lookahead)
}  # fmt: skip
DEFAULT_SYSTEMS = "stock,hicache,lru,lookahead"
TEMPLATE_TOKENS_PER_MESSAGE = 16  # chat-template tokens around a message (upper bound, local models)
QUICK_NOTE = ("--quick is a smoke test: the tiny model's requests take a few ms, so TTFT ratios are noise, "
              "and the histories fit in DRAM, so NVMe is not used; run without --quick to see the effect")
PAGE_NOTE = ("cached tokens are whole pages: hiradix uses --page-size 16 and caches a prompt's full pages "
             "only (up to 15 tokens fewer than stock's page size 1 per request)")

# The device pool is deliberately smaller than the histories of the sessions in flight
# (about 4 x 1,000 tokens at the last turn of the full run), so stock RadixAttention has to
# evict history between turns; that is the situation hiradix's lower tiers are for.
# max_tokens stays small because decoding on CPU is slow and would dominate the run time.
FULL_DEFAULTS = {"model": "models/small", "sessions": 8, "turns": 4, "max_total_tokens": 2048,
                 "max_message_chars": 600, "max_tokens": 8}
QUICK_DEFAULTS = {"model": "models/tiny", "sessions": 3, "turns": 3, "max_total_tokens": 1024,
                  "max_message_chars": 300, "max_tokens": 8}


@dataclass(frozen=True)
class System:
    """A system under test: a label and the server flags added for it."""

    name: str
    server_args: tuple[str, ...]


@dataclass
class SystemRun:
    """What one system's run produced."""

    system: System
    records: list[RequestRecord]
    startup_s: float  # spawn -> /health
    workload_s: float  # first request -> last response
    log_path: str
    metrics_text: str = ""  # /metrics after the workload ("" if unavailable)


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
        systems.append(System(name, tuple(args)))
    if len({s.name for s in systems}) != len(systems) or not systems:
        raise ValueError(f"--systems needs distinct names, got {names!r}")
    if hiradix_args and not any("--enable-hiradix" in s.server_args for s in systems):
        raise ValueError(f"{' '.join(hiradix_args)} given but no system uses --enable-hiradix")
    return systems


def kv_bytes_per_token(model_path: Path, dtype_bytes: int = 4) -> int:
    """Device KV bytes per token of a model dir (K and V, all layers; float32 as `cpu_args`).

    Raises:
        OSError, KeyError: `config.json` is missing or lacks the attention sizes.
    """
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def working_set_tokens(sessions: Sequence[Session], max_tokens: int,
                       count_tokens: Callable[[str], int] | None = None) -> int:
    """An upper bound on the tokens the prefix cache can hold for this run (all systems alike).

    Per session: its last prompt (every message, counted by ``count_tokens``, else one token per
    UTF-8 byte, the most a byte-level BPE gives) plus a chat-template allowance per message and
    the generated answers.
    """
    count = count_tokens or (lambda text: len(text.encode()))
    total = 0
    for session in sessions:
        total += sum(count(m["content"]) + TEMPLATE_TOKENS_PER_MESSAGE for m in session.messages)
        total += max_tokens * session.num_turns
    return total


def token_counter(model_path: Path) -> Callable[[str], int] | None:
    """Token count of a text with the model's own tokenizer (``tokenizer.json``), or None."""
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - no tokenizer file or library: fall back to the byte bound
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def nvme_gb_for_run(nvme_gb: float | None, sessions: Sequence[Session], max_tokens: int, kv_bytes_per_token_: int,
                    dram_bytes: int, count_tokens: Callable[[str], int] | None = None) -> tuple[float, str]:
    """The hiradix NVMe size of this run in GB, and why (for the log).

    ``nvme_gb`` None ("auto"): no NVMe tier when the run's working set fits in DRAM (it would
    be written but never read), else the working set plus half, at least 1 MB.
    """
    if nvme_gb is not None:
        return nvme_gb, "as given (--nvme-gb)"
    need = working_set_tokens(sessions, max_tokens, count_tokens) * kv_bytes_per_token_
    if need <= dram_bytes:
        return 0.0, (f"none: the run's working set (<= {need / 1e6:.1f} MB of KV) fits in DRAM "
                     f"({dram_bytes / 1e6:.1f} MB), so NVMe would never be read")
    gb = max(1e-3, math.ceil(need * 1.5 / 1e6) / 1e3)
    return gb, f"{gb:g} GB: 1.5 x the run's working set (<= {need / 1e6:.1f} MB of KV; DRAM {dram_bytes / 1e6:.1f} MB)"


def remove_tier_files(run_dir: Path) -> int:
    """Remove the NVMe and HiCache file directories of a run; returns the bytes they held."""
    removed = 0
    for path in sorted(run_dir.glob("nvme-*")) + sorted(run_dir.glob("hicache-*")):
        if path.is_dir() and not path.is_symlink():
            removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
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
        out.append(System(system.name, tuple(args)))
    return out


def fetch_metrics(base_url: str) -> str:
    """The server's Prometheus text from `GET /metrics`, or "" if it does not answer in 10 s."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def warm_up(base_url: str, config: WorkloadConfig) -> None:
    """One unrelated short request so lazy initialisation does not land in turn 0's TTFT."""
    warm = Session("warmup", ({"role": "user", "content": "Warm-up: say hello."},), "synthetic")
    records = run_workload(base_url, [warm], config, system="warmup", progress=False)
    if not records[0].ok:
        raise RuntimeError(f"warm-up request failed: {records[0].error}")


def run_system(system: System, model_path: str, max_total_tokens: int, sessions: Sequence[Session],
               config: WorkloadConfig, run_dir: Path, startup_timeout_s: float) -> SystemRun:
    """Start the server for `system`, replay `sessions`, stop the server.

    Raises:
        hiradix.testing.ServerStartError: If the server does not come up (message has its log).
        RuntimeError: If the warm-up request fails.
    """
    log_path = run_dir / f"{system.name}.server.log"
    extra_args = cpu_args(max_total_tokens) + list(system.server_args)
    logger.info("[%s] starting server: %s", system.name, " ".join(extra_args))
    with ServerProcess(model_path, extra_args=extra_args, env=cpu_env(), log_path=log_path,
                       startup_timeout_s=startup_timeout_s) as server:
        logger.info("[%s] healthy on %s after %.1f s", system.name, server.base_url, server.startup_s)
        warm_up(server.base_url, config)
        t0 = time.perf_counter()
        records = run_workload(server.base_url, sessions, config, system=system.name)
        workload_s = time.perf_counter() - t0
        metrics_text = fetch_metrics(server.base_url)
        startup_s = server.startup_s or float("nan")
    return SystemRun(system, records, startup_s, workload_s, str(log_path), metrics_text)


def _mean(values) -> float:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _key(r: RequestRecord) -> tuple[int, int]:
    return (r.session_index, r.turn_index)


def identical_fraction(baseline: Sequence[RequestRecord], other: Sequence[RequestRecord]) -> tuple[int, int]:
    """Count requests whose outputs are identical (token ids if both have them, else text).

    Returns:
        `(identical, compared)`: requests matched by (session, turn) where both succeeded.
    """
    theirs = {_key(r): r for r in other if r.ok}
    identical = compared = 0
    for mine in baseline:
        other_record = theirs.get(_key(mine))
        if not mine.ok or other_record is None:
            continue
        compared += 1
        if mine.output_token_ids is not None and other_record.output_token_ids is not None:
            identical += mine.output_token_ids == other_record.output_token_ids
        else:
            identical += mine.output_text == other_record.output_text
    return identical, compared


def per_turn_summary(runs: Sequence[SystemRun]) -> list[dict]:
    """Per turn index and system: mean TTFT (s), mean prompt and cached tokens, tier split."""
    turns = sorted({r.turn_index for run in runs for r in run.records})
    return [_summary_row(turn, runs, lambda r, t=turn: r.turn_index == t) for turn in turns]


def group_summary(runs: Sequence[SystemRun]) -> list[dict]:
    """The same figures over turns >= 2 (the issue's TTFT target) and over all requests."""
    return [_summary_row(">=2", runs, lambda r: r.turn_index >= 2), _summary_row("all", runs, lambda r: True)]


def _summary_row(label: Any, runs: Sequence[SystemRun], keep: Callable[[RequestRecord], bool]) -> dict:
    row: dict = {"turn_index": label}
    for run in runs:
        ok = [r for r in run.records if r.ok and keep(r)]
        row[run.system.name] = {
            "n": len(ok),
            "mean_ttft_s": _mean(r.ttft_s for r in ok),
            "mean_prompt_tokens": _mean(r.prompt_tokens for r in ok),
            "mean_cached_tokens": _mean(r.cached_tokens for r in ok),
            "mean_cached_host_tokens": _mean(r.cached_host_tokens for r in ok),
            "mean_cached_storage_tokens": _mean(r.cached_storage_tokens for r in ok),
        }
    return row


def _fmt(value: float, scale: float = 1.0, width: int = 8, digits: int = 0) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value * scale:>{width}.{digits}f}"


def _tier_totals(records: Sequence[RequestRecord]) -> str:
    """`device D / host H / storage S` summed over requests (`-` where never reported)."""
    parts = []
    for tier in ("device", "host", "storage"):
        values = [getattr(r, f"cached_{tier}_tokens") for r in records if r.ok]
        reported = [v for v in values if v is not None]
        parts.append(f"{tier} {sum(reported)}" if reported else f"{tier} -")
    return " / ".join(parts)


def format_table(runs: Sequence[SystemRun]) -> str:
    """The side-by-side table printed at the end of a run (TTFT in ms, tokens per request).

    Per turn index and over all requests: the number of requests and mean prompt tokens (of
    the baseline), one column pair (mean TTFT, mean cached tokens) per system, then the TTFT
    ratio of each other system to the first (baseline) one.
    """
    base = runs[0].system.name
    names = [run.system.name for run in runs]
    group_w = max(17, *(len(n) + 2 for n in names))
    ratio_w = max(12, *(len(f"{n}/{base}") + 1 for n in names[1:])) if len(names) > 1 else 0
    top = f"{'':>15} |" + "".join(f" {n:^{group_w}} |" for n in names)
    top += "".join(f" {n + '/' + base:>{ratio_w}}" for n in names[1:])
    sub = f"{'turn':>4} {'n':>3} {'prompt':>6} |" + "".join(f" {'ttft_ms':>{group_w - 8}} {'cached':>7} |" for _ in names)
    sub += "".join(f" {'ttft ratio':>{ratio_w}}" for _ in names[1:])
    lines = [top, sub, "-" * len(sub)]
    for row in per_turn_summary(runs) + group_summary(runs):
        line = f"{row['turn_index']!s:>4} {row[base]['n']:>3} {_fmt(row[base]['mean_prompt_tokens'], 1, 6)} |"
        for name in names:
            cell = row[name]
            line += f" {_fmt(cell['mean_ttft_s'], 1e3, group_w - 8, 1)} {_fmt(cell['mean_cached_tokens'], 1, 7)} |"
        for name in names[1:]:
            line += f" {_fmt(row[name]['mean_ttft_s'] / row[base]['mean_ttft_s'], 1, ratio_w, 2)}"
        lines.append(line)
    lines.append("")
    for run in runs:
        errors = sum(not r.ok for r in run.records)
        lines.append(f"{run.system.name}: {len(run.records)} requests, {errors} errors, "
                     f"server startup {run.startup_s:.1f} s, workload {run.workload_s:.1f} s, "
                     f"cached tokens by tier {_tier_totals(run.records)}")
    lines.append("prefill left after the cache, turns >= 2 (uncached / prompt tokens; a lower bound on "
                 "the TTFT ratio when prefill is linear): "
                 + ", ".join(f"{run.system.name} {_uncached_share(run.records):.2f}" for run in runs))
    for run in runs[1:]:
        same, compared = identical_fraction(runs[0].records, run.records)
        frac = same / compared if compared else float("nan")
        lines.append(f"token-identical outputs {run.system.name} vs {base}: {same}/{compared} ({frac:.0%})")
    if any("--enable-hiradix" in run.system.server_args for run in runs):
        lines.append("note: " + PAGE_NOTE)
    return "\n".join(lines)


def _uncached_share(records: Sequence[RequestRecord]) -> float:
    """Uncached prompt tokens over prompt tokens, summed over the ok requests of turns >= 2."""
    later = [r for r in records if r.ok and r.turn_index >= 2]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    return sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in later) / prompt if prompt else float("nan")


def plot_ttft_by_turn(runs: Sequence[SystemRun], png_path: Path) -> None:
    """Save a PNG: mean TTFT (ms) and mean cached tokens by turn index, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = per_turn_summary(runs)
    turns = [row["turn_index"] for row in rows]
    fig, (ax_ttft, ax_cached) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        name = run.system.name
        ax_ttft.plot(turns, [row[name]["mean_ttft_s"] * 1e3 for row in rows], marker="o", label=name)
        ax_cached.plot(turns, [row[name]["mean_cached_tokens"] for row in rows], marker="o", label=name)
    # Log axis: one slow request (a shared machine) must not flatten every other line.
    ax_ttft.set_yscale("log")
    ax_ttft.set(xlabel="turn index", ylabel="mean TTFT (ms, log scale)", title="TTFT by turn (log scale)")
    ax_cached.set(xlabel="turn index", ylabel="mean cached tokens", title="Prefix-cache hits by turn")
    for ax in (ax_ttft, ax_cached):
        ax.set_xticks(turns)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def write_outputs(runs: Sequence[SystemRun], run_dir: Path, config: dict) -> None:
    """Write records (JSON + CSV), summary.json, config.json, per-system metrics and the PNG."""
    all_records = [r for run in runs for r in run.records]
    write_records(all_records, run_dir / "records.json", run_dir / "records.csv")
    summary = {
        "per_turn": per_turn_summary(runs),
        "groups": group_summary(runs),
        "systems": {run.system.name: {"server_args": list(run.system.server_args),
                                      "startup_s": run.startup_s, "workload_s": run.workload_s,
                                      "requests": len(run.records),
                                      "errors": sum(not r.ok for r in run.records)}
                    for run in runs},
        "identical_vs_baseline": {run.system.name: identical_fraction(runs[0].records, run.records)
                                  for run in runs[1:]},
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    for run in runs:
        if run.metrics_text:
            (run_dir / f"{run.system.name}.metrics.txt").write_text(run.metrics_text)
    plot_ttft_by_turn(runs, run_dir / "ttft_by_turn.png")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A/B: stock SGLang vs SGLang + hiradix on multi-turn ShareGPT sessions.",
        epilog="Unknown --hiradix-* options are passed to the systems that use --enable-hiradix.")
    parser.add_argument("--model", default=None, help=f"model dir (default {FULL_DEFAULTS['model']})")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help="comma-separated systems; the first is the baseline")
    parser.add_argument("--system", action="append", default=[], metavar='NAME="FLAGS"',
                        help="define a system (repeatable)")
    parser.add_argument("--server-args", default="", help="extra server flags for every system")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help=f"device KV pool in tokens (default {FULL_DEFAULTS['max_total_tokens']})")
    parser.add_argument("--dram-ratio", type=float, default=2.0,
                        help="DRAM tier of HiCache and hiradix, as a multiple of the device KV pool "
                             "(default 2, HiCache's own default)")
    parser.add_argument("--keep-tier-files", action="store_true",
                        help="keep the NVMe and HiCache files under the run directory (default: removed at the end)")
    parser.add_argument("--nvme-gb", type=float, default=None,
                        help="hiradix NVMe tier in GB under the run directory (0: none; default: sized to the "
                             "run's working set, none when it fits in DRAM); "
                             "HiCache's file backend is unbounded")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 3 sessions x 3 turns, small pool (for tests)")
    parser.add_argument("--out-dir", default=None, help="default runs/<timestamp>")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    add_workload_args(parser)
    for action in parser._actions:  # these defaults depend on --quick
        if action.dest in FULL_DEFAULTS:
            action.default = None
    return parser


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Parse options; returns (args, pass-through `--hiradix-*` tokens).

    Raises:
        SystemExit: On unknown options that are not `--hiradix-*`.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    stray = [t for t in unknown if t.startswith("-") and not t.startswith("--hiradix-")]
    if stray or (unknown and not unknown[0].startswith("--hiradix-")):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args, unknown


def main(argv: Sequence[str] | None = None) -> int:
    """Run the A/B benchmark; returns the process exit code (1 if any request failed)."""
    args, hiradix_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    systems = resolve_systems(args.systems, args.system, hiradix_args, shlex.split(args.server_args))
    model_path = Path(args.model)
    if not model_path.is_absolute() and not model_path.exists():
        model_path = REPO_ROOT / model_path
    if not model_path.exists():
        raise SystemExit(f"model {args.model} not found; build it with scripts/make_model.py "
                         f"--preset {'tiny' if args.quick else 'small'} --out {args.model}")
    run_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    sessions = load_sessions(args.sessions, args.turns, args.seed, args.max_message_chars, args.source)
    logger.info("%d sessions x %d turns from %s; systems: %s; results in %s", len(sessions),
                args.turns, sessions[0].source, ", ".join(s.name for s in systems), run_dir)
    config = workload_config_from_args(args)
    if args.quick:
        logger.info("%s", QUICK_NOTE)
    per_token = kv_bytes_per_token(model_path)
    device_bytes = args.max_total_tokens * per_token
    nvme_gb, why = nvme_gb_for_run(args.nvme_gb, sessions, config.max_tokens, per_token, int(args.dram_ratio * device_bytes),
                                   token_counter(model_path))
    if any("--enable-hiradix" in s.server_args for s in systems):
        logger.info("hiradix NVMe tier: %s", why)
    systems = with_tier_sizes(systems, args.dram_ratio, nvme_gb, device_bytes, run_dir)
    t0 = time.perf_counter()
    try:
        runs = [run_system(system, str(model_path), args.max_total_tokens, sessions, config, run_dir,
                           args.startup_timeout_s) for system in systems]
    finally:
        if not args.keep_tier_files:
            removed = remove_tier_files(run_dir)
            if removed:
                logger.info("removed the NVMe/HiCache files under %s (%.1f MB; --keep-tier-files keeps them)",
                            run_dir, removed / 1e6)
    total_s = time.perf_counter() - t0
    run_config = {**vars(args), "model": str(model_path), "hiradix_args": hiradix_args,
                  "session_ids": [s.session_id for s in sessions], "session_source": sessions[0].source,
                  "systems_resolved": [dataclasses.asdict(s) for s in systems], "total_s": total_s}
    write_outputs(runs, run_dir, run_config)
    print()
    print(f"model {model_path.name}, {len(sessions)} sessions x {args.turns} turns "
          f"({sessions[0].source}), max_total_tokens {args.max_total_tokens}, "
          f"max_tokens {args.max_tokens}, concurrency {args.concurrency}")
    print(format_table(runs))
    print(f"\nresults: {run_dir} (records.json, records.csv, summary.json, ttft_by_turn.png); "
          f"total {total_s:.0f} s")
    if args.quick:
        print(QUICK_NOTE)
    return 1 if any(not r.ok for run in runs for r in run.records) else 0


if __name__ == "__main__":
    sys.exit(main())
