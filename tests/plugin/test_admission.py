"""The largest admissible prompt (issue 14), against SGLang's own clip and a closed form.

SGLang 0.5.23 admits a prompt of P tokens into an empty pool of C tokens in pages of p when
``P + new(P) + p < C`` (``PrefillAdder.add_one_req`` / ``PrefillBudget.check_prefill``), with
``new`` clipped by ``BaseTokenToKVPoolAllocator.max_new_tokens_for_memory`` (used here as SGLang
ships it), and the answer must have room for at least one token. Worked out by hand: for
p >= 2 the limit is ``C - 2p`` (the page-rounded prompt, one page of rounding reserve and one page
to decode into; one token more rounds up to a page that leaves SGLang no decode token); for
p = 1 it is SGLang's own ``max_req_input_len - 1``; never above the latter.
"""

from __future__ import annotations

import types

import pytest

from hiradix.sglang_plugin import admission
from hiradix.sglang_plugin.admission import max_admissible_prompt_tokens


def sglang_clip(page_size: int, capacity: int):
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    fake = types.SimpleNamespace(page_size=page_size)

    def clip(prompt: int, new_tokens: int) -> int:
        return BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
            fake, prompt, new_tokens, token_capacity=capacity, sliding_window_size=None, chunk_size=None)

    return clip


def sglang_limits(capacity: int, context_len: int = 8192) -> tuple[int, int]:
    """``(max_req_len, max_req_input_len)`` as ``TpModelWorker.get_worker_info`` computes them."""
    max_req_len = min(context_len - 1, capacity - 1)
    return max_req_len, max_req_len - 5


@pytest.mark.parametrize("capacity", [512, 1024, 4096])
@pytest.mark.parametrize("page_size", [1, 2, 8, 16, 32, 64])
def test_limit_matches_the_closed_form(capacity, page_size):
    max_req_len, sglang_limit = sglang_limits(capacity)
    got = max_admissible_prompt_tokens(capacity, page_size, max_req_len, sglang_limit, sglang_clip(page_size, capacity))
    expected = sglang_limit - 1 if page_size == 1 else min(sglang_limit - 1, capacity - 2 * page_size)
    assert got == expected


def test_issue_example_pool_512_page_16():
    max_req_len, sglang_limit = sglang_limits(512)
    assert (max_req_len, sglang_limit) == (511, 506)  # the issue's "506-token limit"
    limit = max_admissible_prompt_tokens(512, 16, max_req_len, sglang_limit, sglang_clip(16, 512))
    assert limit == 480
    clip = sglang_clip(16, 512)
    # 505 tokens (the issue's prompt): 512 rounded, no decode token left, 505 + 0 + 16 >= 512: never admitted.
    assert 505 + clip(505, max_req_len - 505 - 1) + 16 >= 512
    # 495: 496 rounded, admitted (495 + 0 + 16 < 512) but SGLang leaves it no token to generate.
    assert clip(495, max_req_len - 495 - 1) == 0
    # 480: 480 rounded, 15 tokens to generate, 480 + 15 + 16 < 512.
    assert clip(480, max_req_len - 480 - 1) == 15


def test_context_length_below_the_pool_keeps_sglangs_limit():
    max_req_len, sglang_limit = sglang_limits(4096, context_len=1024)
    assert max_admissible_prompt_tokens(4096, 16, max_req_len, sglang_limit, sglang_clip(16, 4096)) == sglang_limit - 1


def test_hook_lowers_max_req_input_len_only(monkeypatch):
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_schedule", lambda: types.SimpleNamespace(chunked_prefill_size=8192))
    allocator = types.SimpleNamespace(page_size=16, available_size=lambda: 512)
    allocator.max_new_tokens_for_memory = lambda p, n, **kw: sglang_clip(16, 512)(p, n)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(token_to_kv_pool_allocator=allocator))
    info = (512, 16384, 8, 100, 511, 506, 0, "cpu", None, 9, 4096, 512)
    out = admission.after_get_worker_info(info, worker)
    assert out[admission.WORKER_INFO_MAX_INPUT_INDEX] == 481  # prompts of >= 481 tokens are refused
    assert out[:5] == info[:5] and out[6:] == info[6:]
    with pytest.raises(RuntimeError, match="12 fields"):
        admission.after_get_worker_info(info[:-1], worker)
