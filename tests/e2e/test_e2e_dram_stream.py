"""End to end: a history on NVMe larger than DRAM comes back whole, streamed through DRAM
(:mod:`hiradix.core.dram_stream`), with stock's tokens.

One hiradix server (defaults; HBM 2,048 tokens, DRAM 0.001 GB = 30 pages of the tiny model = 480
tokens, an NVMe tier). A conversation of ~900 tokens is pushed out of HBM and DRAM by four others;
its next turn then finds it on NVMe only, twice the size of DRAM. A read lands whole in DRAM
before its promotion, so before the stream that request waited its whole load timeout and
recomputed all of it; now the parts are read and promoted in turn while it waits. Compared with
the session's stock server (HBM 32,768 tokens: it never evicts), at pages of 16 tokens.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.e2e import metric, start

pytestmark = pytest.mark.e2e

DRAM_TOKENS = 480  # 0.001 GB of the tiny model's 2 KB tokens, whole pages


def generate(base_url: str, input_ids: list[int], max_new_tokens: int = 8) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                        "ignore_eos": True}}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def stream_server(tiny_model: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dram_stream")
    (tmp / "nvme").mkdir()
    srv = start(tiny_model, tmp / "server.log", 2048, ["--enable-hiradix", "--hiradix-dram-gb", "0.001",
                                                        "--hiradix-nvme-path", str(tmp / "nvme"), "--hiradix-nvme-gb", "0.1"])
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def prompt(tag: int, tokens: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 4000 + 10 for i in range(tokens)]


def chat(base_url: str, tag: int, turns: int, turn_tokens: int) -> tuple[list[int], list]:
    """A conversation of ``turns`` turns (each ``turn_tokens`` new prompt tokens and the model's 8
    answer tokens, the whole history sent again): its history and each turn's output."""
    history, outputs = [], []
    for turn in range(turns):
        out = generate(base_url, history + prompt(tag * 100 + turn, turn_tokens))
        history = history + prompt(tag * 100 + turn, turn_tokens) + out["output_ids"]
        outputs.append(out["output_ids"])
    return history, outputs


def test_a_history_twice_dram_returns_from_nvme_whole_with_stock_tokens(stream_server, stock_server):
    got = {}
    for name, server in (("stock", stock_server), ("hiradix", stream_server)):
        # turn by turn, so each turn's new pages (~14) pass through DRAM (30 pages) down to NVMe
        history, outputs = chat(server.base_url, 1, 4, 220)  # 912 tokens
        for tag in range(2, 6):  # 2,800 more tokens: the history leaves HBM, then DRAM
            chat(server.base_url, tag, 1, 700)
        last = generate(server.base_url, history + [11, 12, 13])
        got[name] = (outputs, last["output_ids"], last["meta_info"])
    assert got["hiradix"][:2] == got["stock"][:2]  # the same tokens
    meta = got["hiradix"][2]
    details = meta.get("cached_tokens_details") or {}
    # what stock, which never evicts, caches of the 912-token history (911: its last token has no
    # KV yet; stock runs pages of 1 token), in whole pages of 16 (the partial last page left HBM
    # with the history), most of it read back from NVMe
    assert got["stock"][2]["cached_tokens"] == 911
    assert meta["cached_tokens"] == 911 // 16 * 16, meta
    # At most DRAM's 480 tokens were in DRAM when it arrived; every other token was read from
    # NVMe for it (storage), and all but the last part, which DRAM holds at admission, was
    # promoted while it waited (streamed). Without the stream: 448 cached, the rest recomputed.
    assert details["storage"] >= 896 - DRAM_TOKENS and details["storage_backend"] == f"nvme={details['storage']}", details
    assert metric(stream_server.base_url, "sglang:hiradix_streamed_tokens_total") >= 896 - DRAM_TOKENS
