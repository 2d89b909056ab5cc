"""The table of SGLang hooks hiradix installs, where each applies, and a self-check.

SGLang's `HookRegistry` only *logs* a hook that fails to apply (and before logging is
configured, so the line is easy to miss), and a hook registered after a target was
patched is silently never applied. hiradix therefore checks after the fact that each
of its hooks really sits in its target's wrapper chain (`verify`), and refuses to run
when one does not.

Scopes (decided once per process, in `register()` during SGLang's `load_plugins()`):

- `Scope.CLI`: every process. The targets live in `sglang.srt.server_args`, which
  every SGLang process imports anyway. These hooks are no-ops unless
  `--enable-hiradix` was given.
- `Scope.SCHEDULER`: processes that have already imported
  `sglang.srt.managers.scheduler` when plugins load (the spawned scheduler ranks
  import it to unpickle `run_scheduler_process`; the launcher does not import it
  before `load_plugins()`), and only when hiradix is enabled, i.e. the launcher
  exported `HIRADIX_CONFIG` (it removes a stale one when hiradix is off). So stock
  servers get no scheduler hooks at all, and the launcher does not pay ~1.5 s to
  import the scheduler module.

To add a scheduler hook, append a `HookSpec` to `HOOKS`, e.g.::

    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler._process_hicache_events",
        hook="hiradix.sglang_plugin.sched_hooks:after_process_hicache_events",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="reap tier-move acks and run the look-ahead each step",
    )

- `Scope.LAUNCHER`: the launcher (tokenizer manager) process only, and only when a flag needs it:
  `install_launcher()` registers and applies them from the `from_cli_args` hook, after SGLang
  applied the plugins' hooks (e.g. `--hiradix-context-overflow` lets long prompts through and
  reports its cuts in OpenAI answers; `--hiradix-stop-timeout-s` keeps a stopping launcher from
  killing the schedulers that drain their tier writes, `hiradix.sglang_plugin.stop`).
  `install_launcher(specs)` installs only the specs given.

The hook function is imported only in processes where its scope applies.
"""

from __future__ import annotations

import enum
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hiradix.config import ENV_VAR

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the hiradix package

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


class Scope(enum.Enum):
    """In which processes a hook is installed (see the module docstring)."""

    CLI = "cli"
    SCHEDULER = "scheduler"
    LAUNCHER = "launcher"  # installed by the launcher itself, once a flag needs it (install_launcher)


@dataclass(frozen=True, slots=True)
class HookSpec:
    """One hook: what it wraps, with which function, how, and where.

    Attributes:
        target: dotted path of the SGLang attribute wrapped, as `HookRegistry` takes it.
        hook: "module:function" of the hook; imported only where `scope` applies.
        hook_type: "before" | "after" | "around" | "replace" (`HookType` values).
        scope: the processes it is installed in.
        purpose: one line for error messages and readers.
    """

    target: str
    hook: str
    hook_type: str
    scope: Scope
    purpose: str

    def load_hook(self) -> Callable:
        """Import and return the hook function."""
        module_name, _, attr = self.hook.partition(":")
        return getattr(importlib.import_module(module_name), attr)


_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_OPENAI = "sglang.srt.entrypoints.openai"

HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        target=f"{_SERVER_ARGS}.add_cli_args",
        hook="hiradix.sglang_plugin.flags:after_add_cli_args",
        hook_type="after",
        scope=Scope.CLI,
        purpose="add the --enable-hiradix / --hiradix-* flags to SGLang's parser",
    ),
    HookSpec(
        target=f"{_SERVER_ARGS}.from_cli_args",
        hook="hiradix.sglang_plugin.flags:after_from_cli_args",
        hook_type="after",
        scope=Scope.CLI,
        purpose="validate the hiradix flags, refuse unsupported combinations, "
        "select --radix-cache-backend hiradix",
    ),
    HookSpec(
        target=f"{_SERVER_ARGS}.resolve_once",
        hook="hiradix.sglang_plugin.flags:after_resolve_once",
        hook_type="after",
        scope=Scope.CLI,
        purpose="re-check what SGLang's resolution decided (model, radix cache) "
        "before any subprocess starts",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler._process_hicache_events",
        hook="hiradix.sglang_plugin.sched_hooks:after_process_hicache_events",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="reap tier transfers and run the look-ahead window every step",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.on_idle",
        hook="hiradix.sglang_plugin.sched_hooks:after_on_idle",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="block (bounded) on I/O results instead of spinning while requests wait for their reads",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        hook="hiradix.sglang_plugin.sched_hooks:after_get_new_batch_prefill_raw",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="start the batch's layer-wise DRAM -> HBM loads (hicache_consumer_index)",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.get_cached_tokens_details",
        hook="hiradix.sglang_plugin.sched_hooks:after_get_cached_tokens_details",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="name where a request's storage hits came from (NVMe, the cluster store) in storage_backend",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.run_batch",
        hook="hiradix.sglang_plugin.sched_hooks:around_run_batch",
        hook_type="around",
        scope=Scope.SCHEDULER,
        purpose="time extend batches: the prefill rate of the load-or-recompute choice (--hiradix-store-read)",
    ),
    HookSpec(
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        hook="hiradix.sglang_plugin.sched_hooks:around_add_one_req",
        hook_type="around",
        scope=Scope.SCHEDULER,
        purpose="skip, without blocking the queue, a request whose NVMe reads are in flight",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.init_batch_result_processor",
        hook="hiradix.sglang_plugin.decode_side:after_init_batch_result_processor",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="build the decode-side offload (PD decode server with a cluster store)",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._prepare_kv_cache_release",
        hook="hiradix.sglang_plugin.decode_side:before_prepare_kv_cache_release",
        hook_type="before",
        scope=Scope.SCHEDULER,
        purpose="put a finished request's pages into the cluster store before its slots are freed (PD decode)",
    ),
    HookSpec(
        target="sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
        hook="hiradix.sglang_plugin.decode_side:after_process_decode_queue",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="reap the decode-side offload's PUTs every decode step",
    ),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
        hook="hiradix.sglang_plugin.overflow:around_init_req_max_new_tokens",
        hook_type="around",
        scope=Scope.SCHEDULER,
        purpose="cut a prompt that overflows the context before SGLang checks its length (--hiradix-context-overflow)",
    ),
    HookSpec(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        hook="hiradix.sglang_plugin.overflow:around_validate_one_request",
        hook_type="around",
        scope=Scope.LAUNCHER,
        purpose="let a prompt longer than the context reach the scheduler, which cuts it (--hiradix-context-overflow)",
    ),
    HookSpec(
        target=f"{_OPENAI}.utils.cached_tokens_details_from_dict",
        hook="hiradix.sglang_plugin.openai_cut:around_cached_tokens_details_from_dict",
        hook_type="around",
        scope=Scope.LAUNCHER,
        purpose="keep a cut's context_truncated_tokens / context_shifted_tokens in OpenAI answers' cache details",
    ),
    HookSpec(
        target=f"{_OPENAI}.utils.process_cached_tokens_details_from_ret",
        hook="hiradix.sglang_plugin.openai_cut:after_process_cached_tokens_details_from_ret",
        hook_type="after",
        scope=Scope.LAUNCHER,
        purpose="report a cut in a non-streamed OpenAI answer whose client did not ask for cache details",
    ),
    *(
        HookSpec(
            target=f"{_OPENAI}.{target}",
            hook="hiradix.sglang_plugin.openai_cut:around_generate_stream",
            hook_type="around",
            scope=Scope.LAUNCHER,
            purpose="report a cut in a streamed OpenAI answer whose client did not ask for cache details",
        )
        for target in ("serving_chat.OpenAIServingChat._generate_chat_stream",
                       "serving_completions.OpenAIServingCompletion._generate_completion_stream")
    ),
    *(
        HookSpec(
            target=f"{_OPENAI}.protocol.{answer}.model_dump_json",
            hook="hiradix.sglang_plugin.openai_cut:around_model_dump_json",
            hook_type="around",
            scope=Scope.LAUNCHER,
            purpose="write a cut's keys in an OpenAI answer (SglExt declares SGLang's CachedTokensDetails)",
        )
        for answer in ("ChatCompletionResponse", "ChatCompletionStreamResponse", "CompletionResponse",
                       "CompletionStreamResponse")
    ),
    HookSpec(
        target="sglang.srt.managers.tokenizer_manager.SignalHandler.sigterm_handler",
        hook="hiradix.sglang_plugin.stop:after_sigterm_handler",
        hook_type="after",
        scope=Scope.LAUNCHER,
        purpose="note that the launcher stops on SIGTERM (--hiradix-stop-timeout-s)",
    ),
    HookSpec(
        target="sglang.srt.utils.watchdog.SubprocessWatchdog._check_processes",
        hook="hiradix.sglang_plugin.stop:around_check_processes",
        hook_type="around",
        scope=Scope.LAUNCHER,
        purpose="while the server stops on SIGTERM, wait for the schedulers draining their tier writes "
        "instead of killing them (--hiradix-stop-timeout-s)",
    ),
    HookSpec(
        target="sglang.srt.mem_cache.kv_cache_builder.create_tree_cache",
        hook="hiradix.sglang_plugin.sessions:around_create_tree_cache",
        hook_type="around",
        scope=Scope.SCHEDULER,
        purpose="serve --enable-streaming-session on hiradix's tree (SGLang's create_tree_cache accepts it "
        "with its UnifiedRadixCache only, an isinstance check; hiradix's cache runs SGLang's StreamingSession)",
    ),
    HookSpec(
        target="sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info",
        hook="hiradix.sglang_plugin.admission:after_get_worker_info",
        hook_type="after",
        scope=Scope.SCHEDULER,
        purpose="lower max_req_input_len to the longest prompt the paged pool can admit "
        "(longer ones get SGLang's HTTP 400 instead of waiting forever)",
    ),
)


def specs_of(*modules: str) -> tuple[HookSpec, ...]:
    """The specs whose hook functions live in ``modules`` (e.g. what one flag installs)."""
    return tuple(spec for spec in HOOKS if spec.hook.split(":", 1)[0] in modules)


def hiradix_env_enabled() -> bool:
    """Whether the launcher exported a configuration (`HIRADIX_CONFIG`) to this process."""
    return bool(os.environ.get(ENV_VAR))


def current_scopes() -> frozenset[Scope]:
    """The scopes whose hooks apply in this process."""
    scopes = {Scope.CLI}
    if SCHEDULER_MODULE in sys.modules and hiradix_env_enabled():
        scopes.add(Scope.SCHEDULER)
    return frozenset(scopes)


# Hooks registered with HookRegistry by this process: target -> hook function.
_registered: dict[str, Callable] = {}


def install(specs: tuple[HookSpec, ...] = HOOKS) -> list[HookSpec]:
    """Register the hooks of this process's scopes with SGLang's `HookRegistry`.

    Registration only; SGLang applies them right after the plugins ran
    (`load_plugins()` -> `HookRegistry.apply_hooks()`). Idempotent per target.

    Returns:
        The specs registered by this call.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    scopes = current_scopes()
    chosen = [s for s in specs if s.scope in scopes and s.target not in _registered]
    loaded = [(spec, spec.load_hook()) for spec in chosen]  # import all, then register
    for spec, fn in loaded:
        HookRegistry.register(spec.target, fn, HookType(spec.hook_type))
        _registered[spec.target] = fn
    return chosen


def install_launcher(specs: tuple[HookSpec, ...] = HOOKS) -> str | None:
    """Register and apply the ``Scope.LAUNCHER`` hooks in this (the launcher's) process, after
    SGLang applied the plugins' hooks (``HookRegistry.apply_hooks`` skips targets already patched).

    Returns:
        Why they are not installed (see :func:`describe_missing`), or None.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in specs:
        if spec.scope is Scope.LAUNCHER and spec.target not in _registered:
            fn = spec.load_hook()
            HookRegistry.register(spec.target, fn, HookType(spec.hook_type))
            _registered[spec.target] = fn
    HookRegistry.apply_hooks()
    absent = missing(Scope.LAUNCHER, specs)
    return describe_missing(absent) if absent else None


def _target_attribute(target: str) -> object:
    """The raw attribute at `target` (classmethod/staticmethod unwrapped)."""
    owner_path, _, name = target.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if raw is None:
        raw = getattr(owner, name)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return raw


def is_installed(target: str, hook: Callable) -> bool:
    """Whether `hook` sits in the wrapper chain now installed at `target`.

    `HookRegistry` wraps with closures over the hook and sets `__wrapped__` to the
    next inner function; a class REPLACE puts the class itself at the target.
    """
    try:
        fn = _target_attribute(target)
    except (AttributeError, ImportError, ValueError):
        return False
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        if fn is hook:
            return True
        seen.add(id(fn))
        cells = getattr(fn, "__closure__", None) or ()
        for cell in cells:
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing(scope: Scope, specs: tuple[HookSpec, ...] = HOOKS) -> list[HookSpec]:
    """The specs of `scope` whose hook is not installed on its target in this process.

    A spec never registered here (its scope did not apply when plugins loaded) counts
    as missing.
    """
    out = []
    for spec in specs:
        if spec.scope is not scope:
            continue
        fn = _registered.get(spec.target)
        if fn is None or not is_installed(spec.target, fn):
            out.append(spec)
    return out


def describe_missing(specs: list[HookSpec]) -> str:
    """One line naming the hooks that are not installed."""
    names = ", ".join(f"{s.hook_type.upper()} {s.target} ({s.purpose})" for s in specs)
    return (
        f"SGLang did not install hook(s) {names}; SGLang logs the reason as "
        "'Failed to apply hooks to ...' (often another plugin patched the target "
        "first, or the SGLang version differs from the pinned 0.5.23)"
    )


def package_problem() -> str | None:
    """Why the imported `hiradix` package is not the one this code runs from, or None.

    Started from a directory holding a folder named `hiradix` (e.g. an old checkout),
    Python imports that folder as the package. With an editable install the plugin's
    own submodules may still come from the installed tree, so the process would mix
    two versions; with a regular install `hiradix.sglang_plugin.plugin` fails to import, SGLang logs
    "Failed to load plugin hiradix" and `--enable-hiradix` is an unknown flag.
    """
    package = sys.modules.get("hiradix")
    paths = [Path(p).resolve() for p in getattr(package, "__path__", None) or ()]
    if PACKAGE_DIR in paths:
        return None
    where = ", ".join(map(str, paths)) or repr(package)
    return (
        f"the package 'hiradix' was imported from {where} but the plugin runs from "
        f"{PACKAGE_DIR}: a folder named 'hiradix' in the working directory (or earlier "
        "on sys.path) shadows the installed package; start the server from another "
        "directory"
    )


def problem(scope: Scope, *, ignore: str | None = None) -> str | None:
    """Why hiradix cannot run in this process (shadowed package, hooks missing), or None.

    Args:
        scope: whose hooks must be installed.
        ignore: a target not to check (the hook that is asking, while it runs).
    """
    shadowed = package_problem()
    if shadowed:
        return shadowed
    absent = [s for s in missing(scope) if s.target != ignore]
    return describe_missing(absent) if absent else None
