"""SGLang DP attention on the CPU engine: padded batches and the idle DP rank's empty batch.

What it changes, in the installed sglang 0.5.23:
1. `srt/layers/attention/torch_native_backend.py`: `TorchNativeAttnBackend` gets
   `get_cpu_graph_seq_len_fill_value()` returning 1, as `IntelAMXAttnBackend` (the other CPU
   backend, `intel_amx_backend.py`) does.
2. `srt/layers/rotary_embedding/base.py`: `forward_native` returns `query, key` unchanged when
   the batch has no token.

Why: with `--attn-dp-size N` (DP attention) every DP rank runs each forward in lock step, so a
DP rank without requests runs an empty (idle) batch and batches are padded across ranks.
`ForwardBatch._pad_inputs_to_size` (`model_executor/forward_batch_info.py`) asks the backend for
the sequence-length fill value, which the torch-native backend lacks (AttributeError at the first
batch); then the idle rank's zero-token batch fails in the rotary embedding ("cannot reshape
tensor of 0 elements into shape [0, -1, 64]"). With both, stock DP attention serves the
DeepSeek presets on CPU with the greedy outputs of `--tp-size 2` (README, "What hiradix serves",
footnote 1). Dense Llama models still cannot use DP attention in stock 0.5.23 (their embedding
and head split span the whole TP group; same footnote). CUDA paths are unchanged: backends there
have their own fill value, and a non-empty batch takes the same rotary path as before.
"""

from __future__ import annotations

from _patchlib import Edit, edit_files, installed_file, require_sglang_version

NAME = "dp-attention-cpu"
MARKER = "hiradix-patch: dp-attention-cpu"

BACKEND_ANCHOR = """    def init_forward_metadata(self, forward_batch: ForwardBatch):
        \"\"\"Init the metadata for a forward pass.\"\"\"
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
"""
BACKEND_REPLACEMENT = f"""    # {MARKER} (hiradix patches/p08_dp_attention_cpu.py):
    # DP attention pads batches across DP ranks; the CPU fill value, as IntelAMXAttnBackend's.
    def get_cpu_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        \"\"\"Init the metadata for a forward pass.\"\"\"
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
"""
ROTARY_ANCHOR = """        positions = positions.flatten()
        num_tokens = positions.shape[0]

        if hasattr(self, "sin_cos_cache"):
"""
ROTARY_REPLACEMENT = f"""        positions = positions.flatten()
        num_tokens = positions.shape[0]
        if num_tokens == 0:  # {MARKER} (hiradix patches/p08_dp_attention_cpu.py): an idle DP rank's batch
            return query, key

        if hasattr(self, "sin_cos_cache"):
"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    targets = [
        (installed_file("sglang", "sglang/srt/layers/attention/torch_native_backend.py"),
         [Edit(BACKEND_ANCHOR, BACKEND_REPLACEMENT)]),
        (installed_file("sglang", "sglang/srt/layers/rotary_embedding/base.py"),
         [Edit(ROTARY_ANCHOR, ROTARY_REPLACEMENT)]),
    ]
    return edit_files(targets, MARKER)
