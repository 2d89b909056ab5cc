"""Load or recompute: how much of a cached prefix is worth reading from the tier that holds it.

A cached page on a lower tier (DRAM, NVMe, the cluster store) only helps if bringing it to HBM is
faster than prefilling its tokens again (issue 19, item 4; HiCache users report L3 hits slower than
recomputing). Pure arithmetic: no I/O, no clock; the caller passes measured (or configured) rates.

The model, per request. The prompt's cached prefix is a sequence of leading runs, one per tier
that holds it, in prefix order (e.g. ``[("hbm", 512), ("dram", 2048), ("store", 4096)]``); after it
come ``uncached_tokens`` that must be prefilled anyway. Reading ``n`` tokens of tier ``t`` takes
``n * bytes_per_token / read_bytes_per_s[t]`` seconds; prefilling ``n`` tokens takes
``n / prefill_tokens_per_s`` seconds. Runs are read one after another (one path into HBM). Only a
leading run can be used (a prefix cache has no holes), so the answer is one number: the tokens
``k`` of the cached prefix to load; the rest is prefilled.

* ``overlap=False`` (reads finish before the prefill starts): time(k) = read(k) + prefill(rest).
  Costs are linear per run, so a run is loaded whole or not at all: walk the runs in order and
  stop at the first whose read time is not below its recompute time.
* ``overlap=True`` (layer-wise loading: layer i+1 is read while layer i computes; AttentionStore /
  CachedAttention, USENIX ATC '24, section 3.3): time(k) = max(read(k), prefill(rest)), up to one
  layer's read. A read that ends before the prefill of the rest is free, so loading pays up to the
  point where the read of the loaded part takes as long as the prefill of everything after it;
  that point may fall inside a run (rounded down to whole pages).

HBM runs (or any tier given ``math.inf`` bandwidth) cost nothing to "load" and are always used.

Example (Llama-3-8B fp16, 128 KiB per token, 50k prefill tokens/s: the break-even link is
131072 * 50000 = 6.6 GB/s): a store at 10 GB/s is read, one at 1 GB/s is recomputed without
overlap; with overlap a 1 GB/s store is still read for the part its read hides behind the prefill.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence


def tokens_worth_loading(
    run_tokens_by_tier: Sequence[tuple[str, int]],
    read_bytes_per_s: Mapping[str, float],
    bytes_per_token: float,
    prefill_tokens_per_s: float,
    overlap: bool = False,
    uncached_tokens: int = 0,
    page_size: int = 1,
) -> int:
    """The leading tokens of the cached prefix to load; the caller prefills the rest.

    Args:
        run_tokens_by_tier: the cached prefix as ``(tier name, tokens)`` runs in prefix order
            (a tier may appear more than once; zero-length runs are ignored).
        read_bytes_per_s: read bandwidth into HBM per tier name, in bytes/s (``math.inf`` = free,
            e.g. ``"hbm"``). Every tier named in the runs must be present.
        bytes_per_token: KV bytes of one token, all layers (K and V).
        prefill_tokens_per_s: prefill throughput, in tokens/s, at the batch size in use.
        overlap: reads overlap the prefill of the tokens not loaded (layer-wise loading).
        uncached_tokens: tokens after the cached prefix, prefilled in any case, in tokens (only
            matters with ``overlap``: they hide reads).
        page_size: a run cut short (only with ``overlap``) is cut on a multiple of it, in tokens.

    Returns:
        ``k``, 0 <= k <= total run tokens: load the first ``k`` tokens, in prefix order.

    Raises:
        ValueError: a negative length, a non-positive rate, or a tier without a bandwidth.
    """
    _check(run_tokens_by_tier, read_bytes_per_s, bytes_per_token, prefill_tokens_per_s, uncached_tokens, page_size)
    compute_s_per_token = 1.0 / prefill_tokens_per_s
    rest_tokens = sum(n for _, n in run_tokens_by_tier) + uncached_tokens  # prefilled if nothing more is loaded
    loaded, read_s = 0, 0.0
    for tier, n in run_tokens_by_tier:
        if n <= 0:
            continue
        bw = read_bytes_per_s[tier]
        read_s_per_token = 0.0 if math.isinf(bw) else bytes_per_token / bw
        if read_s_per_token == 0.0:
            loaded, rest_tokens = loaded + n, rest_tokens - n
            continue
        if not overlap:
            if read_s_per_token >= compute_s_per_token:
                break
            loaded, rest_tokens, read_s = loaded + n, rest_tokens - n, read_s + n * read_s_per_token
            continue
        # Overlap: load x more while read_s + x * r <= (rest - x) * c (the read stays hidden).
        x = (rest_tokens * compute_s_per_token - read_s) / (read_s_per_token + compute_s_per_token)
        take = n if x >= n else _best_cut(loaded, x, n, page_size, read_s, read_s_per_token, rest_tokens, compute_s_per_token)
        loaded, rest_tokens, read_s = loaded + take, rest_tokens - take, read_s + take * read_s_per_token
        if take < n:
            break
    return loaded


def split_by_tier(run_tokens_by_tier: Sequence[tuple[str, int]], tokens: int) -> dict[str, int]:
    """The first ``tokens`` of the runs, summed per tier name (e.g. how much to read from each).

    Args:
        run_tokens_by_tier: ``(tier name, tokens)`` runs in prefix order.
        tokens: leading tokens taken (e.g. :func:`tokens_worth_loading`'s answer).
    """
    out: dict[str, int] = {}
    for tier, n in run_tokens_by_tier:
        take = max(0, min(n, tokens))
        out[tier] = out.get(tier, 0) + take
        tokens -= take
    return out


def request_time_s(
    run_tokens_by_tier: Sequence[tuple[str, int]],
    loaded_tokens: int,
    read_bytes_per_s: Mapping[str, float],
    bytes_per_token: float,
    prefill_tokens_per_s: float,
    overlap: bool = False,
    uncached_tokens: int = 0,
) -> float:
    """Modelled time of one request's prefill, in seconds: reading the first ``loaded_tokens``
    of the runs and prefilling the rest (sum without ``overlap``, max with it; the model of
    :func:`tokens_worth_loading`).

    Raises:
        ValueError: as :func:`tokens_worth_loading`, or ``loaded_tokens`` outside the runs.
    """
    _check(run_tokens_by_tier, read_bytes_per_s, bytes_per_token, prefill_tokens_per_s, uncached_tokens, 1)
    read_s = 0.0
    for tier, n in split_by_tier(run_tokens_by_tier, loaded_tokens).items():
        bw = read_bytes_per_s[tier]
        read_s += 0.0 if math.isinf(bw) or n == 0 else n * bytes_per_token / bw
    cached = sum(n for _, n in run_tokens_by_tier)
    if not 0 <= loaded_tokens <= cached:
        raise ValueError(f"loaded_tokens must be in [0, {cached}], got {loaded_tokens}")
    prefill_s = (cached - loaded_tokens + uncached_tokens) / prefill_tokens_per_s
    return max(read_s, prefill_s) if overlap else read_s + prefill_s


def _best_cut(loaded: int, x: float, n: int, page_size: int, read_s: float, read_s_per_token: float,
              rest_tokens: int, compute_s_per_token: float) -> int:
    """Tokens of a run to take when the exact crossing ``x`` falls inside it: the page boundary
    just below or just above ``loaded + x``, whichever gives the smaller max(read, prefill)."""
    lo = max(0, math.floor((loaded + max(x, 0.0)) / page_size) * page_size - loaded)
    hi = min(n, lo + page_size)

    def cost(take: int) -> float:
        return max(read_s + take * read_s_per_token, (rest_tokens - take) * compute_s_per_token)

    return hi if cost(hi) < cost(lo) else lo


def _check(runs, read_bytes_per_s, bytes_per_token, prefill_tokens_per_s, uncached_tokens, page_size) -> None:
    if bytes_per_token <= 0 or prefill_tokens_per_s <= 0 or page_size < 1 or uncached_tokens < 0:
        raise ValueError(f"need bytes_per_token > 0, prefill_tokens_per_s > 0, page_size >= 1, uncached_tokens >= 0; "
                         f"got {bytes_per_token}, {prefill_tokens_per_s}, {page_size}, {uncached_tokens}")
    for tier, n in runs:
        if n < 0:
            raise ValueError(f"run of tier {tier!r} has {n} tokens")
        if tier not in read_bytes_per_s:
            raise ValueError(f"no read bandwidth for tier {tier!r}; given: {', '.join(sorted(read_bytes_per_s))}")
        if read_bytes_per_s[tier] <= 0:
            raise ValueError(f"read_bytes_per_s[{tier!r}] must be > 0, got {read_bytes_per_s[tier]}")
