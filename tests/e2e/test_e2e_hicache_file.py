"""Stock SGLang HiCache with its `file` L3 on CPU: a history evicted from HBM and host DRAM comes back from L3.

The baseline hiradix is compared with (``bench.ab``'s ``hicache`` system) keeps its L3 in
SGLang's ``file`` storage backend. On a CPU-only torch its prefetch used to fail every time
(``get_dummy_flat_data_page`` asked for pinned memory: "HiCache prefetch transfer failed"), so
HiCache recomputed what it had written to L3; ``patches/p11_hicache_file_prefetch_cpu.py``
fixes that. One stock HiCache server (models/tiny; HBM 1,024 tokens, host pool 2x that, pages
of 16, ``write_through``, ``wait_complete`` prefetch so that admission waits for the read):

| step                                            | expected                                         |
|-------------------------------------------------|--------------------------------------------------|
| prompt P (30 pages), until L3 holds its pages   | answer A                                         |
| 8 other prompts of 30 pages                     | P leaves HBM and the host pool                   |
| P again                                         | ``storage`` hits cover P's written pages; answer A |
"""

from __future__ import annotations

import json
import random

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env
from tests.helpers.e2e import generate_with_logprobs, wait_backed_up

pytestmark = pytest.mark.e2e

PAGE_TOKENS = 16
PROMPT_PAGES = 30
OTHERS = 8  # 8 x 480 tokens push P out of HBM (1,024) and the host pool (2,048)
NEW_TOKENS = 8


def test_a_history_evicted_from_hbm_and_host_comes_back_from_the_file_l3(tiny_model, tmp_path):
    files = tmp_path / "l3"
    args = cpu_args(1024) + [
        "--page-size", str(PAGE_TOKENS), "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--hicache-write-policy", "write_through", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(files)}),
    ]  # fmt: skip
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 4000) for _ in range(PROMPT_PAGES * PAGE_TOKENS)] for _ in range(1 + OTHERS)]
    with ServerProcess(tiny_model, extra_args=args, env=cpu_env(), log_path=tmp_path / "hicache.log") as server:
        first = generate_with_logprobs(server.base_url, prompts[0], NEW_TOKENS)
        assert first["cached"] == 0
        # L3 holds P's full pages before anything pushes P out (the backup is asynchronous).
        wait_backed_up(server, PROMPT_PAGES * PAGE_TOKENS)
        for other in prompts[1:]:
            generate_with_logprobs(server.base_url, other, NEW_TOKENS)
        again = generate_with_logprobs(server.base_url, prompts[0], NEW_TOKENS)
        details = again["details"]
        log = server.log_text()
    assert again["ids"] == first["ids"]  # the KV read back from L3 gives stock's greedy tokens
    assert int(details.get("device", 0)) == 0 and int(details.get("host", 0)) == 0, details  # P had left both
    assert int(details.get("storage", 0)) >= (PROMPT_PAGES - 1) * PAGE_TOKENS, details
    assert "HiCache prefetch transfer failed" not in log and "pin_memory=True requires" not in log
    assert len(list(files.iterdir())) >= (1 + OTHERS) * (PROMPT_PAGES - 1)  # one file per page written
