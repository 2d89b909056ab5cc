"""scripts/make_model.py: same preset and seed give the same bytes; the model loads and chats."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_model.py"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable


def _build(out: Path, *extra: str) -> str:
    proc = subprocess.run([PYTHON, str(SCRIPT), "--preset", "tiny", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a") / "tiny", tmp_path_factory.mktemp("b") / "tiny"
    _build(a)
    _build(b)  # a separate process: hash seeds and thread scheduling differ
    return a, b


@pytest.mark.timeout(900)
def test_same_seed_same_bytes(two_builds):
    a, b = two_builds
    ha, hb = _hashes(a), _hashes(b)
    assert set(ha) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "generation_config.json", "hiradix_model.json"}
    assert ha == hb


@pytest.mark.timeout(900)
def test_rerun_is_a_fast_no_op(two_builds):
    a, _ = two_builds
    before = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    out = _build(a)
    assert "nothing to do" in out
    assert {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == before


@pytest.mark.timeout(900)
def test_other_seed_other_weights_same_tokenizer(two_builds, tmp_path):
    a, _ = two_builds
    c = tmp_path / "tiny-seed1"
    _build(c, "--seed", "1")
    ha, hc = _hashes(a), _hashes(c)
    assert ha["model.safetensors"] != hc["model.safetensors"]
    assert ha["tokenizer.json"] == hc["tokenizer.json"]


@pytest.mark.timeout(900)
def test_loads_with_transformers_and_chats(two_builds):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    a, _ = two_builds
    cfg = AutoConfig.from_pretrained(a)
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (2, 256)
    assert cfg.max_position_embeddings >= 8192
    assert 2000 <= cfg.vocab_size <= 8192

    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok) == cfg.vocab_size
    text = "The people of the world said hello, café 123!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: lossless
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id

    messages = [{"role": "user", "content": "Hi there"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"

    model = AutoModelForCausalLM.from_pretrained(a).eval()
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, len(ids) + 5)

    stamp = json.loads((a / "hiradix_model.json").read_text())
    assert stamp["preset"] == "tiny" and stamp["seed"] == 0
