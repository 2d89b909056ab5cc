"""Sliding-window models served from SGLang's one full KV pool (issue 33, part 1): Gemma 3.

SGLang 0.5.23 keeps every layer's KV of a Gemma 2/3 model in one full pool: its model override
(``arg_groups/model_overrides/gemma2_gemma3.py``) turns on ``--disable-hybrid-swa-memory``, so
``ModelConfig.is_hybrid_swa`` is False and the scheduler builds an ``MHATokenToKVPool`` (no
``SWAKVPool``) with a plain ``UnifiedRadixCache``; the sliding layers mask keys older than their
window at attention time. hiradix accepts such a model after SGLang's resolution (the launcher's
``after_resolve_once``) and checks the pool SGLang built (the cache factory), then tiers the KV of
every layer, sliding ones included. Both servers of the module start together, once:

| server  | model       | tiers                                               | role              |
|---------|-------------|-----------------------------------------------------|-------------------|
| stock   | tiny-gemma3 | HBM 8,192 tokens (never evicts), page size 16       | reference outputs |
| hiradix | tiny-gemma3 | HBM 1,024 tokens, DRAM 0.05 GB (integrity checked)  | histories go down to DRAM and come back |

``tiny-gemma3`` (scripts/make_model.py, scripts/gemma_arch.py): layers sliding, sliding, global;
a 64-token window. Workload: 6 chats x 3 turns at temperature 0 (first prompts 110-240 tokens,
the last ones up to ~720: several windows each; ~3.3k prompt tokens per turn round against 1,024
of HBM). The refusal of a model SGLang serves from its SWA pool (gpt-oss) runs in-process.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import pytest

from hiradix.config import ENV_VAR
from hiradix.sglang_plugin import flags, hooks
from hiradix.sglang_plugin.model_check import page_bytes_estimate
from hiradix.sglang_plugin.refusals import HiRadixRefusal
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import (assert_chats_match_stock_and_hit_hbm_and_dram, assert_log_clean, mla_model,
                                run_sessions)

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET = "tiny-gemma3"
SESSIONS, TURNS, WORDS = 6, 3, 40
PAGE_TOKENS = 16
WINDOW_TOKENS = 64  # the preset's sliding_window


def make_server(model: Path, log: Path, hbm_tokens: int, extra: list[str]) -> ServerProcess:
    env = {**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1"}
    return ServerProcess(model, extra_args=cpu_args(hbm_tokens) + ["--page-size", str(PAGE_TOKENS)] + extra, env=env,
                         log_path=log)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("sliding")
    model = mla_model(PRESET, REPO_ROOT / "models")  # builds any preset of make_model.py
    servers = {"stock": make_server(model, root / "stock.log", 8192, []),
               "hiradix": make_server(model, root / "hiradix.log", 1024, ["--enable-hiradix", "--hiradix-dram-gb", "0.05"])}
    try:
        for server in servers.values():
            server.start(wait=False)
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        stop_all(servers.values())


@pytest.fixture(scope="module")
def chats(servers) -> dict[str, list[list[dict]]]:
    """The multi-turn workload on both servers (stock first: its outputs are the reference)."""
    token_ids = lambda s, t: {"return_token_ids": True}  # noqa: E731
    return {name: run_sessions(servers[name].base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS, extra_of=token_ids)
            for name in ("stock", "hiradix")}  # fmt: skip


def assert_sane(server: ServerProcess) -> str:
    return assert_log_clean(server, "IntegrityError")


@pytest.mark.e2e
def test_sglang_serves_the_sliding_window_model_from_one_full_pool(servers):
    """What SGLang reports at start: its override turned hybrid SWA memory off, no SWA pool, the plain
    radix cache for stock; hiradix built on the same per-head pool, a page holding every layer's KV."""
    stock, server = servers["stock"], servers["hiradix"]
    for log in (assert_sane(stock), assert_sane(server)):
        assert "Disable hybrid SWA memory for Gemma3ForCausalLM" in log  # SGLang's model override
        assert "SWAKVPool" not in log and "'disable_hybrid_swa_memory': True" in log
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache hybrid_swa=False" in stock.log_text()
    log = server.log_text()
    assert "Tree cache initialized: source=registered('hiradix') impl=TieredRadixCache hybrid_swa=False" in log
    assert "hiradix: device KV pool MHATokenToKVPool (every layer's KV in one pool; hybrid_swa=False)" in log
    config = json.loads((Path(server.model_path) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    page_bytes = page_bytes_estimate(config, PAGE_TOKENS, 1, "float32")  # all 3 layers, sliding ones included
    assert page_bytes == 2 * 3 * PAGE_TOKENS * 2 * 64 * 4
    assert re.search(rf"hiradix tiers: DRAM \d+ pages \({page_bytes} B each\)", log), log[-3000:]


@pytest.mark.e2e
def test_multi_turn_chats_match_stock_token_for_token_and_hit_from_hbm_and_dram(servers, chats):
    """Prompts several windows long; hiradix (HBM far smaller than the histories) gives stock's
    tokens, and later turns hit: in HBM, and histories that went down to DRAM and came back."""
    assert_chats_match_stock_and_hit_hbm_and_dram(chats["hiradix"], chats["stock"], WINDOW_TOKENS, servers["hiradix"])


def test_a_model_sglang_serves_from_an_swa_pool_is_refused_before_it_loads(tmp_path, monkeypatch, capsys):
    """gpt-oss (sliding layers in SGLang's SWA pool): refused once SGLang has resolved the flags,
    from its config.json alone (no weights, no server), naming --disable-hybrid-swa-memory."""
    from sglang.srt.server_args import ServerArgs

    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float32", "sliding_window": 128,
              "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(hooks, "missing", lambda scope, specs=hooks.HOOKS: [])  # no hooks in this process
    parser = argparse.ArgumentParser()
    inspect.unwrap(ServerArgs.add_cli_args)(parser)
    flags.after_add_cli_args(None, parser)
    # triton: the only backend SGLang's resolution accepts for gpt-oss on a CPU without AMX (nothing runs)
    namespace = parser.parse_args(["--model-path", str(tmp_path), *cpu_args(4096), "--attention-backend", "triton",
                                   "--enable-hiradix", "--hiradix-dram-gb", "0.01"])
    record = inspect.unwrap(ServerArgs.__dict__["from_cli_args"].__func__)(ServerArgs, namespace)
    flags.after_from_cli_args(record, ServerArgs, namespace)  # config.json alone: waits for the resolution
    record.resolve_once()
    assert record._model_config.is_hybrid_swa  # SGLang would build its SWA pool
    with pytest.raises(HiRadixRefusal) as refused:
        flags.after_resolve_once(None, record)
    message = str(refused.value)
    assert message.startswith(f"hiradix: --model-path {tmp_path} is a sliding-window model (layer_types has "
                              "['full_attention', 'sliding_attention'], sliding_window=128)"), message
    assert "separate SWA pool" in message and "add --disable-hybrid-swa-memory to serve it" in message, message
    assert capsys.readouterr().err.strip().endswith(message)  # the launcher's one line on stderr
