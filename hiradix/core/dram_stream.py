"""Histories larger than DRAM, streamed through it into HBM at admission (pure bookkeeping).

A read from NVMe or the cluster store lands whole in DRAM before its promotion to HBM. A request
whose matched part below DRAM is larger than DRAM would wait its whole load timeout for a read
that can never start, then recompute everything, also what DRAM could have held (measured: three
requests of 655-714 tokens over a 512-token DRAM, 0 cached, 2.9 s TTFT). Instead, at each
admission attempt:

* :meth:`DramStream.readable`: only the leading nodes that fit in DRAM beside the request's
  other DRAM-bound parts are read (in order: a prefix is useful only from its first page);
* :meth:`DramStream.promote_first`: while part of the match is still unread and the part right
  after HBM has landed in DRAM, that part is promoted to HBM now (not at admission), which makes
  its DRAM copies redundant; the next read makes room by dropping them.

The request keeps waiting (``ReadWaits.unread_pending`` for what no read covers yet, bounded by its
whole-wait deadline ``ReadWaits.request_pending``), so it is admitted once every part is in HBM
or DRAM, or with what is ready when its load timeout ends. A single node larger than DRAM is not
split: it is recomputed, as before.
"""

from __future__ import annotations

from hiradix.core.node import Tier, TreeMatch, TreeNode


class DramStream:
    """Decides how much of a match below DRAM is read now, and when DRAM is emptied into HBM.

    Args:
        page_size: tokens per page.
        dram_pages: DRAM's capacity in pages.
    """

    def __init__(self, page_size: int, dram_pages: int):
        self.page_size = page_size
        self.dram_pages = dram_pages

    def readable(self, m: TreeMatch, tier: Tier) -> list[TreeNode]:
        """The leading nodes of ``m``'s part in ``tier`` (NVMe or the store) that DRAM can hold
        beside the request's other DRAM-bound parts (its DRAM part, and its NVMe part when
        ``tier`` is the store): the whole part when it fits."""
        ps = self.page_size
        room = self.dram_pages - (m.dram_len + (m.nvme_len if tier == Tier.STORE else 0)) // ps
        out, pages = [], 0
        for node in m.stage(tier):
            pages += node.num_tokens // ps
            if pages > room:
                break
            out.append(node)
        return out

    def to_hold(self, m: TreeMatch) -> list[TreeNode]:
        """The request's DRAM copies that reads for it must not drop to make room: those within the
        first DRAM's worth of pages of its part below HBM (what can be read and promoted next), and
        every one NVMe does not also hold. A copy further down that NVMe holds may go: it is read
        again when its turn in the stream comes, and holding it could leave no room for the part
        before it (a history whose first node is on NVMe only and whose later nodes fill DRAM
        waited its whole timeout, then recomputed everything)."""
        out, pages = [], 0
        for node in m.nodes:
            if node.in_tier(Tier.HBM):
                continue
            pages += node.num_tokens // self.page_size
            if node.in_tier(Tier.DRAM) and (pages <= self.dram_pages or not node.in_tier(Tier.NVME)):
                out.append(node)
        return out

    def promote_first(self, m: TreeMatch) -> bool:
        """Whether to promote ``m``'s DRAM part to HBM before admission: some node below DRAM is
        not in DRAM and no read covers it (DRAM had no room for it)."""
        if not m.dram_len or not (m.nvme_len or m.store_len):
            return False
        lower = m.stage(Tier.NVME) + m.stage(Tier.STORE)
        return any(n.alive and not n.in_tier(Tier.DRAM) and not n.ops for n in lower)
