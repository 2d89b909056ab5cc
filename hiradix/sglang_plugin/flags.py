"""The hiradix flags in SGLang's command line: the `ServerArgs` hooks (every process, CLI scope).

`after_add_cli_args` adds `--enable-hiradix` and the value flags of `hiradix.config.FLAGS` to
SGLang's parser. Only when `--enable-hiradix` is given, `after_from_cli_args` validates them
into a `HiRadixConfig`, refuses configurations hiradix cannot serve
(`hiradix.sglang_plugin.refusals`; also any `--hicache-*` flag, naming hiradix's equivalent),
selects `--radix-cache-backend hiradix` (not on a PD decode server, which keeps no radix cache: there
hiradix turns on the decode-side offload, `hiradix.sglang_plugin.decode_side`, and needs a cluster
store), defaults `--page-size` to 16, turns on
`--enable-cache-report` and `--enable-metrics` (hiradix's hit details and metrics need them),
installs the launcher's stop hooks when tiers below DRAM may have writes to drain at a stop
(`hiradix.sglang_plugin.stop`, `--hiradix-stop-timeout-s`),
stashes the config as `server_args._hiradix_config` (bookkeeping attributes ride the pickled
record to the spawned schedulers) and exports it as `HIRADIX_CONFIG` (JSON fallback); `after_resolve_once` re-checks what SGLang's own resolution
decided, and decides on sliding-window models there (served when SGLang's resolved
`--disable-hybrid-swa-memory`, its own or the user's, or a window no shorter than the context puts
every layer's KV in one full pool). Without `--enable-hiradix` they change nothing, except refusing
a `--hiradix-*` flag given on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from hiradix.config import ENV_VAR, FLAGS, VALUE_FLAGS, HiRadixConfig, HiRadixConfigError, check_machine
from hiradix.core.policy import make_policy
from hiradix.sglang_plugin import hooks
from hiradix.sglang_plugin.model_check import (
    DISABLE_HYBRID_SWA_FLAG,
    SERVED_MODELS,
    is_mla_config,
    model_config_is_mla,
    read_hf_config,
    unservable_architecture_reason,
    unsupported_model_config_reason,
    unsupported_model_reason,
)
from hiradix.sglang_plugin.refusals import (
    BACKEND_NAME,
    first_conflict,
    given_hicache_flag,
    is_decode_side,
    refuse,
    refuse_decode_side_without_store,
    host_copies_on_this_node,
    refuse_dp_attention_unless_mla,
    refuse_tiers_below_one_page,
    refuse_unreachable_store,
)

logger = logging.getLogger(__name__)

CONFIG_ATTR = "_hiradix_config"  # bookkeeping attribute on ServerArgs
_CHECKED_ATTR = "_hiradix_resolution_checked"  # set once the resolved record passed
_TURNED_ON_ATTR = "_hiradix_turned_on"  # SGLang flags --enable-hiradix turned on (for the log)
# SGLang features hiradix reports through, turned on with --enable-hiradix: ServerArgs field, flag.
REQUIRED_SGLANG_FLAGS: tuple[tuple[str, str], ...] = (
    ("enable_cache_report", "--enable-cache-report"),  # usage.prompt_tokens_details.cached_tokens
    ("enable_metrics", "--enable-metrics"),  # /metrics: SGLang's cache series and hiradix's own
)
ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
DEFAULT_PAGE_SIZE_TOKENS = 16  # hiradix moves KV in pages; SGLang's default is 1


class _EnableHiRadixAction(argparse._StoreTrueAction):
    """`--enable-hiradix`: store-true (also for `--config` YAML files, which look
    for `_StoreTrueAction`), refusing when the plugin is not intact in this process."""

    def __init__(self, option_strings, dest, problem=None, **kwargs):
        self.problem = problem
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.problem:
            refuse(f"--enable-hiradix: {self.problem}")
        setattr(namespace, self.dest, True)



# The launcher hooks --hiradix-context-overflow needs (let long prompts through; report cuts in OpenAI answers).
OVERFLOW_LAUNCHER_HOOKS = tuple(s for s in hooks.specs_of("hiradix.sglang_plugin.overflow",
                                                         "hiradix.sglang_plugin.openai_cut")
                                if s.scope is hooks.Scope.LAUNCHER)


def after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER `ServerArgs.add_cli_args(parser)`: add the hiradix flag group (from `config.FLAGS`).

    Value flags default to None so that "not given" is visible; the real defaults are
    filled in by `HiRadixConfig.from_flags` and shown in the help text.
    """
    problem = hooks.problem(hooks.Scope.CLI, ignore=ADD_CLI_ARGS_TARGET)
    group = parser.add_argument_group(
        "hiradix",
        "Tiered (HBM -> DRAM -> NVMe -> cluster store) radix prefix cache (hiradix plugin). "
        "Sizes are per TP rank (an MLA model under TP: per node, see --hiradix-mla-host-copy), in GB (1e9 bytes).",
    )
    group.add_argument(
        "--enable-hiradix",
        action=_EnableHiRadixAction,
        problem=problem,
        help="Use hiradix as the radix cache (selects --radix-cache-backend hiradix; "
        f"--page-size defaults to {DEFAULT_PAGE_SIZE_TOKENS}).",
    )
    for spec in FLAGS:
        group.add_argument(
            spec.flag,
            dest=spec.dest,
            type=spec.type,
            default=None,
            metavar=spec.metavar,
            choices=spec.choices() if spec.choices is not None else None,
            help=spec.help + _default_text(spec.default),
        )


def _default_text(default: Any) -> str:
    if default is None:
        return ""
    return f" Default: {default:g}." if isinstance(default, float) else f" Default: {default}."


def _given_value_flags(namespace: argparse.Namespace) -> list[str]:
    return [flag for dest, flag in VALUE_FLAGS.items() if getattr(namespace, dest, None) is not None]


def after_from_cli_args(result: Any, cls: type, namespace: argparse.Namespace) -> None:
    """AFTER `ServerArgs.from_cli_args(namespace)`: validate and wire up hiradix.

    Without `--enable-hiradix` the record is left untouched (and a stale
    `HIRADIX_CONFIG` is removed from this process's environment); a `--hiradix-*`
    flag or `--radix-cache-backend hiradix` without it is refused.

    Raises:
        HiRadixRefusal: a configuration hiradix cannot serve (message names the flag).
    """
    if not getattr(namespace, "enable_hiradix", False):
        given = _given_value_flags(namespace)
        if given:
            refuse(f"{', '.join(given)} given without --enable-hiradix")
        if getattr(result, "radix_cache_backend", None) == BACKEND_NAME:
            refuse(f"--radix-cache-backend {BACKEND_NAME} requires --enable-hiradix")
        os.environ.pop(ENV_VAR, None)
        return None

    conflict = first_conflict(result)
    if conflict is not None:
        rule, value = conflict
        refuse(f"--enable-hiradix cannot be combined with {rule.flag(value)} ({rule.why})")
    hicache = given_hicache_flag(result)
    if hicache is not None:
        flag, value, equivalent = hicache
        refuse(f"{flag} {value} configures SGLang's HiCache, which --enable-hiradix replaces (it would be "
               f"ignored); hiradix's equivalent: {equivalent}")
    try:
        config = HiRadixConfig.from_flags(**{spec.name: getattr(namespace, spec.dest, None) for spec in FLAGS})
    except HiRadixConfigError as e:
        refuse(str(e))
    decode_side = is_decode_side(result)
    if decode_side:
        refuse_decode_side_without_store(config)
    if result.page_size is not None and result.page_size < 1:
        refuse(f"--page-size must be >= 1 with --enable-hiradix, got {result.page_size}")
    tp_size = int(getattr(result, "tp_size", 1) or 1)
    if tp_size > 1 and make_policy(config.policy).clock_per_process:
        refuse(f"--hiradix-policy {config.policy} cannot be combined with --tp-size {tp_size} (it ranks by ages "
               "on each process's own clock, and TP ranks must evict alike); use --hiradix-policy lookahead")
    found = read_hf_config(str(result.model_path), getattr(result, "revision", None))
    is_mla = found is not None and is_mla_config(found[0])
    if found is not None:
        hf_config, where = found
        # A sliding window waits for SGLang's resolution (its overrides may disable hybrid SWA memory).
        reason = unservable_architecture_reason(hf_config)
        if reason is not None:
            refuse(
                f"--model-path {result.model_path} is {reason} (from {where}); {SERVED_MODELS}"
            )
        refuse_tiers_below_one_page(config, hf_config, result, result.page_size or DEFAULT_PAGE_SIZE_TOKENS)
        refuse_dp_attention_unless_mla(result, is_mla_config(hf_config))
    try:
        check_machine(config, ranks_on_this_node=host_copies_on_this_node(result, config, is_mla))
    except HiRadixConfigError as e:
        refuse(str(e))
    if config.has_store_tier:
        refuse_unreachable_store(config)
    kv_dtype = str(getattr(result, "kv_cache_dtype", "auto") or "auto")
    if config.cold_format != "exact" and kv_dtype not in ("auto", "float32", "bfloat16", "float16", "bf16", "fp16"):
        refuse(f"--hiradix-cold-format {config.cold_format} compresses 16/32-bit KV pages; --kv-cache-dtype "
               f"{kv_dtype} is already quantized: use --hiradix-cold-format exact")
    if config.context_overflow != "off":
        refuse_context_overflow_with_pd(result)
        refuse_context_overflow_with_sessions(result)
        problem = hooks.install_launcher(OVERFLOW_LAUNCHER_HOOKS)
        if problem:
            refuse(f"--hiradix-context-overflow {config.context_overflow}: {problem}")
    if config.stop_timeout_s > 0 and (config.has_nvme_tier or config.has_store_tier) and not decode_side:
        from hiradix.sglang_plugin.stop import LAUNCHER_HOOKS  # a stopping launcher waits for the drain

        problem = hooks.install_launcher(LAUNCHER_HOOKS)
        if problem:
            refuse(f"--hiradix-stop-timeout-s {config.stop_timeout_s:g}: {problem} (--hiradix-stop-timeout-s 0 "
                   "stops without waiting for the tier writes in flight)")

    setattr(result, CONFIG_ATTR, config)
    if not decode_side:  # a decode server keeps no radix cache: the decode-side offload runs instead
        result.radix_cache_backend = BACKEND_NAME
    if result.page_size is None:
        result.page_size = DEFAULT_PAGE_SIZE_TOKENS
    # What hiradix's own features report through: per-request hit details and /metrics.
    turned_on = [flag for field, flag in REQUIRED_SGLANG_FLAGS if not getattr(result, field)]
    for field, _ in REQUIRED_SGLANG_FLAGS:
        setattr(result, field, True)
    setattr(result, _TURNED_ON_ATTR, tuple(turned_on))
    os.environ[ENV_VAR] = config.to_json()
    return None


def refuse_model(model_path: Any, reason: str | None) -> None:
    """Refuse the model for `reason` (None: served); a sliding-window reason names its own remedy."""
    if reason is None:
        return
    if DISABLE_HYBRID_SWA_FLAG in reason:
        refuse(f"--model-path {model_path} is {reason}")
    refuse(f"--model-path {model_path} is {reason}; {SERVED_MODELS}")


def refuse_context_overflow_with_pd(server_args: Any) -> None:
    """A PD pair would cut the prompt twice, on two trees that differ (the decode side keeps none)."""
    mode = getattr(server_args, "disaggregation_mode", None)
    if mode not in (None, "null"):
        refuse(f"--hiradix-context-overflow cannot be combined with --disaggregation-mode {mode} (the prefill and "
               "decode servers would each cut the prompt, against different trees); serve long conversations "
               "from a server without PD disaggregation")


def refuse_context_overflow_with_sessions(server_args: Any) -> None:
    """A streaming session's next turn runs on the KV its session kept, which a cut prompt no longer matches."""
    if getattr(server_args, "enable_streaming_session", False):
        refuse("--hiradix-context-overflow cannot be combined with --enable-streaming-session (a session's next "
               "turn reuses the KV its session kept, which a cut prompt no longer matches); serve streaming "
               "sessions with --hiradix-context-overflow off (SGLang aborts a turn that overflows the context)")


def _declared_by(server_args: Any, field: str) -> str | None:
    """The resolution step that last declared `field`, if any."""
    for source, declared in reversed(getattr(server_args, "_resolved_overrides", None) or ()):
        if field in declared:
            return str(source)
    return None


def after_resolve_once(result: None, server_args: Any) -> None:
    """AFTER `ServerArgs.resolve_once()`: re-check what SGLang resolved, log "enabled".

    Runs in the launcher before any subprocess starts; a no-op without hiradix and on
    records already checked (the copies the spawned processes receive).

    Raises:
        HiRadixRefusal: resolution produced a configuration hiradix cannot serve.
    """
    config = getattr(server_args, CONFIG_ATTR, None)
    if config is None or getattr(server_args, _CHECKED_ATTR, False):
        return None
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    conflict = first_conflict(view)
    if conflict is not None:
        rule, value = conflict
        source = _declared_by(server_args, rule.field) or "resolution"
        refuse(
            f"SGLang's resolution ({source}) set {rule.flag(value)} for this model and "
            f"configuration, which --enable-hiradix cannot serve ({rule.why})"
        )
    model_config = getattr(server_args, "_model_config", None)
    disable_swa = bool(getattr(view, "disable_hybrid_swa_memory", False))
    if model_config is not None:
        reason = unsupported_model_config_reason(model_config, disable_hybrid_swa_memory=disable_swa)
        refuse_model(view.model_path, reason)
        refuse_dp_attention_unless_mla(view, model_config_is_mla(model_config))
    else:  # no ModelConfig from the resolution: the config.json rules, with the resolved flags
        found = read_hf_config(str(view.model_path), getattr(view, "revision", None))
        if found is not None:
            refuse_model(view.model_path, unsupported_model_reason(found[0], disable_swa, view.context_length))
    setattr(server_args, _CHECKED_ATTR, True)
    turned_on = getattr(server_args, _TURNED_ON_ATTR, ())
    logger.info("hiradix: enabled (%s, page_size=%s)%s", config.summary(), view.page_size,
                f"; turned on {' '.join(turned_on)} (per-tier hit details and /metrics)" if turned_on else "")
    return None
