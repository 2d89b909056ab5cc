"""The decode-side offload's bookkeeping (hiradix.core.decode_offload): which pages, which keys,
staging pages held while a PUT is in flight, the counts."""

from __future__ import annotations

import pytest

from hiradix.core.decode_offload import OffloadBooks, offload_span, page_keys
from hiradix.core.keys import ROOT_HASH, chain

PS = 16


@pytest.mark.parametrize("prompt, kv, expected", [
    (164, 175, (10, 0)),   # the answer's KV stops inside the prompt's last page: nothing
    (164, 176, (10, 1)),   # page 10 (prompt tail + answer start) is the decode side's
    (160, 199, (10, 2)),   # a prompt of whole pages: the prefill side shared them all
    (0, 40, (0, 2)),
    (30, 20, (1, 0)),      # fewer KV tokens than the prompt (never negative)
])  # fmt: skip
def test_offload_span_skips_the_prompts_whole_pages(prompt, kv, expected):
    assert offload_span(prompt, kv, PS) == expected


def test_page_keys_are_the_chain_the_prefill_tree_computes_node_by_node():
    tokens = list(range(1000, 1000 + 5 * PS + 3))
    ns = ("lora", "salt")
    # the prefill tree hashes a node's pages after its parent's last page hash (keys.prefix_hash)
    parent = chain(ROOT_HASH, ns, tokens[: 2 * PS], PS)[-1]
    tail = chain(parent, ns, tokens[2 * PS :], PS)
    assert page_keys("p/", tokens, ns, PS, first_page=2) == ["p/" + h.hex() for h in tail]
    assert len(tail) == 3  # whole pages only
    assert page_keys("p/", tokens, None, PS, 2) != page_keys("p/", tokens, ns, PS, 2)  # salts never share


def test_books_hold_staging_until_the_put_ends_and_count_outcomes():
    books = OffloadBooks(staging_pages=3, page_size=PS)
    job, staging = books.reserve(2)                      # 2 of 3 pages held
    assert books.reserve(2) is None                      # full: dropped, counted
    assert books.tokens["staging_full"] == 2 * PS
    books.check_integrity()
    books.finish(job, [True, False])                     # one page stored, one failed
    assert books.tokens == {"stored": PS, "staging_full": 2 * PS, "failed": PS}
    assert books.allocator.num_free == 3
    job2, _ = books.reserve(3)
    books.cancel(job2)                                   # the copy failed: all 3 failed
    assert books.tokens["failed"] == 4 * PS and books.allocator.num_free == 3
    assert books.finish(job2, [True]) is None            # unknown (already ended): ignored
    books.check_integrity()
