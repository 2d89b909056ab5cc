"""SGLang torch-native attention with per-head attention sinks (gpt-oss), and gpt-oss accepted on it.

What it changes, in the installed sglang 0.5.23:

- `srt/layers/attention/torch_native_backend.py` (after p12, whose windowed reads it keeps):
  - `_sdpa_with_sinks` (new, module level): attention whose softmax, per head, runs over the
    keys' scores and one more logit, the head's sink, and drops the sink's probability (the
    real keys' weights sum to less than one): `softmax([q.k * scale (masked), sink_h])[:-1] @ V`,
    in float32, returned in the query's dtype. It takes `scaled_dot_product_attention`'s
    arguments (a bool or float `attn_mask`, `is_causal` top-left as SDPA's, `enable_gqa`,
    `scale`), plus `sinks` ([num_heads]). `_sdpa_for(sinks)` (new) gives SDPA itself when
    `sinks` is None, else `_sdpa_with_sinks` with the sinks bound.
  - `forward_extend` / `forward_decode` take `sinks=None` (as the Triton backend's do; gpt-oss's
    `GptOssAttention` passes `sinks=self.sinks` to every attention call) and pass it to
    `_run_sdpa_forward_extend` / `_run_sdpa_forward_decode` (new keyword `sinks`, default None).
  - Those two bind the name `scaled_dot_product_attention`, for their whole body, to
    `_sdpa_for(sinks)`: every attention they compute - stock's full-causal and windowed reads,
    p04's new-queries-only extend, p12's window reads of sliding layers (with and without the
    SWA pool) - applies the sinks; without sinks they call SDPA exactly as before.
- `srt/arg_groups/model_hook.py`: `torch_native` joins the attention backends that
  `GptOssForCausalLM` accepts (the assertion in `_handle_model_specific_adjustments`).

Why: stock SGLang refuses gpt-oss on the torch-native backend, the one that runs on a CPU without
AMX, while resolving the flags (`--attention-backend torch_native`):

    AssertionError: GptOssForCausalLM requires one of ['triton', 'trtllm_mha', 'fa3', 'fa4', 'ascend',
    'intel_amx', 'intel_xpu', 'aiter'] attention backend, but got the following backends
    - Prefill: torch_native
    - Decode: torch_native

(`srt/arg_groups/model_hook.py`; SGLang's comment: "torch_native has neither sliding window nor
attention sinks"). Without `--attention-backend`, the resolution picks intel_amx for a CPU (the
assertion passes), then, on a CPU without AMX, falls back to torch_native ("The current platform
does not support Intel AMX, will fallback to torch_native backend."), and the scheduler dies at its
first forward: `TypeError:
TorchNativeAttnBackend.forward_extend() got an unexpected keyword argument 'sinks'`
(`radix_attention.py` -> `base_attn_backend.py forward`). Stock
torch-native applies sliding windows (`_make_sliding_window_mask`) and p12 reads them from the
hybrid SWA pool; this patch adds the sinks, so the backend computes gpt-oss's attention as HF
transformers' `eager_attention_forward` does (concatenate the sink logit, softmax, drop it).
The other backends the assertion lists stay as they were.
"""

from __future__ import annotations

from _patchlib import Edit, PatchError, edit_files, installed_file, require_sglang_version

NAME = "torch-native-sinks"
MARKER = "hiradix-patch: torch-native-sinks"
_TAG = f"# {MARKER} (hiradix patches/p13_torch_native_sinks.py)"
# p12's tag: this patch's anchors include p12's lines (it applies after p12, keeping its window reads).
_P12_MARKER = "hiradix-patch: torch-native-swa-pool"
_P12_TAG = f"# {_P12_MARKER} (hiradix patches/p12_torch_native_swa_pool.py)"

BACKEND_REL = "sglang/srt/layers/attention/torch_native_backend.py"
MODEL_HOOK_REL = "sglang/srt/arg_groups/model_hook.py"

HELPER_ANCHOR = """from sglang.srt.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
"""
HELPER_REPLACEMENT = f'''from sglang.srt.model_executor.forward_batch_info import ForwardBatch


{_TAG}:
# attention with per-head sinks (gpt-oss): each head's softmax runs over its keys' scores and one
# more logit, the head's sink, whose probability is dropped. scaled_dot_product_attention's
# arguments (bool or float attn_mask, top-left is_causal, enable_gqa); float32 inside.
def _sdpa_with_sinks(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    sinks,
):
    q, k, v = query.float(), key.float(), value.float()
    heads = q.shape[-3]
    if k.shape[-3] != heads:
        k = k.repeat_interleave(heads // k.shape[-3], dim=-3)
        v = v.repeat_interleave(heads // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (
        q.shape[-1] ** -0.5 if scale is None else scale
    )
    if is_causal:
        attn_mask = torch.ones(
            scores.shape[-2:], dtype=torch.bool, device=scores.device
        ).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    sink = sinks.float().view(heads, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(query.dtype)


def _sdpa_for(sinks):
    """scaled_dot_product_attention, or attention with these per-head sinks."""
    if sinks is None:
        return scaled_dot_product_attention

    def attend(*args, **kwargs):
        return _sdpa_with_sinks(*args, sinks=sinks, **kwargs)

    return attend


if TYPE_CHECKING:
'''

# The new parameter goes before p12's lines, so that p12's own replacement text stays whole (its
# tests take it out of, and put it back into, the installed file).
EXTEND_SIGNATURE_ANCHOR = f'''        is_cross_attn=False,
        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_P12_TAG}
    ):
        """Run the extend forward by using torch native sdpa op.
'''
EXTEND_SIGNATURE_REPLACEMENT = f'''        is_cross_attn=False,
        sinks=None,  {_TAG}
        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_P12_TAG}
    ):
        """Run the extend forward by using torch native sdpa op.
'''

DECODE_SIGNATURE_ANCHOR = f'''        is_cross_attn=False,
        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_P12_TAG}
    ):
        """Run the decode forward by using torch native sdpa op.
'''
DECODE_SIGNATURE_REPLACEMENT = f'''        is_cross_attn=False,
        sinks=None,  {_TAG}
        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_P12_TAG}
    ):
        """Run the decode forward by using torch native sdpa op.
'''

_BIND = f"""        {_TAG}:
        # every attention below (stock's, p04's, p12's) applies the layer's sinks, if any.
        scaled_dot_product_attention = _sdpa_for(sinks)
"""

EXTEND_BODY_ANCHOR = """        assert seq_lens.shape[0] == extend_prefix_lens.shape[0]
        assert seq_lens.shape[0] == extend_seq_lens.shape[0]
"""
EXTEND_BODY_REPLACEMENT = EXTEND_BODY_ANCHOR + _BIND

DECODE_BODY_ANCHOR = """        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            # TODO: this loop process a sequence per iter, this is inefficient.
            # Need optimize the performance later.

            seq_len_q = 1
"""
DECODE_BODY_REPLACEMENT = _BIND + DECODE_BODY_ANCHOR

FORWARD_EXTEND_ANCHOR = """        save_kv_cache=True,
    ):
        if layer.qk_head_dim != layer.v_head_dim:
"""
FORWARD_EXTEND_REPLACEMENT = f"""        save_kv_cache=True,
        sinks=None,  {_TAG}
    ):
        if layer.qk_head_dim != layer.v_head_dim:
"""

FORWARD_DECODE_ANCHOR = """        save_kv_cache=True,
    ):
        # During torch.compile, there is a bug in rotary_emb that causes the
"""
FORWARD_DECODE_REPLACEMENT = f"""        save_kv_cache=True,
        sinks=None,  {_TAG}
    ):
        # During torch.compile, there is a bug in rotary_emb that causes the
"""

EXTEND_CALL_ANCHOR = """            enable_gqa=use_gqa,
            causal=causal,
"""
EXTEND_CALL_REPLACEMENT = f"""            enable_gqa=use_gqa,
            sinks=sinks,  {_TAG}
            causal=causal,
"""

DECODE_CALL_ANCHOR = """            enable_gqa=use_gqa,
            causal=False,
"""
DECODE_CALL_REPLACEMENT = f"""            enable_gqa=use_gqa,
            sinks=sinks,  {_TAG}
            causal=False,
"""

BACKEND_EDITS = [
    Edit(HELPER_ANCHOR, HELPER_REPLACEMENT),
    Edit(EXTEND_SIGNATURE_ANCHOR, EXTEND_SIGNATURE_REPLACEMENT),
    Edit(DECODE_SIGNATURE_ANCHOR, DECODE_SIGNATURE_REPLACEMENT),
    Edit(EXTEND_BODY_ANCHOR, EXTEND_BODY_REPLACEMENT),
    Edit(DECODE_BODY_ANCHOR, DECODE_BODY_REPLACEMENT),
    Edit(FORWARD_EXTEND_ANCHOR, FORWARD_EXTEND_REPLACEMENT),
    Edit(FORWARD_DECODE_ANCHOR, FORWARD_DECODE_REPLACEMENT),
    Edit(EXTEND_CALL_ANCHOR, EXTEND_CALL_REPLACEMENT),
    Edit(DECODE_CALL_ANCHOR, DECODE_CALL_REPLACEMENT),
]

BACKENDS_ANCHOR = """                "intel_xpu",
                "aiter",
            ]
            prefill_attn_backend, decode_attn_backend = attention_backends_of(
"""
BACKENDS_REPLACEMENT = f"""                "intel_xpu",
                "aiter",
                "torch_native",  {_TAG}: sliding windows and sinks
            ]
            prefill_attn_backend, decode_attn_backend = attention_backends_of(
"""

MODEL_HOOK_EDITS = [Edit(BACKENDS_ANCHOR, BACKENDS_REPLACEMENT)]


def apply() -> tuple[str, str]:
    require_sglang_version()
    backend = installed_file("sglang", BACKEND_REL)
    text = backend.read_text(encoding="utf-8")
    if MARKER not in text and _P12_MARKER not in text:
        raise PatchError(f"{backend}: p12 (torch-native-swa-pool) is not applied; this patch applies after it")
    model_hook = installed_file("sglang", MODEL_HOOK_REL)
    return edit_files([(backend, BACKEND_EDITS), (model_hook, MODEL_HOOK_EDITS)], MARKER)
