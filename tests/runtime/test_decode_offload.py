"""The decode-side offload's data movement (hiradix.runtime.decode_offload) over a CPU "device"
pool and a recording I/O client: staged bytes, keys, staging freed at the PUT's end, no raise."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hiradix.core.decode_offload import page_keys
from hiradix.dataplane.layout import KVLayout
from hiradix.io.protocol import JobDone
from hiradix.runtime.decode_offload import DecodeOffloader
from hiradix.tiers.dram import DramPool

PS, LAYERS, HEADS, DIM, ROWS = 4, 2, 2, 8, 64


class RecordingClient:
    def __init__(self, fail: bool = False):
        self.puts, self.done, self.fail = [], [], fail

    def submit_put(self, job_id, pages, keys):
        if self.fail:
            raise RuntimeError("socket gone")
        self.puts.append((job_id, list(pages), list(keys)))
        self.done.append(JobDone(job_id, [True] * len(pages)))

    def check_alive(self):
        return True

    def poll(self):
        done, self.done = self.done, []
        return done

    def close(self):
        pass


def make(num_pages: int, client) -> DecodeOffloader:
    gen = torch.Generator().manual_seed(0)
    pool = SimpleNamespace(
        k_buffer=[torch.randn(ROWS, HEADS, DIM, generator=gen) for _ in range(LAYERS)],
        v_buffer=[torch.randn(ROWS, HEADS, DIM, generator=gen) for _ in range(LAYERS)],
        head_num=HEADS, head_dim=DIM, dtype=torch.float32, layer_num=LAYERS, size=ROWS)
    layout = KVLayout.from_device_pool(pool, PS)
    return DecodeOffloader(pool, layout, DramPool.create_anonymous(layout, num_pages), client, "k/")


def test_finished_request_pages_are_staged_and_put_under_the_prefill_keys():
    client = RecordingClient()
    off = make(4, client)
    tokens = list(range(100, 113))                         # 13 tokens with KV: pages 0..2 whole
    slots = torch.randperm(ROWS)[: len(tokens)]
    assert off.offload(tokens, None, prompt_tokens=5, slots=slots) == 2  # page 0 is the prompt's
    (job, staging, keys), = client.puts
    assert keys == page_keys("k/", tokens, None, PS, 1)
    for i, page in enumerate(staging):                     # staged bytes = the device rows
        rows = slots[(1 + i) * PS : (2 + i) * PS]
        for layer in range(LAYERS):
            k, v = off.dram.tensor[page, layer]
            assert torch.equal(k, off.kv_pool.k_buffer[layer][rows])
            assert torch.equal(v, off.kv_pool.v_buffer[layer][rows])
    assert off.books.allocator.num_used == 2               # held until the PUT's end
    off.poll()
    assert off.books.allocator.num_used == 0 and off.books.tokens["stored"] == 2 * PS
    off.close()


def test_full_staging_and_a_failing_submit_drop_the_put_without_raising():
    off = make(1, RecordingClient())
    assert off.offload(list(range(12)), None, 0, torch.arange(12)) == 0   # 3 pages > 1 staging page
    assert off.books.tokens["staging_full"] == 3 * PS
    broken = make(4, RecordingClient(fail=True))
    assert broken.offload(list(range(12)), None, 0, torch.arange(12)) == 0
    assert broken.books.tokens["failed"] == 3 * PS and broken.books.allocator.num_used == 0
    off.close()
    broken.close()


class FlakyStoreClient(RecordingClient):
    """A store whose first PUT fails on every page (one master RPC that timed out: -901)."""

    def submit_put(self, job_id, pages, keys):
        first = not self.puts
        super().submit_put(job_id, pages, keys)
        if first:
            self.done[-1] = JobDone(job_id, [False] * len(pages))


def test_a_put_the_store_failed_once_is_tried_again_with_the_same_bytes_and_keys(monkeypatch):
    import hiradix.core.decode_offload as books_module

    monkeypatch.setattr(books_module, "PUT_RETRY_BACKOFF_S", 0.0)  # due at once (the clock is real)
    client = FlakyStoreClient()
    off = make(4, client)
    tokens = list(range(200, 213))
    assert off.offload(tokens, None, prompt_tokens=5, slots=torch.randperm(ROWS)[: len(tokens)]) == 2
    staged = off.dram.tensor[client.puts[0][1]].clone()
    off.poll()  # the failed PUT is reaped and tried again under a new job id
    assert len(client.puts) == 2
    (job1, pages1, keys1), (job2, pages2, keys2) = client.puts
    assert job2 != job1 and pages2 == pages1 and keys2 == keys1
    assert torch.equal(off.dram.tensor[pages2], staged)  # the staging pages were kept as they were
    off.poll()
    assert off.books.tokens == {"stored": 2 * PS, "staging_full": 0, "failed": 0}
    assert off.books.allocator.num_used == 0
    off.close()
