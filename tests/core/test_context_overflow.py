"""The cut of an overflowing prompt (hiradix.core.context_overflow)."""

from __future__ import annotations

import pytest

from hiradix.core.context_overflow import PromptTooLong, Truncation, plan_truncation


def test_a_prompt_that_fits_is_not_cut():
    assert plan_truncation(900, 100, 1024, keep_tokens=32, drop_ratio=0.5, page_size=16) is None
    assert plan_truncation(924, 100, 1024, keep_tokens=32, drop_ratio=0.5, page_size=16) is None  # exactly full


def test_half_of_the_rest_goes_in_whole_pages_after_the_kept_head():
    cut = plan_truncation(1000, 100, 1024, keep_tokens=40, drop_ratio=0.5, page_size=16)
    # head 40 -> 32 (whole pages); rest 968, half 484 -> 496 (whole pages)
    assert cut == Truncation(keep_tokens=32, drop_tokens=496, prompt_tokens=1000)
    assert cut.tail_start == 528 and cut.shift == -496 and cut.kept_tokens == 504
    tokens = list(range(1000))
    assert cut.apply(tokens) == tokens[:32] + tokens[528:]
    with pytest.raises(ValueError):
        cut.apply(tokens[:-1])


def test_at_least_the_overflow_is_dropped():
    cut = plan_truncation(1000, 500, 1024, keep_tokens=0, drop_ratio=0.1, page_size=16)
    assert cut.drop_tokens == 480 and cut.kept_tokens + 500 <= 1024  # overflow 476 -> 480


def test_the_head_is_given_up_before_the_prompt_is_refused():
    cut = plan_truncation(1000, 1000, 1024, keep_tokens=512, drop_ratio=0.5, page_size=16)
    assert cut.keep_tokens == 0 and cut.kept_tokens + 1000 <= 1024 and cut.drop_tokens % 16 == 0
    with pytest.raises(PromptTooLong, match="1024"):
        plan_truncation(1000, 1024, 1024, keep_tokens=0, drop_ratio=0.5, page_size=16)


@pytest.mark.parametrize("prompt, new, keep, ratio", [(n, m, k, r) for n in (17, 1025, 3000, 8191)
                                                       for m in (1, 64, 512) for k in (0, 16, 100)
                                                       for r in (0.25, 0.5, 1.0)])
def test_every_cut_fits_in_whole_pages(prompt, new, keep, ratio):
    try:
        cut = plan_truncation(prompt, new, 1024, keep_tokens=keep, drop_ratio=ratio, page_size=16)
    except PromptTooLong:
        assert new >= 1024 - 15 or prompt <= 16
        return
    if cut is None:
        assert prompt + new <= 1024
        return
    assert cut.kept_tokens + new <= 1024 and cut.kept_tokens > 0
    assert cut.keep_tokens % 16 == 0 and cut.drop_tokens % 16 == 0 and cut.keep_tokens <= keep


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="drop_ratio"):
        plan_truncation(2000, 1, 1024, keep_tokens=0, drop_ratio=0.0, page_size=16)
    with pytest.raises(ValueError):
        plan_truncation(2000, 1, 1024, keep_tokens=0, drop_ratio=0.5, page_size=0)
