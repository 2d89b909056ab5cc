"""Perplexity, agreement and reuse figures of `bench.overflow.quality` (issue 20, item 5).

Input: one record per (system, chat, turn) of a measured turn: ``nll`` (negative log-likelihood of
each answer token, nats), ``top1`` (the top-1 prediction at each answer position), ``ok`` (both
steps cut alike and returned every answer token), and the step-A counts (``prompt_tokens``,
``truncated_tokens``, ``shifted_tokens``, ``cached_tokens``).

Perplexity of a system = exp(total NLL / total answer tokens) over the turns every system
measured (``ok`` everywhere). Intervals: percentile cluster bootstrap over chats (whole
conversations resampled, ``bench.common.stats.RESAMPLES`` times, seeded), the same resample for
every system, so the relative difference to TT and the agreement with TT are paired.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from bench.common.stats import LEVEL, RESAMPLES

REFERENCE = "TT"


def common_turns(records: Sequence[dict], systems: Sequence[str]) -> list[tuple]:
    """``(chat, turn)`` keys measured ``ok`` by every system, sorted."""
    ok: dict[tuple, set] = {}
    for r in records:
        if r["ok"]:
            ok.setdefault((r["chat"], r["turn"]), set()).add(r["system"])
    return sorted(k for k, names in ok.items() if set(systems) <= names)


def per_chat_sums(records: Sequence[dict], systems: Sequence[str], keys: Sequence[tuple]) -> dict:
    """``{"nll": (systems, chats), "tokens": (chats,), "agree": (systems, chats)}`` arrays: summed NLL,
    answer tokens, and positions whose top-1 equals the reference's (TT), per chat."""
    chats = sorted({c for c, _ in keys})
    wanted = set(keys)
    by = {(r["system"], r["chat"], r["turn"]): r for r in records if (r["chat"], r["turn"]) in wanted}
    nll = np.zeros((len(systems), len(chats)))
    agree = np.zeros((len(systems), len(chats)))
    tokens = np.zeros(len(chats))
    for j, chat in enumerate(chats):
        for c, turn in keys:
            if c != chat:
                continue
            ref = by[(REFERENCE, chat, turn)]["top1"] if REFERENCE in systems else None
            tokens[j] += len(by[(systems[0], chat, turn)]["nll"])
            for i, name in enumerate(systems):
                r = by[(name, chat, turn)]
                nll[i, j] += sum(r["nll"])
                if ref is not None:
                    agree[i, j] += sum(a == b for a, b in zip(r["top1"], ref))
    return {"chats": chats, "nll": nll, "tokens": tokens, "agree": agree}


def _interval(samples: np.ndarray) -> list[float]:
    tail = (1.0 - LEVEL) / 2 * 100
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def quality_table(records: Sequence[dict], systems: Sequence[str], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Per system: ``perplexity`` [interval], ``rel_to_tt`` [interval], ``agreement_with_tt`` [interval].

    Raises:
        ValueError: no turn was measured by every system.
    """
    keys = common_turns(records, systems)
    if not keys:
        raise ValueError("no turn was measured ok by every system")
    s = per_chat_sums(records, systems, keys)
    nll, tokens, agree = s["nll"], s["tokens"], s["agree"]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(s["chats"]), size=(resamples, len(s["chats"])))
    boot_tokens = tokens[picks].sum(axis=1)  # (resamples,)
    boot_ppl = np.exp(nll[:, picks].sum(axis=2) / boot_tokens)  # (systems, resamples)
    ref = list(systems).index(REFERENCE) if REFERENCE in systems else None
    table = {}
    for i, name in enumerate(systems):
        row = {"perplexity": float(math.exp(nll[i].sum() / tokens.sum())), "perplexity_ci": _interval(boot_ppl[i])}
        if ref is not None:
            row["rel_to_tt"] = row["perplexity"] / math.exp(nll[ref].sum() / tokens.sum()) - 1.0
            row["rel_to_tt_ci"] = _interval(boot_ppl[i] / boot_ppl[ref] - 1.0)
            row["agreement_with_tt"] = float(agree[i].sum() / tokens.sum())
            row["agreement_with_tt_ci"] = _interval(agree[i][picks].sum(axis=1) / boot_tokens)
        table[name] = row
    return {"systems": table, "turns": len(keys), "chats": len(s["chats"]), "answer_tokens": int(tokens.sum()),
            "resamples": resamples, "level": LEVEL}


def reuse_figures(records: Sequence[dict], system: str) -> dict:
    """Step-A counts of ``system`` over its measured turns: shares of the cut prompt that were
    shifted (``shifted_share``), cached, and turns whose cut shifted anything."""
    rows = [r for r in records if r["system"] == system and r["measured"]]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {"turns": len(rows), "cut_turns": sum(r["truncated_tokens"] > 0 for r in rows),
            "turns_with_shift": sum(r["shifted_tokens"] > 0 for r in rows),
            "shifted_tokens": sum(r["shifted_tokens"] for r in rows), "prompt_tokens": prompt,
            "shifted_share": sum(r["shifted_tokens"] for r in rows) / prompt if prompt else math.nan,
            "cached_share": sum(r["cached_tokens"] for r in rows) / prompt if prompt else math.nan,
            "dropped_tokens": sum(r["truncated_tokens"] for r in rows)}


def format_table(result: dict) -> str:
    """The Markdown table of ``quality_table`` (and the CA reuse line when present)."""
    lines = ["| system | perplexity [95% CI] | vs TT [95% CI] | greedy agreement with TT [95% CI] |",
             "|---|---|---|---|"]
    for name, row in result["systems"].items():
        lo, hi = row["perplexity_ci"]
        rel = (f"{row['rel_to_tt']:+.2%} [{row['rel_to_tt_ci'][0]:+.2%}, {row['rel_to_tt_ci'][1]:+.2%}]"
               if "rel_to_tt" in row else "-")
        agr = (f"{row['agreement_with_tt']:.1%} [{row['agreement_with_tt_ci'][0]:.1%}, "
               f"{row['agreement_with_tt_ci'][1]:.1%}]" if "agreement_with_tt" in row else "-")
        lines.append(f"| {name} | {row['perplexity']:.2f} [{lo:.2f}, {hi:.2f}] | {rel} | {agr} |")
    return "\n".join(lines)


def plot_quality(result: dict, path) -> None:
    """Left: perplexity per system with its 95% interval; right: the paired difference to TT over
    all measured turns, the first cut of each chat and the later turns (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["systems"])
    rows = result["systems"]
    ppl = [rows[n]["perplexity"] for n in names]
    err = np.array([[p - rows[n]["perplexity_ci"][0], rows[n]["perplexity_ci"][1] - p] for n, p in zip(names, ppl)]).T
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, ppl, yerr=err, capsize=6, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(names)])
    for x, p in enumerate(ppl):
        left.text(x, p, f"{p:.1f}", ha="center", va="bottom")
    left.set_ylabel("answer perplexity (teacher forcing)")
    left.set_title(f"{result['turns']} turns of {result['chats']} ShareGPT chats, {result['answer_tokens']} tokens",
                   fontsize=9)
    parts = [("all", result)] + [(p, result[p]) for p in ("first_cut", "later") if p in result]
    others = [n for n in names if n != REFERENCE]
    width = 0.8 / max(1, len(parts))
    for k, (label, part) in enumerate(parts):
        rel = [part["systems"][n]["rel_to_tt"] * 100 for n in others]
        bounds = [[b * 100 for b in part["systems"][n]["rel_to_tt_ci"]] for n in others]
        ci = np.array([[r - lo, hi - r] for r, (lo, hi) in zip(rel, bounds)]).T
        right.bar(np.arange(len(others)) + k * width, rel, width, yerr=ci, capsize=4,
                  label=f"{label} ({part['turns']} turns)")
    right.axhline(0, color="k", lw=0.8)
    right.set_xticks(np.arange(len(others)) + width * (len(parts) - 1) / 2, others)
    right.set_ylabel("perplexity vs TT, % (paired, 95% CI)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
