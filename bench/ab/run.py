"""Paired, repeated A/B benchmark: stock SGLang (RadixAttention), the ideal cache, SGLang + hiradix
and stock SGLang HiCache on the same multi-turn chats, with an A/A control.

How it measures (`bench.ab.paired` has the details): all systems' servers are started at once,
once per run, with the same model and CPU settings (`hiradix.testing.cpu_args`; they sleep when
idle). The workload advances in rounds: a batch of up to `--concurrency` ready requests goes to
one system, then the same batch to the next, back to back (never two systems at once: this
machine has 2 cores), in an order that changes every round (a Williams design and its mirror:
positions, predecessors and the order of every pair balanced). So request (repeat, session,
turn) is paired across systems, and the load of the machine lands on all of them alike. The
run is repeated `--repeats` times (default 3), each repetition with sessions of its own, every
server's cache flushed in between (`/flush_cache`, waiting until hiradix's tiers read empty),
as fresh servers would start, without paying for the start-ups again.

Systems (`bench.ab.systems`): default `stock,ideal,hiradix,hicache,ideal2`. `ideal` is stock
RadixAttention whose device pool holds the run's whole working set (the limit of any prefix
cache); `hicache` is stock HiCache with its `file` storage backend and the same DRAM as
hiradix; `ideal2` is the ideal again, the A/A control (an ideal caches exactly the same tokens
whatever the arrival order, so the pair measures the machine only; two stock servers evict
differently when the requests of a batch arrive in another order: 9,893 vs 10,612 prefill
tokens in one repetition). `stock2`, `lru`, `lookahead` and custom `--system NAME="FLAGS"`
can be added. Unknown `--hiradix-*` options go to the hiradix systems; `--server-args` to all.

Tensor parallelism: `--tp-size N` gives every system's server `--tp-size N` (and
`hiradix.testing.cpu_env(tp_size=N)`: each rank bound to its own core). Sizes are per rank, as
SGLang's and hiradix's flags are: `--max-total-tokens` (every rank's pool holds that many
tokens), `--dram-ratio` (x one rank's device pool) and `--nvme-gb` (per rank; an MLA model's
shared host copy, `--hiradix-mla-host-copy node`, is one per node of that size). The report's
host bytes reserved by hiradix are summed over the ranks.

Workload: ShareGPT sessions (`bench.common.conversations`), 6 turns by default; the history carries
the model's own answers (`--history dataset`: the dataset's), answers of `--answer-tokens`
tokens (EOS ignored); sessions arrive as a Poisson process (`--session-rate`) and think
`--think-time-s` (exponential mean) between turns.

Report (`bench.ab.report`): per turn, median TTFT and cached tokens; per repetition the paired
TTFT ratios (turns >= 2) with 95% bootstrap intervals, "BIASED RUN" where the A/A interval
excludes 1.0; per system the prefill tokens computed (responses and `/metrics`), uncached share
and server-side median TTFT; token-identical outputs; then verdict lines (hiradix vs stock, vs
the ideal, vs HiCache, the A/A) and the targets.
Outputs under `runs/<timestamp>/` (or `--out-dir`): `records.json`/`.csv`, `summary.json`,
`config.json`, `ab_verdict.png`, `ttft_by_turn.png`, and `<system>.server.log`.

    python -m bench.ab              # stock, ideal, hiradix, hicache, ideal2; models/small, 8 x 6, 3 repeats
    python -m bench.ab --quick      # tiny model, 3 sessions x 3 turns, 1 repeat (smoke test)
    python -m bench.ab --spill      # histories over twice HBM + DRAM: HiCache, hiradix, ideal, ideal2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import dataclasses
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: python bench/ab/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from bench.ab.report import SystemRun, format_table, identical_fraction, per_turn_summary, verdict_lines  # noqa: F401
from bench.ab.report import DEMO_GOALS, SPILL_GOALS, write_outputs
from bench.ab.systems import (  # noqa: F401 (re-exported: bench.cluster.run and tests use them from here)
    BUILTIN_SYSTEMS, DEFAULT_SYSTEMS, IDEAL, TEMPLATE_TOKENS_PER_MESSAGE, System, hicache_memory_problem, ideal_pool_tokens,
    kv_bytes_per_token, nvme_gb_for_run, remove_tier_files, resolve_systems, token_counter, with_ideal_pool,
    with_tier_sizes, working_set_tokens)
from bench.common.conversations import Session, load_sessions
from bench.common.multiturn import add_workload_args, workload_config_from_args
from bench.ab.paired import PairedConfig, PairedRecord, run_paired
from bench.ab.open_loop import OpenLoopConfig, run_open_repeat
from bench.ab import plots as ab_plots
from bench.ab.open_report import hits_by_tier, open_loop_lines, open_loop_ratios, stage_split, ttft_distribution
from bench.ab.servers import (  # noqa: F401 (re-exported)
    figures_since, flush_caches, server_cpu_seconds, snapshot, start_servers, warm_up)
from bench.common.server_metrics import fetch_metrics  # noqa: F401 (re-exported)
from hiradix.testing.server import ServerProcess

logger = logging.getLogger("bench.ab.run")
REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK_NOTE = ("--quick is a smoke test: the tiny model's requests take a few ms, so TTFT ratios are noise, "
              "and the histories fit in DRAM, so NVMe is not used; run without --quick to see the effect")
PAGE_NOTE = ("hiradix and ideal use --page-size 16; ideal caches whole pages only, hiradix also keeps a request's "
             "partly filled last page for the next turn (--hiradix-partial-page on, the default), as stock at page "
             "size 1 does, so it can compute fewer prefill tokens than ideal")

# The device pool is smaller than the histories of the sessions in flight (4 x ~1,500 tokens at
# the last turn of the full run), so stock RadixAttention has to evict history between turns;
# that is the situation hiradix's lower tiers are for. Answers stay short: CPU decoding is slow.
FULL_DEFAULTS = {"model": "models/small", "sessions": 8, "turns": 6, "max_total_tokens": 2048,
                 "max_message_chars": 600, "max_tokens": 16, "repeats": 3, "session_rate": 1.0,
                 "think_time_s": 1.0}
QUICK_DEFAULTS = {"model": "models/tiny", "sessions": 3, "turns": 3, "max_total_tokens": 1024,
                  "max_message_chars": 300, "max_tokens": 8, "repeats": 1, "session_rate": None,
                  "think_time_s": 0.0}
# The spill workload, where tiers below DRAM matter: the 16 sessions' histories (~8,000 tokens at
# their last turns) are more than twice HBM + DRAM (1,536 + 1,920 tokens), so most of every hit
# comes back from NVMe (hiradix) or HiCache's L3 `file` backend. HiCache is the baseline. One
# repetition: a short phase (~4 min).
SPILL_DEFAULTS = {**FULL_DEFAULTS, "max_total_tokens": 1536, "dram_ratio": 1.25, "repeats": 1,
                  "systems": "hicache,hiradix,ideal,ideal2", "sessions": 16}
SPILL_NOTE = ("--spill: histories more than twice HBM + DRAM; targets: hiradix under 0.5x HiCache's TTFT and within "
              "2% of the ideal's prefill tokens")


def check_fits(sessions: Sequence[Session], answer_tokens: int, pool_tokens: int, count_tokens,
               own_answers: bool) -> None:
    """Refuse a workload whose longest prompt cannot run in the device pool (SGLang would keep it
    waiting forever). Counts with the model's tokenizer (`count_tokens`); a no-op without one.

    Raises:
        ValueError: naming `--max-total-tokens` and `--max-message-chars`.
    """
    if count_tokens is None:
        return
    for i, session in enumerate(sessions):
        need = working_set_tokens([session], answer_tokens, count_tokens, own_answers)
        if need > pool_tokens:
            raise ValueError(f"session {i} needs up to {need} tokens at its last turn > --max-total-tokens "
                             f"{pool_tokens}; raise the pool or lower --max-message-chars / --turns")


def run_repeat(servers: dict[str, ServerProcess], systems: Sequence[System], repeat: int,
               sessions: Sequence[Session], config: PairedConfig) -> tuple[list[PairedRecord], dict]:
    """One repetition on servers with empty caches; returns its records and, per system,
    `{startup_s, workload_s, metrics}` (`metrics`: the `/metrics` delta over the workload)."""
    before = {}
    for name, server in servers.items():
        warm_up(server.base_url, config.workload, config.concurrency)
        before[name] = snapshot(server)
    order = [s.name for s in systems]
    order = order[repeat % len(order):] + order[: repeat % len(order)]  # round 0's order moves too
    t0 = time.perf_counter()
    total = sum(s.num_turns for s in sessions)

    def progress(round_index: int, done: int) -> None:
        logger.info("repeat %d round %d: %d/%d requests per system done (%.0f s)", repeat, round_index, done,
                    total, time.perf_counter() - t0)

    records = asyncio.run(run_paired({n: servers[n].base_url for n in order}, sessions,
                                     dataclasses.replace(config, repeat=repeat), progress))
    workload_s = time.perf_counter() - t0
    return records, {name: figures_since(server, before[name], workload_s) for name, server in servers.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ab",
        description="Paired A/B: stock SGLang, the ideal cache and SGLang + hiradix on multi-turn chats.",
        epilog="Unknown --hiradix-* options are passed to the systems that use --enable-hiradix.")
    parser.add_argument("--model", default=None, help=f"model dir (default {FULL_DEFAULTS['model']})")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated systems; the first is the baseline; NAME<digits> duplicates NAME (A/A) "
                             f"(default {DEFAULT_SYSTEMS}; --spill {SPILL_DEFAULTS['systems']})")
    parser.add_argument("--system", action="append", default=[], metavar='NAME="FLAGS"',
                        help="define a system (repeatable)")
    parser.add_argument("--server-args", default="", help="extra server flags for every system")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks of every system's server (default 1); --max-total-tokens, "
                             "--dram-ratio and --nvme-gb are per rank")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help=f"device KV pool in tokens, per TP rank (default {FULL_DEFAULTS['max_total_tokens']}; "
                             "the ideal system's is sized to the working set)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions, each with sessions of its own on flushed caches (default 3; --quick 1)")
    parser.add_argument("--answer-tokens", dest="max_tokens", type=int, default=None,
                        help=f"tokens per answer (default {FULL_DEFAULTS['max_tokens']}; EOS ignored)")
    parser.add_argument("--history", choices=["own", "dataset"], default="own",
                        help="answers in the history: the model's own (default) or the dataset's")
    parser.add_argument("--stop-at-eos", action="store_true", help="let answers end at EOS (default: ignored)")
    parser.add_argument("--dram-ratio", type=float, default=None,
                        help="DRAM tier of HiCache and hiradix, as a multiple of one TP rank's device KV pool "
                             "(default 2; --spill 1.25; per rank, or per node for an MLA model's shared hiradix "
                             "host copy)")
    parser.add_argument("--keep-tier-files", action="store_true",
                        help="keep the NVMe and HiCache files under the run directory (default: removed at the end)")
    parser.add_argument("--nvme-gb", type=float, default=None,
                        help="hiradix NVMe tier in GB under the run directory, per TP rank (per node for an MLA "
                             "model's shared host copy; 0: none; default: sized to the run's working set, none when "
                             "it fits in DRAM)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 3 sessions x 3 turns, 1 repeat, small pool (a smoke test)")
    parser.add_argument("--spill", action="store_true",
                        help="the spill workload: histories more than twice HBM + DRAM (--max-total-tokens 1536, "
                             "--dram-ratio 1.25, 16 sessions x 6 turns, 1 repeat, systems "
                             f"{SPILL_DEFAULTS['systems']}); judged by the spill targets (hiradix < 0.5x HiCache's "
                             "TTFT, prefill tokens within 2%% of the ideal's)")
    parser.add_argument("--open-loop", type=float, default=None, metavar="RATE",
                        help="open loop: requests arrive as a Poisson process of RATE per second, at most "
                             "--concurrency in flight, each system alone on its server in turn (mirrored orders "
                             "over the repetitions); reports TTFT mean/p50/p90/p99 and SGLang's per-request split")
    parser.add_argument("--out-dir", default=None, help="default runs/<timestamp>")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    add_workload_args(parser)
    helps = {"sessions": "number of sessions (default 8; --quick 3)", "turns": "user turns per session (default 6; --quick 3)",
             "think_time_s": "mean of the exponential think time between turns, s (default 1; --quick 0)",
             "session_rate": "Poisson session arrivals per second (default 1; 0: all at once; --quick: all at once)",
             "concurrency": "requests per round: sessions in flight at each system (default 4)"}
    for action in parser._actions:  # these defaults depend on --quick
        if action.dest in FULL_DEFAULTS:
            action.default = None
        if action.dest in helps and action.option_strings != ["--answer-tokens"]:
            action.help = helps[action.dest]
    return parser


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Parse options; returns (args, pass-through `--hiradix-*` tokens).

    Raises:
        SystemExit: On unknown options that are not `--hiradix-*`, or `--repeats` < 1.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    stray = [t for t in unknown if t.startswith("-") and not t.startswith("--hiradix-")]
    if stray or (unknown and not unknown[0].startswith("--hiradix-")):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.quick and args.spill:
        parser.error("--quick and --spill are two presets: pick one")
    defaults = QUICK_DEFAULTS if args.quick else SPILL_DEFAULTS if args.spill else FULL_DEFAULTS
    for name, value in {"systems": DEFAULT_SYSTEMS, "dram_ratio": 2.0, **defaults}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.open_loop is not None and args.open_loop <= 0:
        parser.error(f"--open-loop RATE must be > 0 requests/s, got {args.open_loop}")
    return args, unknown


def prepare(args: argparse.Namespace, hiradix_args: Sequence[str], run_dir: Path):
    """Resolve the model, the sessions of each repetition, the systems (tier sizes, the ideal's
    pool) and the paired config.

    Raises:
        SystemExit: If the model is missing.
        ValueError: On bad systems or a workload that does not fit the pool.
    """
    systems = resolve_systems(args.systems, args.system, hiradix_args, shlex.split(args.server_args))
    problem = hicache_memory_problem([s.name for s in systems], psutil.virtual_memory().available)
    if problem is not None:
        raise SystemExit(f"bench.ab: {problem}")
    model_path = Path(args.model)
    if not model_path.is_absolute() and not model_path.exists():
        model_path = REPO_ROOT / model_path
    if not model_path.exists():
        raise SystemExit(f"model {args.model} not found; build it with scripts/make_model.py "
                         f"--preset {'tiny' if args.quick else 'small'} --out {args.model}")
    # Sessions of their own per repetition: the caches are flushed in between, and nothing of an
    # earlier repetition can hit a tier a flush does not empty (HiCache's storage files).
    every = load_sessions(args.sessions * args.repeats, args.turns, args.seed, args.max_message_chars, args.source)
    by_repeat = [every[r * args.sessions:(r + 1) * args.sessions] for r in range(args.repeats)]
    own = args.history == "own"
    counter = token_counter(model_path)
    check_fits(every, args.max_tokens, args.max_total_tokens, counter, own)
    per_token = kv_bytes_per_token(model_path, tp_size=args.tp_size)  # one rank's: tier sizes are per rank
    device_bytes = args.max_total_tokens * per_token
    biggest = max(by_repeat, key=lambda ss: working_set_tokens(ss, args.max_tokens, counter, own))
    nvme_gb, why = nvme_gb_for_run(args.nvme_gb, biggest, args.max_tokens, per_token,
                                   int(args.dram_ratio * device_bytes), counter, own)
    if any("--enable-hiradix" in s.server_args for s in systems):
        logger.info("hiradix NVMe tier: %s", why)
    ideal_pool = max(args.max_total_tokens, ideal_pool_tokens(working_set_tokens(biggest, args.max_tokens, counter, own)))
    systems = with_ideal_pool(with_tier_sizes(systems, args.dram_ratio, nvme_gb, device_bytes, run_dir), ideal_pool)
    workload = workload_config_from_args(args, ignore_eos=not args.stop_at_eos, progress=False,
                                         session_rate_per_s=args.session_rate or None)
    config = PairedConfig(workload, concurrency=args.concurrency, own_answers=own)
    return model_path, by_repeat, systems, config, ideal_pool


def collect(systems: Sequence[System], repeats: list[tuple[list[PairedRecord], dict]], run_dir: Path) -> list[SystemRun]:
    """Per system: its records and figures over all repetitions."""
    runs = []
    for system in systems:
        records = [r for recs, _ in repeats for r in recs if r.system == system.name]
        info = [inf[system.name] for _, inf in repeats]
        runs.append(SystemRun(system, records, statistics.median(i["startup_s"] for i in info),
                              sum(i["workload_s"] for i in info), str(run_dir / f"{system.name}.server.log"),
                              [i["metrics"] for i in info], [i["cpu"] for i in info]))
    return runs


def run_all(args: argparse.Namespace, model_path: Path, by_repeat: list, systems: Sequence[System],
            config: PairedConfig, run_dir: Path) -> list[tuple[list[PairedRecord], dict]]:
    """Start every server once, then the repetitions, each on flushed caches; stops the servers."""
    repeats = []
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            servers = start_servers(stack, systems, str(model_path), args.max_total_tokens, run_dir,
                                    args.startup_timeout_s, args.tp_size)
            logger.info("all servers healthy after %.0f s", time.perf_counter() - t0)
            for repeat, sessions in enumerate(by_repeat):
                if repeat:
                    flush_caches(servers)
                if args.open_loop is None:
                    repeats.append(run_repeat(servers, systems, repeat, sessions, config))
                else:
                    open_config = OpenLoopConfig(config.workload, args.open_loop, config.concurrency, config.own_answers)
                    repeats.append(run_open_repeat(servers, systems, repeat, sessions, open_config))
                logger.info("repeat %d done after %.0f s", repeat, time.perf_counter() - t0)
    finally:
        if not args.keep_tier_files:
            remove_tier_files(run_dir)
    return repeats


def print_report(args: argparse.Namespace, runs: list[SystemRun], result: dict, model_path: Path,
                 by_repeat: list, run_dir: Path, ideal_pool: int, total_s: float) -> None:
    """The table, the notes and the verdict lines on stdout."""
    print()
    print(f"model {model_path.name}, {len(by_repeat[0])} sessions x {args.turns} turns per repeat "
          f"({by_repeat[0][0].source}), history: {args.history} answers of {args.max_tokens} tokens, "
          f"{args.repeats} repeat(s), max_total_tokens {args.max_total_tokens} (ideal {ideal_pool}), "
          f"concurrency {args.concurrency}" + (f", --tp-size {args.tp_size}" if args.tp_size > 1 else ""))
    print(format_table(runs))
    if any("--enable-hiradix" in run.system.server_args for run in runs):
        print("note: " + PAGE_NOTE)
    print(f"\nresults: {run_dir} (records.json, summary.json, ab_verdict.png, ttft_by_turn.png); total {total_s:.0f} s")
    if args.quick:
        print(QUICK_NOTE)
    if args.spill:
        print(SPILL_NOTE)
    if args.open_loop is not None:
        print()
        for line in open_loop_lines(runs, args.open_loop, args.concurrency):
            print(line)
    print("\nverdict (paired per request, median [95% bootstrap CI]):")
    for line in result["verdicts"]:
        print("  " + line)
    for t in result["targets"]:
        print(f"  target: {t['target']}: {t['measured']} -> {'MET' if t['met'] else 'MISSED'}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the paired A/B benchmark; returns the process exit code (1 if any request failed)."""
    args, hiradix_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    run_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path, by_repeat, systems, config, ideal_pool = prepare(args, hiradix_args, run_dir)
    logger.info("%d repeat(s) of %d sessions x %d turns from %s; systems: %s; ideal pool %d tokens; results in %s",
                args.repeats, args.sessions, args.turns, by_repeat[0][0].source, ", ".join(s.name for s in systems),
                ideal_pool, run_dir)
    if args.quick:
        logger.info("%s", QUICK_NOTE)
    t0 = time.perf_counter()
    repeats = run_all(args, model_path, by_repeat, systems, config, run_dir)
    total_s = time.perf_counter() - t0
    runs = collect(systems, repeats, run_dir)
    run_config = {**vars(args), "model": str(model_path), "hiradix_args": hiradix_args, "ideal_pool_tokens": ideal_pool,
                  "session_ids": [[s.session_id for s in ss] for ss in by_repeat],
                  "session_source": by_repeat[0][0].source,
                  "systems_resolved": [dataclasses.asdict(s) for s in systems], "total_s": total_s}
    result = write_outputs(runs, run_dir, run_config, SPILL_GOALS if args.spill else DEMO_GOALS)
    if args.open_loop is not None:
        result["open_loop"] = {"rate_per_s": args.open_loop, "max_in_flight": args.concurrency,
                               "systems": {run.system.name: {"ttft_s": ttft_distribution(run), "split": stage_split(run),
                                                             "hits_by_tier": hits_by_tier(run)} for run in runs},
                               "ratios": open_loop_ratios(runs)}
        (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
        ab_plots.plot_open_loop(result["open_loop"], run_dir / "open_loop.png")
    print_report(args, runs, result, model_path, by_repeat, run_dir, ideal_pool, total_s)
    return 1 if any(not r.ok for run in runs for r in run.records) else 0


if __name__ == "__main__":
    sys.exit(main())
