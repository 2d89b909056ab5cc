"""The largest prompt a paged KV pool can ever admit, and SGLang's own refusal of longer ones.

SGLang 0.5.23 refuses a prompt up front (HTTP 400, ``managers/utils.py:validate_input_length``)
only when it has at least ``max_req_input_len`` tokens (``tp_worker.py:get_worker_info``: pool
or context length minus 6). Its prefill admission (``schedule_policy.py:PrefillAdder.add_one_req``
and ``mem_cache/prefill_budget.py:PrefillBudget.check_prefill``) asks for more: a request is
admitted only while

    extend_tokens + reserved_decode_tokens + page_size < available + evictable tokens

where ``reserved_decode_tokens`` is the request's ``max_new_tokens`` after SGLang clipped it to
the pool (``allocator.max_new_tokens_for_memory``: pool minus the page-rounded prompt minus one
page, at least 0) and ``page_size`` is the per-request page-rounding reserve. With pages of 16
tokens a prompt just under SGLang's limit never satisfies this even on an empty pool, so it is
neither admitted nor refused: it stays at the head of the queue and blocks every request behind
it (issue 14). Stock SGLang does the same at ``--page-size 16``; at page size 1 the two limits
agree.

:func:`max_admissible_prompt_tokens` computes the largest prompt that an empty pool admits with
room for at least one generated token, and
:func:`after_get_worker_info` (AFTER ``TpModelWorker.get_worker_info``, scheduler processes with
hiradix only) lowers SGLang's ``max_req_input_len`` to one above it, so SGLang's own length
check refuses longer prompts with its usual HTTP 400 message.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

# SGLang's default max_new_tokens when a request gives none (scheduler.init_req_max_new_tokens).
UNBOUNDED_NEW_TOKENS = 1 << 30
# Position of max_req_input_len in the tuple TpModelWorker.get_worker_info returns (0.5.23).
WORKER_INFO_MAX_INPUT_INDEX = 5
WORKER_INFO_LEN = 12


def max_admissible_prompt_tokens(
    empty_pool_tokens: int,
    page_size: int,
    max_req_len: int,
    max_req_input_len: int,
    clip_new_tokens: Callable[[int, int], int],
) -> int:
    """Largest prompt, in tokens, that SGLang's prefill admission takes from an empty pool and
    still lets generate at least one token.

    A prompt of ``P`` tokens with no cached prefix is admitted when ``P + new(P) + page_size <
    empty_pool_tokens``, with ``new(P) = clip_new_tokens(P, min(UNBOUNDED, max_req_len - P - 1))``
    (SGLang's ``init_req_max_new_tokens``); a request asking for fewer new tokens reserves
    fewer, so this is the worst case. SGLang clips ``new(P)`` to 0 when the page-rounded prompt
    leaves no page for decoding: such a prompt may be admitted but answers with no token, so it
    does not count (with pages of 16 and a 512-token pool: 495 tokens would get an empty answer,
    480 get up to 15 tokens). A cached prefix shortens the extend but is locked out of the
    evictable budget, so the same bound holds with hits.

    Args:
        empty_pool_tokens: device KV slots available when nothing is cached (tokens).
        page_size: tokens per page; also SGLang's per-request page-rounding reserve.
        max_req_len: SGLang's longest request, prompt + output (tokens).
        max_req_input_len: SGLang's own limit: prompts of this many tokens or more are refused.
        clip_new_tokens: ``(prompt_tokens, max_new_tokens) -> max_new_tokens`` after SGLang's
            clip to the pool (``allocator.max_new_tokens_for_memory``).

    Returns:
        The largest admissible prompt length (< ``max_req_input_len``), or 0 if none is.
    """
    for prompt in range(max_req_input_len - 1, 0, -1):
        new_tokens = clip_new_tokens(prompt, max(0, min(UNBOUNDED_NEW_TOKENS, max_req_len - prompt - 1)))
        if new_tokens >= 1 and prompt + new_tokens + page_size < empty_pool_tokens:
            return prompt
    return 0


def _clip_of(allocator: Any, token_capacity: int, chunk_size: Any) -> Callable[[int, int], int]:
    def clip(prompt: int, new_tokens: int) -> int:
        out = allocator.max_new_tokens_for_memory(
            prompt, new_tokens, token_capacity=token_capacity, sliding_window_size=None, chunk_size=chunk_size
        )
        return 0 if out is None else out

    return clip


def after_get_worker_info(result: tuple, worker: Any, *args: Any, **kwargs: Any) -> tuple:
    """AFTER ``TpModelWorker.get_worker_info()``: lower ``max_req_input_len`` to what admits.

    The scheduler reads the tuple once at start; its length check then refuses, with HTTP 400,
    any prompt the pool could never admit, and ``/get_server_info`` reports the new limit.

    Raises:
        RuntimeError: the tuple is not SGLang 0.5.23's (another version).
    """
    if not isinstance(result, tuple) or len(result) != WORKER_INFO_LEN:
        raise RuntimeError(
            "hiradix: TpModelWorker.get_worker_info() did not return the 12 fields of SGLang 0.5.23; "
            "the prompt-length limit cannot be set"
        )
    allocator = worker.model_runner.token_to_kv_pool_allocator
    max_total_tokens, max_req_len, sglang_limit = result[0], result[4], result[WORKER_INFO_MAX_INPUT_INDEX]
    from sglang.srt.runtime_context import get_schedule  # noqa: PLC0415 - scheduler process only

    limit = max_admissible_prompt_tokens(
        allocator.available_size(), allocator.page_size, max_req_len, sglang_limit,
        _clip_of(allocator, max_total_tokens, get_schedule().chunked_prefill_size),
    )
    new_limit = min(sglang_limit, limit + 1)
    logger.info(
        "hiradix: prompts up to %d tokens are admitted (KV pool: %d of %d tokens free at start, pages of %d); "
        "longer ones are refused up front (max_req_input_len %d -> %d). The %d tokens below SGLang's own limit "
        "are what its prefill admission reserves at this page size (the page-rounded prompt, one page per "
        "request and one generated token): stock SGLang at the same --page-size leaves such prompts waiting at "
        "the head of the queue",
        limit, allocator.available_size(), max_total_tokens, allocator.page_size, sglang_limit, new_limit,
        sglang_limit - 1 - limit,
    )
    out = list(result)
    out[WORKER_INFO_MAX_INPUT_INDEX] = new_limit
    return tuple(out)
