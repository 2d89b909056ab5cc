"""What a model is, from its config.json before it loads: can hiradix serve it, how big is a KV page.

:func:`unsupported_model_reason` (config.json, in the launcher) and
:func:`unsupported_model_config_reason` (SGLang's own ``ModelConfig``, after resolution) say
why an architecture is refused; :func:`page_bytes_estimate` sizes a KV page for the budget checks.

Sliding-window models are served where SGLang itself keeps every layer's KV in one full pool
(:func:`sliding_window_reason`): SGLang's resolved ``--disable-hybrid-swa-memory`` (the user's flag,
or SGLang's own override, as for Gemma 2/3), or a window no shorter than the context. The launcher
decides that after SGLang's resolution; the scheduler checks the pool SGLang built
(:func:`unsupported_device_pool_reason`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

# The end of every architecture refusal: what is served, and what to use for the rest.
SERVED_MODELS = (
    "--enable-hiradix serves full-attention decoder models with per-head K/V (MHA/GQA/MQA) or "
    "multi-head latent attention (MLA: DeepSeek V2/V3/R1, Kimi K2); for this model use SGLang's "
    "HiCache (--enable-hierarchical-cache), which keeps a host pool per attention component"
)

# SGLang's flag that keeps the KV of every token of every layer in one full pool (no SWA pool).
DISABLE_HYBRID_SWA_FLAG = "--disable-hybrid-swa-memory"

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


def unsupported_model_reason(hf_config: Mapping[str, Any], disable_hybrid_swa_memory: bool = False,
                             context_length: int | None = None) -> str | None:
    """Why hiradix cannot serve a model, from its HF `config.json`, or None if it can.

    hiradix serves decoder-only models whose every layer keeps per-head K/V (MHA/GQA/MQA) or one
    latent per token (MLA: DeepSeek V2/V3/R1, Kimi K2) in one full KV pool. Refused: DeepSeek
    sparse attention (DSA: V3.2's indexer, `index_topk`), chunked local attention
    (`attention_chunk_size`), Mamba/SSM/linear-attention hybrids, encoder-decoder models
    (:func:`unservable_architecture_reason`); and a sliding-window model unless its KV is in one
    full pool (:func:`sliding_window_reason`). Nested text configs are checked too.

    Args:
        hf_config: the parsed config.json.
        disable_hybrid_swa_memory: SGLang's `--disable-hybrid-swa-memory` (after its resolution, when known).
        context_length: the server's `--context-length` in tokens; None: the config's `max_position_embeddings`.
    """
    reason = unservable_architecture_reason(hf_config)
    if reason is not None:
        return reason
    for cfg in _configs_of(hf_config):
        window = sliding_window_of(cfg)
        if window is not None:
            context = context_length or _int_or_none(cfg.get("max_position_embeddings"))
            return sliding_window_reason(window, disable_hybrid_swa_memory, context)
    return None


def _configs_of(hf_config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [hf_config] + [hf_config[k] for k in _NESTED_CONFIG_KEYS if isinstance(hf_config.get(k), Mapping)]


def unservable_architecture_reason(hf_config: Mapping[str, Any]) -> str | None:
    """Why hiradix cannot serve a model whatever SGLang resolves, from its `config.json`, or None.

    Everything :func:`unsupported_model_reason` refuses except sliding windows (a sliding-window
    model is servable or not according to SGLang's resolved flags: :func:`sliding_window_reason`).
    """
    archs = list(hf_config.get("architectures") or [])
    if hf_config.get("is_encoder_decoder") or _ENCODER_DECODER_ARCHS.intersection(archs):
        return f"an encoder-decoder model (architectures={archs})"
    for cfg in _configs_of(hf_config):
        model_type = str(cfg.get("model_type", ""))
        if is_mla_config(cfg) and (cfg.get("index_topk") or _DSA_ARCHS.intersection(archs)):
            return f"a DeepSeek sparse-attention (DSA) model (architectures={archs})"
        if model_type in _SSM_MODEL_TYPES or any(k in cfg for k in _SSM_KEYS):
            return f"a Mamba/SSM/linear-attention hybrid (model_type={model_type!r})"
        if cfg.get("cross_attention_layers"):
            return f"an encoder-decoder (cross-attention) model (architectures={archs})"
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list) and set(map(str, layer_types)) - _SERVABLE_LAYER_TYPES:
            kinds = sorted(set(map(str, layer_types)))
            return f"a hybrid-attention model (layer_types has {kinds})"
        if cfg.get("attention_chunk_size"):
            return f"a chunked local-attention model (architectures={archs})"
    return None


_SERVABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class SlidingWindow:
    """The sliding window a config declares for some or all of its layers."""

    tokens: int | None  # in tokens, the current one included (HF's convention); None: not stated
    described: str  # the config's own words, for messages


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def sliding_window_of(cfg: Mapping[str, Any]) -> SlidingWindow | None:
    """The sliding window of one (text) config: `layer_types` with `sliding_attention`,
    `use_sliding_window` with a `sliding_window`, `sliding_window_pattern` (Gemma 3),
    `interleaved_sliding_window` or SGLang's `is_hybrid_swa` opt-in; None if it declares none."""
    window = _int_or_none(cfg.get("sliding_window"))
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" in map(str, layer_types):
        kinds = sorted(set(map(str, layer_types)))
        return SlidingWindow(window, f"layer_types has {kinds}, sliding_window={window}")
    if cfg.get("use_sliding_window") and window:
        return SlidingWindow(window, f"use_sliding_window=true, sliding_window={window}")
    for key in ("sliding_window_pattern", "interleaved_sliding_window", "is_hybrid_swa"):
        if cfg.get(key):
            tokens = window or _int_or_none(cfg.get("interleaved_sliding_window"))
            return SlidingWindow(tokens, f"{key}={cfg[key]}, sliding_window={tokens}")
    return None


def sliding_window_reason(window: SlidingWindow, disable_hybrid_swa_memory: bool,
                          context_length: int | None, is_hybrid_swa: bool = False) -> str | None:
    """Why a sliding-window model cannot be served, or None when SGLang keeps its KV in one full pool.

    Served: SGLang's resolved `--disable-hybrid-swa-memory` is on (every layer's KV of every token
    in the full pool; the sliding layers mask keys older than the window), or the window is no
    shorter than the context (no layer ever masks) and SGLang does not build its hybrid SWA pool.

    Args:
        window: what the config declares (:func:`sliding_window_of`).
        disable_hybrid_swa_memory: SGLang's flag, as resolved (the user's, or SGLang's model override).
        context_length: the server's context length in tokens (None: unknown).
        is_hybrid_swa: SGLang's `ModelConfig.is_hybrid_swa` (its own hybrid SWA pool for this model).
    """
    if disable_hybrid_swa_memory:
        return None
    covers_context = window.tokens is not None and context_length is not None and window.tokens >= context_length
    if covers_context and not is_hybrid_swa:
        return None
    keep_all = ("SGLang then keeps every token's KV of every layer in one full pool, which hiradix tiers; the "
                "sliding layers mask at attention time")
    if is_hybrid_swa:
        return (f"a sliding-window model ({window.described}) that SGLang serves from a separate SWA pool for its "
                f"sliding layers (hybrid SWA memory), which hiradix does not tier; add {DISABLE_HYBRID_SWA_FLAG} "
                f"to serve it ({keep_all})")
    size = f"{window.tokens} tokens" if window.tokens else "size not stated"
    shorter = f", or --context-length {window.tokens} or less," if window.tokens else ""
    return (f"a sliding-window model ({window.described}) whose window ({size}) is shorter than the context "
            f"({context_length} tokens) while {DISABLE_HYBRID_SWA_FLAG} is off; add {DISABLE_HYBRID_SWA_FLAG}"
            f"{shorter} to serve it ({keep_all})")


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


def unsupported_model_config_reason(model_config: Any, disable_hybrid_swa_memory: bool | None = None) -> str | None:
    """Why hiradix cannot serve a model, from SGLang's own `ModelConfig`, or None.

    The authoritative form of `unsupported_model_reason` (SGLang's classification).

    Args:
        model_config: SGLang's `ModelConfig` of the server.
        disable_hybrid_swa_memory: SGLang's resolved flag; None: the one `model_config` was built
            with (a `ModelConfig` built during resolution may predate SGLang's model override).
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
    if getattr(model_config, "is_local_attention_model", False):
        return f"a chunked local-attention model (architectures={archs})"
    if any(f(model_config) is not None for f in (mambaish_config, kimi_linear_config, glm5_next_config)):
        return f"a Mamba/SSM/linear-attention hybrid (architectures={archs})"
    if is_deepseek_dsa(model_config.hf_config):
        return f"a DeepSeek sparse-attention model (architectures={archs})"
    return _model_config_sliding_reason(model_config, disable_hybrid_swa_memory, archs)


def _model_config_sliding_reason(model_config: Any, disable: bool | None, archs: list[str]) -> str | None:
    """:func:`sliding_window_reason` on SGLang's text config, hybrid flag and context length."""
    if disable is None:
        disable = bool(getattr(model_config, "disable_hybrid_swa_memory", False))
    is_hybrid_swa = bool(getattr(model_config, "is_hybrid_swa", False)) and not disable
    if not is_hybrid_swa:
        # SGLang's own classification: one full pool for every layer (a sliding layer, if the model
        # applies its window at all, masks at attention time), which hiradix tiers exactly as stock caches it.
        return None
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    try:
        window = sliding_window_of(text.to_dict())
    except (AttributeError, TypeError, ValueError):  # no to_dict: SGLang's hybrid flag alone decides
        window = None
    if window is None and is_hybrid_swa:
        window = SlidingWindow(None, f"architectures={archs}")
    if window is None:
        return None
    context = _int_or_none(getattr(model_config, "context_len", None))
    return sliding_window_reason(window, disable, context, is_hybrid_swa=is_hybrid_swa)


def unsupported_device_pool_reason(kv_pool: Any) -> str | None:
    """Why hiradix cannot tier the device KV pool SGLang built, or None for a plain full pool.

    Served: SGLang's per-head pool (`MHATokenToKVPool` and its subclasses) and its MLA pool
    (`MLATokenToKVPool`). Refused: the hybrid pools (`SWAKVPool` and the other `BaseSWAKVPool`s,
    `HybridLinearKVPool`) and any other pool class.
    """
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
    )

    name = type(kv_pool).__name__
    if isinstance(kv_pool, BaseSWAKVPool):
        return (f"SGLang built a hybrid sliding-window KV pool ({name}: the sliding layers keep only their "
                f"window), which hiradix does not tier; start the server with {DISABLE_HYBRID_SWA_FLAG} "
                "(one full pool for every layer)")
    if isinstance(kv_pool, HybridLinearKVPool):
        return f"SGLang built a Mamba/linear-attention hybrid KV pool ({name}), which hiradix does not tier"
    if not isinstance(kv_pool, (MHATokenToKVPool, MLATokenToKVPool)):
        return f"SGLang built a {name} KV pool, not a per-head (MHATokenToKVPool) or MLA (MLATokenToKVPool) pool"
    return None
