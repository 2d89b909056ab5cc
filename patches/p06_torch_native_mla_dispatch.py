"""SGLang DeepSeek attention on the torch-native backend: every forward takes the absorbed MLA path.

What it changes, in the installed sglang 0.5.23:
`srt/models/deepseek_common/attention_backend_handler.py` registers a handler for
`torch_native` in `AttentionBackendRegistry`; it returns the absorbed MLA method
(`_dispatch_mla_subtype`, i.e. `AttnForwardMethod.MLA`, or the CPU AMX variant where SGLang
picks it) for every forward: prefill, extend after a cache hit and decode alike.

Why: `torch_native` has no entry in the registry, so the DeepSeek attention (MLA models:
DeepSeek V2/V3/R1, Kimi K2) falls back to the `triton` handler, which sends an extend without a
cached prefix down the MHA path (`AttnForwardMethod.MHA`: per-head K of `qk_nope + qk_rope`
columns, V of `v_head_dim`). The torch-native backend's `forward_extend` then stores them into
`MLATokenToKVPool` and reads the pool's latent rows (`kv_lora_rank + qk_rope_head_dim` columns)
back as if they were those K/V, and the first prefill fails ("expected [4, 48] ... got [4, 80]"
for a 4-head model with a 64 + 16 latent). Decode and extends with a cached prefix already take
the absorbed path, which is correct on this backend; making every forward take it serves MLA
models on CPU with stock SGLang. Stock RadixAttention, SGLang HiCache and hiradix all run with
the patch, so comparisons stay fair. Other backends are unchanged.
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "torch-native-mla-dispatch"
MARKER = "hiradix-patch: torch-native-mla-dispatch"

ANCHOR = """AttentionBackendRegistry.register("intel_xpu", handle_attention_intel_xpu)
"""
REPLACEMENT = f"""AttentionBackendRegistry.register("intel_xpu", handle_attention_intel_xpu)


# {MARKER} (hiradix patches/p06_torch_native_mla_dispatch.py):
# the torch-native backend computes MLA only through the absorbed path (latent K, V = its first
# kv_lora_rank columns); the triton fallback would send a fresh prefill down the MHA path.
def handle_attention_torch_native(attn, forward_batch):
    return _dispatch_mla_subtype(attn, forward_batch)


AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)
"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/models/deepseek_common/attention_backend_handler.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
