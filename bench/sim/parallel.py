"""Run simulator scenarios on several processes, with one progress bar over all simulated requests."""

from __future__ import annotations

from typing import Sequence


def run_all(trace: Sequence, cfg, scenarios: Sequence[tuple[str, str]], jobs: int) -> list[dict]:
    """Run ``scenarios`` ((lowest tier, policy) pairs) on ``jobs`` processes, with one
    tqdm bar over all simulated requests; results in the order of ``scenarios``."""
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    from bench.sim.simulate import TIERS, run_scenario

    if jobs <= 1:
        with tqdm(total=len(trace) * len(scenarios), unit="req", desc=f"{len(scenarios)} scenarios", mininterval=1.0) as bar:
            return [run_scenario(trace, cfg, tier, policy, bar.update) for tier, policy in scenarios]
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        progress_q = manager.Queue()
        # Slowest first (look-ahead plans every step; NVMe adds I/O events) to balance the workers.
        order = sorted(scenarios, key=lambda s: (s[1] != "lookahead", TIERS.index(s[0]) * -1))
        futures = {s: pool.submit(run_scenario, trace, cfg, s[0], s[1], progress_q.put) for s in order}
        with tqdm(total=len(trace) * len(scenarios), unit="req", desc=f"{len(scenarios)} scenarios", mininterval=1.0) as bar:
            while not all(f.done() for f in futures.values()):
                try:
                    bar.update(progress_q.get(timeout=0.5))
                except queue_mod.Empty:
                    pass
            while not progress_q.empty():
                bar.update(progress_q.get())
        return [futures[s].result() for s in scenarios]
