"""SGLang torch-native attention: an extend (prefill after a cache hit) computes only its new queries.

What it changes, in the installed sglang 0.5.23: `srt/layers/attention/torch_native_backend.py`,
`TorchNativeAttnBackend._run_sdpa_forward_extend`. For a causal self-attention request with a
cached prefix (`extend_prefix_lens > 0`, no sliding window, no encoder), it calls
`scaled_dot_product_attention` with the request's new queries only (`extend_len` rows) against
all its keys and values (`prefix + extend_len` columns) under a lower-right causal mask (row i
sees columns `<= prefix + i`). Requests without a cached prefix, sliding-window and cross
attention keep the stock code path.

Why: stock builds a "redundant" query of the full sequence length (the prefix rows left
uninitialised) and runs full causal attention over prefix + new tokens, then keeps the new rows.
So on this backend a request whose history came from the cache still pays attention for the
whole history: O(L^2) instead of O(new x L). The GPU backends SGLang ships (FlashInfer, FA3,
Triton extend kernels) compute only the new queries; without this patch the CPU A/B would charge
every cache hit (stock RadixAttention's, HiCache's and hiradix's alike) for work no GPU server
does. The masked rows are the same dot products the stock path computes for those rows, so the
attention output agrees with the stock path to float rounding (tests/test_patches.py).
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "torch-native-extend-new-queries"
MARKER = "hiradix-patch: torch-native-extend-new-queries"

ANCHOR = """            per_req_out_redudant = (
                scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0),
"""
REPLACEMENT = f"""            # {MARKER} (hiradix patches/p04_torch_native_extend_new_queries.py):
            # with a cached prefix, attend from the new queries only (lower-right causal mask).
            if (
                causal
                and encoder_lens is None
                and int(prefill_seq_len_q) > 0
                and (sliding_window_size is None or sliding_window_size <= -1)
            ):
                _new_len, _kv_len = int(extend_seq_len_q), int(seq_len_kv)
                _mask = torch.ones((_new_len, _kv_len), dtype=torch.bool, device=per_req_query.device)
                _mask = _mask.tril(_kv_len - _new_len)
                output[start_q:end_q, :, :] = (
                    scaled_dot_product_attention(
                        per_req_query.unsqueeze(0),
                        per_req_key.unsqueeze(0),
                        per_req_value.unsqueeze(0),
                        attn_mask=_mask,
                        enable_gqa=enable_gqa,
                        scale=scaling,
                    )
                    .squeeze(0)
                    .movedim(query.dim() - 2, 0)
                )
                start_q, start_kv = end_q, end_kv
                continue
{ANCHOR}"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/layers/attention/torch_native_backend.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
