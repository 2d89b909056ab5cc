"""DeepSeek-architecture test models for scripts/make_model.py: MLA attention and MoE MLPs.

Three tiny presets (tests) and one small one (benchmarks) with random weights, shaped after the families SGLang is known for serving
(numbers from their published config.json files, scaled down):

- ``tiny-deepseek-v2``: ``DeepseekV2ForCausalLM`` as DeepSeek-V2-Lite: no query LoRA
  (``q_lora_rank`` null), softmax gating with greedy top-k, one shared expert, the first layer dense.
- ``tiny-deepseek-v3``: ``DeepseekV3ForCausalLM``: query LoRA, sigmoid gating with
  ``noaux_tc`` (grouped top-k with the ``e_score_correction_bias``), ``first_k_dense_replace`` 1,
  ``routed_scaling_factor`` 2.5.
- ``tiny-kimi-k2``: Kimi K2's shape on the DeepSeek-V3 architecture: one expert group
  (``n_group`` = ``topk_group`` = 1), many small experts, top-8 of them, twice V3's experts per head.

All three use YaRN RoPE scaling as the real checkpoints do (SGLang's CPU rotary embedding for
DeepSeek models exists only for ``deepseek_yarn``). Every MLA layer caches one latent row of ``kv_lora_rank + qk_rope_head_dim`` elements per token
(SGLang's ``MLATokenToKVPool``). Checkpoint names follow the DeepSeek checkpoints that SGLang's
``models/deepseek_v2.py`` loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MLAPreset:
    architecture: str  # DeepseekV2ForCausalLM | DeepseekV3ForCausalLM
    model_type: str  # deepseek_v2 | deepseek_v3
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # one expert's MLP
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    topk_method: str  # greedy | noaux_tc
    scoring_func: str  # softmax | sigmoid
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    yarn_mscale: float = 1.0  # YaRN's mscale and mscale_all_dim (V2-Lite 0.707, V3 and K2 1.0)
    yarn_beta_fast: float = 32.0  # K2: 1
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    yarn_original_max_position: int = 1024  # x yarn_factor = max_position_embeddings
    yarn_factor: float = 8.0

    @property
    def latent_elements(self) -> int:
        """Elements of one token's cached row per layer (``kv_lora_rank + qk_rope_head_dim``)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


MLA_PRESETS = {
    "tiny-deepseek-v2": MLAPreset(
        "DeepseekV2ForCausalLM", "deepseek_v2", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, yarn_mscale=0.707),
    "tiny-deepseek-v3": MLAPreset(
        "DeepseekV3ForCausalLM", "deepseek_v3", num_hidden_layers=3, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    "tiny-kimi-k2": MLAPreset(
        "DeepseekV3ForCausalLM", "deepseek_v3", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=64, num_attention_heads=8, q_lora_rank=96, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=24, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, yarn_beta_fast=1.0),
    # Benchmarks (bench.ab --model models/small-deepseek-v2): ~140M parameters, a prefill that
    # costs enough on CPU for a cache hit to show in TTFT (like the dense `small`).
    "small-deepseek-v2": MLAPreset(
        "DeepseekV2ForCausalLM", "deepseek_v2", num_hidden_layers=8, hidden_size=1024, intermediate_size=2560,
        moe_intermediate_size=512, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, yarn_mscale=0.707),
}  # fmt: skip


def mla_model_config(p: MLAPreset, special_ids: dict[str, int], vocab_size: int, init_std: float,
                     bos: str, eos: str, pad: str) -> dict:
    """config.json of a DeepSeek-V2/V3 model (the fields SGLang 0.5.23 and transformers read)."""
    return {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[bos],
        "eos_token_id": special_ids[eos],
        "pad_token_id": special_ids[pad],
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": init_std,
        "intermediate_size": p.intermediate_size,
        "moe_intermediate_size": p.moe_intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "q_lora_rank": p.q_lora_rank,
        "kv_lora_rank": p.kv_lora_rank,
        "qk_nope_head_dim": p.qk_nope_head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "v_head_dim": p.v_head_dim,
        "n_routed_experts": p.n_routed_experts,
        "num_experts_per_tok": p.num_experts_per_tok,
        "n_shared_experts": p.n_shared_experts,
        "first_k_dense_replace": p.first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": p.topk_method,
        "scoring_func": p.scoring_func,
        "n_group": p.n_group,
        "topk_group": p.topk_group,
        "norm_topk_prob": p.norm_topk_prob,
        "routed_scaling_factor": p.routed_scaling_factor,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "ep_size": 1,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "rope_scaling": {  # YaRN as the DeepSeek and Kimi checkpoints have it (SGLang's CPU path needs it)
            "type": "yarn", "factor": p.yarn_factor, "original_max_position_embeddings": p.yarn_original_max_position,
            "beta_fast": p.yarn_beta_fast, "beta_slow": 1.0, "mscale": p.yarn_mscale, "mscale_all_dim": p.yarn_mscale,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _mlp(shapes: dict, prefix: str, hidden: int, inner: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (inner, hidden)
    shapes[prefix + "up_proj.weight"] = (inner, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, inner)


def _attention(shapes: dict, prefix: str, p: MLAPreset) -> None:
    h, heads = p.hidden_size, p.num_attention_heads
    qk_head = p.qk_nope_head_dim + p.qk_rope_head_dim
    if p.q_lora_rank is None:
        shapes[prefix + "q_proj.weight"] = (heads * qk_head, h)
    else:
        shapes[prefix + "q_a_proj.weight"] = (p.q_lora_rank, h)
        shapes[prefix + "q_a_layernorm.weight"] = (p.q_lora_rank,)
        shapes[prefix + "q_b_proj.weight"] = (heads * qk_head, p.q_lora_rank)
    shapes[prefix + "kv_a_proj_with_mqa.weight"] = (p.latent_elements, h)
    shapes[prefix + "kv_a_layernorm.weight"] = (p.kv_lora_rank,)
    shapes[prefix + "kv_b_proj.weight"] = (heads * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank)
    shapes[prefix + "o_proj.weight"] = (h, heads * p.v_head_dim)


def mla_weight_shapes(p: MLAPreset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name. Norm weights end in ``norm.weight`` (ones);
    the gate's ``e_score_correction_bias`` (noaux_tc only) is drawn like the others."""
    h = p.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        _attention(shapes, pre + "self_attn.", p)
        if i < p.first_k_dense_replace:
            _mlp(shapes, pre + "mlp.", h, p.intermediate_size)
            continue
        shapes[pre + "mlp.gate.weight"] = (p.n_routed_experts, h)
        if p.topk_method == "noaux_tc":
            shapes[pre + "mlp.gate.e_score_correction_bias"] = (p.n_routed_experts,)
        for e in range(p.n_routed_experts):
            _mlp(shapes, f"{pre}mlp.experts.{e}.", h, p.moe_intermediate_size)
        _mlp(shapes, pre + "mlp.shared_experts.", h, p.moe_intermediate_size * p.n_shared_experts)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab_size, h)
    return shapes
