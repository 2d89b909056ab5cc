"""SGLang torch-native attention on the hybrid SWA pool: sliding layers read their window, at SWA-pool slots.

What it changes, in the installed sglang 0.5.23: `srt/layers/attention/torch_native_backend.py`.

- `TorchNativeAttnBackend._swa_loc_translate(layer)` (new): the pool's
  `translate_loc_from_full_to_swa` when the backend serves an `SWAKVPool` and `layer` is one of
  its sliding-window layers (`layers_mapping[layer_id]` says so), else None.
- `forward_extend` / `forward_decode` pass it to `_run_sdpa_forward_extend` /
  `_run_sdpa_forward_decode` (new keyword `kv_loc_translate`, default None).
- A causal sliding-window layer (`sliding_window_size` >= 0, no encoder) reads only the keys its
  queries can see: an extend of `new` tokens after a `prefix` reads `req_to_token` from
  `max(0, prefix - window)` to the end and attends from its new queries only, under the window
  mask (`_make_sliding_window_mask` with the query offset); a decode reads the last
  `window + 1` tokens, all visible, without a mask. The `req_to_token` locations are translated
  with `kv_loc_translate` before they index the cache. This path serves sliding layers with and
  without the SWA pool (`--disable-hybrid-swa-memory`), so both give the same float results.
- Any other read (full-attention layers, cross attention) translates too when given a translator
  (none does with the pools SGLang builds today: SWA-pool layers are sliding-window layers).

Why: with a model that SGLang serves from its hybrid SWA pool (`is_hybrid_swa_model`: Mellum,
Gemma 4, GPT-OSS, Llama 4, ...; the sliding layers' KV in a second, smaller pool found through
`full_to_swa_index_mapping`, slots freed once they leave the window), stock torch-native
translates the writes (`KVWriteLoc(out_cache_loc, swa_out_cache_loc)`) but indexes the SWA
pool's buffers with full-pool locations on every read. Once a full-pool location exceeds the
SWA pool's size the scheduler dies (`IndexError: index 1639 is out of bounds for dimension 0
with size 1639`, `_run_sdpa_forward_decode`, on the fifth 300-token prompt of a 2,048-token
pool); before that, and always with `--swa-full-tokens-ratio 1.0`, the reads land on other
tokens' KV and outputs past the window are silently wrong. The Triton and FlashInfer backends
translate their window's indices (`update_sliding_window_buffer` in `triton_backend.py`); this
does the same. Reading only the window also keeps the reads off slots the SWA pool has freed
(the mapping sends them to the dummy slot 0), which stock's full-length read would touch, and
makes a sliding layer's attention O(new x window) instead of O(L^2) (stock builds the full
causal query, as p04 describes, for every sliding layer).

The window is stock torch-native's, unchanged: `_make_sliding_window_mask` keeps key positions
`q - sliding_window_size .. q`, i.e. `sliding_window_size + 1` keys, and SGLang's models pass
`config.sliding_window - 1` (Mellum, Gemma): the `sliding_window` keys HF transformers
attends to, current token included. The SWA radix cache keeps that many (it frees below
`pre_len - sliding_window_size`).
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "torch-native-swa-pool"
MARKER = "hiradix-patch: torch-native-swa-pool"
_TAG = f"# {MARKER} (hiradix patches/p12_torch_native_swa_pool.py)"

HELPER_ANCHOR = '''    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Init the metadata for a forward pass."""
'''
HELPER_REPLACEMENT = f'''    {_TAG}:
    # full-pool locations -> SWA-pool locations for a layer whose KV lives in the SWA pool.
    def _swa_loc_translate(self, layer):
        if self.use_sliding_window_kv_pool and not layer.is_cross_attention:
            _, is_swa_layer = self.token_to_kv_pool.layers_mapping[layer.layer_id]
            if is_swa_layer:
                return self.token_to_kv_pool.translate_loc_from_full_to_swa
        return None

{HELPER_ANCHOR}'''

EXTEND_SIGNATURE_ANCHOR = '''        sliding_window_size: Optional[int] = None,
    ):
        """Run the extend forward by using torch native sdpa op.
'''
EXTEND_SIGNATURE_REPLACEMENT = f'''        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_TAG}
    ):
        """Run the extend forward by using torch native sdpa op.
'''

DECODE_SIGNATURE_ANCHOR = '''        sliding_window_size: Optional[int] = None,
    ):
        """Run the decode forward by using torch native sdpa op.
'''
DECODE_SIGNATURE_REPLACEMENT = f'''        sliding_window_size: Optional[int] = None,
        kv_loc_translate=None,  {_TAG}
    ):
        """Run the decode forward by using torch native sdpa op.
'''

EXTEND_WINDOW_ANCHOR = """            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
"""
EXTEND_WINDOW_REPLACEMENT = f"""            per_req_query = query[:, start_q:end_q, :]
            {_TAG}:
            # a sliding layer reads the keys its new queries can see (translated to the SWA
            # pool's slots) and attends from the new queries only, under the window mask.
            if (
                causal
                and encoder_lens is None
                and sliding_window_size is not None
                and sliding_window_size > -1
            ):
                _window = int(sliding_window_size)
                _prefix, _new, _kv_len = int(prefill_seq_len_q), int(extend_seq_len_q), int(seq_len_kv)
                _lo = max(0, _prefix - _window)
                _locs = req_to_token[req_pool_indices[seq_idx], _lo:_kv_len]
                if kv_loc_translate is not None:
                    _locs = kv_loc_translate(_locs)
                _key = k_cache[_locs].movedim(0, query.dim() - 2)
                _value = v_cache[_locs].movedim(0, query.dim() - 2)
                if not (per_req_query.dtype == _key.dtype == _value.dtype):
                    _key = _key.to(per_req_query.dtype)
                    _value = _value.to(per_req_query.dtype)
                _mask = self._make_sliding_window_mask(
                    q_len=_new,
                    kv_len=_kv_len - _lo,
                    sliding_window_size=_window,
                    device=per_req_query.device,
                    query_offset=_prefix - _lo,
                )
                output[start_q:end_q, :, :] = (
                    scaled_dot_product_attention(
                        per_req_query.unsqueeze(0),
                        _key.unsqueeze(0),
                        _value.unsqueeze(0),
                        attn_mask=_mask,
                        enable_gqa=enable_gqa,
                        scale=scaling,
                    )
                    .squeeze(0)
                    .movedim(query.dim() - 2, 0)
                )
                start_q, start_kv = end_q, end_kv
                continue
            per_req_query_redudant = torch.empty(
"""

EXTEND_TRANSLATE_ANCHOR = """            # index for each token in the sequence.
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, start_kv:end_kv]
"""
EXTEND_TRANSLATE_REPLACEMENT = f"""            # index for each token in the sequence.
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, start_kv:end_kv]
            if kv_loc_translate is not None:  {_TAG}
                per_req_tokens = kv_loc_translate(per_req_tokens)
"""

DECODE_WINDOW_ANCHOR = """            per_req_query = query[:, start_q:end_q, :]

            # get key and value from cache. per_req_tokens contains the kv cache
            # index for each token in the sequence.

            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, start_kv:end_kv]
"""
DECODE_WINDOW_REPLACEMENT = f"""            per_req_query = query[:, start_q:end_q, :]

            {_TAG}:
            # a sliding layer reads its window (every key visible: no mask), translated to
            # the SWA pool's slots.
            if (
                encoder_lens is None
                and sliding_window_size is not None
                and sliding_window_size > -1
            ):
                _kv_len = int(seq_len_kv)
                _lo = max(0, _kv_len - 1 - int(sliding_window_size))
                _locs = req_to_token[req_pool_indices[seq_idx], _lo:_kv_len]
                if kv_loc_translate is not None:
                    _locs = kv_loc_translate(_locs)
                _key = k_cache[_locs].movedim(0, query.dim() - 2)
                _value = v_cache[_locs].movedim(0, query.dim() - 2)
                if not (per_req_query.dtype == _key.dtype == _value.dtype):
                    _key = _key.to(per_req_query.dtype)
                    _value = _value.to(per_req_query.dtype)
                output[start_q:end_q, :, :] = (
                    scaled_dot_product_attention(
                        per_req_query.unsqueeze(0),
                        _key.unsqueeze(0),
                        _value.unsqueeze(0),
                        enable_gqa=enable_gqa,
                        scale=scaling,
                    )
                    .squeeze(0)
                    .movedim(query.dim() - 2, 0)
                )
                start_q, start_kv = end_q, end_kv
                continue

            # get key and value from cache. per_req_tokens contains the kv cache
            # index for each token in the sequence.

            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, start_kv:end_kv]
            if kv_loc_translate is not None:
                per_req_tokens = kv_loc_translate(per_req_tokens)
"""

EXTEND_CALL_ANCHOR = """            is_cross_attn=layer.is_cross_attention,
            sliding_window_size=(
                layer.sliding_window_size
                if causal
"""
EXTEND_CALL_REPLACEMENT = f"""            is_cross_attn=layer.is_cross_attention,
            kv_loc_translate=self._swa_loc_translate(layer),  {_TAG}
            sliding_window_size=(
                layer.sliding_window_size
                if causal
"""

DECODE_CALL_ANCHOR = """            causal=False,
            is_cross_attn=layer.is_cross_attention,
            sliding_window_size=(
"""
DECODE_CALL_REPLACEMENT = f"""            causal=False,
            is_cross_attn=layer.is_cross_attention,
            kv_loc_translate=self._swa_loc_translate(layer),  {_TAG}
            sliding_window_size=(
"""

EDITS = [
    Edit(HELPER_ANCHOR, HELPER_REPLACEMENT),
    Edit(EXTEND_SIGNATURE_ANCHOR, EXTEND_SIGNATURE_REPLACEMENT),
    Edit(DECODE_SIGNATURE_ANCHOR, DECODE_SIGNATURE_REPLACEMENT),
    Edit(EXTEND_WINDOW_ANCHOR, EXTEND_WINDOW_REPLACEMENT),
    Edit(EXTEND_TRANSLATE_ANCHOR, EXTEND_TRANSLATE_REPLACEMENT),
    Edit(DECODE_WINDOW_ANCHOR, DECODE_WINDOW_REPLACEMENT),
    Edit(EXTEND_CALL_ANCHOR, EXTEND_CALL_REPLACEMENT),
    Edit(DECODE_CALL_ANCHOR, DECODE_CALL_REPLACEMENT),
]


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/layers/attention/torch_native_backend.py")
    return edit_file(path, MARKER, EDITS), str(path)
