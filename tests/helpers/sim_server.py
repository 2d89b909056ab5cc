"""A simulated server for the core tests: the real prefix cache, controller, placement and ledger
over the data-less ports (:mod:`hiradix.testing.sim_ports`) on a virtual clock, so every
transfer's timing is exact. After every step the invariants hold (books + HBM balance)."""

from __future__ import annotations

from hiradix.core.node import Tier
from hiradix.core.policy import LRUPolicy
from hiradix.core.ports import READ_AT_ADMISSION
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimClock, SimDevicePool, simulated_controller
from tests.helpers.core import serve_request

PS = 2  # tokens per page
TIMEOUT_S = 2.0


class SimServer:
    """One simulated server (HBM 64 tokens unless given)."""

    def __init__(self, policy=None, dram_pages: int = 8, nvme_slots: int = 32, hbm_tokens: int = 64,
                 write_s: float = 1.0, read_s: float = 0.5, dram_free_low_pages: int = 0, store=None):
        self.clock = SimClock()
        self.tree = TieredRadixTree(PS, policy or LRUPolicy(), clock=self.clock)
        self.tiers = simulated_controller(self.tree, dram_pages, nvme_slots, page_bytes=64, write_through=True,
                                          clock=self.clock, read_s_per_page=read_s, write_s_per_page=write_s,
                                          store=store, store_read_s_per_page=read_s)
        self.tiers.placement.dram_free_low_pages = dram_free_low_pages
        self.device = SimDevicePool(hbm_tokens, PS)
        self.cache = TieredPrefixCache(self.tree, self.device, self.tiers, load_timeout_s=TIMEOUT_S)
        self.io = self.tiers.client
        self.submitted: list[tuple[int, int]] = []  # (op id, priority) of every NVMe read
        real = self.io.submit_load

        def spy(job_id, slots, pages, priority=READ_AT_ADMISSION):
            self.submitted.append((job_id, priority))
            real(job_id, slots, pages, priority=priority)

        self.io.submit_load = spy

    def check(self) -> None:
        self.cache.check_integrity(0, used_tokens=self.device.num_used_tokens())

    def at(self, t_s: float) -> None:
        """Advance the clock to ``t_s`` and run a scheduler step."""
        self.clock.advance_to(t_s)
        self.cache.step()
        self.check()

    def serve(self, tokens: list[int]):
        """A request: its HBM hit, its DRAM part loaded back, the rest computed; inserted, finished."""
        last = serve_request(self.cache, tokens)
        self.check()
        return last

    def compute(self, tokens: list[int]):
        """A request that recomputes all of ``tokens`` (no match, no reads) and inserts them."""
        m = self.tree.match(tokens, split=True, touch=False)
        self.cache.lock(m.hbm_node)
        new = self.cache.alloc_device(len(tokens) - m.hbm_len)
        _, last = self.cache.checkpoint(tokens, None, self.cache.path_slots(m.hbm_node) + new, m.hbm_len)
        self.cache.unlock(m.hbm_node)
        self.check()
        return last

    def drop_hbm(self) -> None:
        """Evict everything evictable from HBM (what is not in DRAM is lost)."""
        self.cache.evict(self.tree.hbm_evictable_tokens)
        self.check()

    def history_on_nvme(self, tag: int, turns: list[int], t: float) -> tuple[list[int], float]:
        """A conversation of ``turns`` (pages per turn, one node each) computed from ``t`` on, turn
        by turn (each stored to NVMe through DRAM, 30 s apart) and left on NVMe only. Returns its
        tokens and the time reached."""
        history: list[int] = []
        for k, n in enumerate(turns):
            history = history + [tag * 10000 + k * 100 + i for i in range(n * PS)]
            self.clock.advance_to(t)
            self.compute(list(history))
            self.at(t)  # the write-through backup lands in DRAM
            self.drop_hbm()  # the DRAM copy is the last one: stored to NVMe
            self.at(t + 20.0)
            self.tiers.placement.make_room(Tier.DRAM, self.tiers.books.dram.capacity)  # NVMe only now
            t += 30.0
        return history, t


def keys(tag: int, pages: int = 2) -> list[int]:
    return [tag * 100 + i for i in range(pages * PS)]
