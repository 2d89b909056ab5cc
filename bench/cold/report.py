"""Perplexity, agreement with ``exact`` and storage shares of `bench.cold.quality` (issue 21, item 3).

Input: one record per (system, chat, turn) of a measured turn (every turn after the first):
``nll`` (negative log-likelihood of each answer token, nats), ``top1`` (top-1 prediction at each
answer position), ``history_tokens`` (the previous turn's input rounded down to whole pages: what
the cache can hold), ``storage_tokens`` (``cached_tokens_details["storage"]``: read back from NVMe)
and ``ok``.

A turn counts when every system measured it ``ok``. Perplexity of a system =
exp(total NLL / total answer tokens) over those turns. Intervals: percentile cluster bootstrap over
chats (``bench.common.stats.RESAMPLES`` resamples, seeded), the same resample for every system, so
the relative difference to ``exact`` and the agreement with ``exact`` are paired.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from bench.common.stats import LEVEL, RESAMPLES

REFERENCE = "exact"


def common_turns(records: Sequence[dict], systems: Sequence[str]) -> list[tuple]:
    """``(chat, turn)`` keys measured ``ok`` by every system, sorted."""
    ok: dict[tuple, set] = {}
    for r in records:
        if r["ok"]:
            ok.setdefault((r["chat"], r["turn"]), set()).add(r["system"])
    return sorted(k for k, names in ok.items() if set(systems) <= names)


def per_chat_sums(records: Sequence[dict], systems: Sequence[str], keys: Sequence[tuple]) -> dict:
    """``nll`` and ``agree`` (systems, chats) and ``tokens`` (chats,) arrays over ``keys``:
    summed NLL, answer tokens, and positions whose top-1 equals ``exact``'s."""
    chats = sorted({c for c, _ in keys})
    column = {c: j for j, c in enumerate(chats)}
    by = {(r["system"], r["chat"], r["turn"]): r for r in records}
    nll = np.zeros((len(systems), len(chats)))
    agree = np.zeros((len(systems), len(chats)))
    tokens = np.zeros(len(chats))
    for chat, turn in keys:
        j = column[chat]
        ref = by[(REFERENCE, chat, turn)]["top1"]
        tokens[j] += len(ref)
        for i, name in enumerate(systems):
            r = by[(name, chat, turn)]
            nll[i, j] += sum(r["nll"])
            agree[i, j] += sum(a == b for a, b in zip(r["top1"], ref))
    return {"chats": chats, "nll": nll, "tokens": tokens, "agree": agree}


def _interval(samples: np.ndarray) -> list[float]:
    tail = (1.0 - LEVEL) / 2 * 100
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def storage_share(records: Sequence[dict], system: str, keys: Sequence[tuple] | None = None) -> dict:
    """Of ``system``'s measured turns (or only ``keys``): history tokens, storage tokens, their
    share, and turns with no storage hit."""
    wanted = None if keys is None else set(keys)
    rows = [r for r in records if r["system"] == system and (wanted is None or (r["chat"], r["turn"]) in wanted)]
    history = sum(r["history_tokens"] for r in rows)
    storage = sum(r["storage_tokens"] for r in rows)
    return {"turns": len(rows), "history_tokens": history, "storage_tokens": storage,
            "share": storage / history if history else math.nan,
            "turns_without_storage": sum(r["storage_tokens"] == 0 for r in rows)}


def quality_table(records: Sequence[dict], systems: Sequence[str], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Per system: ``perplexity``, ``rel_to_exact``, ``agreement_with_exact`` (each with ``_ci``) and
    ``storage`` (over all measured turns and over the counted ones).

    Raises:
        ValueError: ``exact`` is not among ``systems``, or no turn was measured ok by every system.
    """
    if REFERENCE not in systems:
        raise ValueError(f"the reference system {REFERENCE!r} is not among {list(systems)}")
    keys = common_turns(records, systems)
    if not keys:
        raise ValueError("no turn was measured ok by every system")
    s = per_chat_sums(records, systems, keys)
    nll, tokens, agree = s["nll"], s["tokens"], s["agree"]
    picks = np.random.default_rng(seed).integers(0, len(s["chats"]), size=(resamples, len(s["chats"])))
    boot_tokens = tokens[picks].sum(axis=1)  # (resamples,)
    boot_ppl = np.exp(nll[:, picks].sum(axis=2) / boot_tokens)  # (systems, resamples)
    ref = list(systems).index(REFERENCE)
    ref_ppl = math.exp(nll[ref].sum() / tokens.sum())
    table = {}
    for i, name in enumerate(systems):
        ppl = math.exp(nll[i].sum() / tokens.sum())
        table[name] = {"perplexity": ppl, "perplexity_ci": _interval(boot_ppl[i]),
                       "rel_to_exact": ppl / ref_ppl - 1.0, "rel_to_exact_ci": _interval(boot_ppl[i] / boot_ppl[ref] - 1.0),
                       "agreement_with_exact": float(agree[i].sum() / tokens.sum()),
                       "agreement_with_exact_ci": _interval(agree[i][picks].sum(axis=1) / boot_tokens),
                       "storage_all": storage_share(records, name), "storage_counted": storage_share(records, name, keys)}
    return {"systems": table, "turns": len(keys), "chats": len(s["chats"]), "answer_tokens": int(tokens.sum()),
            "resamples": resamples, "level": LEVEL}


def format_table(result: dict) -> str:
    """The Markdown table of ``quality_table``."""
    lines = ["| system | perplexity [95% CI] | vs exact [95% CI] | greedy agreement with exact [95% CI] "
             "| history from NVMe (all measured turns) | turns without NVMe hit |", "|---|---|---|---|---|---|"]
    for name, row in result["systems"].items():
        lo, hi = row["perplexity_ci"]
        rlo, rhi = row["rel_to_exact_ci"]
        alo, ahi = row["agreement_with_exact_ci"]
        st = row["storage_all"]
        lines.append(f"| {name} | {row['perplexity']:.2f} [{lo:.2f}, {hi:.2f}] | {row['rel_to_exact']:+.2%} "
                     f"[{rlo:+.2%}, {rhi:+.2%}] | {row['agreement_with_exact']:.1%} [{alo:.1%}, {ahi:.1%}] "
                     f"| {st['share']:.1%} ({st['storage_tokens']:,} / {st['history_tokens']:,}) "
                     f"| {st['turns_without_storage']} of {st['turns']} |")
    return "\n".join(lines)
