"""hiradix's flags, config validation, early refusals, self-checks, and "off = stock".

Three kinds of test:
- unit tests of `HiRadixConfig`, the model-architecture rules and the hook self-check;
- in-process parsing through SGLang's own `add_cli_args`/`from_cli_args` (unwrapped)
  followed by our hook functions, so no global monkey-patching leaks into this process;
- a few real `python -m sglang.launch_server` launchers (own session, killed in `finally`;
  forked from the test zygote, hiradix.testing.zygote, except where a folder in the working
  directory must shadow the package as it would cold) that prove the wiring: exit status 2
  within 30 s, one "hiradix: ..." line on stderr naming the flag, and no model loaded; and the
  shared session servers' logs (cold launchers, as users start them). Both
  are marked `e2e` (they start the real launcher), so `-m "not e2e"` runs only the first two.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import shutil
import pickle
import re
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest

from hiradix.sglang_plugin import flags, hooks, model_check, plugin, refusals
from hiradix.testing import zygote
from hiradix.testing.process_group import kill_group
from hiradix.testing.server import ZYGOTE_ENV
from hiradix.config import (
    ENV_VAR,
    HiRadixConfig,
    HiRadixConfigError,
    check_machine,
)

REFUSAL_TIME_LIMIT_S = 30.0
WEIGHT_LOADING_MARKERS = ("Load weight begin", "Loading safetensors")

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}
# DeepSeek-V2-Lite-like: Multi-head Latent Attention.
MLA_CONFIG = {
    **LLAMA_CONFIG,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# DeepSeek-V3.2-like: MLA with the sparse-attention indexer (DSA), which hiradix refuses.
DSA_CONFIG = {**MLA_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_topk": 2048}
# gpt-oss-like: sliding-window layers interleaved with full-attention layers.
SWA_HYBRID_CONFIG = {
    **LLAMA_CONFIG,
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
}
# Gemma-3-1B-like config.json, scaled down (transformers 4's form: the pattern, no layer_types):
# SGLang's model override turns on --disable-hybrid-swa-memory, so its KV is in one full pool.
GEMMA3_CONFIG = {
    **LLAMA_CONFIG,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 64,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
}
# Qwen2 with its sliding window on (window 1024 < context 2048): not a hybrid-SWA architecture in SGLang.
QWEN2_SWA_CONFIG = {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 0}
# HRM-Text passes the config.json rules, but SGLang's resolution disables the radix cache.
HRM_TEXT_CONFIG = {**LLAMA_CONFIG, "architectures": ["HrmTextForCausalLM"], "model_type": "hrm_text"}


def write_model_dir(root: Path, name: str, config: dict) -> Path:
    """A model directory holding only config.json (no weights, no tokenizer)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path, "llama", LLAMA_CONFIG)


# --------------------------------------------------------------------- subprocesses


class Finished(zygote.Finished):
    """A process that ran to its end (:class:`hiradix.testing.zygote.Finished`), read as a launcher's."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def hiradix_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("hiradix:")]


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill the session we started for `proc` (the launcher and anything it spawned), by PID."""
    kill_group(proc)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_python(
    python: str, args: list[str], env: dict, cwd: Path, timeout_s: float = 90.0, cold: bool = False
) -> Finished:
    """``python *args`` in ``cwd`` with ``env``, to its end: forked from the test zygote where the
    tests use one (hiradix.testing.zygote: the same interpreter, SGLang already imported, ~14 s of
    CPU less), else (or ``cold``: what a package folder in ``cwd`` would shadow) a new process."""
    if not cold and os.environ.get(ZYGOTE_ENV) == "1" and python == sys.executable:
        return _run_forked(args, env, cwd, timeout_s)
    start = time.monotonic()
    proc = subprocess.Popen(
        [python, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{args[:3]} did not exit within {timeout_s} s:\n{stdout}\n{stderr}")
    finally:
        _kill_session(proc)
    return Finished(proc.returncode, stdout, stderr, time.monotonic() - start)


def _run_forked(args: list[str], env: dict, cwd: Path, timeout_s: float) -> Finished:
    try:
        ran = zygote.run(args, env, cwd, timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[:3]} did not exit within {timeout_s} s")
    return Finished(**dataclasses.asdict(ran))


def launch(python: str, args: list[str], env: dict, cwd: Path, cold: bool = False) -> Finished:
    return run_python(python, ["-m", "sglang.launch_server", *args], env, cwd, cold=cold)


def assert_refused(result: Finished, *expected: str, resolved: bool = False) -> str:
    """Exit status 2, fast, one hiradix line containing `expected`, no model loaded."""
    assert result.returncode == 2, result.output[-3000:]
    assert result.elapsed_s < REFUSAL_TIME_LIMIT_S, result.elapsed_s
    lines = result.hiradix_lines()
    assert len(lines) == 1, result.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    for marker in WEIGHT_LOADING_MARKERS:
        assert marker not in result.output
    if not resolved:  # stopped in from_cli_args: SGLang never reached run_server
        assert "hiradix: enabled" not in result.output
        assert "server_args=" not in result.output
    return lines[0]


REFUSALS = [
    # (id, extra args, text the hiradix line must contain)
    ("disable-radix-cache", ["--disable-radix-cache"], ["--disable-radix-cache"]),
    ("hierarchical-cache", ["--enable-hierarchical-cache"], ["--enable-hierarchical-cache"]),
    ("hicache-alias", ["--enable-hicache"], ["--enable-hierarchical-cache"]),
    ("lmcache", ["--enable-lmcache"], ["--enable-lmcache"]),
    ("flexkv", ["--enable-flexkv"], ["--enable-flexkv"]),
    ("other-backend", ["--radix-cache-backend", "flexkv"], ["--radix-cache-backend flexkv"]),
    ("speculative", ["--speculative-algorithm", "EAGLE"], ["--speculative-algorithm EAGLE", "draft model's KV",
                                                          "use SGLang's HiCache (--enable-hierarchical-cache)"]),
    ("attn-dp", ["--attn-dp-size", "2"], ["--attn-dp-size 2", "DP attention", "use --tp-size without --attn-dp-size"]),
    ("dp-attention-deprecated", ["--dp-size", "2", "--enable-dp-attention"],
     ["--enable-dp-attention (SGLang 0.5.23 rewrites it to --attn-dp-size N)", "DP attention"]),
    # issue 18: the decode side offloads finished requests into the store the prefill side reads
    ("pd-decode-without-store", ["--disaggregation-mode", "decode"],
     ["--disaggregation-mode decode needs a cluster store", "--hiradix-store and --hiradix-store-config",
      "a store the prefill side can read", "run the decode server without --enable-hiradix"]),
    ("pd-decode-with-nvme", ["--disaggregation-mode", "decode", "--hiradix-store", "mooncake", "--hiradix-store-config",
                             '{"master_server_address": "127.0.0.1:1"}', "--hiradix-nvme-path", "/tmp", "--hiradix-nvme-gb", "1"],
     ["--hiradix-nvme-path and --hiradix-nvme-gb do not apply with --disaggregation-mode decode"]),
    ("pipeline-parallel", ["--pp-size", "2"], ["--pp-size 2", "use --tp-size"]),
    # issue 36: SGLang's cache factory raises for this after the model loaded (UnifiedRadixCache only)
    ("session-radix-cache", ["--enable-session-radix-cache"], ["--enable-session-radix-cache", "drop the flag"]),
    # issue 36: streaming sessions are served, but a cut prompt would not match the KV a session kept
    ("overflow-with-streaming-session", ["--enable-streaming-session", "--hiradix-context-overflow", "shift"],
     ["--hiradix-context-overflow cannot be combined with --enable-streaming-session"]),
    ("eviction-policy-tlru", ["--radix-eviction-policy", "tlru"],
     ["--radix-eviction-policy tlru", "use --hiradix-policy"]),
    ("eviction-policy-lfu", ["--radix-eviction-policy", "lfu"], ["--radix-eviction-policy lfu", "use --hiradix-policy"]),
    ("nvme-gb-without-path", ["--hiradix-nvme-gb", "1"], ["--hiradix-nvme-gb 1 needs --hiradix-nvme-path"]),
    ("dram-negative", ["--hiradix-dram-gb", "-1"], ["--hiradix-dram-gb must be > 0, got -1"]),
    ("dram-over-ram", ["--hiradix-dram-gb", "1000000"], ["--hiradix-dram-gb 1000000 needs", "available"]),
    ("nvme-not-writable", ["--hiradix-nvme-path", "/proc", "--hiradix-nvme-gb", "1"], ["--hiradix-nvme-path /proc is not writable"]),
    ("dram-below-one-page", ["--hiradix-dram-gb", "0.00001"], ["--hiradix-dram-gb 1e-05 (10000 bytes) holds no KV page"]),
    ("nvme-below-one-page", ["--hiradix-nvme-path", "/tmp", "--hiradix-nvme-gb", "0.00001"], ["--hiradix-nvme-gb 1e-05 (10000 bytes) holds no KV page"]),
    ("page-size-below-one", ["--page-size", "-16"], ["--page-size must be >= 1 with --enable-hiradix, got -16"]),
    ("predictive-with-tp", ["--hiradix-policy", "predictive", "--tp-size", "2"],
     ["--hiradix-policy predictive cannot be combined with --tp-size 2", "use --hiradix-policy lookahead"]),
    # issue 14: HiCache's flags would be silently ignored; each names hiradix's equivalent.
    ("hicache-ratio", ["--hicache-ratio", "2"], ["--hicache-ratio 2.0 configures SGLang's HiCache", "--hiradix-dram-ratio"]),
    ("dram-zero", ["--hiradix-dram-gb", "0"], ["--hiradix-dram-gb must be > 0, got 0", "--hiradix-dram-mode staging"]),
    # issue 19: load or recompute is a choice about store hits
    ("store-read-without-store", ["--hiradix-store-read", "never"], ["--hiradix-store-read applies only with --hiradix-store"]),
]  # fmt: skip


# Rows of REFUSALS that also go through a real launcher process: one SGLang conflict, one
# hiradix value error, one machine check. The wiring (plugin loaded, hooks applied, exit status
# 2 before any model loads) is the same for every row; the rows' messages are checked in-process.
LAUNCHER_REFUSALS = ("hierarchical-cache", "nvme-gb-without-path", "dram-over-ram", "eviction-policy-tlru")


def refused_in_process(argv: list[str], monkeypatch, capsys) -> str:
    """Parse `argv` through SGLang's parser and our hooks (as the launcher does) and expect a
    refusal: a SystemExit with status 2 and exactly one "hiradix: ..." line on stderr."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    capsys.readouterr()
    with pytest.raises(refusals.HiRadixRefusal) as caught:
        parse_in_process(argv, monkeypatch)
    assert caught.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hiradix:")]
    assert lines == [str(caught.value)], lines
    return lines[0]


@pytest.mark.parametrize("extra, expected", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_flag(monkeypatch, capsys, llama_dir, cpu_flags, extra, expected):
    line = refused_in_process(["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix", *extra],
                              monkeypatch, capsys)
    for text in expected:
        assert text in line, line


@pytest.mark.parametrize("extra, expected", [r[1:] for r in REFUSALS if r[0] in LAUNCHER_REFUSALS],
                         ids=[r[0] for r in REFUSALS if r[0] in LAUNCHER_REFUSALS])
@pytest.mark.e2e
def test_launcher_refuses_before_loading(
    venv_python, cpu_env, cpu_flags, llama_dir, tmp_path, extra, expected
):
    args = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix", *extra]
    assert_refused(launch(venv_python, args, cpu_env, tmp_path), *expected)


def test_refuses_nvme_path_that_is_a_file(monkeypatch, capsys, cpu_flags, llama_dir, tmp_path):
    file_path = tmp_path / "not-a-dir"
    file_path.write_text("x")
    argv = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix",
            "--hiradix-nvme-path", str(file_path), "--hiradix-nvme-gb", "1"]  # fmt: skip
    line = refused_in_process(argv, monkeypatch, capsys)
    assert f"--hiradix-nvme-path {file_path} exists but is not a directory" in line
    assert file_path.read_text() == "x"


@pytest.mark.e2e
def test_launcher_refuses_missing_nvme_path(venv_python, cpu_env, cpu_flags, llama_dir, tmp_path):
    missing = tmp_path / "no" / "such"
    args = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix",
            "--hiradix-nvme-path", str(missing), "--hiradix-nvme-gb", "0.1"]  # fmt: skip
    assert_refused(launch(venv_python, args, cpu_env, tmp_path), f"--hiradix-nvme-path {missing} does not exist")
    assert not (tmp_path / "no").exists()


def test_refuses_nvme_larger_than_free_disk(monkeypatch, capsys, cpu_flags, llama_dir, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    argv = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix",
            "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "1e9"]  # fmt: skip
    line = refused_in_process(argv, monkeypatch, capsys)
    assert "--hiradix-nvme-gb 1000000000 needs" in line
    assert f"--hiradix-nvme-path {nvme} has" in line and "GB free" in line
    assert list(nvme.iterdir()) == []


@pytest.mark.parametrize(
    "flag_args, flag",
    [(["--hiradix-policy", "lru"], "--hiradix-policy"), (["--hiradix-dram-gb", "2"], "--hiradix-dram-gb")],
)
def test_refuses_hiradix_flag_without_enable(monkeypatch, capsys, cpu_flags, llama_dir, flag_args, flag):
    line = refused_in_process(["--model-path", str(llama_dir), *cpu_flags, *flag_args], monkeypatch, capsys)
    assert f"{flag} given without --enable-hiradix" in line


def test_refuses_backend_name_without_enable(monkeypatch, capsys, cpu_flags, llama_dir):
    argv = ["--model-path", str(llama_dir), *cpu_flags, "--radix-cache-backend", "hiradix"]
    assert "--radix-cache-backend hiradix requires --enable-hiradix" in refused_in_process(argv, monkeypatch, capsys)


@pytest.mark.parametrize(
    "config, expected",
    [(DSA_CONFIG, "a DeepSeek sparse-attention (DSA) model"),
     ({**LLAMA_CONFIG, "attention_chunk_size": 8192}, "a chunked local-attention model")],
    ids=["dsa", "llama4-chunked"],
)
def test_refuses_unsupported_architecture(monkeypatch, capsys, cpu_flags, tmp_path, config, expected):
    """Refused from config.json before SGLang's resolution, --disable-hybrid-swa-memory or not."""
    model_dir = write_model_dir(tmp_path, "model", config)
    argv = ["--model-path", str(model_dir), *cpu_flags, "--enable-hiradix", "--disable-hybrid-swa-memory"]
    line = refused_in_process(argv, monkeypatch, capsys)
    assert f"--model-path {model_dir} is" in line and expected in line, line
    assert "--enable-hierarchical-cache" in line  # SERVED_MODELS: what to use instead


@pytest.mark.parametrize("config", [SWA_HYBRID_CONFIG, GEMMA3_CONFIG, QWEN2_SWA_CONFIG],
                         ids=["gpt-oss", "gemma3", "qwen2-swa"])
def test_sliding_window_configs_wait_for_sglang_resolution(monkeypatch, cpu_flags, tmp_path, config):
    """Issue 33: config.json alone does not decide a sliding-window model (SGLang's model overrides
    may turn on --disable-hybrid-swa-memory); `after_resolve_once` does."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    model_dir = write_model_dir(tmp_path, "model", config)
    args = parse_in_process(["--model-path", str(model_dir), *cpu_flags, "--enable-hiradix", "--hiradix-dram-gb",
                             "0.01"], monkeypatch)
    assert args.radix_cache_backend == "hiradix"


# ``--attention-backend triton``: SGLang's resolution accepts no other backend for gpt-oss (resolution only).
TRITON = ["--attention-backend", "triton"]


@pytest.mark.e2e
def test_launcher_refuses_unsupported_architecture(venv_python, cpu_env, cpu_flags, tmp_path):
    # gpt-oss: SGLang serves its sliding layers from a separate SWA pool; refused after SGLang's
    # resolution (resolve_once hook), in the launcher, before any subprocess or weight loading.
    model_dir = write_model_dir(tmp_path, "model", SWA_HYBRID_CONFIG)
    args = ["--model-path", str(model_dir), *cpu_flags, *TRITON, "--enable-hiradix"]
    assert_refused(launch(venv_python, args, cpu_env, tmp_path), f"--model-path {model_dir} is",
                   "a sliding-window model", "separate SWA pool", "add --disable-hybrid-swa-memory to serve it",
                   resolved=True)


@pytest.mark.e2e
def test_launcher_refuses_when_resolution_disables_radix_cache(venv_python, cpu_env, cpu_flags, tmp_path):
    # config.json passes our rules; SGLang's resolution then forces --disable-radix-cache
    # for HRM-Text. The resolve_once hook refuses in the launcher, before any subprocess.
    model_dir = write_model_dir(tmp_path, "hrm", HRM_TEXT_CONFIG)
    args = ["--model-path", str(model_dir), *cpu_flags, "--enable-hiradix"]
    assert_refused(
        launch(venv_python, args, cpu_env, tmp_path),
        "SGLang's resolution (_handle_model_capability_adjustments) set --disable-radix-cache",
        resolved=True,
    )


@pytest.mark.e2e
def test_help_lists_hiradix_flags(venv_python, cpu_env, tmp_path):
    result = launch(venv_python, ["--help"], cpu_env, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    help_text = result.stdout.split("\nhiradix:\n", 1)[1]  # our argument group
    for flag in ("--enable-hiradix", *flags.VALUE_FLAGS.values()):
        assert flag in help_text
    assert "{lru,lookahead,predictive}" in help_text and "{write_through,write_back}" in help_text


@pytest.mark.e2e
def test_valid_config_is_accepted_by_the_launcher(venv_python, cpu_env, cpu_flags, llama_dir, tmp_path):
    # The launcher passes every hiradix check and logs the config; with no tokenizer
    # in llama_dir SGLang itself fails afterwards, which is not hiradix's concern.
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix",
            "--hiradix-dram-gb", "0.5", "--hiradix-policy", "lru",
            "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.25",
            "--hiradix-write-policy", "write_back", "--hiradix-load-timeout-s", "3"]  # fmt: skip
    result = launch(venv_python, args, cpu_env, tmp_path)
    assert result.hiradix_lines() == []
    assert (
        "hiradix: enabled (policy=lru, write_policy=write_back, dram_bytes=500000000, dram_mode=cache, "
        f"nvme={nvme} (250000000 bytes), store=off, load_timeout_s=3, partial_page=on, page_size=16)"
    ) in result.output
    assert "'radix_cache_backend': 'hiradix'" in result.output
    assert list(nvme.iterdir()) == []  # checking creates nothing


# ------------------------------------------------------- self-check, in a subprocess

_UNDO_FROM_CLI_ARGS_HOOK = textwrap.dedent(
    """
    import inspect, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    # As if SGLang had failed to apply our from_cli_args hook (it would only log that).
    raw = ServerArgs.__dict__["from_cli_args"].__func__
    ServerArgs.from_cli_args = classmethod(inspect.unwrap(raw))
    args = prepare_server_args(sys.argv[1:])
    print("PARSED", args.radix_cache_backend)
    """
)


@pytest.mark.e2e
def test_enable_refuses_when_a_hook_is_not_installed(venv_python, cpu_env, llama_dir, tmp_path):
    base = ["-c", _UNDO_FROM_CLI_ARGS_HOOK, "--model-path", str(llama_dir)]
    refused = run_python(venv_python, [*base, "--enable-hiradix"], cpu_env, tmp_path)
    assert refused.returncode == 2, refused.output[-3000:]
    (line,) = refused.hiradix_lines()
    assert "SGLang did not install hook(s) AFTER sglang.srt.server_args.ServerArgs.from_cli_args" in line
    assert "PARSED" not in refused.stdout
    # Without --enable-hiradix the same broken process parses as stock SGLang.
    stock = run_python(venv_python, base, cpu_env, tmp_path)
    assert stock.returncode == 0, stock.output[-3000:]
    assert "PARSED None" in stock.stdout


@pytest.mark.e2e
def test_enable_refuses_when_package_is_shadowed(venv_python, cpu_env, cpu_flags, llama_dir, tmp_path):
    # A folder named hiradix in the working directory is imported as the package; with
    # the editable install the plugin's own modules still load from the repository.
    (tmp_path / "hiradix").mkdir()
    (tmp_path / "hiradix" / "__init__.py").write_text("")
    args = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix"]
    assert_refused(
        launch(venv_python, args, cpu_env, tmp_path, cold=True),
        f"the package 'hiradix' was imported from {tmp_path / 'hiradix'}",
        "shadows the installed package",
    )


@pytest.mark.e2e
def test_plugin_that_fails_to_import_cannot_run_silently(venv_python, cpu_env, cpu_flags, llama_dir, tmp_path):
    # A shadowing folder whose plugin module fails: SGLang only logs the failure and
    # drops the plugin, so --enable-hiradix becomes an unknown flag (argparse exits 2).
    (tmp_path / "hiradix" / "sglang_plugin").mkdir(parents=True)
    (tmp_path / "hiradix" / "__init__.py").write_text("")
    (tmp_path / "hiradix" / "sglang_plugin" / "__init__.py").write_text("")
    (tmp_path / "hiradix" / "sglang_plugin" / "plugin.py").write_text("raise ImportError('not the plugin')\n")
    args = ["--model-path", str(llama_dir), *cpu_flags, "--enable-hiradix"]
    result = launch(venv_python, args, cpu_env, tmp_path, cold=True)
    assert result.returncode == 2
    assert result.elapsed_s < REFUSAL_TIME_LIMIT_S
    assert "Failed to load plugin hiradix" in result.output
    assert "unrecognized arguments: --enable-hiradix" in result.stderr


# ------------------------------------------------- plugin off = stock, in a subprocess

_DUMP_PARSED_AND_RESOLVED = textwrap.dedent(
    """
    import json, sys
    import msgspec
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    from hiradix.sglang_plugin import hooks
    args = prepare_server_args(sys.argv[1:])
    fields = {k: repr(v) for k, v in msgspec.structs.asdict(args).items()}
    bookkeeping = {k: repr(v) for k, v in vars(args).items()}
    args.resolve_once()
    resolved = {k: repr(v) for k, v in args.resolved_dict().items()}
    print("DUMP" + json.dumps({
        "fields": fields, "bookkeeping": bookkeeping, "resolved": resolved,
        "plugin_loaded": "hiradix.sglang_plugin.plugin" in sys.modules,
        "hooks_installed": [
            hooks.is_installed(s.target, hooks._registered[s.target])
            for s in hooks.HOOKS if s.target in hooks._registered
        ],
    }))
    """
)


def _dump(python: str, argv: list[str], env: dict, cwd: Path) -> dict:
    result = run_python(python, ["-c", _DUMP_PARSED_AND_RESOLVED, *argv], env, cwd)
    assert result.returncode == 0, result.output[-3000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("DUMP")]
    return json.loads(line[len("DUMP"):])


@pytest.mark.e2e
def test_without_enable_hiradix_parsing_and_resolution_match_stock(
    venv_python, cpu_env, cpu_flags, llama_dir, tmp_path
):
    argv = ["--model-path", str(llama_dir), *cpu_flags, "--random-seed", "1"]
    with_plugin = _dump(venv_python, argv, cpu_env, tmp_path)
    without_env = {**cpu_env, "SGLANG_PLUGINS": "no-such-plugin"}  # whitelist drops hiradix
    without_plugin = _dump(venv_python, argv, without_env, tmp_path)
    assert with_plugin["plugin_loaded"] and not without_plugin["plugin_loaded"]
    # every launcher-side hook is installed (scheduler hooks only go into scheduler processes)
    cli_hooks = [s for s in hooks.HOOKS if s.scope is hooks.Scope.CLI]
    assert with_plugin["hooks_installed"] == [True] * len(cli_hooks)  # not vacuous
    assert with_plugin["fields"] == without_plugin["fields"]
    assert with_plugin["bookkeeping"] == without_plugin["bookkeeping"]
    assert with_plugin["resolved"] == without_plugin["resolved"]
    assert with_plugin["fields"]["page_size"] == "None"
    assert with_plugin["fields"]["radix_cache_backend"] == "None"


# ------------------------------------------------------------ in-process parsing


def parse_in_process(argv: list[str], monkeypatch) -> object:
    """SGLang's own parser + our hook functions, without patching ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(hooks, "missing", lambda scope, specs=hooks.HOOKS: [])
    parser = argparse.ArgumentParser()
    inspect.unwrap(ServerArgs.add_cli_args)(parser)
    flags.after_add_cli_args(None, parser)
    namespace = parser.parse_args(argv)
    from_cli_args = inspect.unwrap(ServerArgs.__dict__["from_cli_args"].__func__)
    result = from_cli_args(ServerArgs, namespace)
    assert flags.after_from_cli_args(result, ServerArgs, namespace) is None
    return result


def resolved_in_process(argv: list[str], monkeypatch) -> object:
    """`parse_in_process`, then SGLang's resolution (`resolve_once`: the model's config, no
    weights) and our check of what it decided (`after_resolve_once`), as the launcher runs them."""
    args = parse_in_process(argv, monkeypatch)
    args.resolve_once()
    flags.after_resolve_once(None, args)
    return args


# Issue 33: sliding-window models after SGLang's resolution. (id, config, flags, None = served |
# texts of the refusal). gpt-oss refused as SGLang serves it (SWA pool): tests/e2e/test_e2e_sliding_full_pool.py.
RESOLVED_SLIDING = [
    ("gemma3-sglang-override", GEMMA3_CONFIG, [], None),
    ("gpt-oss-full-pool", SWA_HYBRID_CONFIG, [*TRITON, "--disable-hybrid-swa-memory"], None),
    ("gpt-oss-window-covers-context", SWA_HYBRID_CONFIG, [*TRITON, "--context-length", "128"],
     ["that SGLang serves from a separate SWA pool", "add --disable-hybrid-swa-memory to serve it"]),
    # Qwen2's sliding window is not a hybrid-SWA architecture to SGLang: one full pool, served as stock serves it.
    ("qwen2-swa", QWEN2_SWA_CONFIG, [], None),
    ("qwen2-swa-window-covers-context", QWEN2_SWA_CONFIG, ["--context-length", "1024"], None),
]  # fmt: skip


@pytest.mark.parametrize("config, extra, expected", [r[1:] for r in RESOLVED_SLIDING], ids=[r[0] for r in RESOLVED_SLIDING])
def test_sliding_window_models_are_decided_by_sglang_resolution(monkeypatch, capsys, cpu_flags, tmp_path, config,
                                                                extra, expected):
    """Served where SGLang's resolution puts every layer's KV in one full pool (its
    --disable-hybrid-swa-memory, the user's or its own override, or an architecture SGLang does not
    serve with hybrid SWA memory); refused otherwise, naming the flag, before any weights load."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import is_hybrid_swa_model

    monkeypatch.delenv(ENV_VAR, raising=False)
    model_dir = write_model_dir(tmp_path, "model", config)
    argv = ["--model-path", str(model_dir), *cpu_flags, *extra, "--enable-hiradix", "--hiradix-dram-gb", "0.01"]
    if expected is not None:
        capsys.readouterr()
        with pytest.raises(refusals.HiRadixRefusal) as caught:
            resolved_in_process(argv, monkeypatch)
        assert f"--model-path {model_dir} is a sliding-window model" in str(caught.value)
        for text in expected:
            assert text in str(caught.value), str(caught.value)
        assert "--enable-hierarchical-cache" not in str(caught.value)  # the flag is the remedy here
        return
    args = resolved_in_process(argv, monkeypatch)
    # What the scheduler's ModelConfig derives (is_hybrid_swa): False, so SGLang builds one full pool.
    model_config = args._model_config
    assert not (is_hybrid_swa_model(model_config.hf_config.architectures, model_config.hf_text_config)
                and not resolving_view(args).disable_hybrid_swa_memory)
    if config is GEMMA3_CONFIG:  # not the user's flag: SGLang's override for Gemma 2/3 turned it on
        assert args.disable_hybrid_swa_memory is False and resolving_view(args).disable_hybrid_swa_memory is True
        assert flags._declared_by(args, "disable_hybrid_swa_memory") is not None


@pytest.mark.parametrize("dp_flags", [["--attn-dp-size", "2"], ["--dp-size", "2", "--enable-dp-attention"]],
                         ids=["attn-dp-size", "enable-dp-attention"])
def test_dp_attention_is_served_for_mla_models(monkeypatch, tmp_path, cpu_flags, dp_flags):
    """Issue 18: DP attention with an MLA model is accepted (one tree and tier set per DP rank);
    the same flags with a dense model are refused (test_refusals_name_the_flag[attn-dp])."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    mla_dir = write_model_dir(tmp_path, "mla", MLA_CONFIG)
    args = parse_in_process(["--model-path", str(mla_dir), *cpu_flags, "--tp-size", "2", *dp_flags,
                             "--enable-hiradix", "--hiradix-dram-gb", "0.01"], monkeypatch)
    assert args.radix_cache_backend == "hiradix"
    assert refusals.dp_attention_flag(args) is not None


def test_valid_flags_become_config_backend_and_page_size(monkeypatch, llama_dir, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    args = parse_in_process(
        ["--model-path", str(llama_dir), "--enable-hiradix", "--hiradix-dram-gb", "0.5",
         "--hiradix-nvme-path", "nvme", "--hiradix-nvme-gb", "0.25",
         "--hiradix-lookahead-window", "8", "--hiradix-load-timeout-s", "3.5"],
        monkeypatch,
    )  # fmt: skip
    expected = HiRadixConfig(
        dram_bytes=500_000_000,
        nvme_path=(tmp_path / "nvme").resolve(),
        nvme_bytes=250_000_000,
        policy="lookahead",
        lookahead_window=8,
        write_policy="write_through",
        load_timeout_s=3.5,
    )
    assert args._hiradix_config == expected
    assert args.radix_cache_backend == "hiradix"
    assert args.page_size == flags.DEFAULT_PAGE_SIZE_TOKENS == 16
    assert HiRadixConfig.from_json(os.environ[ENV_VAR]) == expected
    assert plugin.config_from_server_args(args) is args._hiradix_config
    # Bookkeeping attributes ride ServerArgs.__reduce__ to the spawned schedulers.
    assert pickle.loads(pickle.dumps(args))._hiradix_config == expected


def test_enable_turns_on_cache_report_and_metrics(monkeypatch, llama_dir):
    """Issue 14: the README's command, without --enable-metrics/--enable-cache-report, still
    gives per-tier hit details and /metrics."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix"], monkeypatch)
    assert args.enable_metrics is True and args.enable_cache_report is True
    assert args._hiradix_turned_on == ("--enable-cache-report", "--enable-metrics")
    given = parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix", "--enable-metrics"], monkeypatch)
    assert given.enable_metrics is True and given._hiradix_turned_on == ("--enable-cache-report",)


@pytest.mark.parametrize(
    "extra, flag, equivalent",
    [
        (["--hicache-ratio", "2"], "--hicache-ratio 2.0", "--hiradix-dram-ratio"),
        (["--hicache-size", "8"], "--hicache-size 8", "--hiradix-dram-gb"),
        (["--hicache-write-policy", "write_back"], "--hicache-write-policy write_back", "--hiradix-write-policy"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend file", "--hiradix-nvme-path"),
        (["--hicache-storage-prefetch-policy", "wait_complete"], "--hicache-storage-prefetch-policy wait_complete",
         "--hiradix-load-timeout-s"),
        (["--hicache-host-memory-mode", "buffer_only"], "--hicache-host-memory-mode buffer_only", "--hiradix-dram-mode"),
        (["--hicache-mem-layout", "layer_first"], "--hicache-mem-layout layer_first", "nothing"),
    ],
)  # fmt: skip
def test_hicache_flags_are_refused_naming_the_equivalent(monkeypatch, llama_dir, extra, flag, equivalent):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(refusals.HiRadixRefusal) as caught:
        parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix", *extra], monkeypatch)
    message = str(caught.value)
    assert message.startswith(f"hiradix: {flag} configures SGLang's HiCache"), message
    assert f"hiradix's equivalent: {equivalent}" in message
    # Without --enable-hiradix the same flags are SGLang's business: nothing refused.
    parse_in_process(["--model-path", str(llama_dir), *extra], monkeypatch)


def test_hicache_defaults_given_explicitly_are_not_refused(monkeypatch, llama_dir):
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix",
                             "--hicache-write-policy", "write_through"], monkeypatch)  # the default: no effect
    assert args.radix_cache_backend == "hiradix"


def test_dram_ratio_flag(monkeypatch, llama_dir):
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix", "--hiradix-dram-ratio", "2.5"],
                            monkeypatch)
    config = args._hiradix_config
    assert (config.dram_ratio, config.dram_bytes) == (2.5, 0)
    assert config.dram_bytes_for(1_000_000) == 2_500_000
    assert HiRadixConfig().dram_bytes_for(1_000_000) == 4_000_000_000  # a size in GB ignores the pool
    with pytest.raises(refusals.HiRadixRefusal, match="--hiradix-dram-ratio and --hiradix-dram-gb both size"):
        parse_in_process(["--model-path", str(llama_dir), "--enable-hiradix", "--hiradix-dram-ratio", "2",
                          "--hiradix-dram-gb", "1"], monkeypatch)


def test_dram_ratio_is_checked_before_the_model_loads_when_the_pool_is_given(monkeypatch, llama_dir):
    monkeypatch.delenv(ENV_VAR, raising=False)
    base = ["--model-path", str(llama_dir), "--enable-hiradix", "--max-total-tokens", "2048"]
    with pytest.raises(refusals.HiRadixRefusal, match=r"--hiradix-dram-ratio 0.0001 x the device pool "
                       r"\(--max-total-tokens 2048: \d+ bytes\) holds no KV page of this model"):
        parse_in_process(base + ["--hiradix-dram-ratio", "0.0001"], monkeypatch)
    with pytest.raises(refusals.HiRadixRefusal, match=r"--hiradix-dram-ratio 1e\+07 x the device pool .* needs "
                       r"[\d.]+ GB of RAM but only [\d.]+ GB is available"):
        parse_in_process(base + ["--hiradix-dram-ratio", "1e7"], monkeypatch)
    assert parse_in_process(base + ["--hiradix-dram-ratio", "2"], monkeypatch)._hiradix_config.dram_ratio == 2
    # without --max-total-tokens the pool is sized by SGLang's profiling: the scheduler checks the ratio
    unsized = ["--model-path", str(llama_dir), "--enable-hiradix", "--hiradix-dram-ratio", "0.0001"]
    assert parse_in_process(unsized, monkeypatch)._hiradix_config.dram_ratio == 0.0001


def test_explicit_page_size_is_kept(monkeypatch, llama_dir):
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = parse_in_process(
        ["--model-path", str(llama_dir), "--enable-hiradix", "--page-size", "32"], monkeypatch
    )
    assert args.page_size == 32


def test_disabled_changes_nothing_and_clears_stale_env(monkeypatch, llama_dir):
    from sglang.srt.server_args import ServerArgs
    import msgspec

    monkeypatch.setenv(ENV_VAR, HiRadixConfig().to_json())  # stale, e.g. from a shell
    argv = ["--model-path", str(llama_dir), "--random-seed", "1"]
    hooked = parse_in_process(argv, monkeypatch)
    parser = argparse.ArgumentParser()
    inspect.unwrap(ServerArgs.add_cli_args)(parser)
    stock = inspect.unwrap(ServerArgs.__dict__["from_cli_args"].__func__)(
        ServerArgs, parser.parse_args(argv)
    )
    assert msgspec.structs.asdict(hooked) == msgspec.structs.asdict(stock)
    assert vars(hooked) == vars(stock)
    assert ENV_VAR not in os.environ


def test_config_from_server_args_falls_back_to_env(monkeypatch):
    config = HiRadixConfig(policy="lru")
    bare = types.SimpleNamespace()
    monkeypatch.setenv(ENV_VAR, config.to_json())
    assert plugin.config_from_server_args(bare) == config
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(HiRadixConfigError, match="no configuration"):
        plugin.config_from_server_args(bare)


def test_refusal_is_a_system_exit_with_one_line(monkeypatch, llama_dir, capsys):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(refusals.HiRadixRefusal) as caught:
        parse_in_process(
            ["--model-path", str(llama_dir), "--enable-hiradix", "--pp-size", "2"], monkeypatch
        )
    assert caught.value.code == 2
    assert str(caught.value).startswith("hiradix: --enable-hiradix cannot be combined with --pp-size 2")
    assert capsys.readouterr().err == str(caught.value) + "\n"


# ------------------------------------------------------------- HiRadixConfig units


# The flag table of docs/configuration.md against `--help`: tests/docs/test_configuration_doc.py.


def test_config_defaults():
    config = HiRadixConfig.from_flags()
    assert config == HiRadixConfig()
    assert (config.dram_bytes, config.nvme_path, config.nvme_bytes) == (4_000_000_000, None, 0)
    assert (config.policy, config.lookahead_window) == ("lookahead", 64)
    assert (config.write_policy, config.load_timeout_s, config.stop_timeout_s) == ("write_through", 2.0, 10.0)
    assert not config.has_nvme_tier
    assert isinstance(config.dram_bytes, int)


def test_config_converts_gb_and_resolves_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    config = HiRadixConfig.from_flags(dram_gb=1.5, nvme_path="link", nvme_gb=2)
    assert config.dram_bytes == 1_500_000_000
    assert config.nvme_bytes == 2_000_000_000
    assert config.nvme_path == (tmp_path / "real").resolve()
    assert config.nvme_path.is_absolute() and config.has_nvme_tier


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dram_gb=-1), "--hiradix-dram-gb must be > 0, got -1"),
        (dict(dram_gb=0), "--hiradix-dram-gb must be > 0, got 0"),
        (dict(dram_gb=math.nan), "--hiradix-dram-gb must be a finite number, got nan"),
        (dict(nvme_gb=-2), "--hiradix-nvme-gb must be >= 0, got -2"),
        (dict(nvme_gb=1), "--hiradix-nvme-gb 1 needs --hiradix-nvme-path"),
        (dict(nvme_path="/tmp/x"), "--hiradix-nvme-path /tmp/x is given but --hiradix-nvme-gb is 0"),
        (dict(nvme_path="  ", nvme_gb=1), "--hiradix-nvme-path must not be empty"),
        (dict(lookahead_window=0), "--hiradix-lookahead-window must be >= 1 (requests), got 0"),
        (dict(policy="lru", lookahead_window=8),
         "--hiradix-lookahead-window applies only to --hiradix-policy lookahead"),
        (dict(policy="fifo"), "--hiradix-policy must be one of ['lru', 'lookahead', 'predictive'], got 'fifo'"),
        (dict(write_policy="write_around"),
         "--hiradix-write-policy must be one of ['write_through', 'write_back'], got 'write_around'"),
        (dict(load_timeout_s=0), "--hiradix-load-timeout-s must be a finite number > 0 (seconds), got 0.0"),
        (dict(load_timeout_s=math.inf), "--hiradix-load-timeout-s must be a finite number > 0"),
        (dict(stop_timeout_s=-1), "--hiradix-stop-timeout-s must be a finite number >= 0 (seconds), got -1.0"),
        (dict(stop_timeout_s=math.nan), "--hiradix-stop-timeout-s must be a finite number >= 0"),
        (dict(dram_ratio=0), "--hiradix-dram-ratio must be a finite number > 0 (x the device KV pool), got 0"),
        (dict(dram_ratio=-1), "--hiradix-dram-ratio must be a finite number > 0"),
        (dict(dram_ratio=1, dram_gb=2), "--hiradix-dram-ratio and --hiradix-dram-gb both size the DRAM tier"),
        (dict(dram_mode="staging"), "--hiradix-dram-mode staging needs an NVMe tier (--hiradix-nvme-gb > 0)"),
        (dict(dram_mode="buffer"), "--hiradix-dram-mode must be one of ['cache', 'staging'], got 'buffer'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(HiRadixConfigError) as caught:
        HiRadixConfig.from_flags(**kwargs)
    assert str(caught.value).startswith(message), str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_store_read_flag(monkeypatch, capsys):
    """Issue 19: --hiradix-store-read always|auto|never (default always); a bad value stops the parser
    (before any model loads) with a message naming the flag."""
    store = dict(store="mooncake", store_config='{"master_server_address": "127.0.0.1:1"}')
    assert HiRadixConfig.from_flags(**store).store_read == "always"
    assert HiRadixConfig.from_flags(**store, store_read="auto").store_read == "auto"
    assert HiRadixConfig.from_flags(**store, store_read="never").store_read == "never"
    assert "read never" in HiRadixConfig.from_flags(**store, store_read="never").summary()
    with pytest.raises(HiRadixConfigError, match=r"--hiradix-store-read must be one of \['auto', 'always', 'never'\]"):
        HiRadixConfig(store_backend="mooncake", store_config="{}", store_read="sometimes")
    parser = argparse.ArgumentParser()
    flags.after_add_cli_args(None, parser)
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--hiradix-store-read", "sometimes"])
    assert caught.value.code == 2
    assert "argument --hiradix-store-read: invalid choice: 'sometimes'" in capsys.readouterr().err


def test_config_constructor_validates_bytes_too():
    with pytest.raises(HiRadixConfigError, match=r"^--hiradix-dram-gb must be > 0, got -0.5$"):
        HiRadixConfig(dram_bytes=-500_000_000)
    with pytest.raises(HiRadixConfigError, match="must be an absolute path"):
        HiRadixConfig(nvme_path=Path("relative"), nvme_bytes=1)
    with pytest.raises(HiRadixConfigError, match="must be an int"):
        HiRadixConfig(lookahead_window=2.5)


@pytest.mark.parametrize(
    "config",
    [HiRadixConfig(), HiRadixConfig(nvme_path=Path("/mnt/nvme"), nvme_bytes=7, policy="lru", load_timeout_s=0.25)],
)
def test_config_json_and_pickle_round_trip(config):
    text = config.to_json()
    assert "\n" not in text and json.loads(text)["dram_bytes"] == config.dram_bytes
    assert HiRadixConfig.from_json(text) == config
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "HIRADIX_CONFIG is not valid JSON"),
        ("[1, 2]", "HIRADIX_CONFIG must be a JSON object"),
        (json.dumps({**json.loads(HiRadixConfig().to_json()), "extra": 1}), "HIRADIX_CONFIG has unknown keys ['extra']"),
        (json.dumps({"dram_bytes": 1}), "HIRADIX_CONFIG lacks keys ['cold_format', 'cold_tiers', 'context_overflow'"),
        (HiRadixConfig().to_json().replace("4000000000", "-1000000000"), "--hiradix-dram-gb must be > 0, got -1"),
    ],
)
def test_config_from_json_errors(text, message):
    with pytest.raises(HiRadixConfigError, match=f"^{re.escape(message)}"):
        HiRadixConfig.from_json(text)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HiRadixConfig().dram_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("fields, is_mla, mode, copies", [
    ({"tp_size": 8}, True, "node", 1),  # one shared copy per node: 1/8 of per-rank RAM and disk
    ({"tp_size": 8}, True, "rank", 8),
    ({"tp_size": 8}, False, "node", 8),  # dense: every rank holds its own heads
    ({"tp_size": 2, "attn_dp_size": 2}, True, "node", 2),  # DP attention: a copy per DP rank
    ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, True, "node", 4),  # 4 x 2 ranks, attn-TP 2
    ({"tp_size": 8, "nnodes": 2}, True, "node", 4),  # TP across hosts: a copy per rank
], ids=["mla-tp8", "mla-tp8-rank", "dense-tp8", "mla-dp2", "mla-deprecated-dp", "mla-two-nodes"])
def test_host_copies_on_this_node(fields, is_mla, mode, copies):
    """The free RAM and disk checks count the copies a node keeps, not its ranks, for a shared MLA copy."""
    args = types.SimpleNamespace(**{"tp_size": 1, "dp_size": 1, "nnodes": 1, "attn_dp_size": None, **fields})
    assert refusals.host_copies_on_this_node(args, HiRadixConfig(mla_host_copy=mode), is_mla) == copies


def test_check_machine(tmp_path):
    available = psutil.virtual_memory().available
    check_machine(HiRadixConfig(dram_bytes=1_000_000))
    with pytest.raises(HiRadixConfigError, match="^--hiradix-dram-gb .* GB of RAM but only"):
        check_machine(HiRadixConfig(dram_bytes=2 * available))
    # Two ranks need twice the memory.
    half = HiRadixConfig(dram_bytes=int(available * 0.6))
    check_machine(half, ranks_on_this_node=1)
    with pytest.raises(HiRadixConfigError, match=r"x 2 ranks needs"):
        check_machine(half, ranks_on_this_node=2)
    # A missing directory is refused (a typo must not create directories elsewhere), and
    # the check creates nothing.
    missing_dir = tmp_path / "a" / "b"
    with pytest.raises(HiRadixConfigError, match=r"^--hiradix-nvme-path .*/a/b does not exist; create"):
        check_machine(HiRadixConfig(nvme_path=missing_dir, nvme_bytes=1))
    assert not (tmp_path / "a").exists()
    check_machine(HiRadixConfig(nvme_path=tmp_path, nvme_bytes=1))


def test_check_machine_counts_an_earlier_runs_slot_files_as_free(tmp_path, monkeypatch):
    """A restart with the same sizes is not refused for the disk its own pre-allocated slot file
    holds (found by `hiradix doctor`'s review: free space excludes the existing nvme.kv)."""
    slot_bytes = 32 << 20
    restarted, fresh = tmp_path / "restarted", tmp_path / "fresh"
    (restarted / "hiradix-rank0").mkdir(parents=True)
    fresh.mkdir()
    fd = os.open(restarted / "hiradix-rank0" / "nvme.kv", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, slot_bytes)
    finally:
        os.close(fd)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=4 << 20))
    check_machine(HiRadixConfig(nvme_path=restarted, nvme_bytes=slot_bytes))
    with pytest.raises(HiRadixConfigError, match=r"^--hiradix-nvme-gb .* has 0.00 GB free"):
        check_machine(HiRadixConfig(nvme_path=fresh, nvme_bytes=slot_bytes))


# ------------------------------------------------------- model architecture rules


NO_SWA_POOL = {"disable_hybrid_swa_memory": True}  # SGLang's resolved --disable-hybrid-swa-memory
QWEN2_LONG = {**QWEN2_SWA_CONFIG, "sliding_window": 4096, "max_position_embeddings": 32768}


@pytest.mark.parametrize(
    "config, resolved, expected",
    [
        (LLAMA_CONFIG, {}, None),
        ({**LLAMA_CONFIG, "model_type": "qwen3", "layer_types": ["full_attention"] * 2,
          "sliding_window": None, "use_sliding_window": False}, {}, None),
        ({**LLAMA_CONFIG, "model_type": "mistral", "sliding_window": 4096}, {}, None),
        (MLA_CONFIG, {}, None),  # served since issue 18
        ({"architectures": ["KimiVLForConditionalGeneration"], "text_config": MLA_CONFIG}, {}, None),
        # issue 33: sliding windows are served from one full pool, refused (naming the flag) otherwise
        (SWA_HYBRID_CONFIG, {}, "a sliding-window model (layer_types has ['full_attention', 'sliding_attention'], "
                                "sliding_window=128) whose window (128 tokens) is shorter than the context (2048 tokens)"),
        (SWA_HYBRID_CONFIG, NO_SWA_POOL, None),
        (SWA_HYBRID_CONFIG, {"context_length": 128}, None),  # config alone: SGLang's hybrid flag decides later
        (SWA_HYBRID_CONFIG, {"context_length": 129}, "a sliding-window model"),
        (QWEN2_LONG, {}, "a sliding-window model (use_sliding_window=true, sliding_window=4096)"),
        (QWEN2_LONG, {"context_length": 4096}, None),
        ({**LLAMA_CONFIG, "model_type": "gemma3_text", "sliding_window_pattern": 6},
         {}, "a sliding-window model (sliding_window_pattern=6, sliding_window=None) whose window (size not stated)"),
        ({**LLAMA_CONFIG, "model_type": "gemma3_text", "sliding_window_pattern": 6}, NO_SWA_POOL, None),
        ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": GEMMA3_CONFIG}, {}, "a sliding-window model"),
        ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": GEMMA3_CONFIG}, NO_SWA_POOL, None),
        # not tiered, whatever SGLang resolves
        (DSA_CONFIG, NO_SWA_POOL, "a DeepSeek sparse-attention (DSA) model"),
        ({**LLAMA_CONFIG, "model_type": "jamba", "attn_layer_period": 8}, NO_SWA_POOL, "a Mamba/SSM/linear-attention hybrid"),
        ({**LLAMA_CONFIG, "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*"}, NO_SWA_POOL, "a Mamba/SSM"),
        ({**LLAMA_CONFIG, "layer_types": ["linear_attention", "full_attention"]}, NO_SWA_POOL, "a hybrid-attention model"),
        ({**LLAMA_CONFIG, "sliding_window": 128, "layer_types": ["sliding_attention", "chunked_attention"]},
         NO_SWA_POOL, "a hybrid-attention model (layer_types has ['chunked_attention', 'sliding_attention'])"),
        ({"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"}, {}, "an encoder-decoder"),
        ({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}, {}, "an encoder-decoder"),
        ({"architectures": ["X"], "text_config": {**LLAMA_CONFIG, "cross_attention_layers": [3, 8]}}, {},
         "an encoder-decoder (cross-attention)"),
        ({**LLAMA_CONFIG, "attention_chunk_size": 8192}, NO_SWA_POOL, "a chunked local-attention model"),
    ],
    ids=["llama", "qwen3-all-full", "mistral-pure-swa", "mla", "nested-mla", "swa-hybrid", "swa-hybrid-full-pool",
         "swa-hybrid-window-covers-context", "swa-hybrid-window-short", "qwen2-swa", "qwen2-swa-short-context",
         "gemma3-pattern", "gemma3-pattern-full-pool", "gemma3-nested", "gemma3-nested-full-pool", "dsa", "jamba",
         "nemotron-h", "linear-layers", "chunked-layers", "whisper", "t5", "mllama", "llama4-chunked"],
)  # fmt: skip
def test_unsupported_model_reason(config, resolved, expected):
    """The config.json rules; `resolved` holds what SGLang's resolution decides (the launcher
    applies the sliding-window rule after it, with SGLang's ModelConfig: the tests above)."""
    reason = model_check.unsupported_model_reason(config, **resolved)
    if expected is None:
        assert reason is None
        return
    assert reason is not None and reason.startswith(expected), reason
    is_sliding = expected.startswith("a sliding-window model")
    assert ("add --disable-hybrid-swa-memory" in reason) == is_sliding, reason  # the flag is named where it helps
    # Only a sliding window waits for SGLang's resolution; everything else is refused from config.json.
    assert (model_check.unservable_architecture_reason(config) is None) == is_sliding


def test_unsupported_device_pool_reason():
    """The scheduler's check of the pool SGLang built: its plain per-head and MLA pools are
    tiered; its hybrid SWA and linear-attention pools are refused, naming why."""
    from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool,
                                                  PageMajorMHATokenToKVPool)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    def pool(cls: type) -> object:
        return object.__new__(cls)  # the class is what is checked; no buffers allocated

    for served in (MHATokenToKVPool, PageMajorMHATokenToKVPool, MLATokenToKVPool):
        assert model_check.unsupported_device_pool_reason(pool(served)) is None, served
    reason = model_check.unsupported_device_pool_reason(pool(SWAKVPool))
    assert reason.startswith("SGLang built a hybrid sliding-window KV pool (SWAKVPool") and \
        "start the server with --disable-hybrid-swa-memory" in reason, reason
    assert "linear-attention hybrid KV pool (HybridLinearKVPool)" in model_check.unsupported_device_pool_reason(
        pool(HybridLinearKVPool))
    assert "SGLang built a object KV pool" in model_check.unsupported_device_pool_reason(object())


# ------------------------------------------------------------- hook self-check


@pytest.fixture
def dummy_target(monkeypatch):
    """A module `hx_dummy_target` with a class holding a method, classmethod, staticmethod."""
    module = types.ModuleType("hx_dummy_target")

    class Target:
        def method(self):
            return "m"

        @classmethod
        def cmethod(cls):
            return "c"

        @staticmethod
        def smethod():
            return "s"

    module.Target = Target
    monkeypatch.setitem(sys.modules, "hx_dummy_target", module)
    return Target


def test_is_installed_follows_hook_registry_wrappers(dummy_target):
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def ours(result, *args):
        return None

    def theirs(result, *args):
        return None

    # Not wrapped yet.
    assert not hooks.is_installed("hx_dummy_target.Target.method", ours)
    # Wrapped as HookRegistry does, ours inside another plugin's wrapper.
    dummy_target.method = _wrap_fn(_wrap_fn(dummy_target.__dict__["method"], ours, HookType.AFTER),
                                   theirs, HookType.AROUND)  # fmt: skip
    assert hooks.is_installed("hx_dummy_target.Target.method", ours)
    dummy_target.cmethod = classmethod(_wrap_fn(dummy_target.__dict__["cmethod"].__func__, ours, HookType.AFTER))
    dummy_target.smethod = staticmethod(_wrap_fn(dummy_target.__dict__["smethod"].__func__, theirs, HookType.AFTER))
    assert hooks.is_installed("hx_dummy_target.Target.cmethod", ours)
    assert dummy_target.cmethod() == "c"
    assert not hooks.is_installed("hx_dummy_target.Target.smethod", ours)
    assert hooks.is_installed("hx_dummy_target.Target.smethod", theirs)
    assert not hooks.is_installed("hx_dummy_target.Target.nothing_here", ours)


def test_missing_reports_specs_never_registered(dummy_target):
    spec = hooks.HookSpec(
        target="hx_dummy_target.Target.method",
        hook="hiradix.sglang_plugin.flags:after_add_cli_args",
        hook_type="after",
        scope=hooks.Scope.SCHEDULER,
        purpose="test",
    )
    assert hooks.missing(hooks.Scope.SCHEDULER, specs=(spec,)) == [spec]
    assert hooks.missing(hooks.Scope.CLI, specs=(spec,)) == []
    message = hooks.describe_missing([spec])
    assert "AFTER hx_dummy_target.Target.method (test)" in message


def test_scheduler_scope_needs_scheduler_module_and_env(monkeypatch):
    monkeypatch.delitem(sys.modules, hooks.SCHEDULER_MODULE, raising=False)
    monkeypatch.setenv(ENV_VAR, HiRadixConfig().to_json())
    assert hooks.current_scopes() == {hooks.Scope.CLI}
    monkeypatch.setitem(sys.modules, hooks.SCHEDULER_MODULE, types.ModuleType("fake"))
    assert hooks.current_scopes() == {hooks.Scope.CLI, hooks.Scope.SCHEDULER}
    monkeypatch.delenv(ENV_VAR)
    assert hooks.current_scopes() == {hooks.Scope.CLI}


def test_package_is_not_shadowed_in_tests():
    assert hooks.package_problem() is None


def test_hook_table_targets_exist():
    # Each target resolves in SGLang 0.5.23 and each hook function imports.
    for spec in hooks.HOOKS:
        assert callable(hooks._target_attribute(spec.target)), spec.target
        assert callable(spec.load_hook()), spec.hook


# ----------------------------------------------------------------- e2e (real server)


def _sgl_kernel_importable(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import sgl_kernel"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.e2e
def test_config_reaches_the_scheduler(hiradix_server):
    if not _sgl_kernel_importable(hiradix_server.python):
        pytest.fail("patches not applied (sgl_kernel stand-in missing): run scripts/setup or patches/apply.py")
    args = hiradix_server.extra_args
    nvme = args[args.index("--hiradix-nvme-path") + 1]
    output = hiradix_server.log_text()
    summary = (
        "policy=lookahead, lookahead_window=64, write_policy=write_through, "
        f"dram_bytes=500000000, dram_mode=cache, nvme={nvme} (250000000 bytes), store=off, load_timeout_s=2, "
        "partial_page=on"
    )
    assert f"hiradix: enabled ({summary}, page_size=16)" in output, output[-4000:]
    assert output.count("hiradix: enabled") == 1  # checked once, not again in children
    # Logged by the factory in the scheduler process: the config arrived on the record.
    building = (
        f"hiradix: building the cache on tp_rank 0 (config from server_args._hiradix_config: {summary})"
    )
    assert building in output, output[-4000:]
    assert output.index("Load weight end") < output.index(building)  # the factory runs after the model loaded


@pytest.mark.e2e
def test_stock_server_with_plugin_installed_uses_default_cache(stock_server):
    if not _sgl_kernel_importable(stock_server.python):
        pytest.fail("patches not applied (sgl_kernel stand-in missing): run scripts/setup or patches/apply.py")
    output = stock_server.log_text()
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache" in output, output[-4000:]
    assert "hiradix" not in output


def test_page_bytes_estimate_matches_the_pools_of_the_local_models():
    """The launcher's one-page check uses the same bytes per page the tiers use once loaded
    (logs: tiny 32768 B, small 262144 B per 16-token page at --dtype float32)."""
    from hiradix.sglang_plugin.model_check import page_bytes_estimate

    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    small = {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
             "hidden_size": 1024}
    assert page_bytes_estimate(tiny, 16, 1, "float32") == 32768
    assert page_bytes_estimate(small, 16, 1, "float32") == 262144
    assert page_bytes_estimate(small, 16, 2, "auto") == 262144 // 4  # half the heads, 2-byte dtype
    assert page_bytes_estimate(small, 16, 1, "bfloat16", "fp8_e4m3") == 262144 // 4
    assert page_bytes_estimate({"text_config": small}, 16, 1, "float32") == 262144
    assert page_bytes_estimate({"architectures": ["X"]}, 16, 1, "auto") is None
    # MLA: one latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, the same on every TP rank
    v2 = {**MLA_CONFIG, "num_hidden_layers": 2}
    assert page_bytes_estimate(v2, 16, 1, "bfloat16") == 2 * 16 * (512 + 64) * 2 == 36864
    assert page_bytes_estimate(v2, 16, 8, "bfloat16") == 36864  # not divided by TP
    assert page_bytes_estimate(v2, 16, 1, "bfloat16", "fp8_e4m3") == 36864 // 2


def test_decode_side_accepts_the_radix_cache_sglang_disables_there():
    # SGLang's resolution disables the radix cache on every PD decode server; hiradix keeps no tree
    # there (the decode-side offload runs instead), so only there is it not a conflict.
    view = types.SimpleNamespace(disaggregation_mode="decode", disable_radix_cache=True)
    assert refusals.first_conflict(view) is None
    view.disaggregation_mode = "prefill"
    rule, _ = refusals.first_conflict(view)
    assert rule.field == "disable_radix_cache"


@pytest.mark.parametrize("given, held", [
    ("dram", ("dram", "nvme", "store")),  # DRAM's encoded bytes go down as they are
    ("store,nvme", ("nvme", "store")),
    ("nvme", ("nvme",)),
])
def test_cold_tiers_are_kept_top_down_and_dram_implies_the_tiers_below(given, held):
    config = HiRadixConfig.from_flags(cold_format="fp8", cold_tiers=given)
    assert config.cold_tiers == held
    assert HiRadixConfig.from_json(config.to_json()).cold_tiers == held


@pytest.mark.parametrize("given", ["hbm", "dram,dram", ""])
def test_bad_cold_tiers_are_refused_naming_the_flag(given):
    with pytest.raises(HiRadixConfigError, match="--hiradix-cold-tiers"):
        HiRadixConfig.from_flags(cold_format="fp8", cold_tiers=given)
