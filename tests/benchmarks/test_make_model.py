"""scripts/make_model.py: same preset and seed give the same bytes; the model loads and chats; `trained` learns."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    # two processes at once (hash seeds and thread scheduling differ), one core each
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_build, (a, b)))
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


# ---------------------------------------------------------------------------------------------
# The `trained` preset (scripts/train_small_llama.py)
# ---------------------------------------------------------------------------------------------

if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))

SPECIAL_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
SLOW = pytest.mark.skipif(
    os.environ.get("HIRADIX_SLOW_TESTS") != "1",
    reason="trains the `trained` preset (~10 min on one core); run with "
           "HIRADIX_SLOW_TESTS=1 .venv/bin/python -m pytest -m slow tests/benchmarks/test_make_model.py",
)


def test_trained_preset_config_and_stamp():
    import make_model as mm

    cfg = mm.model_config(mm.PRESETS["trained"], SPECIAL_IDS)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (4, 256, 704)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)  # GQA
    assert cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] >= 4096
    assert cfg["vocab_size"] == mm.VOCAB_SIZE
    # The budget is part of the stamp: another budget is another build; random presets have no plan.
    default, other = mm.training_plan("trained"), mm.training_plan("trained", 4096)
    assert default.num_train_tokens > 1_000_000 and other.num_train_tokens == 4096
    assert mm.stamp_for("trained", 0, default) != mm.stamp_for("trained", 0, other)
    assert mm.training_plan("tiny") is None and "training" not in mm.stamp_for("tiny", 0)
    with pytest.raises(ValueError, match="not trained"):
        mm.training_plan("tiny", 4096)


def test_render_chatml_is_the_chat_template():
    import jinja2
    import make_model as mm
    from train_small_llama import record_to_messages, render_chatml

    record = {"conversations": [{"from": "system", "value": "Be brief."},
                                {"from": "human", "value": "  What is 2+2? \n"},
                                {"from": "gpt", "value": "4."}]}
    messages = record_to_messages(record)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(mm.CHAT_TEMPLATE)
    assert render_chatml(messages) == template.render(messages=messages, add_generation_prompt=False)
    assert render_chatml(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                       "What is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n")
    assert record_to_messages({"conversations": [{"from": "human", "value": "hi"}]}) is None  # one message
    assert record_to_messages({"conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "gpt", "value": " "}]}) is None  # empty answer
    assert record_to_messages({"conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "bing", "value": "x"}]}) is None  # unknown role


def test_small_llama_matches_transformers_llama():
    import make_model as mm
    import torch
    from train_small_llama import SmallLlama
    from transformers import LlamaConfig, LlamaForCausalLM

    preset = mm.PRESETS["trained"]
    model = SmallLlama(preset, mm.VOCAB_SIZE, max_positions=300)
    model.init_weights(torch.Generator().manual_seed(3), std=0.2)  # large: a wrong RoPE/GQA layout shows
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == mm.weight_shapes(preset)
    cfg = {k: v for k, v in mm.model_config(preset, SPECIAL_IDS).items() if k not in ("architectures", "model_type")}
    reference = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    reference.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, mm.VOCAB_SIZE, (2, 300), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = model.eval()(ids), reference(ids).logits
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_training_steps_learn_and_repeat():
    import make_model as mm
    import torch
    from train_small_llama import TrainingPlan, lr_at, train_small_llama

    plan = TrainingPlan(num_train_tokens=64 * 2 * 25, seq_len_tokens=64, batch_size_seqs=2,
                        num_heldout_conversations=2, num_threads=1)
    assert plan.num_steps == 25
    schedule = TrainingPlan(num_train_tokens=200 * 4096, seq_len_tokens=1024, batch_size_seqs=4)
    assert schedule.num_steps == 200  # warm-up: 10 steps, then cosine over 190
    assert lr_at(0, schedule) == pytest.approx(schedule.peak_lr / 10)
    assert lr_at(9, schedule) == lr_at(10, schedule) == schedule.peak_lr
    assert lr_at(105, schedule) == pytest.approx(schedule.peak_lr * (1 + schedule.final_lr_ratio) / 2)
    assert lr_at(199, schedule) == pytest.approx(schedule.peak_lr * schedule.final_lr_ratio, rel=1e-3)
    # A repetitive "corpus": learnable in a few steps. Token ids: characters.
    chats = [f"<user> count {i} {i + 1} {i + 2} and again {i} {i + 1} {i + 2} </user>" * 3 for i in range(200)]
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    runs = [train_small_llama(mm.PRESETS["trained"], mm.VOCAB_SIZE, encode, plan, seed=0, chats=chats,
                              log=lambda line: None) for _ in range(2)]
    first = runs[0]
    assert set(first.weights) == set(mm.weight_shapes(mm.PRESETS["trained"]))
    assert first.heldout_num_tokens == 2 * 63
    assert first.heldout_perplexity < 0.05 * mm.VOCAB_SIZE  # uniform: 4096
    assert first.final_train_loss < 4.0  # from ln(4096) = 8.3
    # Same plan, same seed, same data: the same weights, bit for bit.
    assert all(torch.equal(first.weights[k], runs[1].weights[k]) for k in first.weights)
    assert first.heldout_perplexity == runs[1].heldout_perplexity


@SLOW
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_trained_preset_predicts_and_rebuild_is_cached(tmp_path):
    out = tmp_path / "trained"
    proc = subprocess.run([PYTHON, str(SCRIPT), "--preset", "trained", "--out", str(out)],
                          capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stamp = json.loads((out / "hiradix_model.json").read_text())
    assert stamp["preset"] == "trained" and stamp["training"]["num_train_tokens"] > 1_000_000
    assert stamp["heldout_num_tokens"] > 10_000
    assert stamp["heldout_perplexity"] < 0.25 * 4096  # far below the uniform vocabulary's 4096
    assert "held-out perplexity" in proc.stdout
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert "nothing to do" in _build_preset(out, "trained")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def _build_preset(out: Path, preset: str) -> str:
    proc = subprocess.run([PYTHON, str(SCRIPT), "--preset", preset, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
