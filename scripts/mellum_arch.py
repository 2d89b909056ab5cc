"""Mellum-architecture test model: sliding-window layers that SGLang serves from its hybrid SWA pool.

One tiny preset with random weights, shaped after ``JetBrains/Mellum2`` (``MellumForCausalLM``,
``model_type`` ``mellum``: a Qwen3-MoE variant with interleaved sliding-window / full attention
and per-layer-type RoPE), scaled down and without experts:

- ``tiny-mellum-swa``: 4 layers, ``layer_types`` sliding, sliding, full, sliding, a 32-token
  sliding window (so prompts of a few hundred tokens exceed it many times over), GQA (4 query
  heads, 2 KV heads of 64), q/k norms, every MLP dense (``mlp_layer_types`` all ``dense``: a
  SwiGLU MLP as Llama's; no MoE on the CPU path), RoPE theta 1,000,000 on the full layer and
  10,000 on the sliding ones.

Unlike Gemma 2/3 (one full pool, the window applied at attention time), SGLang 0.5.23 lists
``MellumForCausalLM`` in ``is_hybrid_swa_model`` (``srt/configs/model_config.py``), so a server
builds ``SWAKVPool``: the sliding layers' KV lives in a second, smaller pool whose slots are found
through ``full_to_swa_index_mapping`` and freed once they fall out of the window (the SWA radix
tree keeps tombstones for them). ``--disable-hybrid-swa-memory`` serves the same model from one
full pool. transformers 5.19 has the architecture too (``transformers.MellumForCausalLM``).

Checkpoint names are HF Mellum's (SGLang's ``models/mellum.py`` stacks ``q_proj``/``k_proj``/
``v_proj`` and ``gate_proj``/``up_proj`` at load). RMSNorm scales by ``weight``: norms are ones.
SGLang's layers take ``sliding_window - 1`` as ``sliding_window_size`` (the keys a query sees
besides itself); HF's ``sliding_window`` counts the current token: both see 32 keys.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MellumPreset:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int  # in tokens, the current token included (HF's convention)
    layer_pattern: str  # one letter a layer: S sliding-window attention, F full attention
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_local_theta: float = 10_000.0  # sliding layers
    # Unused by dense layers, but SGLang's Qwen3-MoE base and HF's config read them.
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64

    @property
    def layer_types(self) -> list[str]:
        kinds = {"S": "sliding_attention", "F": "full_attention"}
        return [kinds[c] for c in self.layer_pattern]


MELLUM_PRESETS = {
    "tiny-mellum-swa": MellumPreset(num_hidden_layers=4, hidden_size=256, intermediate_size=704,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=32,
                                    layer_pattern="SSFS"),
}  # fmt: skip


def mellum_model_config(p: MellumPreset, special_ids: dict[str, int], vocab_size: int, init_std: float,
                        bos: str, eos: str, pad: str) -> dict:
    """config.json of a Mellum model (the fields SGLang 0.5.23 and transformers 5.19 read)."""
    if len(p.layer_types) != p.num_hidden_layers:
        raise ValueError(f"layer_types has {len(p.layer_types)} entries for {p.num_hidden_layers} layers")
    return {
        "architectures": ["MellumForCausalLM"],
        "model_type": "mellum",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[bos],
        "eos_token_id": special_ids[eos],
        "pad_token_id": special_ids[pad],
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": init_std,
        "intermediate_size": p.intermediate_size,
        "layer_types": p.layer_types,
        "max_position_embeddings": p.max_position_embeddings,
        "mlp_layer_types": ["dense"] * p.num_hidden_layers,
        "moe_intermediate_size": p.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": p.num_attention_heads,
        "num_experts": p.num_experts,
        "num_experts_per_tok": p.num_experts_per_tok,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_local_theta},
        },
        "sliding_window": p.sliding_window,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def mellum_weight_shapes(p: MellumPreset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name. Norm weights end in ``norm.weight`` (ones)."""
    h, hd = p.hidden_size, p.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
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
    shapes["lm_head.weight"] = (vocab_size, h)
    return shapes
