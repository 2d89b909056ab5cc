#!/usr/bin/env python3
"""Build a local Llama-architecture test model: random (or CPU-trained) weights, locally trained tokenizer.

Nothing can be downloaded here, so the tests and benchmarks use models built by this
script: `LlamaForCausalLM` weights drawn from a fixed seed (float32, safetensors) and a
byte-level BPE tokenizer trained with `tokenizers` on a corpus that this script
generates deterministically (pseudo-English sentences, numbers, code-like lines and
short dialogues; no external data). The tokenizer carries a ChatML-style chat template
so `/v1/chat/completions` works. The same preset and seed give the same bytes.

    python scripts/make_model.py --preset tiny  --out models/tiny   # tests: 2 layers, hidden 256
    python scripts/make_model.py --preset small --out models/small  # benchmarks: 8 layers, hidden 1024, GQA
    python scripts/make_model.py --preset tiny-deepseek-v2           # MLA + MoE (also tiny-deepseek-v3, tiny-kimi-k2)
    python scripts/make_model.py --preset tiny-gemma3                # Gemma 3: sliding-window layers + a global one
    python scripts/make_model.py --preset tiny-mellum-swa            # Mellum: SGLang's hybrid SWA pool (layer_types)
    python scripts/make_model.py --preset tiny-gpt-oss               # gpt-oss: attention sinks, sliding + full, MoE
    python scripts/make_model.py --preset trained                    # 4 layers, hidden 256, GQA, TRAINED (~10 min)

The `trained` preset is the one model whose predictions mean something: it is trained here on
the CPU on ShareGPT chats (scripts/train_small_llama.py: data, loop, budget in tokens) and its
stamp records the held-out perplexity. It shares the tokenizer of every other preset.

The DeepSeek-architecture presets (MLA attention, MoE) are described in scripts/deepseek_arch.py,
the Gemma 3 one (sliding-window attention) in scripts/gemma_arch.py, the Mellum one (SGLang's hybrid SWA
pool) in scripts/mellum_arch.py, the gpt-oss one (attention sinks) in scripts/gptoss_arch.py.

Re-running with the same preset, seed and script version finds `hiradix_model.json`
in the output directory and exits at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # bench.common.conversations (training data)
from deepseek_arch import MLA_PRESETS, MLAPreset, mla_model_config, mla_weight_shapes  # noqa: E402
from gemma_arch import GEMMA_PRESETS, GemmaPreset, gemma_model_config, gemma_weight_shapes  # noqa: E402
from gptoss_arch import GPTOSS_PRESETS, GptOssPreset, gptoss_model_config, gptoss_sinks, gptoss_weight_shapes  # noqa: E402
from mellum_arch import MELLUM_PRESETS, MellumPreset, mellum_model_config, mellum_weight_shapes  # noqa: E402
from training_plan import TRAINING_VERSION, TrainingPlan  # noqa: E402

# Bump when anything that changes the output bytes changes.
SCRIPT_VERSION = 1
STAMP_NAME = "hiradix_model.json"
REPO_ROOT = Path(__file__).resolve().parent.parent

VOCAB_SIZE = 4096  # tokens, special tokens included
CORPUS_SEED = 20261101  # the corpus (hence the tokenizer) does not depend on --seed
CORPUS_LINES = 60_000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INIT_STD = 0.02  # normal init of every linear and embedding weight; norms are the identity


@dataclass(frozen=True)
class Preset:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0


PRESETS = {
    # Tests: the server starts in seconds; 2 KiB of KV per token.
    "tiny": Preset(num_hidden_layers=2, hidden_size=256, intermediate_size=704,
                   num_attention_heads=4, num_key_value_heads=2),
    # Benchmarks: 92M parameters. Measured here (2 shared cores): a cold 1,500-token prompt
    # 3.7 s at best (median 7-9 s under load), the same prompt cached ~1.1 s.
    "small": Preset(num_hidden_layers=8, hidden_size=1024, intermediate_size=2560,
                    num_attention_heads=16, num_key_value_heads=4),
    # Trained on ShareGPT (TRAINED_PRESETS): measures output-changing features on real predictions.
    "trained": Preset(num_hidden_layers=4, hidden_size=256, intermediate_size=704,
                      num_attention_heads=4, num_key_value_heads=2),
    **MLA_PRESETS,
    **GEMMA_PRESETS,
    **MELLUM_PRESETS,
    **GPTOSS_PRESETS,
}
# Presets whose weights are trained (scripts/train_small_llama.py), with their plan. Measured here
# (1 thread, shared 2-core machine): 2,200-2,900 training tokens/s; 1.6M tokens took 571 s (the
# whole build 585 s), held-out perplexity 86.16. Two threads were slower under the shared load.
TRAINED_PRESETS = {
    "trained": TrainingPlan(num_train_tokens=1_600_000, seq_len_tokens=1024, batch_size_seqs=4,
                            num_threads=1),
}

# ---------------------------------------------------------------------------------------------
# Corpus: deterministic text from a fixed word list, a syllable generator and templates.
# ---------------------------------------------------------------------------------------------

COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too same
tell does set three want air well also play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need house picture try
us again animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw left late run while
press close night real life few north open seem together next white children begin got walk example
ease paper group always music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top
whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war
lay against pattern slow center love person money serve appear road map rain rule govern pull cold
notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star box
noun field rest correct able pound done beauty drive stood contain front teach week final gave green
quick develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot system
busy test record boat common gold possible plane dry wonder laugh thousand ago ran check game shape
equate hot miss brought heat snow tire bring yes distant fill east paint language among cache memory
token layer model request server prefix tree node page disk queue batch latency throughput prompt
""".split()
ACCENTED = "café naïve über façade résumé jalapeño Zürich smörgåsbord crème déjà São Kraków".split()
ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
          "br", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "st", "th", "tr", "ch", "sp", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y", "ee", "oo"]
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x", "rt"]
IDENTS = ["value", "count", "index", "result", "items", "node", "page", "size", "key", "data",
          "tokens", "layer", "cache", "request", "offset", "total", "name", "config", "state"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                   for _ in range(rng.randint(1, 3)))


def _sentence(rng: random.Random, lexicon: list[str], cum_weights: list[float]) -> str:
    words = []
    for _ in range(rng.randint(4, 18)):
        r = rng.random()
        if r < 0.06:
            words.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
        elif r < 0.07:
            words.append(rng.choice(ACCENTED))
        else:
            words.append(rng.choices(lexicon, cum_weights=cum_weights)[0])
        if rng.random() < 0.08:
            words[-1] += ","
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":"])


def _code_line(rng: random.Random) -> str:
    a, b = rng.choice(IDENTS), rng.choice(IDENTS)
    n = rng.randint(0, 4096)
    return rng.choice([
        f"    {a} = {b}[{n}] + {rng.randint(1, 9)}",
        f"def get_{a}(self, {b}: int) -> int:",
        f"    return self.{a}.get({b}, {n})",
        f"for {a} in range({n}):",
        f"if {a} is None or len({b}) > {n}:",
        f'    print(f"{{{a}}} {b}={{{b}!r}}")',
        f"{a}_{b} = {{'{a}': {n}, '{b}': [{n}, {n + 1}]}}",
    ])


def corpus_lines() -> list[str]:
    """The fixed training corpus: CORPUS_LINES lines, identical on every run."""
    rng = random.Random(CORPUS_SEED)
    pseudo = sorted({_pseudo_word(rng) for _ in range(6000)})
    lexicon = COMMON_WORDS + pseudo
    # Zipf-like weights: common words first, so they become single tokens.
    weights = [1.0 / (rank + 10) for rank in range(len(lexicon))]
    cum, acc = [], 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    lines = []
    for _ in range(CORPUS_LINES):
        kind = rng.random()
        if kind < 0.75:
            lines.append(" ".join(_sentence(rng, lexicon, cum) for _ in range(rng.randint(1, 4))))
        elif kind < 0.9:
            lines.append(_code_line(rng))
        else:
            role = rng.choice(["user", "assistant", "system"])
            lines.append(f"<|im_start|>{role}\n{_sentence(rng, lexicon, cum)}<|im_end|>")
    return lines


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def build_tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer; return its tokenizer.json text."""
    # One worker thread, so that merge ties cannot depend on scheduling.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    return tok.to_str(pretty=True)


def tokenizer_config(special_ids: dict[str, int]) -> dict:
    added = {
        str(special_ids[t]): {"content": t, "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def model_config(p: Preset | MLAPreset | GemmaPreset | MellumPreset | GptOssPreset, special_ids: dict[str, int]) -> dict:
    if isinstance(p, MLAPreset):
        return mla_model_config(p, special_ids, VOCAB_SIZE, INIT_STD, BOS, EOS, PAD)
    if isinstance(p, GemmaPreset):
        return gemma_model_config(p, special_ids, VOCAB_SIZE, INIT_STD, BOS, EOS, PAD)
    if isinstance(p, MellumPreset):
        return mellum_model_config(p, special_ids, VOCAB_SIZE, INIT_STD, BOS, EOS, PAD)
    if isinstance(p, GptOssPreset):
        return gptoss_model_config(p, special_ids, VOCAB_SIZE, INIT_STD, BOS, EOS, PAD)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[BOS],
        "eos_token_id": special_ids[EOS],
        "pad_token_id": special_ids[PAD],
        "head_dim": p.hidden_size // p.num_attention_heads,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": p.rope_theta, "rope_type": "default"},
        "rope_theta": p.rope_theta,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def weight_shapes(p: Preset | MLAPreset | GemmaPreset | MellumPreset | GptOssPreset) -> dict[str, tuple[int, ...]]:
    """Every tensor of LlamaForCausalLM (or of the DeepSeek, Gemma, Mellum or gpt-oss model of a preset), by its checkpoint name."""
    if isinstance(p, MLAPreset):
        return mla_weight_shapes(p, VOCAB_SIZE)
    if isinstance(p, GemmaPreset):
        return gemma_weight_shapes(p, VOCAB_SIZE)
    if isinstance(p, MellumPreset):
        return mellum_weight_shapes(p, VOCAB_SIZE)
    if isinstance(p, GptOssPreset):
        return gptoss_weight_shapes(p, VOCAB_SIZE)
    h, hd = p.hidden_size, p.hidden_size // p.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        shapes[pre + "self_attn.q_proj.weight"] = (p.num_attention_heads * hd, h)
        shapes[pre + "self_attn.k_proj.weight"] = (p.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.v_proj.weight"] = (p.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.o_proj.weight"] = (h, p.num_attention_heads * hd)
        shapes[pre + "mlp.gate_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.up_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.down_proj.weight"] = (h, p.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (VOCAB_SIZE, h)
    return shapes


def build_weights(p: Preset | MLAPreset | GemmaPreset | MellumPreset | GptOssPreset, seed: int):
    """Random float32 weights: one generator, tensors drawn in name order; norms are the identity
    (ones; zeros for Gemma, whose RMSNorm scales by 1 + weight); gpt-oss's attention sinks their own
    (scripts/gptoss_arch.py)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    norm_init = torch.zeros if isinstance(p, GemmaPreset) else torch.ones
    for name, shape in sorted(weight_shapes(p).items()):
        if name.endswith("norm.weight"):
            out[name] = norm_init(shape, dtype=torch.float32)
        elif name.endswith("self_attn.sinks"):
            out[name] = gptoss_sinks(shape, gen)
        else:
            out[name] = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
    return out


# ---------------------------------------------------------------------------------------------
# Output directory
# ---------------------------------------------------------------------------------------------

def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp_for(preset: str, seed: int, plan: TrainingPlan | None = None) -> dict:
    """The inputs that decide a build's bytes (a build with the same stamp is reused)."""
    stamp = {"preset": preset, "seed": seed, "script_version": SCRIPT_VERSION,
             "config": asdict(PRESETS[preset]), "vocab_size": VOCAB_SIZE}
    if plan is not None:
        stamp["training"] = asdict(plan)
        stamp["training_version"] = TRAINING_VERSION
    return stamp


def training_plan(preset: str, num_train_tokens: int | None = None) -> TrainingPlan | None:
    """The preset's TrainingPlan (None for random-weight presets), its budget replaced if given.

    Raises:
        ValueError: If a budget is given for a random-weight preset.
    """
    plan = TRAINED_PRESETS.get(preset)
    if num_train_tokens is None:
        return plan
    if plan is None:
        raise ValueError(f"--train-tokens: preset {preset!r} is not trained (trained: {sorted(TRAINED_PRESETS)})")
    return replace(plan, num_train_tokens=num_train_tokens)


def make_weights(preset: str, seed: int, tok_json: str, plan: TrainingPlan | None) -> tuple[dict, dict]:
    """The checkpoint tensors (float32, by weight_shapes name) and what the stamp records about them.

    Random-weight presets: `build_weights`, nothing to record. Trained presets: trained per `plan`
    on ShareGPT with the tokenizer `tok_json` (train_small_llama), recording held-out perplexity.
    """
    if plan is None:
        return build_weights(PRESETS[preset], seed), {}
    from tokenizers import Tokenizer
    from train_small_llama import train_small_llama

    tok = Tokenizer.from_str(tok_json)
    result = train_small_llama(PRESETS[preset], VOCAB_SIZE, lambda text: tok.encode(text).ids, plan, seed)
    shapes = weight_shapes(PRESETS[preset])
    if {k: tuple(v.shape) for k, v in result.weights.items()} != shapes:
        raise RuntimeError("trained tensors do not match weight_shapes")
    print(f"[make_model] trained {plan.num_steps} steps x {plan.tokens_per_step} tokens in {result.train_s:.0f} s; "
          f"final train loss {result.final_train_loss:.3f}; held-out perplexity {result.heldout_perplexity:.2f} "
          f"over {result.heldout_num_tokens} tokens ({plan.num_heldout_conversations} conversations)")
    return result.weights, {"heldout_perplexity": round(result.heldout_perplexity, 4),
                            "heldout_num_tokens": result.heldout_num_tokens,
                            "final_train_loss": round(result.final_train_loss, 4),
                            "train_s": round(result.train_s, 1)}


def existing_build(out: Path, want: dict) -> bool:
    """True when `out` holds a finished build with the same inputs (files present, sizes right)."""
    try:
        stamp = json.loads((out / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if {k: stamp.get(k) for k in want} != want:
        return False
    files = stamp.get("files", {})
    return bool(files) and all(
        (out / name).is_file() and (out / name).stat().st_size == meta["bytes"]
        for name, meta in files.items()
    )


def build(preset: str, out: Path, seed: int, plan: TrainingPlan | None = None) -> None:
    """Write the model directory `out` (tokenizer, config, weights, stamp last); `plan` trains the weights."""
    from safetensors.torch import save_file

    p = PRESETS[preset]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok_json = build_tokenizer_json()
        vocab = json.loads(tok_json)["added_tokens"]
        special_ids = {t["content"]: t["id"] for t in vocab}
        (tmp / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(special_ids))
        _write_json(tmp / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
        _write_json(tmp / "config.json", model_config(p, special_ids))
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": special_ids[BOS], "eos_token_id": special_ids[EOS],
            "pad_token_id": special_ids[PAD], "do_sample": False,
        })
        weights, results = make_weights(preset, seed, tok_json, plan)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        stamp = {**stamp_for(preset, seed, plan), **results}
        stamp["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
                          for f in sorted(tmp.iterdir())}
        _write_json(tmp / STAMP_NAME, stamp)
        # Replace the output directory's files; the stamp goes last so a crash leaves no stamp.
        out.mkdir(parents=True, exist_ok=True)
        (out / STAMP_NAME).unlink(missing_ok=True)
        for f in sorted(tmp.iterdir()):
            os.chmod(f, 0o644)
            if f.name != STAMP_NAME:
                os.replace(f, out / f.name)
        os.replace(tmp / STAMP_NAME, out / STAMP_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, help="output directory (default: models/<preset> at the repo root)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random (or initial) weights (default 0)")
    ap.add_argument("--train-tokens", type=int, help="trained presets: training budget in tokens "
                    f"(default {TRAINED_PRESETS['trained'].num_train_tokens:,} for `trained`)")
    args = ap.parse_args(argv)
    out = (args.out or REPO_ROOT / "models" / args.preset).resolve()
    try:
        plan = training_plan(args.preset, args.train_tokens)
    except ValueError as exc:
        ap.error(str(exc))
    want = stamp_for(args.preset, args.seed, plan)
    if existing_build(out, want):
        print(f"[make_model] {out}: already holds preset={args.preset} seed={args.seed} "
              f"(script version {SCRIPT_VERSION}); nothing to do")
        return 0
    t0 = time.monotonic()
    build(args.preset, out, args.seed, plan)
    p = PRESETS[args.preset]
    n_params = sum(_numel(s) for s in weight_shapes(p).values())
    print(f"[make_model] {out}: built preset={args.preset} seed={args.seed} "
          f"({n_params / 1e6:.1f}M parameters, vocab {VOCAB_SIZE}) in {time.monotonic() - t0:.1f} s")
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
