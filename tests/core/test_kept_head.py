"""The head a cut keeps by default (hiradix.core.kept_head): the part shared with other
conversations, never a fork of one conversation's own history; integrity checked after every insert.

Chats are served as the server serves them: the prompt is remembered when it arrives, then the
prompt and the generated answer are inserted. The next turn's prompt holds the answer
re-tokenized (its first token splits in two), so the tree forks inside every answer.
"""

from __future__ import annotations

from typing import Optional

from hiradix.core.kept_head import KeptHead, PromptEnds, shared_head
from hiradix.core.tree import TieredRadixTree
from tests.helpers.core import FakeClock, SlotPool

PS = 4
SYSTEM = list(range(1, 9))  # 2 pages


class Server:
    """A tree and the prompt ends, as one scheduler keeps them."""

    def __init__(self):
        self.tree, self.pool, self.ends = TieredRadixTree(PS, clock=FakeClock()), SlotPool(4096), PromptEnds(PS)

    def insert(self, tokens: list[int], namespace: Optional[tuple] = None) -> None:
        slots = self.pool.alloc(len(tokens))
        dup, _, _ = self.tree.insert(tokens, slots, namespace)
        self.pool.release(slots[:dup])
        self.tree.check_integrity()

    def head(self, prompt: list[int], namespace: Optional[tuple] = None) -> KeptHead:
        return shared_head(self.tree, prompt, namespace, self.ends.first_end(prompt, namespace))

    def serve(self, prompt: list[int], answer: list[int], namespace: Optional[tuple] = None) -> KeptHead:
        """One request: its head (were it cut), then it is remembered and cached with its answer."""
        head = self.head(prompt, namespace)
        self.ends.add(prompt, namespace)
        self.insert(prompt + answer, namespace)
        return head


def retokenized(answer: list[int]) -> list[int]:
    """The answer's text tokenized again by the next turn: its first token comes out as two."""
    return [answer[0] + 5000, answer[0] + 6000] + answer[1:]


def user(chat_id: int, turn: int) -> list[int]:
    return [chat_id + 10 * turn + i for i in range(6)]


def answer(chat_id: int, turn: int) -> list[int]:
    return [chat_id + 10 * turn + 100 + i for i in range(5)]


def chat(server: Server, first_word: int, turns: int, namespace: Optional[tuple] = None) -> list[KeptHead]:
    """``turns`` turns of one chat after SYSTEM (user turns of 6 tokens, answers of 5: no turn
    ends on a page boundary); the heads its prompts would get, and its next prompt."""
    prompt, heads = list(SYSTEM), []
    for t in range(turns):
        prompt += user(first_word, t)
        heads.append(server.serve(prompt, answer(first_word, t), namespace))
        prompt += retokenized(answer(first_word, t))
    return heads + [server.head(prompt + [first_word + 999] * 6, namespace)]


def test_one_chat_alone_keeps_its_first_page_not_its_own_forks():
    server = Server()
    heads = chat(server, 1000, turns=4)
    # every answer's re-tokenization forks the path (the old rule kept up to the deepest fork)
    assert all(h == KeptHead(PS, shared=False) for h in heads), heads
    prompt = SYSTEM + [t for turn in range(4) for t in user(1000, turn) + retokenized(answer(1000, turn))]
    server.insert(prompt[:PS] + prompt[PS + 16 :])  # its own earlier cut (head 4, drop 16)
    assert server.head(prompt + [9] * 10) == KeptHead(PS, shared=False)


def test_chats_sharing_a_system_prompt_keep_exactly_it():
    server = Server()
    chat(server, 1000, turns=1)  # another conversation: the system prompt is shared
    heads = chat(server, 2000, turns=5)
    assert heads[0] == KeptHead(len(SYSTEM), shared=True)  # its first prompt: another chat left it there
    assert all(h == KeptHead(len(SYSTEM), shared=True) for h in heads), heads
    assert chat(server, 3000, turns=3) == [KeptHead(len(SYSTEM), shared=True)] * 4


def test_an_edited_turn_and_the_chats_own_cut_branch_are_not_shared():
    server = Server()
    chat(server, 1000, turns=2)  # another conversation shares the system prompt
    prompt = list(SYSTEM)
    for t in range(3):
        prompt += user(2000, t)
        server.serve(prompt, answer(2000, t))
        prompt += retokenized(answer(2000, t))
    edited = prompt[:-12] + [7777] * 6  # the client sends its last turn again, edited
    assert server.serve(edited, [8888] * 5) == KeptHead(len(SYSTEM), shared=True)
    server.insert(SYSTEM + prompt[len(SYSTEM) + 16 :])  # an earlier cut of this chat (head 8, drop 16)
    assert server.head(prompt + [9] * 10) == KeptHead(len(SYSTEM), shared=True)
    assert server.head(edited + retokenized([8888] * 5) + [9] * 10) == KeptHead(len(SYSTEM), shared=True)


def test_a_shared_branch_counts_from_the_token_where_it_leaves():
    server = Server()
    system = list(range(1, 11))  # 10 tokens: conversations part inside the third page
    server.serve(system + [50, 51, 52], [60, 61])
    assert server.head(system + [50]) == KeptHead(PS, shared=False)  # it ends inside the cached branch
    head = server.serve(system + [70, 71, 72, 73, 74], [80])  # it leaves inside the other chat's node
    assert head == KeptHead(8, shared=True)
    assert server.head(system + [50]) == KeptHead(8, shared=True)


def test_with_no_earlier_turn_known_every_branch_counts():
    """A restart forgot the prompts: the deepest branching point is kept (the rule before issue 30)."""
    server = Server()
    chat(server, 1000, turns=3)
    prompt = SYSTEM + user(1000, 0) + retokenized(answer(1000, 0)) + [9] * 8  # leaves at 20
    assert shared_head(server.tree, prompt, None, own_from=None) == KeptHead(20, shared=True)
    assert server.head(prompt) == KeptHead(PS, shared=False)


def test_other_namespaces_share_nothing():
    server = Server()
    chat(server, 1000, turns=2, namespace=("salt",))
    assert chat(server, 2000, turns=2) == [KeptHead(PS, shared=False)] * 3


def test_prompt_ends_finds_the_shortest_earlier_prompt():
    ends = PromptEnds(PS, capacity=2)
    ends.add([1, 2, 3, 4, 5, 6], None)
    ends.add([1, 2, 3, 4, 5, 6, 7, 8, 9], ("salt",))
    assert ends.first_end([1, 2, 3, 4, 5, 6, 7], None) == 6
    assert ends.first_end([1, 2, 3, 4, 5, 6], None) is None  # a proper prefix only
    assert ends.first_end([1, 2, 3, 4, 5, 7, 7], None) is None
    assert ends.first_end([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], ("salt",)) == 9
    assert ends.first_end([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None) == 6  # namespaces apart
    ends.add([1, 2, 3, 4, 5, 6], None)  # again: now the most recent
    ends.add([7, 7, 7, 7], None)  # a whole-page prompt; the oldest (salt) is forgotten
    assert len(ends) == 2
    assert ends.first_end([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], ("salt",)) is None
    assert ends.first_end([7, 7, 7, 7, 1], None) == 4
    ends.add([1, 2, 3], None)
    assert ends.first_end([1, 2, 3, 4, 5, 6, 7], None) == 3  # the shortest
