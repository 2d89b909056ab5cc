"""gpt-oss on SGLang's torch-native backend: per-head attention sinks, served through hiradix (issue 33, part 3).

Stock SGLang 0.5.23 refuses gpt-oss on torch-native (an assertion in its flag resolution), and the
backend had no attention sinks; patches/p13_torch_native_sinks.py adds them (softmax over each head's
scores and its sink logit, the sink's probability dropped) on top of p12's windowed reads.
``models/tiny-gpt-oss`` (scripts/make_model.py --preset tiny-gpt-oss, scripts/gptoss_arch.py): 4 layers
alternating sliding (32-token window) and full attention, a learned sink per head, MoE MLPs (4 experts,
top 2), random weights. Three servers, started together for the module:

| server  | pool                                                        | role                                  |
|---------|-------------------------------------------------------------|---------------------------------------|
| full    | stock, ``--disable-hybrid-swa-memory``: 8,192 tokens, one pool | HF transformers' outputs; hiradix's reference |
| pool    | stock, SGLang's hybrid SWA pool (full 2,048, SWA 1,638)      | the same outputs from the SWA pool    |
| hiradix | ``--enable-hiradix --disable-hybrid-swa-memory``: HBM 1,024 tokens, DRAM 0.05 GB | histories go to DRAM and come back |

HF transformers' ``GptOssForCausalLM`` (eager attention with sinks) is the reference for the greedy
outputs; its outputs change when the sinks are taken out, so the comparison sees them.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import (assert_chats_match_stock_and_hit_hbm_and_dram, assert_log_clean, mla_model,
                                run_sessions)

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET = "tiny-gpt-oss"
WINDOW = 32  # config.sliding_window: keys a query sees, itself included
PAGE_TOKENS = 16
SESSIONS, TURNS, WORDS = 6, 3, 40
PROMPT_LENS, NEW_TOKENS = (70, 150, 300), 16


def make_server(model: Path, log: Path, hbm_tokens: int, extra: list[str]) -> ServerProcess:
    env = {**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1"}
    return ServerProcess(model, extra_args=cpu_args(hbm_tokens) + extra, env=env, log_path=log)


@pytest.fixture(scope="module")
def model() -> Path:
    return mla_model(PRESET, REPO_ROOT / "models")  # builds any preset of make_model.py


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("sinks")
    page = ["--page-size", str(PAGE_TOKENS)]
    servers = {
        "full": make_server(model, root / "full.log", 8192, page + ["--disable-hybrid-swa-memory"]),
        "pool": make_server(model, root / "pool.log", 2048, []),
        "hiradix": make_server(model, root / "hiradix.log", 1024,
                               page + ["--disable-hybrid-swa-memory", "--enable-hiradix", "--hiradix-dram-gb", "0.05"]),
    }  # fmt: skip
    try:
        for server in servers.values():
            server.start(wait=False)
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        stop_all(servers.values())


@pytest.fixture(scope="module")
def hf(model):
    """HF transformers' model of the checkpoint and what loading it reported."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model, info = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, output_loading_info=True)
    return hf_model.eval(), info


def generate(server: ServerProcess, ids: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy /generate of token ids: the output ids, and the log-probability of every prompt token
    after the first (the server's prefill of the whole prompt)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
    req = urllib.request.Request(f"{server.base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    prompt_logprobs = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    assert len(prompt_logprobs) == len(ids) - 1
    return out["output_ids"], prompt_logprobs


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def assert_sane(server: ServerProcess) -> str:
    return assert_log_clean(server, "IntegrityError")


def test_hf_transformers_loads_the_checkpoint_whole(hf):
    hf_model, info = hf
    assert type(hf_model).__name__ == "GptOssForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf_model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert hf_model.config.sliding_window == WINDOW


def test_the_servers_use_the_pools_they_should(servers):
    full, pool, tiered = (assert_sane(servers[n]) for n in ("full", "pool", "hiradix"))
    assert "hybrid_swa=False" in full and "SWAKVPool" not in full
    assert "hybrid_swa=True" in pool
    assert "Tree cache initialized: source=registered('hiradix') impl=TieredRadixCache hybrid_swa=False" in tiered
    assert "hiradix: device KV pool MHATokenToKVPool" in tiered, tiered[-3000:]


def test_greedy_outputs_are_hf_transformers_with_sinks(servers, hf):
    """Prompts of 70-300 tokens (several windows): both stock servers give HF transformers' greedy tokens
    (each the argmax after the prompt and the tokens before it: one forward pass per prompt) and HF's
    log-probability of every prompt token (the prefill, every position); with the sinks taken out of
    HF's model its argmaxes change and its log-probabilities move far past the tolerance."""
    import torch

    hf_model, _ = hf

    def hf_forward(ids: list[int], n_new: int) -> tuple[list[int], torch.Tensor]:
        """HF's argmax after each of the last n_new tokens' predecessors, and the log-probabilities of
        the prompt's tokens 1.. (ids without its last n_new)."""
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
        n = len(ids) - n_new
        prompt_lp = logprobs[: n - 1].gather(1, torch.tensor(ids[1:n])[:, None])[:, 0]
        return logprobs[n - 1 : len(ids) - 1].argmax(-1).tolist(), prompt_lp

    runs, worst = [], 0.0
    for seed, n in enumerate(PROMPT_LENS):
        ids = prompt(seed, n)
        got = {name: generate(servers[name], ids) for name in ("full", "pool")}
        assert got["pool"][0] == got["full"][0], seed
        outputs = got["full"][0]
        argmaxes, hf_lp = hf_forward(ids + outputs, NEW_TOKENS)
        assert argmaxes == outputs, seed
        for name in ("full", "pool"):
            diff = (torch.tensor(got[name][1], dtype=torch.float64) - hf_lp).abs().max().item()
            assert diff < 1e-4, (seed, name, diff)
            worst = max(worst, diff)
        runs.append((ids + outputs, hf_lp))
    sinks = [layer.self_attn.sinks for layer in hf_model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    try:
        for s in sinks:
            s.data.fill_(-1e9)  # the sink's probability: 0
        without = [hf_forward(r, NEW_TOKENS) for r, _ in runs]
    finally:
        for s, v in zip(sinks, saved):
            s.data.copy_(v)
    assert sum(argmaxes != r[-NEW_TOKENS:] for (argmaxes, _), (r, _) in zip(without, runs)) > 0
    moved = min((lp - ref).abs().max().item() for (_, lp), (_, ref) in zip(without, runs))
    assert moved > 100 * max(worst, 1e-5), (moved, worst)


def test_multi_turn_chats_through_hiradix_match_stock_and_hit_from_hbm_and_dram(servers):
    """hiradix (HBM far smaller than the histories) gives the full-pool stock server's tokens on
    multi-turn chats; later turns hit, in HBM and from histories that went to DRAM and came back."""
    token_ids = lambda s, t: {"return_token_ids": True}  # noqa: E731
    got = {name: run_sessions(servers[name].base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS, extra_of=token_ids)
           for name in ("full", "hiradix")}  # fmt: skip
    assert_chats_match_stock_and_hit_hbm_and_dram(got["hiradix"], got["full"], WINDOW, servers["hiradix"])
