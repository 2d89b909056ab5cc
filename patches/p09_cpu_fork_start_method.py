"""SGLang's launcher: an opt-in multiprocessing start method, for CPU test servers that start fast.

What it changes, in the installed sglang 0.5.23: `srt/entrypoints/engine.py`, where the launcher
sets `mp.set_start_method("spawn", force=True)` before it starts the scheduler and detokenizer
processes, the method is read from the environment variable `HIRADIX_MP_START_METHOD`
(`spawn` when unset, so nothing changes for anyone who does not set it).

Why: with `spawn` every child process imports SGLang, torch and transformers again. Measured here
(2 cores, models/tiny, loaded machine, Dec 6 2026): a server's processes used 37.5 s of CPU to
become healthy with `spawn` and 14.0 s with `fork` (healthy after 94.5 s vs 61.8 s; the same
greedy answer). The test suite starts ~50 servers, so that is most of its time.
`hiradix.testing.server.cpu_env(fork=True)` sets `fork` for the test fixtures' servers on the CPU
engine (no CUDA context exists there, which is what makes `spawn` necessary on a GPU); the
session's shared servers and the benchmarks keep SGLang's `spawn`, so the start method users get
stays tested.
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "cpu-fork-start-method"
MARKER = "hiradix-patch: cpu-fork-start-method"

ANCHOR = """    # Set mp start method
    mp.set_start_method("spawn", force=True)
"""
REPLACEMENT = f"""    # Set mp start method
    # {MARKER} (hiradix patches/p09_cpu_fork_start_method.py):
    # opt-in (CPU test servers): HIRADIX_MP_START_METHOD=fork; unset: spawn, as stock.
    mp.set_start_method(os.environ.get("HIRADIX_MP_START_METHOD") or "spawn", force=True)
"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/entrypoints/engine.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
