"""What a model is, from its config.json before it loads: can hiradix serve it, how big is a KV page.

:func:`unsupported_model_reason` (config.json, in the launcher) and
:func:`unsupported_model_config_reason` (SGLang's own ``ModelConfig``, after resolution) say
why an architecture is refused; :func:`page_bytes_estimate` sizes a KV page for the budget checks.

The exact layout comes from SGLang's device pool once the model is loaded
(:meth:`hiradix.dataplane.layout.KVLayout.from_device_pool`); this estimate lets the launcher refuse a
DRAM or NVMe budget that cannot hold a single page before minutes of model loading. The dtype
follows SGLang 0.5.23's resolution (``srt/configs/model_config.py``, ``_get_and_verify_dtype``):
``--dtype auto`` keeps a 16-bit checkpoint's dtype and turns float32 into 16-bit; an fp8
``--kv-cache-dtype`` stores 1 byte per element.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

# The end of every architecture refusal: what is served, and what to use for the rest.
SERVED_MODELS = (
    "--enable-hiradix serves full-attention decoder models with per-head K/V (MHA/GQA/MQA) or "
    "multi-head latent attention (MLA: DeepSeek V2/V3/R1, Kimi K2); for this model use SGLang's "
    "HiCache (--enable-hierarchical-cache), which keeps a host pool per attention component"
)

_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def kv_element_bytes(hf_config: Mapping[str, Any], dtype: str, kv_cache_dtype: Optional[str]) -> int:
    """Bytes per stored KV element: fp8 cache -> 1, else the resolved model dtype (4 or 2)."""
    if kv_cache_dtype and str(kv_cache_dtype).startswith("fp8"):
        return 1
    if dtype and dtype != "auto":
        return _BYTES.get(str(dtype), 2)
    return 2  # auto: a 16-bit checkpoint keeps 2 bytes, a float32 one is cast to 16-bit


def is_mla_config(cfg: Mapping[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek V2/V3/R1, Kimi K2): ``kv_lora_rank`` set, MLA not
    switched off (``use_mla``)."""
    return cfg.get("kv_lora_rank") is not None and bool(cfg.get("use_mla", True))


def page_bytes_estimate(hf_config: Mapping[str, Any], page_size: int, tp_size: int, dtype: str,
                        kv_cache_dtype: Optional[str] = None) -> Optional[int]:
    """KV bytes of one page of one TP rank (all layers), or None if the config lacks a size.

    Per-head K/V: ``2 x layers x page_size x max(1, kv_heads // tp_size) x head_dim x element
    bytes``. MLA: ``layers x page_size x (kv_lora_rank + qk_rope_head_dim) x element bytes`` on
    every rank (the latent is not split by TP; SGLang's ``MLATokenToKVPool``).
    """
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), Mapping) else hf_config
    if is_mla_config(text):
        try:
            row = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
            layers = int(text["num_hidden_layers"])
        except (KeyError, TypeError, ValueError):
            return None
        return layers * page_size * row * kv_element_bytes(text, dtype, kv_cache_dtype)
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_rank = max(1, kv_heads // max(1, tp_size))
    return 2 * layers * page_size * per_rank * head_dim * kv_element_bytes(text, dtype, kv_cache_dtype)


_SSM_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba",
        "falcon_h1", "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2",
        "plamo2", "minimax", "minimax_m1", "kimi_linear",
    }
)  # fmt: skip
_SSM_KEYS = (
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_heads",
    "ssm_state_size", "layers_block_type", "hybrid_override_pattern",
    "linear_attn_config", "full_attention_interval", "attn_layer_period",
)  # fmt: skip
_ENCODER_DECODER_ARCHS = frozenset(
    {
        "WhisperForConditionalGeneration",
        "MllamaForConditionalGeneration",
        "MossVLForConditionalGeneration",
    }
)
_DSA_ARCHS = frozenset({"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"})
_NESTED_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


def unsupported_model_reason(hf_config: Mapping[str, Any]) -> str | None:
    """Why hiradix cannot serve a model, from its HF `config.json`, or None if it can.

    hiradix serves decoder-only models whose every layer is plain full attention with
    per-head K/V (MHA/GQA/MQA) or one latent per token (MLA: DeepSeek V2/V3/R1, Kimi K2).
    Refused: DeepSeek sparse attention (DSA: V3.2's indexer, `index_topk`), sliding-window or
    chunked-attention hybrids (`layer_types`, `use_sliding_window` on some layers,
    `sliding_window_pattern`, `attention_chunk_size`), Mamba/SSM/linear-attention
    hybrids, and encoder-decoder models. Nested text configs are checked too.

    Args:
        hf_config: the parsed config.json.
    """
    archs = list(hf_config.get("architectures") or [])
    configs = [hf_config] + [
        hf_config[k] for k in _NESTED_CONFIG_KEYS if isinstance(hf_config.get(k), Mapping)
    ]
    if hf_config.get("is_encoder_decoder") or _ENCODER_DECODER_ARCHS.intersection(archs):
        return f"an encoder-decoder model (architectures={archs})"
    for cfg in configs:
        model_type = str(cfg.get("model_type", ""))
        if is_mla_config(cfg) and (cfg.get("index_topk") or _DSA_ARCHS.intersection(archs)):
            return f"a DeepSeek sparse-attention (DSA) model (architectures={archs})"
        if model_type in _SSM_MODEL_TYPES or any(k in cfg for k in _SSM_KEYS):
            return f"a Mamba/SSM/linear-attention hybrid (model_type={model_type!r})"
        if cfg.get("cross_attention_layers"):
            return f"an encoder-decoder (cross-attention) model (architectures={archs})"
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list) and set(layer_types) - {"full_attention"}:
            kinds = sorted(set(map(str, layer_types)))
            return f"a hybrid-attention model (layer_types has {kinds})"
        if cfg.get("is_hybrid_swa") or cfg.get("sliding_window_pattern") or cfg.get(
            "interleaved_sliding_window"
        ):
            return f"a sliding-window hybrid (architectures={archs})"
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            return (
                f"a sliding-window model (use_sliding_window=true, "
                f"sliding_window={cfg['sliding_window']})"
            )
        if cfg.get("attention_chunk_size"):
            return f"a chunked local-attention model (architectures={archs})"
    return None


def read_hf_config(model_path: str, revision: str | None) -> tuple[dict, str] | None:
    """The model's config.json (parsed, and where it was read), without loading weights.

    Reads a local directory, or the Hugging Face cache for a repo id; None if neither
    has it (SGLang's resolution and the cache factory check the model again).
    """
    path = Path(model_path).expanduser()
    if path.is_dir():
        candidate: str | None = str(path / "config.json")
    elif path.exists():
        return None  # a single file (e.g. GGUF)
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model_path, "config.json", revision=revision)
        except Exception:  # invalid repo id, no hub library: nothing to read
            return None
        candidate = found if isinstance(found, str) else None
    if candidate is None or not os.path.isfile(candidate):
        return None
    try:
        with open(candidate, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # SGLang reports an unreadable config itself
    return (data, candidate) if isinstance(data, dict) else None


def model_config_is_mla(model_config: Any) -> bool:
    """Whether SGLang's `ModelConfig` says multi-head latent attention (`AttentionArch.MLA`)."""
    from sglang.srt.configs.model_config import AttentionArch

    return model_config.attention_arch == AttentionArch.MLA


def unsupported_model_config_reason(model_config: Any) -> str | None:
    """Why hiradix cannot serve a model, from SGLang's own `ModelConfig`, or None.

    The authoritative form of `unsupported_model_reason` (SGLang's classification).
    """
    from sglang.srt.configs.hybrid_arch import (
        glm5_next_config,
        kimi_linear_config,
        mambaish_config,
    )
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if model_config.attention_arch not in (AttentionArch.MHA, AttentionArch.MLA):
        return f"a {model_config.attention_arch.name} model (architectures={archs})"
    if getattr(model_config, "is_encoder_decoder", False):
        return f"an encoder-decoder model (architectures={archs})"
    if getattr(model_config, "is_hybrid_swa", False):
        return f"a hybrid sliding-window model (architectures={archs})"
    if getattr(model_config, "is_local_attention_model", False):
        return f"a chunked local-attention model (architectures={archs})"
    if any(f(model_config) is not None for f in (mambaish_config, kimi_linear_config, glm5_next_config)):
        return f"a Mamba/SSM/linear-attention hybrid (architectures={archs})"
    if is_deepseek_dsa(model_config.hf_config):
        return f"a DeepSeek sparse-attention model (architectures={archs})"
    return None
