"""KV page size of a model from its config.json, before the model loads (flag checks).

The exact layout comes from SGLang's device pool once the model is loaded
(:meth:`hiradix.layout.KVLayout.from_device_pool`); this estimate lets the launcher refuse a
DRAM or NVMe budget that cannot hold a single page before minutes of model loading. The dtype
follows SGLang 0.5.23's resolution (``srt/configs/model_config.py``, ``_get_and_verify_dtype``):
``--dtype auto`` keeps a 16-bit checkpoint's dtype and turns float32 into 16-bit; an fp8
``--kv-cache-dtype`` stores 1 byte per element.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def kv_element_bytes(hf_config: Mapping[str, Any], dtype: str, kv_cache_dtype: Optional[str]) -> int:
    """Bytes per stored KV element: fp8 cache -> 1, else the resolved model dtype (4 or 2)."""
    if kv_cache_dtype and str(kv_cache_dtype).startswith("fp8"):
        return 1
    if dtype and dtype != "auto":
        return _BYTES.get(str(dtype), 2)
    return 2  # auto: a 16-bit checkpoint keeps 2 bytes, a float32 one is cast to 16-bit


def page_bytes_estimate(hf_config: Mapping[str, Any], page_size: int, tp_size: int, dtype: str,
                        kv_cache_dtype: Optional[str] = None) -> Optional[int]:
    """K and V bytes of one page of one TP rank (all layers), or None if the config lacks a size.

    ``2 x layers x page_size x max(1, kv_heads // tp_size) x head_dim x element bytes``.
    """
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), Mapping) else hf_config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_rank = max(1, kv_heads // max(1, tp_size))
    return 2 * layers * page_size * per_rank * head_dim * kv_element_bytes(text, dtype, kv_cache_dtype)
