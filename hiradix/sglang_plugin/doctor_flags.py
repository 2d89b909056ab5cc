"""``hiradix doctor``'s SGLang side: the launch flags judged as the launcher judges them, no model loaded.

:func:`examine` parses the command line with SGLang's own parser plus hiradix's group (the stock
``ServerArgs.add_cli_args``/``from_cli_args``, unwrapped, so no hook of this process runs), then:

1. every setting hiradix cannot be combined with (``refusals.CONFLICTS``) and every HiCache flag
   (``refusals.given_hicache_flag``), each as its own error line naming the flag; they are then
   reset on the record so that the checks after them still run;
2. the hiradix flags into a ``HiRadixConfig`` (``HiRadixConfig.from_flags``);
3. the rest of the launcher's up-front refusals by running its own hook
   (``flags.after_from_cli_args``) on the record, with the two checks the doctor reports itself
   with figures (``check_machine``: RAM and disk; ``refuse_unreachable_store``) and the launcher-hook
   installation switched off for the call;
4. the model's ``config.json`` (``model_check.read_hf_config``);
5. SGLang's own resolution (``ServerArgs.resolve_once``: reads the model's config, no weights)
   and hiradix's check of what it decided (``flags.after_resolve_once``), for a local model directory.

SGLang and hiradix print and log as they go; ``hiradix.doctor.cli`` captures it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hiradix.config import ENV_VAR, FLAGS, HiRadixConfig, HiRadixConfigError
from hiradix.doctor.plan import KVFacts, LaunchPlan
from hiradix.doctor.report import Check, Status, error, ok, warning
from hiradix.sglang_plugin import flags, hooks
from hiradix.sglang_plugin.model_check import (
    is_mla_config,
    page_bytes_estimate,
    read_hf_config,
)
from hiradix.sglang_plugin.refusals import (
    HiRadixRefusal,
    first_conflict,
    given_hicache_flag,
    host_copies_on_this_node,
)


def _fix(flag: str) -> str:
    """The fix of a refusal that names ``flag``."""
    return f"change {flag} as the message says (python -m sglang.launch_server --help lists the values)"


class _ParseError(Exception):
    """argparse refused the command line (its message)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit 2
        raise _ParseError(message)


@dataclass
class Examined:
    """What :func:`examine` found: the check lines, and the plan (None when the flags do not validate)."""

    checks: list[Check] = field(default_factory=list)
    plan: LaunchPlan | None = None


def examine(argv: list[str]) -> Examined:
    """Judge the launch flags ``argv`` (what follows ``python -m sglang.launch_server``)."""
    found = Examined()
    _examine(argv, found)
    return found


def _examine(argv: list[str], found: Examined) -> None:
    from sglang.srt.server_args import ServerArgs

    try:
        namespace = _parse(argv)
    except _ParseError as exc:
        found.checks.append(error("flags", f"sglang.launch_server would stop: {exc}", "correct the command line"))
        return
    record = inspect.unwrap(ServerArgs.__dict__["from_cli_args"].__func__)(ServerArgs, namespace)
    if not getattr(namespace, "enable_hiradix", False):
        found.checks.append(error("flags", "--enable-hiradix is not given: the server would run stock SGLang (and "
                                  "refuse any --hiradix-* flag)", "add --enable-hiradix"))
        return
    found.checks += _conflicts(record) + _hicache_flags(record)
    try:
        config = HiRadixConfig.from_flags(**{spec.name: getattr(namespace, spec.dest, None) for spec in FLAGS})
    except HiRadixConfigError as exc:
        found.checks.append(error("flags", str(exc), _fix(_flag_named(str(exc), "the flag it names"))))
        return
    refusal = _launcher_refusal(record, namespace)
    about_model = refusal is not None and refusal.startswith("--model-path")  # an architecture it refuses
    if refusal is not None:
        found.checks.append(error("model" if about_model else "flags", refusal,
                                  _fix(_flag_named(refusal, "the setting it names"))))
    elif not found.checks:
        found.checks.append(ok("flags", f"the launcher accepts them: {config.summary()}"))
    hf = read_hf_config(str(record.model_path), getattr(record, "revision", None))
    if not about_model:
        found.checks.append(_model_line(record, hf))
    if refusal is None and found.checks[-1].status is not Status.ERROR:
        found.checks.append(_resolution(record, hf))
    found.plan = _plan(record, config, hf)


def _parse(argv: list[str]) -> argparse.Namespace:
    """SGLang's parser with hiradix's group, as ``sglang.srt.server_args.prepare_server_args`` builds it."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang.launch_server", add_help=False)
    inspect.unwrap(ServerArgs.add_cli_args)(parser)
    flags.after_add_cli_args(None, parser)
    for action in parser._actions:
        if isinstance(action, flags._EnableHiRadixAction):
            action.problem = None  # hooks are not applied in the doctor; hiradix.doctor.install checks the plugin
    if "--config" in argv:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        try:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        except Exception as exc:  # noqa: BLE001 - a missing or malformed --config file, in its words
            raise _ParseError(f"--config: {exc}") from None
    return parser.parse_args(argv)


def _flag_named(message: str, default: str) -> str:
    """The flag a refusal is about: the first one it names other than --enable-hiradix (for the fix)."""
    words = [w.strip(",;:()") for w in message.removeprefix("hiradix:").split()]
    return next((w for w in words if w.startswith("--") and w != "--enable-hiradix"), default)


def _reset(record: Any, name: str) -> None:
    """Set field ``name`` of ``record`` back to ServerArgs' default (a msgspec Struct)."""
    import msgspec

    setattr(record, name, next(f.default for f in msgspec.structs.fields(type(record)) if f.name == name))


def _conflicts(record: Any) -> list[Check]:
    """One error per setting hiradix cannot be combined with; each is then reset on ``record``."""
    out = []
    while (found := first_conflict(record)) is not None:
        rule, value = found
        flag = rule.flag(value)
        out.append(error("conflict", f"{flag} cannot be combined with --enable-hiradix ({rule.why})",
                         f"drop {flag}"))
        _reset(record, rule.field)
    return out


def _hicache_flags(record: Any) -> list[Check]:
    """One error per HiCache flag given; each is then reset to its default on ``record``."""
    out = []
    while (found := given_hicache_flag(record)) is not None:
        flag, value, equivalent = found
        out.append(error("hicache-flag", f"{flag} {value} configures SGLang's HiCache, which --enable-hiradix replaces "
                         "(it would be ignored)", f"drop {flag}; hiradix's equivalent: {equivalent}"))
        _reset(record, flag.removeprefix("--").replace("-", "_"))
    return out


@contextlib.contextmanager
def _launcher_checks_only():
    """While the launcher's hook runs for the doctor: no RAM/disk or store check (the doctor
    reports those with figures), no launcher hooks installed, ``HIRADIX_CONFIG`` left as it was."""
    saved = flags.check_machine, flags.refuse_unreachable_store, hooks.install_launcher, os.environ.get(ENV_VAR)
    flags.check_machine = lambda config, **kwargs: None
    flags.refuse_unreachable_store = lambda config: None
    hooks.install_launcher = lambda specs=hooks.HOOKS: None
    try:
        yield
    finally:
        flags.check_machine, flags.refuse_unreachable_store, hooks.install_launcher, env = saved
        if env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = env


def _launcher_refusal(record: Any, namespace: argparse.Namespace) -> str | None:
    """The launcher's first up-front refusal of ``record`` (its own hook), or None; on None the
    record is wired as the launcher wires it (backend, page size, ``_hiradix_config``)."""
    from sglang.srt.server_args import ServerArgs

    with _launcher_checks_only():
        try:
            flags.after_from_cli_args(record, ServerArgs, namespace)
        except HiRadixRefusal as refusal:
            return str(refusal).removeprefix("hiradix: ")
    return None


def _model_line(record: Any, hf: tuple[dict, str] | None) -> Check:
    path = str(record.model_path)
    if hf is not None:
        config, where = hf
        archs = ", ".join(config.get("architectures") or ["?"])
        kind = "multi-head latent attention (MLA)" if is_mla_config(config) else "per-head K/V"
        return ok("model", f"{where}: {archs}, {kind}; no weights loaded")
    if Path(path).expanduser().exists():
        return warning("model", f"--model-path {path} has no readable config.json: the model checks are skipped "
                       "(SGLang and the cache factory check it at start)", "give a model directory with config.json")
    return error("model", f"--model-path {path} is not a local directory and not in the Hugging Face cache: the "
                 "doctor cannot check it (the server would try to download it)",
                 f"download it first (huggingface-cli download {path}) or give its local directory")


def _resolution(record: Any, hf: tuple[dict, str] | None) -> Check:
    """SGLang's resolution of the record and hiradix's check of it (a local model directory only:
    for a hub id it may go to the network)."""
    if hf is None or not Path(str(record.model_path)).expanduser().is_dir():
        return warning("resolution", "SGLang's resolution not run (the model is not a local directory); "
                       "the server checks what it decides at start", "give a local model directory to check it here")
    try:
        record.resolve_once()
        flags.after_resolve_once(None, record)
    except HiRadixRefusal as refusal:
        message = str(refusal).removeprefix("hiradix: ")
        return error("resolution", message, f"change {_flag_named(message, 'the setting it names')}")
    except Exception as exc:  # noqa: BLE001 - SGLang refuses the flags for this model or machine, as it would at launch
        return error("resolution", f"SGLang's resolution stopped: {type(exc).__name__}: {exc}",
                     "correct the flags it names (the launcher would stop here too)")
    view = _view(record)
    return ok("resolution", f"SGLang resolved the flags: page size {view.page_size}, radix cache backend "
              f"{view.radix_cache_backend or 'none (decode side)'}, model dtype {_model_config(record).dtype}")


def _view(record: Any) -> Any:
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(record) if getattr(record, "_resolution_finished", False) else record


def _model_config(record: Any) -> Any:
    return getattr(record, "_model_config", None) if getattr(record, "_resolution_finished", False) else None


def _plan(record: Any, config: HiRadixConfig, hf: tuple[dict, str] | None) -> LaunchPlan:
    """The launch plan of a record the launcher accepted (or refused for reasons the machine checks do not need)."""
    view = _view(record)

    def field_of(name: str) -> int:
        return int(getattr(view, name, 1) or 1)

    is_mla = hf is not None and is_mla_config(hf[0])
    tp, nnodes, attn_dp = field_of("tp_size"), field_of("nnodes"), field_of("attn_dp_size")
    if attn_dp == 1 and getattr(view, "enable_dp_attention", False):
        attn_dp = field_of("dp_size")  # the deprecated spelling, before resolution (refusals does the same)
    node_rank = int(getattr(view, "node_rank", 0) or 0)
    per_node = max(1, tp // nnodes)
    here = range(node_rank * per_node, min(tp, (node_rank + 1) * per_node))
    attn_tp = max(1, tp // attn_dp)
    shared = is_mla and config.mla_host_copy == "node" and 1 < attn_tp <= per_node
    page_size = int(view.page_size or flags.DEFAULT_PAGE_SIZE_TOKENS)
    return LaunchPlan(
        config=config, model_path=str(record.model_path), revision=getattr(record, "revision", None),
        page_size=page_size, tp_size=tp, attn_dp_size=attn_dp,
        nvme_ranks=tuple(r for r in here if not shared or r % attn_tp == 0),
        host_copies=host_copies_on_this_node(record, config, is_mla), shared_host_copy=shared,
        dram_bytes_per_copy=_dram_bytes_per_copy(config, view, hf, page_size),
        kv=_kv_facts(record, view, attn_tp))  # fmt: skip


def _dram_bytes_per_copy(config: HiRadixConfig, view: Any, hf: tuple[dict, str] | None, page_size: int) -> int | None:
    """``--hiradix-dram-gb``; for ``--hiradix-dram-ratio``, the ratio of the device pool when
    ``--max-total-tokens`` fixes it (as ``refusals.refuse_dram_ratio``), else None."""
    if not config.dram_ratio:
        return config.dram_bytes
    tokens = getattr(view, "max_total_tokens", None)
    page_bytes = None if hf is None else page_bytes_estimate(
        hf[0], page_size, int(view.tp_size or 1), str(getattr(view, "dtype", "auto")), getattr(view, "kv_cache_dtype", None))
    if not tokens or page_bytes is None:
        return None
    return config.dram_bytes_for((int(tokens) // page_size) * page_bytes)


_KV_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "float32": "float32"}


def _kv_facts(record: Any, view: Any, attn_tp: int) -> KVFacts | None:
    """The KV layout the pool will have, from SGLang's resolved ``ModelConfig`` (None before resolution)."""
    model_config = _model_config(record)
    if model_config is None:
        return None
    from hiradix.sglang_plugin.model_check import model_config_is_mla

    if model_config_is_mla(model_config):
        rope = int(model_config.qk_rope_head_dim)
        heads, head_dim = 1, int(model_config.kv_lora_rank) + rope
    else:
        rope, heads, head_dim = 0, int(model_config.get_num_kv_heads(attn_tp)), int(model_config.head_dim)
    layers = int(getattr(model_config, "num_attention_layers", None) or model_config.num_hidden_layers)
    model_dtype = str(model_config.dtype)
    kv = str(getattr(view, "kv_cache_dtype", "auto") or "auto")
    kv_dtype = (model_dtype.removeprefix("torch.") if kv == "auto" else
                "uint8" if kv.startswith("fp8") else _KV_DTYPES.get(kv))  # SGLang stores fp8 KV as uint8
    return KVFacts(layers, heads, head_dim, rope, model_dtype, kv_dtype)
