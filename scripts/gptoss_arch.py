"""gpt-oss-architecture test model for scripts/make_model.py: per-head attention sinks, sliding and full layers, MoE.

One tiny preset with random weights, shaped after ``openai/gpt-oss-20b`` (``GptOssForCausalLM``,
``model_type`` ``gpt_oss``) as HF transformers stores it (bf16 experts, not MXFP4), scaled down:

- ``tiny-gpt-oss``: 4 layers, ``layer_types`` sliding, full, sliding, full (gpt-oss's alternation),
  a 32-token sliding window, GQA (4 query heads, 2 KV heads of 64), biases on q/k/v/o, one learned
  sink logit per query head, every MLP a MoE of 4 experts (top 2, a 128-wide clamped SwiGLU with
  biases, gate and up interleaved in ``gate_up_proj`` as gpt-oss's), a router with a bias, RoPE as
  gpt-oss's (YaRN: theta 150,000, factor 32, ``truncate`` false) scaled down: 32 x 256 original
  positions = the 8,192 of ``max_position_embeddings`` (gpt-oss: 32 x 4,096 = 131,072).

Attention sinks: each head's softmax runs over its keys' scores and one more logit, the head's sink
(``self_attn.sinks``), whose probability is dropped: the weights of the real keys sum to less than one.
SGLang 0.5.23 keeps sinks in bfloat16 (``GptOssAttention.sinks``, any backend but trtllm_mha), so
the sinks drawn here are bfloat16 values (stored as float32): HF transformers and SGLang use the same
numbers. Their scale (``SINK_STD``) is large enough that a sink takes a real share of a head's
probability (a sink of 2 weighs as ~7 keys), so outputs change without them.

SGLang lists ``GptOssForCausalLM`` in ``is_hybrid_swa_model`` (its hybrid SWA pool for the sliding
layers; ``--disable-hybrid-swa-memory`` keeps every layer's KV in one full pool). Checkpoint names are
HF's (SGLang's ``models/gpt_oss.py`` ``_load_normal_weights``: ``q_proj``/``k_proj``/``v_proj`` stacked
into ``qkv_proj``, ``mlp.experts.gate_up_proj`` [E, hidden, 2I] and ``down_proj`` [E, I, hidden]
transposed into ``w13_weight``/``w2_weight``). RMSNorm scales by ``weight``: norms are ones.
"""

from __future__ import annotations

from dataclasses import dataclass

SINK_STD = 1.0  # per-head sink logits ~ N(0, SINK_STD), rounded to bfloat16


@dataclass(frozen=True)
class GptOssPreset:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int  # of each expert
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int  # in tokens, the current token included (HF's convention)
    max_position_embeddings: int = 8192
    rope_theta: float = 150_000.0
    rope_factor: float = 32.0  # YaRN, as gpt-oss
    rope_original_max_position_embeddings: int = 256  # x rope_factor = max_position_embeddings
    swiglu_limit: float = 7.0

    @property
    def layer_types(self) -> list[str]:
        # gpt-oss: even layers sliding, odd layers full (transformers' GptOssConfig default)
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]


GPTOSS_PRESETS = {
    "tiny-gpt-oss": GptOssPreset(num_hidden_layers=4, hidden_size=256, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=32),
}  # fmt: skip


def gptoss_model_config(p: GptOssPreset, special_ids: dict[str, int], vocab_size: int, init_std: float,
                        bos: str, eos: str, pad: str) -> dict:
    """config.json of a gpt-oss model (the fields SGLang 0.5.23 and transformers 5.19 read)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
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
        "num_attention_heads": p.num_attention_heads,
        "num_experts_per_tok": p.num_experts_per_tok,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "num_local_experts": p.num_local_experts,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": p.rope_theta,
            "factor": p.rope_factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": p.rope_original_max_position_embeddings,
        },
        "router_aux_loss_coef": 0.9,
        "sliding_window": p.sliding_window,
        "swiglu_limit": p.swiglu_limit,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def gptoss_weight_shapes(p: GptOssPreset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name. Norm weights end in ``norm.weight`` (ones); the sinks
    end in ``self_attn.sinks`` (:func:`gptoss_sinks`)."""
    h, hd, e, i_size = p.hidden_size, p.head_dim, p.num_local_experts, p.intermediate_size
    q, kv = p.num_attention_heads * hd, p.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{pre}self_attn.{name}.weight"] = (rows, h)
            shapes[f"{pre}self_attn.{name}.bias"] = (rows,)
        shapes[pre + "self_attn.o_proj.weight"] = (h, q)
        shapes[pre + "self_attn.o_proj.bias"] = (h,)
        shapes[pre + "self_attn.sinks"] = (p.num_attention_heads,)
        shapes[pre + "mlp.router.weight"] = (e, h)
        shapes[pre + "mlp.router.bias"] = (e,)
        shapes[pre + "mlp.experts.gate_up_proj"] = (e, h, 2 * i_size)
        shapes[pre + "mlp.experts.gate_up_proj_bias"] = (e, 2 * i_size)
        shapes[pre + "mlp.experts.down_proj"] = (e, i_size, h)
        shapes[pre + "mlp.experts.down_proj_bias"] = (e, h)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def gptoss_sinks(shape: tuple[int, ...], generator):
    """Sink logits ~ N(0, SINK_STD), bfloat16 values stored as float32 (SGLang keeps them in bfloat16)."""
    import torch

    drawn = torch.empty(shape, dtype=torch.float32).normal_(0.0, SINK_STD, generator=generator)
    return drawn.to(torch.bfloat16).to(torch.float32)
