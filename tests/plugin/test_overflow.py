"""The server's context-overflow glue without a server (hiradix.sglang_plugin.overflow): which cut a
prompt gets, over a real tree."""

from __future__ import annotations

from types import SimpleNamespace

from hiradix.core.tree import TieredRadixTree
from hiradix.sglang_plugin.overflow import MIN_MOVED_TOKENS, ContextOverflow
from tests.helpers.core import FakeClock, SlotPool

PS = 16


def overflow_over(tree: TieredRadixTree) -> ContextOverflow:
    cache = SimpleNamespace(tree=tree, page_size=PS)
    return ContextOverflow(cache, kv_pool=None, mode="shift", rope=None, keep_tokens=32, drop_ratio=0.5)


def insert(tree: TieredRadixTree, pool: SlotPool, tokens: list[int]) -> None:
    slots = pool.alloc(len(tokens))
    dup, _, _ = tree.insert(tokens, slots)
    pool.release(slots[:dup])


def test_an_earlier_cut_is_kept_only_if_its_branch_goes_on():
    """A repeated page is not an earlier cut (found by the quality benchmark: a ShareGPT chat repeats
    a page 128 and 560 tokens after the head; step A cut 560, step B then 'reused' a cut at 128)."""
    tree, pool = TieredRadixTree(PS, clock=FakeClock()), SlotPool(8192)
    head = list(range(1, 33))  # 2 pages
    repeated = list(range(500, 516))
    body = list(range(1000, 1128)) + repeated + list(range(2000, 2416)) + repeated + list(range(3000, 3200))
    tokens = head + body  # the repeated page sits at keep + 128 and keep + 560
    insert(tree, pool, tokens)
    overflow = overflow_over(tree)
    # the first cut (drop 560) made a branch head + tokens[32 + 560:], as a served turn would
    insert(tree, pool, head + tokens[32 + 560 :])
    longer = tokens + list(range(4000, 4040))
    cut = overflow._earlier_cut(longer, 32, None, reserve=8, context=len(longer) - 120)  # 128 and 560 both fit
    assert cut is not None and cut.drop_tokens == 560  # not 128: that branch is one repeated page
    # with only the repeated page at 128 continuing the head, nothing qualifies
    tree2, pool2 = TieredRadixTree(PS, clock=FakeClock()), SlotPool(8192)
    insert(tree2, pool2, tokens)
    insert(tree2, pool2, head + repeated + list(range(9000, 9016)))
    assert overflow_over(tree2)._earlier_cut(longer, 32, None, reserve=8, context=len(longer) - 100) is None
    assert MIN_MOVED_TOKENS >= 2 * PS
    tree.check_integrity()


# ------------------------------------------------------------ the default head (issue 30)
CONTEXT, NEW = 320, 8
SYSTEM = list(range(1, 49))  # 3 pages


def request(tokens: list[int], rid: str) -> SimpleNamespace:
    return SimpleNamespace(origin_input_ids=list(tokens), sampling_params=SimpleNamespace(max_new_tokens=NEW),
                           extra_key=None, cache_salt=None, rid=rid, multimodal_inputs=None, input_embeds=None,
                           hiradix_cut=None)


def chats(overflow: ContextOverflow, pool: SlotPool, first_words: list[int], turns: int) -> list[tuple]:
    """Chats after SYSTEM, turn t of each before turn t+1, served as the server serves them: each
    prompt goes through ``cut``, then its (cut) prompt and answer are cached; the next turn holds
    the answer re-tokenized (its first token comes out as two). Returns ``(uncut prompt, cut)``
    of every cut request."""
    histories = {w: list(SYSTEM) for w in first_words}
    cuts = []
    for t in range(turns):
        for w in first_words:
            prompt = histories[w] + [w + 100 * t + i for i in range(37)]
            req = request(prompt, rid=f"{w}-{t}")
            cut = overflow.cut(req, context_tokens=CONTEXT, max_prompt_tokens=CONTEXT - 1)
            if cut is not None:
                assert list(req.origin_input_ids) == cut.apply(prompt)
                cuts.append((prompt, cut))
            answer = [w + 100 * t + 50 + i for i in range(11)]
            insert(overflow.cache.tree, pool, list(req.origin_input_ids) + answer)
            histories[w] = prompt + [answer[0] + 3000, answer[0] + 4000] + answer[1:]
    overflow.cache.tree.check_integrity()
    return cuts


def test_chats_sharing_a_system_prompt_keep_exactly_it_and_drop_their_oldest_turns(caplog):
    tree, pool = TieredRadixTree(PS, clock=FakeClock()), SlotPool(1 << 15)
    overflow = ContextOverflow(SimpleNamespace(tree=tree, page_size=PS), None, "recompute", None, -1, 0.5)
    with caplog.at_level("INFO", logger="hiradix.sglang_plugin.overflow"):
        cuts = chats(overflow, pool, [1000, 2000, 3000], turns=9)
    assert len(cuts) >= 9 and len({p[: len(SYSTEM) + 37][-1] for p, _ in cuts}) == 3  # every chat was cut
    for prompt, cut in cuts:
        assert cut.keep_tokens == len(SYSTEM) and cut.drop_tokens > 0  # the head is the system prompt
        assert len(prompt) - cut.drop_tokens + NEW <= CONTEXT
    lines = [r.getMessage() for r in caplog.records if "context overflow" in r.getMessage()]
    assert len(lines) == 1 and "keeps 48 + " in lines[0] and "shared with other conversations" in lines[0], lines


def test_a_chat_that_shares_nothing_keeps_its_first_page_and_says_so(caplog):
    tree, pool = TieredRadixTree(PS, clock=FakeClock()), SlotPool(1 << 15)
    overflow = ContextOverflow(SimpleNamespace(tree=tree, page_size=PS), None, "recompute", None, -1, 0.5)
    with caplog.at_level("INFO", logger="hiradix.sglang_plugin.overflow"):
        cuts = chats(overflow, pool, [1000], turns=12)
    assert len(cuts) >= 3 and all(cut.keep_tokens == PS for _, cut in cuts), [c for _, c in cuts]
    lines = [r.getMessage() for r in caplog.records if "context overflow" in r.getMessage()]
    assert len(lines) == 1 and "keeps 16 + " in lines[0] and "its first page, as llama.cpp's n_keep" in lines[0], lines
    assert len(overflow.prompt_ends) == 12  # every prompt, cut or not
    fixed = ContextOverflow(SimpleNamespace(tree=tree, page_size=PS), None, "recompute", None, 40, 0.5)
    assert fixed.prompt_ends is None and fixed.head(cuts[-1][0], None).tokens == 32  # the flag, in whole pages
