"""SGLang plugin entry point: flags, early refusals, and the "hiradix" cache backend.

SGLang calls `register()` (entry point `sglang.srt.plugins: hiradix`) once per
process in `load_plugins()`, then applies the registered hooks. What happens where:

- Every process: the CLI hooks of `hiradix.hooks.HOOKS` (`Scope.CLI`). They add the
  `--enable-hiradix` / `--hiradix-*` flags to SGLang's parser and, only when
  `--enable-hiradix` is given, validate them into a `HiRadixConfig`, refuse
  configurations hiradix cannot serve, select `--radix-cache-backend hiradix`,
  default `--page-size` to 16, stash the config as `server_args._hiradix_config`
  (bookkeeping attributes ride the pickled record to the spawned schedulers) and
  export it as `HIRADIX_CONFIG` (JSON fallback). Without `--enable-hiradix` they
  change nothing, except refusing a `--hiradix-*` flag given on its own.
- Scheduler processes: the radix-cache backend "hiradix" (its factory imports
  `hiradix.cache` lazily), plus the `Scope.SCHEDULER` hooks when hiradix is enabled.

Refusals print one line "hiradix: <what, naming the flag>" on stderr and exit with
status 2 (`HiRadixRefusal`, a `SystemExit`), in the launcher, before any subprocess
starts or the model loads: from the `from_cli_args` hook (flags, paths, RAM/disk,
the model's config.json), or from the `resolve_once` hook (what SGLang's own
resolution decided, e.g. that this model runs without a radix cache).

A folder named `hiradix` in the directory the server starts from shadows the
installed package. With a regular install `hiradix.plugin` then fails to import:
SGLang only logs "Failed to load plugin hiradix ..." and starts without it, but
`--enable-hiradix` is then an unknown flag and argparse stops the launcher
("unrecognized arguments: --enable-hiradix"), so a hiradix launch cannot silently
run stock. With an editable install the plugin's submodules still load from the
installed tree while `hiradix` itself is the shadow; `--enable-hiradix` refuses
that mixture (`hooks.package_problem`), as it refuses hooks SGLang did not install.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hiradix import hooks
from hiradix.config import (
    DEFAULT_DRAM_GB,
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_LOOKAHEAD_WINDOW,
    DEFAULT_NVME_GB,
    DEFAULT_POLICY,
    DEFAULT_WRITE_POLICY,
    ENV_VAR,
    POLICIES,
    WRITE_POLICIES,
    HiRadixConfig,
    HiRadixConfigError,
    check_machine,
)

logger = logging.getLogger(__name__)

BACKEND_NAME = "hiradix"
CONFIG_ATTR = "_hiradix_config"  # bookkeeping attribute on ServerArgs
_CHECKED_ATTR = "_hiradix_resolution_checked"  # set once the resolved record passed
ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
DEFAULT_PAGE_SIZE_TOKENS = 16  # hiradix moves KV in pages; SGLang's default is 1

# argparse dest -> flag, for the flags that take a value.
VALUE_FLAGS: dict[str, str] = {
    "hiradix_dram_gb": "--hiradix-dram-gb",
    "hiradix_nvme_path": "--hiradix-nvme-path",
    "hiradix_nvme_gb": "--hiradix-nvme-gb",
    "hiradix_policy": "--hiradix-policy",
    "hiradix_lookahead_window": "--hiradix-lookahead-window",
    "hiradix_write_policy": "--hiradix-write-policy",
    "hiradix_load_timeout_s": "--hiradix-load-timeout-s",
}


class HiRadixRefusal(SystemExit):
    """Stops the launcher: exit status 2, message already printed on stderr."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _refuse(message: str) -> NoReturn:
    line = "hiradix: " + " ".join(message.split())
    print(line, file=sys.stderr, flush=True)
    raise HiRadixRefusal(line)


# --------------------------------------------------------------------------- register


_registered = False


def register() -> None:
    """Entry point: register hiradix's hooks and cache backend in this process.

    Idempotent. Registration only: SGLang applies the hooks after all plugins ran.
    """
    global _registered
    if _registered:
        return
    _registered = True
    hooks.install()
    if hooks.SCHEDULER_MODULE in sys.modules:
        _register_backend()


def _register_backend() -> None:
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is hiradix_cache_factory:
        return
    if existing is not None:
        raise RuntimeError(
            f"hiradix: radix-cache backend {BACKEND_NAME!r} is already registered by "
            f"{getattr(existing, '__module__', existing)!r}"
        )
    register_radix_cache_backend(BACKEND_NAME, hiradix_cache_factory)


# ------------------------------------------------------------------------ CLI flags


class _EnableHiRadixAction(argparse._StoreTrueAction):
    """`--enable-hiradix`: store-true (also for `--config` YAML files, which look
    for `_StoreTrueAction`), refusing when the plugin is not intact in this process."""

    def __init__(self, option_strings, dest, problem=None, **kwargs):
        self.problem = problem
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.problem:
            _refuse(f"--enable-hiradix: {self.problem}")
        setattr(namespace, self.dest, True)


def _plugin_problem(scope: hooks.Scope, *, ignore: str | None = None) -> str | None:
    """Why hiradix cannot run in this process (shadowed package, hooks missing), or None."""
    shadowed = hooks.package_problem()
    if shadowed:
        return shadowed
    missing = [s for s in hooks.missing(scope) if s.target != ignore]
    return hooks.describe_missing(missing) if missing else None


def after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER `ServerArgs.add_cli_args(parser)`: add the hiradix flag group.

    Value flags default to None so that "not given" is visible; the real defaults are
    filled in by `HiRadixConfig.from_flags` and shown in the help text.
    """
    problem = _plugin_problem(hooks.Scope.CLI, ignore=ADD_CLI_ARGS_TARGET)
    group = parser.add_argument_group(
        "hiradix",
        "Three-tier (HBM -> DRAM -> NVMe) radix prefix cache (hiradix plugin). "
        "Sizes are per TP rank, in GB (1e9 bytes).",
    )
    group.add_argument(
        "--enable-hiradix",
        action=_EnableHiRadixAction,
        problem=problem,
        help="Use hiradix as the radix cache (selects --radix-cache-backend hiradix; "
        f"--page-size defaults to {DEFAULT_PAGE_SIZE_TOKENS}).",
    )
    group.add_argument(
        "--hiradix-dram-gb",
        type=float,
        default=None,
        metavar="GB",
        help=f"DRAM tier size, in GB. Default: {DEFAULT_DRAM_GB:g}.",
    )
    group.add_argument(
        "--hiradix-nvme-path",
        type=str,
        default=None,
        metavar="DIR",
        help="Directory for the NVMe tier's files (must exist; a private hiradix-rank<r>/ is made inside).",
    )
    group.add_argument(
        "--hiradix-nvme-gb",
        type=float,
        default=None,
        metavar="GB",
        help=f"NVMe tier size, in GB; 0 = no NVMe tier. Default: {DEFAULT_NVME_GB:g}.",
    )
    group.add_argument(
        "--hiradix-policy",
        choices=list(POLICIES),
        default=None,
        help=f"Eviction/promotion policy. Default: {DEFAULT_POLICY}.",
    )
    group.add_argument(
        "--hiradix-lookahead-window",
        type=int,
        default=None,
        metavar="REQUESTS",
        help="Waiting requests the lookahead policy inspects per step. "
        f"Default: {DEFAULT_LOOKAHEAD_WINDOW}.",
    )
    group.add_argument(
        "--hiradix-write-policy",
        choices=list(WRITE_POLICIES),
        default=None,
        help=f"When KV is copied down a tier. Default: {DEFAULT_WRITE_POLICY}.",
    )
    group.add_argument(
        "--hiradix-load-timeout-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Abandon a lower-tier load after this long and recompute. "
        f"Default: {DEFAULT_LOAD_TIMEOUT_S:g}.",
    )


# ------------------------------------------------- incompatible SGLang settings


@dataclass(frozen=True)
class _Conflict:
    """A ServerArgs field value hiradix cannot serve; `flag` spells it as a user would."""

    field: str
    is_conflict: Callable[[Any], bool]
    flag: Callable[[Any], str]
    why: str


def _gt1(v: Any) -> bool:
    return v is not None and v > 1


_CONFLICTS: tuple[_Conflict, ...] = (
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
              "speculative decoding is not supported"),
    _Conflict("attn_dp_size", _gt1, lambda v: f"--attn-dp-size {v}",
              "DP attention is not supported"),
    _Conflict("enable_dp_attention", bool, lambda v: "--enable-dp-attention",
              "DP attention is not supported"),
    _Conflict("disaggregation_mode", lambda v: v not in (None, "null"),
              lambda v: f"--disaggregation-mode {v}",
              "PD disaggregation is not supported"),
    _Conflict("pp_size", _gt1, lambda v: f"--pp-size {v}",
              "pipeline parallelism is not supported: the per-step hooks follow "
              "the non-PP scheduler loop"),
)  # fmt: skip


def _first_conflict(config_view: Any) -> tuple[_Conflict, Any] | None:
    for conflict in _CONFLICTS:
        value = getattr(config_view, conflict.field, None)
        if conflict.is_conflict(value):
            return conflict, value
    return None


# ------------------------------------------------------- model architecture checks

_SSM_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba",
        "falcon_h1", "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2",
        "plamo2", "minimax", "minimax_m1", "kimi_linear",
    }
)  # fmt: skip
_SSM_KEYS = (
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_heads",
    "ssm_state_size", "layers_block_type", "hybrid_override_pattern",
    "linear_attn_config", "full_attention_interval", "attn_layer_period",
)  # fmt: skip
_ENCODER_DECODER_ARCHS = frozenset(
    {
        "WhisperForConditionalGeneration",
        "MllamaForConditionalGeneration",
        "MossVLForConditionalGeneration",
    }
)
_NESTED_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


def unsupported_model_reason(hf_config: Mapping[str, Any]) -> str | None:
    """Why hiradix cannot serve a model, from its HF `config.json`, or None if it can.

    hiradix serves decoder-only models whose every layer is plain full attention with
    per-head K/V (MHA/GQA/MQA). Refused: MLA (`kv_lora_rank`), sliding-window or
    chunked-attention hybrids (`layer_types`, `use_sliding_window` on some layers,
    `sliding_window_pattern`, `attention_chunk_size`), Mamba/SSM/linear-attention
    hybrids, and encoder-decoder models. Nested text configs are checked too.

    Args:
        hf_config: the parsed config.json.
    """
    archs = list(hf_config.get("architectures") or [])
    configs = [hf_config] + [
        hf_config[k] for k in _NESTED_CONFIG_KEYS if isinstance(hf_config.get(k), Mapping)
    ]
    if hf_config.get("is_encoder_decoder") or _ENCODER_DECODER_ARCHS.intersection(archs):
        return f"an encoder-decoder model (architectures={archs})"
    for cfg in configs:
        model_type = str(cfg.get("model_type", ""))
        if cfg.get("kv_lora_rank") is not None and cfg.get("use_mla", True):
            return (
                f"an MLA model (kv_lora_rank={cfg['kv_lora_rank']}, "
                f"architectures={archs})"
            )
        if model_type in _SSM_MODEL_TYPES or any(k in cfg for k in _SSM_KEYS):
            return f"a Mamba/SSM/linear-attention hybrid (model_type={model_type!r})"
        if cfg.get("cross_attention_layers"):
            return f"an encoder-decoder (cross-attention) model (architectures={archs})"
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list) and set(layer_types) - {"full_attention"}:
            kinds = sorted(set(map(str, layer_types)))
            return f"a hybrid-attention model (layer_types has {kinds})"
        if cfg.get("is_hybrid_swa") or cfg.get("sliding_window_pattern") or cfg.get(
            "interleaved_sliding_window"
        ):
            return f"a sliding-window hybrid (architectures={archs})"
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            return (
                f"a sliding-window model (use_sliding_window=true, "
                f"sliding_window={cfg['sliding_window']})"
            )
        if cfg.get("attention_chunk_size"):
            return f"a chunked local-attention model (architectures={archs})"
    return None


def _read_hf_config(model_path: str, revision: str | None) -> tuple[dict, str] | None:
    """The model's config.json (parsed, and where it was read), without loading weights.

    Reads a local directory, or the Hugging Face cache for a repo id; None if neither
    has it (SGLang's resolution and the cache factory check the model again).
    """
    path = Path(model_path).expanduser()
    if path.is_dir():
        candidate: str | None = str(path / "config.json")
    elif path.exists():
        return None  # a single file (e.g. GGUF)
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model_path, "config.json", revision=revision)
        except Exception:  # invalid repo id, no hub library: nothing to read
            return None
        candidate = found if isinstance(found, str) else None
    if candidate is None or not os.path.isfile(candidate):
        return None
    try:
        with open(candidate, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # SGLang reports an unreadable config itself
    return (data, candidate) if isinstance(data, dict) else None


# ------------------------------------------------------------- from_cli_args hook


def _given_value_flags(namespace: argparse.Namespace) -> list[str]:
    return [flag for dest, flag in VALUE_FLAGS.items() if getattr(namespace, dest, None) is not None]


def _ranks_on_this_node(server_args: Any) -> int:
    ranks = (getattr(server_args, "tp_size", 1) or 1) * (getattr(server_args, "dp_size", 1) or 1)
    return max(1, ranks // max(1, getattr(server_args, "nnodes", 1) or 1))


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
            _refuse(f"{', '.join(given)} given without --enable-hiradix")
        if getattr(result, "radix_cache_backend", None) == BACKEND_NAME:
            _refuse(f"--radix-cache-backend {BACKEND_NAME} requires --enable-hiradix")
        os.environ.pop(ENV_VAR, None)
        return None

    conflict = _first_conflict(result)
    if conflict is not None:
        rule, value = conflict
        _refuse(f"--enable-hiradix cannot be combined with {rule.flag(value)} ({rule.why})")
    try:
        config = HiRadixConfig.from_flags(
            dram_gb=namespace.hiradix_dram_gb,
            nvme_path=namespace.hiradix_nvme_path,
            nvme_gb=namespace.hiradix_nvme_gb,
            policy=namespace.hiradix_policy,
            lookahead_window=namespace.hiradix_lookahead_window,
            write_policy=namespace.hiradix_write_policy,
            load_timeout_s=namespace.hiradix_load_timeout_s,
        )
    except HiRadixConfigError as e:
        _refuse(str(e))
    if result.page_size is not None and result.page_size < 1:
        _refuse(f"--page-size must be >= 1 with --enable-hiradix, got {result.page_size}")
    found = _read_hf_config(str(result.model_path), getattr(result, "revision", None))
    if found is not None:
        hf_config, where = found
        reason = unsupported_model_reason(hf_config)
        if reason is not None:
            _refuse(
                f"--model-path {result.model_path} is {reason} (from {where}); "
                "--enable-hiradix serves plain MHA/GQA full-attention decoder models only"
            )
        _refuse_tiers_below_one_page(config, hf_config, result)
    try:
        check_machine(config, ranks_on_this_node=_ranks_on_this_node(result))
    except HiRadixConfigError as e:
        _refuse(str(e))

    setattr(result, CONFIG_ATTR, config)
    result.radix_cache_backend = BACKEND_NAME
    if result.page_size is None:
        result.page_size = DEFAULT_PAGE_SIZE_TOKENS
    os.environ[ENV_VAR] = config.to_json()
    return None


def _refuse_tiers_below_one_page(config: HiRadixConfig, hf_config: dict, result: Any) -> None:
    """Refuse a DRAM or NVMe budget smaller than one KV page of this model (estimated)."""
    from hiradix.model_shape import page_bytes_estimate
    from hiradix.tiers.nvme import slot_bytes_for

    page_size = result.page_size or DEFAULT_PAGE_SIZE_TOKENS
    page_bytes = page_bytes_estimate(hf_config, page_size, int(getattr(result, "tp_size", 1) or 1),
                                     str(getattr(result, "dtype", "auto")), getattr(result, "kv_cache_dtype", None))
    if page_bytes is None:
        return
    if config.dram_bytes < page_bytes:
        _refuse(f"--hiradix-dram-gb {config.dram_bytes / 1e9:g} ({config.dram_bytes} bytes) holds no KV page "
                f"of this model ({page_bytes} bytes per page of {page_size} tokens)")
    if 0 < config.nvme_bytes < slot_bytes_for(page_bytes):
        _refuse(f"--hiradix-nvme-gb {config.nvme_bytes / 1e9:g} ({config.nvme_bytes} bytes) holds no KV page "
                f"of this model ({slot_bytes_for(page_bytes)} bytes per slot)")


# -------------------------------------------------------------- resolve_once hook


def _declared_by(server_args: Any, field: str) -> str | None:
    """The resolution step that last declared `field`, if any."""
    for source, declared in reversed(getattr(server_args, "_resolved_overrides", None) or ()):
        if field in declared:
            return str(source)
    return None


def unsupported_model_config_reason(model_config: Any) -> str | None:
    """Why hiradix cannot serve a model, from SGLang's own `ModelConfig`, or None.

    The authoritative form of `unsupported_model_reason` (SGLang's classification).
    """
    from sglang.srt.configs.hybrid_arch import (
        glm5_next_config,
        kimi_linear_config,
        mambaish_config,
    )
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if model_config.attention_arch != AttentionArch.MHA:
        return f"a {model_config.attention_arch.name} model (architectures={archs})"
    if getattr(model_config, "is_encoder_decoder", False):
        return f"an encoder-decoder model (architectures={archs})"
    if getattr(model_config, "is_hybrid_swa", False):
        return f"a hybrid sliding-window model (architectures={archs})"
    if getattr(model_config, "is_local_attention_model", False):
        return f"a chunked local-attention model (architectures={archs})"
    if any(f(model_config) is not None for f in (mambaish_config, kimi_linear_config, glm5_next_config)):
        return f"a Mamba/SSM/linear-attention hybrid (architectures={archs})"
    if is_deepseek_dsa(model_config.hf_config):
        return f"a DeepSeek sparse-attention model (architectures={archs})"
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
    conflict = _first_conflict(view)
    if conflict is not None:
        rule, value = conflict
        source = _declared_by(server_args, rule.field) or "resolution"
        _refuse(
            f"SGLang's resolution ({source}) set {rule.flag(value)} for this model and "
            f"configuration, which --enable-hiradix cannot serve ({rule.why})"
        )
    model_config = getattr(server_args, "_model_config", None)
    if model_config is not None:
        reason = unsupported_model_config_reason(model_config)
        if reason is not None:
            _refuse(
                f"--model-path {view.model_path} is {reason}; --enable-hiradix serves "
                "plain MHA/GQA full-attention decoder models only"
            )
    setattr(server_args, _CHECKED_ATTR, True)
    logger.info("hiradix: enabled (%s, page_size=%s)", config.summary(), view.page_size)
    return None


# ---------------------------------------------------------- scheduler-side factory


def _config_with_source(server_args: Any) -> tuple[HiRadixConfig, str]:
    config = getattr(server_args, CONFIG_ATTR, None)
    if isinstance(config, HiRadixConfig):
        return config, f"server_args.{CONFIG_ATTR}"
    text = os.environ.get(ENV_VAR)
    if text:
        return HiRadixConfig.from_json(text), f"${ENV_VAR}"
    raise HiRadixConfigError(
        f"hiradix: no configuration: server_args.{CONFIG_ATTR} is unset and "
        f"${ENV_VAR} is empty; start the server with --enable-hiradix"
    )


def config_from_server_args(server_args: Any) -> HiRadixConfig:
    """The `HiRadixConfig` of this server: `server_args._hiradix_config`, else `$HIRADIX_CONFIG`.

    Raises:
        HiRadixConfigError: neither is set, or the JSON is invalid.
    """
    return _config_with_source(server_args)[0]


def _unsupported_build_context(ctx: Any) -> str | None:
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
    if ctx.model_config.attention_arch != AttentionArch.MHA:
        return f"the model uses {ctx.model_config.attention_arch.name} attention"
    return None


def hiradix_cache_factory(ctx: Any) -> Any:
    """Radix-cache factory registered as "hiradix" (runs in each scheduler process).

    Checks that the package is not shadowed, that this process's scheduler hooks are
    installed and that the build context is servable, then calls `hiradix.cache.create_hiradix_cache(ctx)`.

    Raises:
        RuntimeError: a hook is missing or the context cannot be served.
    """
    problem = _plugin_problem(hooks.Scope.SCHEDULER)
    if problem:
        raise RuntimeError(f"hiradix: {problem}")
    config, source = _config_with_source(ctx.server_args)
    reason = _unsupported_build_context(ctx)
    if reason is not None:
        raise RuntimeError(f"hiradix: cannot build the cache: {reason}")
    logger.info(
        "hiradix: building the cache on tp_rank %d (config from %s: %s)",
        ctx.tp_rank,
        source,
        config.summary(),
    )
    from hiradix.cache import create_hiradix_cache

    return create_hiradix_cache(ctx)
