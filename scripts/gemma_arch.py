"""Gemma-3-architecture test model for scripts/make_model.py: sliding-window layers beside a global one.

One tiny preset with random weights, shaped after ``google/gemma-3-1b`` (``Gemma3ForCausalLM``,
``model_type`` ``gemma3_text``), scaled down:

- ``tiny-gemma3``: 3 layers, ``layer_types`` sliding, sliding, full (``sliding_window_pattern`` 3:
  every third layer global), a 64-token sliding window, GQA (4 query heads, 2 KV heads of 64),
  tied embeddings (scaled by sqrt(hidden_size)), q/k norms, four norms per layer, GeLU-tanh MLP,
  RoPE theta 10,000 on the sliding layers and 1,000,000 on the global one.

SGLang 0.5.23 serves Gemma 2/3 from one full KV pool (``MHATokenToKVPool``): its model override
(``arg_groups/model_overrides/gemma2_gemma3.py``) turns on ``--disable-hybrid-swa-memory``, and
the architecture is not in ``is_hybrid_swa_model``'s list either; the sliding layers mask keys
older than the window at attention time. Checkpoint names follow the Gemma 3 checkpoints that
SGLang's ``models/gemma3_causal.py`` loads (``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` are stacked at load; ``lm_head`` is the embedding, so it is absent).
Gemma's RMSNorm scales by ``1 + weight``: norm weights are zeros (the identity).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmaPreset:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int  # in tokens, the current token included (HF's convention)
    sliding_window_pattern: int  # every pattern-th layer is global (full attention)
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # sliding layers

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)]


GEMMA_PRESETS = {
    "tiny-gemma3": GemmaPreset(num_hidden_layers=3, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, sliding_window=64, sliding_window_pattern=3),
}  # fmt: skip


def gemma_model_config(p: GemmaPreset, special_ids: dict[str, int], vocab_size: int, init_std: float,
                       bos: str, eos: str, pad: str) -> dict:
    """config.json of a Gemma 3 text model (the fields SGLang 0.5.23 and transformers read)."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": special_ids[bos],
        "eos_token_id": special_ids[eos],
        "pad_token_id": special_ids[pad],
        "final_logit_softcapping": None,
        "head_dim": p.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": p.hidden_size,
        "initializer_range": init_std,
        "intermediate_size": p.intermediate_size,
        "layer_types": p.layer_types,
        "max_position_embeddings": p.max_position_embeddings,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "query_pre_attn_scalar": p.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {  # transformers 5's per-layer-type form (SGLang reads both forms)
            "full_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_local_base_freq},
        },
        "sliding_window": p.sliding_window,
        "sliding_window_pattern": p.sliding_window_pattern,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_bidirectional_attention": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def gemma_weight_shapes(p: GemmaPreset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name. Norm weights end in ``norm.weight`` (zeros)."""
    h, hd = p.hidden_size, p.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[f"{pre}{norm}.weight"] = (h,)
        shapes[pre + "self_attn.q_proj.weight"] = (p.num_attention_heads * hd, h)
        shapes[pre + "self_attn.k_proj.weight"] = (p.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.v_proj.weight"] = (p.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.o_proj.weight"] = (h, p.num_attention_heads * hd)
        shapes[pre + "self_attn.q_norm.weight"] = (hd,)
        shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        shapes[pre + "mlp.gate_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.up_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.down_proj.weight"] = (h, p.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    return shapes
