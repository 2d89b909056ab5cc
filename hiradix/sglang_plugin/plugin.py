"""SGLang plugin entry point: flags, early refusals, and the "hiradix" cache backend.

SGLang calls `register()` (entry point `sglang.srt.plugins: hiradix`) once per
process in `load_plugins()`, then applies the registered hooks. What happens where:

- Every process: the CLI hooks of `hiradix.sglang_plugin.hooks.HOOKS` (`Scope.CLI`, in
  `hiradix.sglang_plugin.flags`). They add the
  `--enable-hiradix` / `--hiradix-*` flags to SGLang's parser and, only when
  `--enable-hiradix` is given, validate them into a `HiRadixConfig`, refuse
  configurations hiradix cannot serve, select `--radix-cache-backend hiradix`,
  default `--page-size` to 16, stash the config as `server_args._hiradix_config`
  (bookkeeping attributes ride the pickled record to the spawned schedulers) and
  export it as `HIRADIX_CONFIG` (JSON fallback). Without `--enable-hiradix` they
  change nothing, except refusing a `--hiradix-*` flag given on its own.
- Scheduler processes: the radix-cache backend "hiradix" (its factory imports
  `hiradix.sglang_plugin.cache` lazily), plus the `Scope.SCHEDULER` hooks when hiradix is enabled.

Refusals print one line "hiradix: <what, naming the flag>" on stderr and exit with
status 2 (`HiRadixRefusal`, a `SystemExit`), in the launcher, before any subprocess
starts or the model loads: from the `from_cli_args` hook (flags, paths, RAM/disk,
the model's config.json), or from the `resolve_once` hook (what SGLang's own
resolution decided, e.g. that this model runs without a radix cache).

A folder named `hiradix` in the directory the server starts from shadows the
installed package. With a regular install `hiradix.sglang_plugin.plugin` then fails to import:
SGLang only logs "Failed to load plugin hiradix ..." and starts without it, but
`--enable-hiradix` is then an unknown flag and argparse stops the launcher
("unrecognized arguments: --enable-hiradix"), so a hiradix launch cannot silently
run stock. With an editable install the plugin's submodules still load from the
installed tree while `hiradix` itself is the shadow; `--enable-hiradix` refuses
that mixture (`hooks.package_problem`), as it refuses hooks SGLang did not install.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from hiradix.config import ENV_VAR, HiRadixConfig, HiRadixConfigError
from hiradix.sglang_plugin import hooks
from hiradix.sglang_plugin.flags import CONFIG_ATTR
from hiradix.sglang_plugin.refusals import BACKEND_NAME, unsupported_build_context

logger = logging.getLogger(__name__)


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
    # A launcher that forks its scheduler (HIRADIX_MP_START_METHOD=fork, the test servers:
    # patches/p09_cpu_fork_start_method.py) hands it this process's state, where the plugins have
    # already run (SGLang's `load_plugins()` returns at once there); the child installs what a
    # spawned scheduler would have at its `load_plugins()`.
    os.register_at_fork(after_in_child=_install_in_forked_child)


def _install_in_forked_child() -> None:
    """In a forked child of a process that imported the scheduler module: the scheduler hooks
    (when hiradix is on), applied, and the cache backend. Idempotent; nothing without fork."""
    if hooks.SCHEDULER_MODULE not in sys.modules:
        return
    if hooks.install():
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
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


def hiradix_cache_factory(ctx: Any) -> Any:
    """Radix-cache factory registered as "hiradix" (runs in each scheduler process).

    Checks that the package is not shadowed, that this process's scheduler hooks are
    installed and that the build context is servable, then calls
    `hiradix.sglang_plugin.factory.create_hiradix_cache(ctx)`.

    Raises:
        RuntimeError: a hook is missing or the context cannot be served.
    """
    problem = hooks.problem(hooks.Scope.SCHEDULER)
    if problem:
        raise RuntimeError(f"hiradix: {problem}")
    config, source = _config_with_source(ctx.server_args)
    reason = unsupported_build_context(ctx)
    if reason is not None:
        raise RuntimeError(f"hiradix: cannot build the cache: {reason}")
    logger.info(
        "hiradix: building the cache on tp_rank %d (config from %s: %s)",
        ctx.tp_rank,
        source,
        config.summary(),
    )
    from hiradix.sglang_plugin.factory import create_hiradix_cache

    return create_hiradix_cache(ctx)
