"""bench.overflow's arithmetic, without servers: perplexity, agreement and paired TTFT ratios."""

from __future__ import annotations

import math

import pytest

from bench.overflow.chats import Chat, Turn, keep_tokens_for
from bench.overflow.quality_report import quality_table, reuse_figures
from bench.overflow.servers import ServerPlan, base_name, cut_threshold_tokens, server_flags
from bench.overflow.ttft import summarize


def record(system: str, chat: str, turn: int, nll: list[float], top1: list[int], ok: bool = True, **counts) -> dict:
    return {"system": system, "chat": chat, "turn": turn, "measured": True, "ok": ok, "nll": nll, "top1": top1,
            "prompt_tokens": counts.get("prompt", 100), "truncated_tokens": counts.get("dropped", 32),
            "shifted_tokens": counts.get("shifted", 0), "cached_tokens": counts.get("cached", 0)}


def test_perplexity_is_exp_of_the_mean_nll_over_common_turns():
    records = [
        record("TT", "a", 3, [1.0, 3.0], [5, 6]), record("CA", "a", 3, [2.0, 2.5], [5, 7]),
        record("TT", "b", 2, [2.0], [9]), record("CA", "b", 2, [2.0], [9]),
        record("TT", "b", 3, [9.0], [1]), record("CA", "b", 3, [9.0], [1], ok=False),  # flagged on CA: left out
    ]
    result = quality_table(records, ("TT", "CA"), resamples=200)
    assert result["turns"] == 2 and result["answer_tokens"] == 3
    tt, ca = result["systems"]["TT"], result["systems"]["CA"]
    assert tt["perplexity"] == pytest.approx(math.exp(6.0 / 3))
    assert ca["perplexity"] == pytest.approx(math.exp(6.5 / 3))
    assert ca["rel_to_tt"] == pytest.approx(math.exp(0.5 / 3) - 1)
    assert ca["agreement_with_tt"] == pytest.approx(2 / 3) and tt["agreement_with_tt"] == 1.0
    lo, hi = ca["perplexity_ci"]
    assert math.exp(2.0) <= lo <= ca["perplexity"] <= hi <= math.exp(2.25) + 1e-9  # per-chat means 2.25 and 2.0


def test_reuse_share_counts_the_shifted_tokens_of_cut_prompts():
    records = [record("CA", "a", 3, [1.0], [1], shifted=60, cached=80), record("CA", "a", 4, [1.0], [1], cached=90)]
    figures = reuse_figures(records, "CA")
    assert figures["shifted_share"] == pytest.approx(60 / 200) and figures["turns_with_shift"] == 1
    assert figures["cached_share"] == pytest.approx(170 / 200)


def test_paired_ttft_ratios_and_the_aa_control():
    records = []
    for repeat in range(2):
        for chat in ("a", "b", "c"):
            for system, ttft in (("CA", 0.1), ("TT", 0.3), ("IDEAL", 0.05), ("CA2", 0.1)):
                records.append({"system": system, "repeat": repeat, "chat": chat, "turn": 4, "measured": True,
                                "ttft_s": ttft, "prompt_tokens": 100, "cached_tokens": 50 if system != "TT" else 10,
                                "truncated_tokens": 10, "shifted_tokens": 0})
    summary = summarize(records, ("CA", "TT", "IDEAL", "CA2"))
    assert summary["ratios"]["CA/TT"]["median"] == pytest.approx(1 / 3)
    assert summary["ratios"]["CA/IDEAL"]["median"] == pytest.approx(2.0)
    assert summary["ratios"]["CA2/CA"]["ci"] == pytest.approx([1.0, 1.0])
    assert summary["systems"]["TT"]["hit_share"] == pytest.approx(0.1)


def test_flags_and_keep_tokens():
    plan = ServerPlan(context_tokens=1024, uncut_context_tokens=8192, keep_tokens=48)
    assert server_flags("CA2", plan)[server_flags("CA2", plan).index("--hiradix-context-overflow") + 1] == "shift"
    assert "8192" in server_flags("FULL", plan) and "recompute" in server_flags("TT", plan)
    with pytest.raises(ValueError):
        base_name("XX")
    chats = [Chat("a", 59, (Turn((1,), (2,)),)), Chat("b", 59, ())]
    assert keep_tokens_for(chats, 16) == 48
    assert cut_threshold_tokens(1024) == 1018  # SGLang: max_req_input_len = context - 1 - 5
