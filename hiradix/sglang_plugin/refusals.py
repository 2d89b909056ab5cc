"""What hiradix refuses to serve, and how it says so (before the model loads where it can).

Refusals print one line "hiradix: <what, naming the flag>" on stderr and exit with status 2
(:class:`HiRadixRefusal`, a ``SystemExit``), in the launcher, before any subprocess starts or
the model loads: SGLang settings hiradix cannot serve (:data:`CONFLICTS`), tier budgets below
one KV page of the model, and build contexts the cache factory finds unservable in the
scheduler (:func:`unsupported_build_context`). Model architectures are judged by
:mod:`hiradix.sglang_plugin.model_check`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from hiradix.config import FLAG_OF_FIELD, HiRadixConfig
from hiradix.sglang_plugin.model_check import is_mla_config, page_bytes_estimate
from hiradix.tiers.nvme import slot_bytes_for

BACKEND_NAME = "hiradix"  # --radix-cache-backend name hiradix registers


class HiRadixRefusal(SystemExit):
    """Stops the launcher: exit status 2, message already printed on stderr."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(message: str) -> NoReturn:
    """Print ``hiradix: <message>`` on stderr and stop with exit status 2."""
    line = "hiradix: " + " ".join(message.split())
    print(line, file=sys.stderr, flush=True)
    raise HiRadixRefusal(line)


@dataclass(frozen=True)
class _Conflict:
    """A ServerArgs field value hiradix cannot serve; `flag` spells it as a user would."""

    field: str
    is_conflict: Callable[[Any], bool]
    flag: Callable[[Any], str]
    why: str


_DP_DENSE_WHY = ("hiradix serves DP attention with MLA models only (DeepSeek V2/V3, Kimi K2; tested: one tree and tier "
                 "set per DP rank, histories shared between DP ranks through --hiradix-store); dense models with DP "
                 "attention are not tested, and stock SGLang 0.5.23's Llama is not DP-attention aware (docs/compatibility.md); use --tp-size without --attn-dp-size")


def _gt1(v: Any) -> bool:
    return v is not None and v > 1


CONFLICTS: tuple[_Conflict, ...] = (
    _Conflict("disable_radix_cache", bool, lambda v: "--disable-radix-cache",
              "hiradix is a radix prefix cache"),
    _Conflict("enable_hierarchical_cache", bool, lambda v: "--enable-hierarchical-cache",
              "hiradix replaces SGLang's HiCache; use one of them"),
    _Conflict("enable_lmcache", bool, lambda v: "--enable-lmcache",
              "hiradix replaces the radix cache LMCache would extend"),
    _Conflict("enable_flexkv", bool, lambda v: "--enable-flexkv",
              "hiradix replaces the radix cache FlexKV would extend"),
    _Conflict("radix_cache_backend", lambda v: v is not None and v != BACKEND_NAME,
              lambda v: f"--radix-cache-backend {v}",
              f"--enable-hiradix selects --radix-cache-backend {BACKEND_NAME}"),
    _Conflict("speculative_algorithm", lambda v: v is not None,
              lambda v: f"--speculative-algorithm {v}",
              "speculative decoding is not supported: the draft model's KV (EAGLE/MTP layers) has no tier "
              "in hiradix and its verify steps change the tree outside the hooks; serve without it, or use "
              "SGLang's HiCache (--enable-hierarchical-cache), which appends the draft layers to its host pool"),
    _Conflict("disaggregation_mode", lambda v: v not in (None, "null", "prefill", "decode"),
              lambda v: f"--disaggregation-mode {v}",
              "hiradix serves PD disaggregation's prefill and decode sides only"),
    _Conflict("pp_size", _gt1, lambda v: f"--pp-size {v}",
              "pipeline parallelism is not supported: the per-step hooks follow "
              "the non-PP scheduler loop (a PP stage holds only its layers' KV); use --tp-size, or "
              "SGLang's HiCache (--enable-hierarchical-cache)"),
    # SGLang 0.5.23's cache factory (mem_cache/registry.py, create_tree_cache) raises for this with any
    # tree but its UnifiedRadixCache, in the scheduler, after the model loaded: refused here instead.
    # (--enable-streaming-session is served: hiradix.sglang_plugin.sessions.)
    _Conflict("enable_session_radix_cache", bool, lambda v: "--enable-session-radix-cache",
              "SGLang 0.5.23 keeps session radix caches in its UnifiedRadixCache only; drop the flag (hiradix's "
              "tree keeps every conversation's prefix)"),
    _Conflict("radix_eviction_policy", lambda v: v not in (None, "lru"),
              lambda v: f"--radix-eviction-policy {v}",
              "that flag orders SGLang's own radix tree (tlru exists only in its UnifiedRadixCache) and hiradix "
              "would ignore it; hiradix orders eviction across its tiers itself: use --hiradix-policy "
              "(lookahead | predictive | lru)"),
)  # fmt: skip


def dp_attention_flag(config_view: Any) -> str | None:
    """The DP-attention flag as the user gave it (``--attn-dp-size N``, or ``--enable-dp-attention``,
    which SGLang 0.5.23 rewrites to ``--attn-dp-size N``), or None without DP attention."""
    size = getattr(config_view, "attn_dp_size", None)
    if _gt1(size):
        return f"--attn-dp-size {size}"
    if getattr(config_view, "enable_dp_attention", False):
        return "--enable-dp-attention (SGLang 0.5.23 rewrites it to --attn-dp-size N)"
    return None


def refuse_dp_attention_unless_mla(config_view: Any, is_mla: bool) -> None:
    """DP attention is served for MLA models only (each DP rank its own tree and tiers).

    Raises:
        HiRadixRefusal: DP attention with a model that is not MLA (message names the flag).
    """
    flag = dp_attention_flag(config_view)
    if flag is not None and not is_mla:
        refuse(f"--enable-hiradix cannot be combined with {flag} for a model without MLA ({_DP_DENSE_WHY})")


# On a decode server SGLang itself disables the radix cache (its resolution, for every decode
# server): hiradix keeps no tree there, it offloads finished requests (sglang_plugin.decode_side).
DECODE_SIDE_ACCEPTS = frozenset({"disable_radix_cache"})


def is_decode_side(config_view: Any) -> bool:
    """Whether this is the decode server of PD disaggregation (``--disaggregation-mode decode``)."""
    return getattr(config_view, "disaggregation_mode", None) == "decode"


def first_conflict(config_view: Any) -> tuple[_Conflict, Any] | None:
    skip = DECODE_SIDE_ACCEPTS if is_decode_side(config_view) else frozenset()
    for conflict in CONFLICTS:
        if conflict.field in skip:
            continue
        value = getattr(config_view, conflict.field, None)
        if conflict.is_conflict(value):
            return conflict, value
    return None



# SGLang HiCache's flags (ServerArgs fields) and what hiradix offers instead. With --enable-hiradix
# they would configure a cache that does not run, so a given one (not at its default) is refused.
HICACHE_EQUIVALENTS: dict[str, str] = {
    "hicache_ratio": "--hiradix-dram-ratio (x the device pool)",
    "hicache_size": "--hiradix-dram-gb (GB per TP rank; per node for an MLA model's shared copy)",
    "hicache_host_memory_mode": "--hiradix-dram-mode (cache | staging)",
    "hicache_host_memory_fraction": "--hiradix-dram-gb or --hiradix-dram-ratio (checked against free RAM at start)",
    "hicache_write_policy": "--hiradix-write-policy (write_through | write_back)",
    "hicache_io_backend": "nothing: hiradix copies HBM <-> DRAM itself, layer by layer",
    "hicache_mem_layout": "nothing: hiradix keeps DRAM and NVMe pages in its own paged layout",
    "hicache_storage_backend": "--hiradix-nvme-path and --hiradix-nvme-gb (an NVMe tier of the tree), "
                               "or --hiradix-store (a cluster store shared by the servers)",
    "hicache_storage_backend_extra_config": "--hiradix-store-config (with --hiradix-store)",
    "hicache_storage_prefetch_policy": "--hiradix-load-timeout-s (how long admission waits for NVMe or store reads)",
    "hicache_storage_prefetch_retry_poll_interval": "--hiradix-load-timeout-s",
    "hicache_storage_prefetch_retry_max_attempts": "--hiradix-load-timeout-s",
}


def _field_defaults(server_args: Any) -> dict[str, Any]:
    import msgspec  # noqa: PLC0415 - SGLang's ServerArgs is a msgspec Struct

    try:
        return {f.name: f.default for f in msgspec.structs.fields(type(server_args))}
    except TypeError:  # not a Struct (a stand-in in tests): compare with nothing
        return {}


def given_hicache_flag(server_args: Any) -> tuple[str, Any, str] | None:
    """The first HiCache flag given with a non-default value: ``(flag, value, equivalent)``, or None."""
    defaults = _field_defaults(server_args)
    for field, equivalent in HICACHE_EQUIVALENTS.items():
        if field not in defaults:
            continue
        value = getattr(server_args, field, defaults[field])
        if value != defaults[field]:
            return "--" + field.replace("_", "-"), value, equivalent
    return None
def refuse_decode_side_without_store(config: HiRadixConfig) -> None:
    """Refuse hiradix on a PD decode server that has no cluster store, or that is given an NVMe
    tier: its only job there is to put finished requests' pages where the prefill side reads."""
    store, store_config = FLAG_OF_FIELD["store_backend"], FLAG_OF_FIELD["store_config"]
    if not config.has_store_tier:
        refuse(f"--enable-hiradix with --disaggregation-mode decode needs a cluster store: give {store} and "
               f"{store_config}, the same store as the prefill servers' (the decode-side offload puts each "
               f"finished request's pages into a store the prefill side can read; the decode server keeps "
               f"no prefix cache of its own); or run the decode server without --enable-hiradix, with the "
               f"prefill server's --page-size")
    if config.has_nvme_tier:
        refuse(f"{FLAG_OF_FIELD['nvme_path']} and {FLAG_OF_FIELD['nvme_bytes']} do not apply with "
               f"--disaggregation-mode decode: the decode server keeps no prefix cache; its DRAM "
               f"({FLAG_OF_FIELD['dram_bytes']}) stages the pages it puts into {store}")


STORE_PROBE_TIMEOUT_S = 10.0  # the launcher waits at most this long to reach the cluster store


def refuse_unreachable_store(config: HiRadixConfig) -> None:
    """Refuse a cluster store that cannot be reached (or whose client does not load), before
    the model loads, naming ``--hiradix-store-config``."""
    from hiradix.tiers.store import StoreConfig, probe_backend

    flag = FLAG_OF_FIELD["store_config"]
    reason = probe_backend(config.store_backend, StoreConfig.parse(config.store_config, flag), STORE_PROBE_TIMEOUT_S)
    if reason is not None:
        refuse(f"{FLAG_OF_FIELD['store_backend']} {config.store_backend}: the store of {flag} is unusable: {reason}")


def host_copies_on_this_node(server_args: Any, config: HiRadixConfig, is_mla: bool) -> int:
    """Copies of the DRAM and NVMe tiers on this node: one per scheduler (TP rank x DP replica),
    or, for an MLA model with ``--hiradix-mla-host-copy node``, one per attention-TP group (the
    ranks of a group share rank 0's copy: ``hiradix.runtime.shared_host_copy``)."""
    def field(name: str) -> int:
        return int(getattr(server_args, name, 1) or 1)

    ranks = max(1, field("tp_size") * field("dp_size") // field("nnodes"))  # schedulers on this node
    if not (is_mla and config.mla_host_copy == "node"):
        return ranks
    attn_dp = field("attn_dp_size")
    if attn_dp == 1 and getattr(server_args, "enable_dp_attention", False):
        attn_dp = field("dp_size")  # the deprecated spelling, before SGLang's resolution
    attn_tp = max(1, field("tp_size") // attn_dp)
    if attn_tp > ranks:
        return ranks  # a group spans hosts: its ranks keep a copy each (shared_host_copy.wants_shared_copy)
    return max(1, ranks // attn_tp)


def refuse_tiers_below_one_page(config: HiRadixConfig, hf_config: dict, server_args: Any, page_size: int) -> None:
    """Refuse a DRAM or NVMe budget smaller than one KV page of this model (estimated)."""
    page_bytes = page_bytes_estimate(hf_config, page_size, int(getattr(server_args, "tp_size", 1) or 1),
                                     str(getattr(server_args, "dtype", "auto")), getattr(server_args, "kv_cache_dtype", None))
    if page_bytes is None:
        return
    if config.dram_ratio:
        refuse_dram_ratio(config, page_bytes, page_size, server_args, is_mla_config(hf_config))
    elif config.dram_bytes < page_bytes:
        refuse(f"{FLAG_OF_FIELD['dram_bytes']} {config.dram_bytes / 1e9:g} ({config.dram_bytes} bytes) holds no KV page "
               f"of this model ({page_bytes} bytes per page of {page_size} tokens)")
    if 0 < config.nvme_bytes < slot_bytes_for(page_bytes):
        refuse(f"{FLAG_OF_FIELD['nvme_bytes']} {config.nvme_bytes / 1e9:g} ({config.nvme_bytes} bytes) holds no KV page "
               f"of this model ({slot_bytes_for(page_bytes)} bytes per slot)")


def refuse_dram_ratio(config: HiRadixConfig, page_bytes: int, page_size: int, server_args: Any,
                      is_mla: bool = False) -> None:
    """Refuse a ``--hiradix-dram-ratio`` that holds no page or needs more RAM than is free, when
    ``--max-total-tokens`` fixes the device pool before the model loads (otherwise the pool is
    sized by SGLang's memory profiling and the scheduler checks the ratio: ``dram_bytes_of``).

    ``page_bytes`` is one rank's page; the RAM needed counts every copy on this node
    (:func:`host_copies_on_this_node`).
    """
    import psutil

    max_total_tokens = getattr(server_args, "max_total_tokens", None)
    if not max_total_tokens:
        return
    device_bytes = (int(max_total_tokens) // page_size) * page_bytes
    dram_bytes = config.dram_bytes_for(device_bytes)
    flag = f"{FLAG_OF_FIELD['dram_ratio']} {config.dram_ratio:g}"
    pool = f"the device pool (--max-total-tokens {max_total_tokens}: {device_bytes} bytes)"
    if dram_bytes < page_bytes:
        refuse(f"{flag} x {pool} holds no KV page of this model ({page_bytes} bytes per page of {page_size} tokens)")
    ranks = host_copies_on_this_node(server_args, config, is_mla)
    available = psutil.virtual_memory().available
    if dram_bytes * ranks > available:
        times = f" x {ranks} copies (ranks)" if ranks > 1 else ""
        refuse(f"{flag} x {pool}{times} needs {dram_bytes * ranks / 1e9:.2f} GB of RAM but only "
               f"{available / 1e9:.2f} GB is available")


def unsupported_build_context(ctx: Any) -> str | None:
    """Why the scheduler's cache build context cannot be served by hiradix, or None."""
    from sglang.srt.configs.model_config import AttentionArch

    if ctx.disable_radix_cache:
        return "the radix cache is disabled for this server"
    if ctx.enable_hierarchical_cache:
        return "SGLang's hierarchical cache is enabled"
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False):
        return (
            f"the model is not plain full attention (hybrid_swa={ctx.is_hybrid_swa}, "
            f"hybrid_ssm={ctx.is_hybrid_ssm}, dsa={getattr(ctx, 'is_dsa', False)})"
        )
    if ctx.model_config.attention_arch not in (AttentionArch.MHA, AttentionArch.MLA):
        return f"the model uses {ctx.model_config.attention_arch.name} attention"
    return None
