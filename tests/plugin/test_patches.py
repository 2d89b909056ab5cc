"""Tests of patches/: the sgl_kernel stand-in, the patch mechanics, and stock SGLang on CPU.

The stand-in helpers are checked against straightforward loops (the semantics of the
Triton kernels they replace, read from SGLang 0.5.23's call sites), directly and through
SGLang's own CPU wrappers. The patch tests run on copies of the installed files. The
`e2e` tests use real `sglang.launch_server` processes on models/tiny: the session's stock
server (tests/conftest.py) and a stock HiCache server of their own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from hiradix.testing import zygote
from hiradix.testing.server import ZYGOTE_ENV, ServerProcess, cpu_args, cpu_env

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
STANDIN = PATCHES / "sgl_kernel_standin" / "sgl_kernel"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

if str(PATCHES) not in sys.path:
    sys.path.insert(0, str(PATCHES))

import _patchlib  # noqa: E402


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The stand-in's sources, loaded under private names (whatever sgl_kernel is installed).
sk = _load("hiradix_standin_sgl_kernel", STANDIN / "__init__.py")
kvio = _load("hiradix_standin_kvcacheio", STANDIN / "kvcacheio.py")


# ---------------------------------------------------------------------------------------------
# The stand-in helpers against reference loops
# ---------------------------------------------------------------------------------------------

def ref_assign_req_to_token_pool(req_pool_indices, req_to_token, start, end, out_cache_loc):
    offset = 0
    for i in range(len(req_pool_indices)):
        row, s, e = int(req_pool_indices[i]), int(start[i]), int(end[i])
        for col in range(s, e):
            req_to_token[row, col] = int(out_cache_loc[offset])
            offset += 1


@pytest.mark.parametrize("seed", range(5))
def test_assign_req_to_token_pool_cpu_matches_reference(seed):
    rng = random.Random(seed)
    num_reqs, pool_len, bs = 12, 64, rng.randint(1, 8)
    rows = torch.tensor(rng.sample(range(num_reqs), bs), dtype=torch.int64)
    start = torch.tensor([rng.randint(0, 40) for _ in range(bs)], dtype=torch.int64)
    end = start + torch.tensor([rng.choice([0, 1, rng.randint(0, 24)]) for _ in range(bs)])
    total = int((end - start).sum())
    out_cache_loc = torch.randint(1, 10_000, (total + 3,), dtype=torch.int64)  # longer than needed
    table = torch.randint(-5, 0, (num_reqs, pool_len), dtype=torch.int32)
    want = table.clone()

    sk.assign_req_to_token_pool_cpu(rows, table, start, end, out_cache_loc, pool_len)
    ref_assign_req_to_token_pool(rows, want, start, end, out_cache_loc)

    assert torch.equal(table, want)
    assert table.dtype == torch.int32


def test_assign_req_to_token_pool_cpu_rejects_wrong_pool_len():
    table = torch.zeros(4, 16, dtype=torch.int32)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="pool_len"):
        sk.assign_req_to_token_pool_cpu(one, table, one, one + 1, one, 8)


def _kv_buffers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    slots = 50
    return [
        torch.randn(slots, 2, 8, generator=gen),                         # K, float32
        torch.randn(slots, 2, 8, generator=gen),                         # V, float32
        torch.randn(slots, 4, 16, generator=gen).to(torch.bfloat16),     # another layer, bf16
        torch.randint(0, 255, (slots, 24), generator=gen, dtype=torch.uint8),  # odd row size
    ]


def _ptrs_and_strides(buffers):
    # As MHATokenToKVPool._init_data_ptrs_and_strides builds them.
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    return ptrs, strides


@pytest.mark.parametrize("seed", range(4))
def test_copy_all_layer_kv_cache_cpu_matches_reference(seed):
    rng = random.Random(seed)
    buffers = _kv_buffers(seed)
    before = [b.clone() for b in buffers]
    n = rng.randint(1, 20)
    # Overlapping source and target slots: a shifted window, so some targets are sources.
    first = rng.randint(0, 20)
    src = torch.arange(first, first + n, dtype=torch.int64)
    tgt = src + rng.choice([-1, 1, 3]) if first > 0 else src + 2
    ptrs, strides = _ptrs_and_strides(buffers)

    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)

    for b, orig in zip(buffers, before):
        want = orig.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):  # every source read before any write
            want[t] = orig[s]
        assert torch.equal(b, want)


def test_copy_all_layer_kv_cache_cpu_empty_and_identity():
    buffers = _kv_buffers(7)
    before = [b.clone() for b in buffers]
    ptrs, strides = _ptrs_and_strides(buffers)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.zeros(0, dtype=torch.int64),
                                   torch.zeros(0, dtype=torch.int64))
    # SGLang's warm-up call: slot 0 onto itself.
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.zeros(1, dtype=torch.int64),
                                   torch.zeros(1, dtype=torch.int64))
    assert all(torch.equal(b, o) for b, o in zip(buffers, before))


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_direct_matches_reference(page_size):
    gen = torch.Generator().manual_seed(page_size)
    host = [torch.randn(64, 2, 8, generator=gen) for _ in range(4)]
    device = [torch.zeros(32, 2, 8) for _ in range(4)]
    host_pages = torch.randperm(64 // page_size, generator=gen)[:5]
    dev_pages = torch.randperm(32 // page_size, generator=gen)[:5]
    within = torch.arange(page_size)
    src = (host_pages[:, None] * page_size + within).flatten()
    dst = (dev_pages[:, None] * page_size + within).flatten()

    kvio.transfer_kv_direct(src_layers=host, dst_layers=device, src_indices=src,
                            dst_indices=dst, page_size=page_size)

    for h, d in zip(host, device):
        want = torch.zeros_like(d)
        for s, t in zip(src.tolist(), dst.tolist()):
            want[t] = h[s]
        assert torch.equal(d, want)


def _page_first_direct_case(seed: int, page_size: int, num_layers: int = 3):
    """Device layers (K then V, `(slots, H, D)`), host `[k, v]` `(pages, L, ps, H, D)`, and
    page-aligned index runs as SGLang passes them (host pages and device pages, shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim, device_slots, host_pages = 2, 8, 48, 10
    device = [torch.randn(device_slots, heads, dim, generator=gen) for _ in range(2 * num_layers)]
    host = [torch.randn(host_pages, num_layers, page_size, heads, dim, generator=gen) for _ in range(2)]
    n_pages = 4
    within = torch.arange(page_size)
    host_idx = (torch.randperm(host_pages, generator=gen)[:n_pages, None] * page_size + within).flatten()
    dev_idx = (torch.randperm(device_slots // page_size, generator=gen)[:n_pages, None] * page_size + within).flatten()
    return device, host, dev_idx, host_idx


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_all_layer_direct_lf_pf_matches_reference(page_size):
    device, host, dev_idx, host_idx = _page_first_direct_case(page_size, page_size)
    want = [h.clone() for h in host]
    num_layers = host[0].shape[1]
    for c in range(2):  # the reference: one row at a time
        for s, d in zip(dev_idx.tolist(), host_idx.tolist()):
            for layer in range(num_layers):
                want[c][d // page_size, layer, d % page_size] = device[c * num_layers + layer][s]

    kvio.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=host, src_indices=dev_idx,
                                            dst_indices=host_idx, page_size=page_size)
    assert all(torch.equal(h, w) for h, w in zip(host, want))


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_per_layer_direct_pf_lf_matches_reference(page_size):
    device, host, dev_idx, host_idx = _page_first_direct_case(10 + page_size, page_size)
    num_layers = host[0].shape[1]
    for layer in range(num_layers):
        dst = [device[layer].clone(), device[num_layers + layer].clone()]
        want = [d.clone() for d in dst]
        for c in range(2):
            for s, d in zip(host_idx.tolist(), dev_idx.tolist()):
                want[c][d] = host[c][s // page_size, layer, s % page_size]
        kvio.transfer_kv_per_layer_direct_pf_lf(src_ptrs=host, dst_ptrs=dst, src_indices=host_idx,
                                                dst_indices=dev_idx, layer_id=layer, page_size=page_size)
        assert all(torch.equal(x, w) for x, w in zip(dst, want)), layer


def test_page_first_direct_round_trip_and_refusals():
    device, host, dev_idx, host_idx = _page_first_direct_case(3, 4)
    kvio.transfer_kv_all_layer_direct_lf_pf(device, host, dev_idx, host_idx, 4)
    back = [torch.zeros_like(d) for d in device]
    for layer in range(3):
        kvio.transfer_kv_per_layer_direct_pf_lf(host, [back[layer], back[3 + layer]], host_idx, dev_idx, layer, 4)
    untouched = torch.ones(back[0].shape[0], dtype=torch.bool)
    untouched[dev_idx] = False
    for d, b in zip(device, back):
        assert torch.equal(b[dev_idx], d[dev_idx]) and not b[untouched].any()
    with pytest.raises(ValueError, match="device buffers"):
        kvio.transfer_kv_all_layer_direct_lf_pf(device[:5], host, dev_idx, host_idx, 4)
    with pytest.raises(ValueError, match="whole number of pages"):
        kvio.transfer_kv_all_layer_direct_lf_pf(device, host, dev_idx[:3], host_idx[:3], 4)
    with pytest.raises(ValueError, match="layer_id"):
        kvio.transfer_kv_per_layer_direct_pf_lf(host, back[:2], host_idx, dev_idx, 3, 4)


def test_transfer_kv_direct_rejects_mismatches():
    a, b = [torch.zeros(8, 2)], [torch.zeros(8, 2)]
    with pytest.raises(ValueError):
        kvio.transfer_kv_direct(a, b + b, torch.arange(2), torch.arange(2), 1)
    with pytest.raises(ValueError):
        kvio.transfer_kv_direct(a, b, torch.arange(2), torch.arange(3), 1)
    with pytest.raises(ValueError):
        kvio.transfer_kv_direct(a, b, torch.arange(3), torch.arange(3), 2)


def test_speculative_names_exist_and_refuse():
    for name in ["assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                 "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu",
                 "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu"]:
        with pytest.raises(NotImplementedError, match=name):
            getattr(sk, name)()
    with pytest.raises(AttributeError, match="stand-in"):
        sk.some_cuda_only_kernel  # noqa: B018


def probe(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` in a process with the installed SGLang imported, to its end (output
    captured): forked from the test zygote where the tests use one (hiradix.testing.zygote: SGLang
    already imported, ~14 s of CPU less), else a new process. For code that checks what importing
    does, run a new process instead."""
    env = {**cpu_env(), **(os.environ if env is None else env)}  # the test servers' threads: their zygote
    if os.environ.get(ZYGOTE_ENV) == "1" and PYTHON == sys.executable:
        ran = zygote.run(["-c", code], env, os.getcwd(), timeout_s=300)
        return subprocess.CompletedProcess(["-c", code], ran.returncode, ran.stdout, ran.stderr)
    return subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_standin_registers_no_torch_ops():
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(STANDIN.parent)!r})
        import sgl_kernel, sgl_kernel.kvcacheio
        assert sgl_kernel.HIRADIX_STANDIN
        names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("sgl_kernel::")]
        assert not names, names
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    """)
    subprocess.run([PYTHON, "-c", code], check=True, timeout=120)


def test_sglang_cpu_wrappers_call_the_standin_correctly():
    """SGLang's own CPU wrappers (argument order at the call sites) give the reference result."""
    code = textwrap.dedent("""
        import torch
        import sgl_kernel
        assert getattr(sgl_kernel, "HIRADIX_STANDIN", False), "stand-in not installed"
        from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func
        from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func

        table = torch.zeros(4, 16, dtype=torch.int32)
        assign_req_to_token_pool_func(torch.tensor([2, 0]), table, torch.tensor([3, 0]),
                                      torch.tensor([5, 1]), torch.tensor([7, 8, 9]), 2)
        assert table[2, 3:5].tolist() == [7, 8] and table[0, 0].item() == 9, table
        assert int((table != 0).sum()) == 3

        bufs = [torch.arange(40, dtype=torch.float32).view(10, 4) for _ in range(2)]
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
        tgt, src = torch.tensor([5, 6, 0, 0]), torch.tensor([1, 2, 0, 0])
        copy_all_layer_kv_cache_func(ptrs, strides, tgt, src, 2, 2, {})
        for b in bufs:
            assert b[5].tolist() == [4, 5, 6, 7] and b[6].tolist() == [8, 9, 10, 11], b
            assert b[0].tolist() == [0, 1, 2, 3]
        print("ok")
    """)
    proc = probe(code, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Patch mechanics: idempotence, anchors, version check
# ---------------------------------------------------------------------------------------------

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_apply_is_idempotent():
    """Re-running apply.py changes nothing and reports every patch as done or skipped."""
    import p01_sgl_kernel_standin as p01
    import p02_torchvision_op_schemas as p02
    import p03_hicache_host_pool_cpu as p03
    import p04_torch_native_extend_new_queries as p04
    import p05_hicache_page_first_direct_cpu as p05
    import p06_torch_native_mla_dispatch as p06
    import p07_pd_prefill_host_indices_cpu as p07
    import p08_dp_attention_cpu as p08
    import p09_cpu_fork_start_method as p09
    import p10_dp_controller_idle_wait as p10
    import p11_hicache_file_prefetch_cpu as p11
    import p12_torch_native_swa_pool as p12
    import p13_torch_native_sinks as p13

    first = subprocess.run([PYTHON, str(PATCHES / "apply.py")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    sp = Path(subprocess.check_output(
        [PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    files = [sp / "sglang/srt/mem_cache/pool_host/common.py", sp / "sglang/srt/mem_cache/pool_host/mha.py",
             sp / "sglang/srt/mem_cache/pool_host/mla.py", sp / "torchvision/extension.py", sp / "sglang/srt/layers/attention/torch_native_backend.py",
             sp / "sglang/srt/models/deepseek_common/attention_backend_handler.py",
             sp / "sglang/srt/disaggregation/prefill.py", sp / "sglang/srt/layers/rotary_embedding/base.py",
             sp / "sglang/srt/entrypoints/engine.py", sp / "sglang/srt/managers/data_parallel_controller.py",
             sp / "sglang/srt/arg_groups/model_hook.py",
             *sorted((sp / "sgl_kernel").glob("*.py"))]
    files = [f for f in files if f.exists()]
    before = {f: _sha(f) for f in files}
    second = subprocess.run([PYTHON, str(PATCHES / "apply.py")], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    lines = second.stdout.strip().splitlines()
    assert len(lines) == 13, second.stdout
    for module, line in zip((p01, p02, p03, p04, p05, p06, p07, p08, p09, p10, p11, p12, p13), lines):
        assert line.startswith(f"[patches] {module.NAME}: "), line
        assert ": already applied (" in line or ": skipped (" in line, line
    assert {f: _sha(f) for f in files} == before


def test_fork_start_method_is_opt_in():
    """p09: SGLang's launcher spawns its processes unless HIRADIX_MP_START_METHOD says otherwise."""
    code = ("import multiprocessing as mp, sglang.srt.entrypoints.engine as e, inspect; "
            "src = inspect.getsource(e); print('HIRADIX_MP_START_METHOD' in src)")
    out = probe(code, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
    import p09_cpu_fork_start_method as p09

    assert '"spawn"' in p09.REPLACEMENT and p09.MARKER in p09.REPLACEMENT  # unset: stock's spawn


def test_hicache_dummy_pages_are_pinned_only_with_an_accelerator():
    """p11: the host pools' dummy pages (HiCache's L3 prefetch target) on this CPU-only torch are
    plain memory, so `file` prefetches land; stock asked for pinned memory and raised."""
    code = ("import torch\n"
            "from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost\n"
            "from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost\n"
            "class Pool:\n"
            "    layer_num, page_size, head_num, head_dim, kv_cache_dim = 2, 4, 3, 8, 16\n"
            "    dtype, device, pin_memory = torch.float32, 'cpu', True\n"
            "for cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):\n"
            "    page = cls.get_dummy_flat_data_page(Pool())\n"
            "    print(cls.__name__, page.numel(), page.is_pinned(), int(page.abs().sum()))\n")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["MHATokenToKVPoolHost 384 False 0", "MLATokenToKVPoolHost 128 False 0"], out


def test_dp_controller_waits_for_requests_instead_of_spinning():
    """p10: the DP attention controller's loop waits on its socket once it is empty (the idle
    controller's CPU is measured in tests/e2e/test_e2e_pd_dp.py)."""
    code = ("import inspect; from sglang.srt.managers.data_parallel_controller import DataParallelController as C; "
            "print(inspect.getsource(C.event_loop))")
    out = probe(code, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    import p10_dp_controller_idle_wait as p10

    assert p10.MARKER in out.stdout and f"self.recv_from_tokenizer.poll(timeout={p10.POLL_TIMEOUT_MS})" in out.stdout


def test_edit_file_reports_missing_anchor_and_writes_nothing(tmp_path):
    target = tmp_path / "mod.py"
    target.write_text("x = 1\n")
    with pytest.raises(_patchlib.PatchError) as err:
        _patchlib.edit_file(target, "MARK", [_patchlib.Edit("y = 2\n", "# MARK\ny = 3\n")])
    assert str(target) in str(err.value) and "anchor missing" in str(err.value) and "y = 2" in str(err.value)
    assert target.read_text() == "x = 1\n"


def test_edit_file_applies_once(tmp_path):
    target = tmp_path / "mod.py"
    target.write_text("a\nb\n")
    edit = _patchlib.Edit("b\n", "# MARK\nb\nc\n")
    assert _patchlib.edit_file(target, "MARK", [edit]) == _patchlib.APPLIED
    once = target.read_text()
    assert _patchlib.edit_file(target, "MARK", [edit]) == _patchlib.ALREADY
    assert target.read_text() == once == "a\n# MARK\nb\nc\n"


def test_edit_file_refuses_ambiguous_anchor(tmp_path):
    target = tmp_path / "mod.py"
    target.write_text("b\nb\n")
    with pytest.raises(_patchlib.PatchError, match="found 2 times"):
        _patchlib.edit_file(target, "MARK", [_patchlib.Edit("b\n", "# MARK\n")])


def _unpatched_copies(tmp_path, p03):
    """Copies of the two installed SGLang files with p03's edits taken out again."""
    out = {}
    for rel, anchor, replacement in [
        ("sglang/srt/mem_cache/pool_host/common.py", p03.COMMON_ANCHOR, p03.COMMON_REPLACEMENT),
        ("sglang/srt/mem_cache/pool_host/mha.py", p03.MHA_ANCHOR, p03.MHA_REPLACEMENT),
    ]:
        text = _patchlib.installed_file("sglang", rel).read_text().replace(replacement, anchor)
        assert p03.MARKER not in text
        copy = tmp_path / Path(rel).name
        copy.write_text(text)
        out[rel] = copy
    return out


def test_hicache_patch_on_copies_applies_once(tmp_path, monkeypatch):
    import p03_hicache_host_pool_cpu as p03

    copies = _unpatched_copies(tmp_path, p03)
    monkeypatch.setattr(p03, "installed_file", lambda dist, rel: copies[rel])
    status, _ = p03.apply()
    assert status == _patchlib.APPLIED
    patched = {rel: p.read_text() for rel, p in copies.items()}
    assert all(p03.MARKER in t for t in patched.values())
    compile(patched["sglang/srt/mem_cache/pool_host/mha.py"], "mha.py", "exec")
    compile(patched["sglang/srt/mem_cache/pool_host/common.py"], "common.py", "exec")
    status, _ = p03.apply()
    assert status == _patchlib.ALREADY
    assert {rel: p.read_text() for rel, p in copies.items()} == patched


def test_hicache_patch_fails_loudly_without_anchor(tmp_path, monkeypatch):
    import p03_hicache_host_pool_cpu as p03

    copies = _unpatched_copies(tmp_path, p03)
    mha = copies["sglang/srt/mem_cache/pool_host/mha.py"]
    mha.write_text(mha.read_text().replace("if _is_npu:\n", "if _is_npu_renamed:\n"))
    before = {rel: p.read_text() for rel, p in copies.items()}
    monkeypatch.setattr(p03, "installed_file", lambda dist, rel: copies[rel])
    with pytest.raises(_patchlib.PatchError) as err:
        p03.apply()
    assert str(mha) in str(err.value) and "transfer_kv_dim_exchange" in str(err.value)
    # Nothing written, common.py included: no half-patched state.
    assert {rel: p.read_text() for rel, p in copies.items()} == before


def test_apply_exits_nonzero_with_file_and_anchor(tmp_path):
    """The entry point turns a PatchError into exit status 1 with the message on stderr."""
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.path.insert(0, {str(PATCHES)!r})
        import p03_hicache_host_pool_cpu as p03
        p03.MHA_ANCHOR = "this anchor is not in the file\\n"
        p03.MARKER = "hiradix-patch: a-marker-nobody-wrote"
        p03.MHA_REPLACEMENT = "# " + p03.MARKER + "\\n"
        p03.COMMON_REPLACEMENT = "# " + p03.MARKER + "\\n" + p03.COMMON_ANCHOR
        # Point the patch at copies so that nothing installed can change.
        import shutil, _patchlib
        real = p03.installed_file
        def copy(dist, rel):
            dst = __import__("pathlib").Path({str(tmp_path)!r}) / rel.replace("/", "_")
            shutil.copy(real(dist, rel), dst)
            return dst
        p03.installed_file = copy
        sys.argv = ["apply.py"]
        runpy.run_path({str(PATCHES / "apply.py")!r}, run_name="__main__")
    """)
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "hicache-host-pool-cpu: FAILED" in proc.stderr
    assert "mha.py: anchor missing" in proc.stderr and "this anchor is not in the file" in proc.stderr


def test_page_first_direct_patch_on_a_copy_applies_once_and_fails_loudly(tmp_path, monkeypatch):
    import p05_hicache_page_first_direct_cpu as p05

    installed = _patchlib.installed_file("sglang", "sglang/srt/mem_cache/pool_host/mha.py").read_text()
    copy = tmp_path / "mha.py"
    copy.write_text(installed.replace(p05.REPLACEMENT, p05.ANCHOR))
    assert p05.MARKER not in copy.read_text()
    monkeypatch.setattr(p05, "installed_file", lambda dist, rel: copy)
    assert p05.apply()[0] == _patchlib.APPLIED
    patched = copy.read_text()
    assert patched.count(p05.MARKER) == 1 and "transfer_kv_per_layer_direct_pf_lf," in patched
    compile(patched, "mha.py", "exec")
    assert p05.apply()[0] == _patchlib.ALREADY and copy.read_text() == patched
    copy.write_text(installed.replace(p05.REPLACEMENT, p05.ANCHOR).replace("def prepare_mha_write_back_staging(",
                                                                         "def prepare_staging("))
    with pytest.raises(_patchlib.PatchError, match="anchor missing"):
        p05.apply()


def test_stock_hicache_on_cpu_binds_the_page_first_direct_copies():
    """With the patches, SGLang's MHA host pool module has the stand-in's two copies (not stubs)."""
    code = textwrap.dedent("""
        import sglang.srt.mem_cache.pool_host.mha as mha
        for name in ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"):
            fn = getattr(mha, name)
            assert fn.__module__ == "sgl_kernel.kvcacheio", (name, fn.__module__)
        print("ok")
    """)
    proc = probe(code, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_standin_install_decisions(tmp_path, monkeypatch):
    """p01 on an empty site-packages: installs, then finds it, updates a stale copy, and
    leaves a real or a broken sgl_kernel alone."""
    import p01_sgl_kernel_standin as p01

    def fake_python_ok(result_for_import):
        def run(code, timeout_s=120.0):
            return (True, "") if "HIRADIX_STANDIN" in code else result_for_import
        return run

    monkeypatch.setattr(p01, "site_packages", lambda: tmp_path)
    monkeypatch.setattr(p01, "python_ok", fake_python_ok((True, "")))
    assert p01.apply()[0] == _patchlib.SKIPPED  # a real sgl_kernel imports
    assert not (tmp_path / "sgl_kernel").exists()

    monkeypatch.setattr(p01, "python_ok", fake_python_ok((False, "ImportError: libcuda.so.1: cannot open")))
    with pytest.raises(_patchlib.PatchError, match="does not import"):
        p01.apply()
    assert not (tmp_path / "sgl_kernel").exists()

    monkeypatch.setattr(p01, "python_ok", fake_python_ok(
        (False, "ModuleNotFoundError: No module named 'sgl_kernel'")))
    assert p01.apply()[0] == _patchlib.APPLIED
    installed = {p.name: p.read_text() for p in (tmp_path / "sgl_kernel").glob("*.py")}
    assert installed == {p.name: p.read_text() for p in STANDIN.glob("*.py")}
    record = next(tmp_path.glob("hiradix_sgl_kernel_standin-*.dist-info")) / "RECORD"
    assert "sgl_kernel/__init__.py,sha256=" in record.read_text()
    assert p01.apply()[0] == _patchlib.ALREADY

    (tmp_path / "sgl_kernel" / "kvcacheio.py").write_text("# an older version\n")
    status, detail = p01.apply()
    assert status == _patchlib.APPLIED and "kvcacheio.py" in detail
    assert (tmp_path / "sgl_kernel" / "kvcacheio.py").read_text() == (STANDIN / "kvcacheio.py").read_text()


def test_torchvision_patch_decisions(tmp_path, monkeypatch):
    import p02_torchvision_op_schemas as p02

    installed = _patchlib.installed_file("torchvision", "torchvision/extension.py").read_text()
    copy = tmp_path / "extension.py"
    copy.write_text(installed.replace(p02.BLOCK, ""))
    assert p02.MARKER not in copy.read_text()
    monkeypatch.setattr(p02, "installed_file", lambda dist, rel: copy)

    monkeypatch.setattr(p02, "python_ok", lambda code: (True, ""))
    assert p02.apply()[0] == _patchlib.SKIPPED  # the C extension loads: nothing to do

    results = iter([(False, "RuntimeError: operator torchvision::nms does not exist"), (True, "")])
    monkeypatch.setattr(p02, "python_ok", lambda code: next(results))
    assert p02.apply()[0] == _patchlib.APPLIED
    patched = copy.read_text()
    assert patched.count(p02.MARKER) == 1 and "qnms(Tensor dets" in patched
    compile(patched, "extension.py", "exec")
    assert p02.apply()[0] == _patchlib.ALREADY
    assert copy.read_text() == patched

    copy.write_text(installed.replace(p02.BLOCK, "").replace('if _load_library("_C"):', "if _load():"))
    monkeypatch.setattr(p02, "python_ok", lambda code: (False, "RuntimeError: operator torchvision::nms does not exist"))
    with pytest.raises(_patchlib.PatchError, match="anchor missing"):
        p02.apply()


def test_patches_require_sglang_0_5_23(monkeypatch):
    import p01_sgl_kernel_standin as p01
    import p02_torchvision_op_schemas as p02
    import p03_hicache_host_pool_cpu as p03
    import p05_hicache_page_first_direct_cpu as p05

    monkeypatch.setattr(_patchlib, "installed_version", lambda dist: "0.5.22")
    for module in (p01, p02, p03, p05):
        with pytest.raises(_patchlib.PatchError, match="sglang==0.5.23"):
            module.apply()


def test_torchvision_imports():
    proc = subprocess.run([PYTHON, "-c", "import torchvision, transformers; "
                           "from transformers import LlamaConfig; print(torchvision.__version__)"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# End to end: stock SGLang on models/tiny
# ---------------------------------------------------------------------------------------------

HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                 "--hicache-mem-layout", "layer_first"]
def _post(port: int, path: str, body: dict, timeout_s: float = 300) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


@pytest.fixture(scope="class")
def radix_server(stock_server) -> int:
    """Stock RadixAttention: the session's stock server (tests/conftest.py); its port."""
    return stock_server.port


@pytest.fixture(scope="class")
def hicache_server(tiny_model, tmp_path_factory):
    """Stock HiCache with a 4,096-token device pool (host pool: twice that, the default ratio); its port."""
    log = tmp_path_factory.mktemp("hicache") / "server.log"
    with ServerProcess(tiny_model, extra_args=cpu_args(4096) + HICACHE_FLAGS, env=cpu_env(), log_path=log) as srv:
        yield srv.port


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model) -> Path:
    return tiny_model


@pytest.mark.e2e
class TestStockRadixCache:
    """Stock SGLang (RadixAttention) on models/tiny; one server for the class."""

    @pytest.mark.timeout(900)
    def test_chat_completion_reports_cached_tokens(self, radix_server):
        body = {"model": "tiny", "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Tell me about the river near the mountain, "
                                                         "the people of the world and their long story."}]}
        first = _post(radix_server, "/v1/chat/completions", body)
        second = _post(radix_server, "/v1/chat/completions", body)
        assert first["choices"][0]["message"]["content"]
        assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
        assert second["usage"]["prompt_tokens"] > 20
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    @pytest.mark.timeout(900)
    def test_greedy_output_matches_transformers(self, radix_server, tiny_model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        n_new = 30
        for prompt in ["The people of the world said that the river near the mountain is deep.",
                       "def get_value(self, key: int) -> int:\n    return self.cache.get(key, 7)"]:
            ids = tok(prompt)["input_ids"]
            out = _post(radix_server, "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}})
            with torch.no_grad():
                hf = model.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new,
                                    do_sample=False)[0, len(ids):].tolist()
            assert out["output_ids"] == hf, prompt


@pytest.mark.e2e
class TestStockHiCache:
    """Stock HiCache (patch p03) on models/tiny; one server for the class."""

    @pytest.mark.timeout(900)
    def test_stock_hicache_brings_back_evicted_prefix_from_host(self, hicache_server):
        rng = random.Random(1)
        n = 1500

        def gen(ids):
            out = _post(hicache_server, "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
            return out["output_ids"], out["meta_info"]

        prompt = [rng.randrange(10, 4000) for _ in range(n)]
        first, _ = gen(prompt)
        for _ in range(3):  # 3 x 1,516 tokens push the prompt out of the 4,096-token device pool
            gen([rng.randrange(10, 4000) for _ in range(n)])
        again, meta = gen(prompt)
        assert again == first
        details = meta.get("cached_tokens_details") or {}
        assert details.get("host", 0) > 0, meta
        assert meta["cached_tokens"] >= n - 1


@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 48, 16], [20, 9, 33]), ([96], [1])])
def test_extend_attention_with_cached_prefix_matches_full_recompute(prefix_lens, extend_lens):
    """p04: a request with a cached prefix attends from its new queries only; the result equals
    what the stock path (full causal attention over prefix + new, keep the new rows) gives."""
    import torch

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 32
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = sum(seq_lens) + 8
    k_cache, v_cache = torch.randn(pool, kv_heads, dim), torch.randn(pool, kv_heads, dim)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    perm, at = torch.randperm(pool), 0
    for r, n in enumerate(seq_lens):
        req_to_token[r, :n] = perm[at : at + n]
        at += n
    query = torch.randn(sum(extend_lens), heads, dim)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    out = torch.empty_like(query)
    backend._run_sdpa_forward_extend(
        query, out, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)), torch.tensor(seq_lens),
        torch.tensor(prefix_lens), torch.tensor(extend_lens), scaling=dim ** -0.5, enable_gqa=True, causal=True)
    start = 0
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        idx = req_to_token[r, : p + e]
        k = k_cache[idx].movedim(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = v_cache[idx].movedim(0, 1).repeat_interleave(heads // kv_heads, 0)
        full_q = torch.zeros(heads, p + e, dim)
        full_q[:, p:] = query[start : start + e].movedim(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(full_q, k, v, is_causal=True, scale=dim ** -0.5)
        torch.testing.assert_close(out[start : start + e], ref[:, p:].movedim(0, 1), rtol=1e-5, atol=1e-5)
        start += e


MLA_DISPATCH_PROBE = """
from types import SimpleNamespace
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
handler = AttentionBackendRegistry.get_handler("torch_native")
fresh_prefill = SimpleNamespace(extend_prefix_lens_cpu=[0], forward_mode=None)
print(handler.__name__, handler(SimpleNamespace(), fresh_prefill) == AttnForwardMethod.MLA)
"""


def test_torch_native_mla_dispatch_takes_the_absorbed_path():
    """p06: a DeepSeek prefill without a cached prefix on torch_native takes the absorbed MLA
    method (stock falls back to the triton handler, i.e. the MHA path, which fails on CPU)."""
    out = probe(MLA_DISPATCH_PROBE, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["handle_attention_torch_native", "True"], out.stdout



def _swa_case(seq_lens, kv_heads=2, dim=32, seed=0):
    """K and V of requests of `seq_lens` tokens in a full pool (slot 0 unused, as SGLang's), and
    their `req_to_token` rows."""
    gen = torch.Generator().manual_seed(seed)
    full_size = sum(seq_lens) + 8
    k_full, v_full = torch.randn(full_size, kv_heads, dim, generator=gen), torch.randn(full_size, kv_heads, dim, generator=gen)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    perm, at = torch.randperm(full_size - 1, generator=gen) + 1, 0
    for r, n in enumerate(seq_lens):
        req_to_token[r, :n] = perm[at : at + n]
        at += n
    return k_full, v_full, req_to_token, full_size


def _swa_pool(k_full, v_full, req_to_token, live, full_size, seed=1):
    """An SWA pool that holds, at other slots, only the tokens of positions `live[r] = (lo, n)` of
    each request r, and the full -> SWA mapping (0 for the rest, as SGLang's allocator maps a freed
    token). Every other SWA slot, dummy slot 0 included, holds NaN: a read of one shows."""
    gen = torch.Generator().manual_seed(seed)
    live_locs = torch.cat([req_to_token[r, lo:n] for r, (lo, n) in enumerate(live)])
    swa_size = len(live_locs) + 5
    mapping = torch.zeros(full_size, dtype=torch.int64)
    mapping[live_locs] = torch.randperm(swa_size - 1, generator=gen)[: len(live_locs)] + 1
    k_swa = torch.full((swa_size, *k_full.shape[1:]), float("nan"))
    v_swa = torch.full((swa_size, *v_full.shape[1:]), float("nan"))
    k_swa[mapping[live_locs]], v_swa[mapping[live_locs]] = k_full[live_locs], v_full[live_locs]
    return k_swa, v_swa, mapping


def _windowed_reference(query, k, v, positions, window, heads):
    """Attention of queries at `positions` over keys 0..max(positions), each seeing keys
    `pos - window .. pos` (stock torch-native's `_make_sliding_window_mask`)."""
    kv_len = k.shape[0]
    q_pos, k_pos = torch.tensor(positions)[:, None], torch.arange(kv_len)[None, :]
    mask = (k_pos <= q_pos) & (k_pos >= q_pos - window)
    rep = heads // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.movedim(0, 1), k.movedim(0, 1).repeat_interleave(rep, 0), v.movedim(0, 1).repeat_interleave(rep, 0),
        attn_mask=mask, scale=query.shape[-1] ** -0.5)
    return out.movedim(0, 1)


@pytest.mark.parametrize("prefix_lens,extend_lens,window", [([0, 48, 16], [20, 9, 33], 7), ([96], [1], 31), ([5], [7], 31)])
def test_sliding_window_extend_reads_its_window_at_swa_slots(prefix_lens, extend_lens, window):
    """p12: a sliding layer's extend reads the keys its new queries see, translated to the SWA pool
    (never a freed slot: those hold NaN here), and equals window attention over the full pool; the
    same path without a translator (--disable-hybrid-swa-memory) gives the same numbers."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    heads, dim = 8, 32
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_full, v_full, req_to_token, full_size = _swa_case(seq_lens, dim=dim)
    k_swa, v_swa, mapping = _swa_pool(k_full, v_full, req_to_token,
                                      [(max(0, p - window), n) for p, n in zip(prefix_lens, seq_lens)], full_size)
    query = torch.randn(sum(extend_lens), heads, dim, generator=torch.Generator().manual_seed(2))
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    outs = {}
    for name, (k_cache, v_cache, translate) in {"swa": (k_swa, v_swa, lambda locs: mapping[locs]),
                                                "full": (k_full, v_full, None)}.items():
        out = torch.empty_like(query)
        backend._run_sdpa_forward_extend(
            query, out, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)), torch.tensor(seq_lens),
            torch.tensor(prefix_lens), torch.tensor(extend_lens), scaling=dim ** -0.5, enable_gqa=True, causal=True,
            sliding_window_size=window, kv_loc_translate=translate)
        outs[name] = out
    assert torch.equal(outs["swa"], outs["full"])
    start = 0
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        idx = req_to_token[r, : p + e]
        ref = _windowed_reference(query[start : start + e], k_full[idx], v_full[idx], list(range(p, p + e)), window, heads)
        torch.testing.assert_close(outs["swa"][start : start + e], ref, rtol=1e-5, atol=1e-5)
        start += e


def test_sliding_window_decode_reads_its_window_at_swa_slots():
    """p12: a sliding layer's decode reads its last `window + 1` keys at their SWA slots."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    heads, dim, window = 8, 32, 7
    seq_lens = [1, 8, 9, 40, 100]
    k_full, v_full, req_to_token, full_size = _swa_case(seq_lens, dim=dim)
    k_swa, v_swa, mapping = _swa_pool(k_full, v_full, req_to_token,
                                      [(max(0, n - 1 - window), n) for n in seq_lens], full_size)
    query = torch.randn(len(seq_lens), heads, dim, generator=torch.Generator().manual_seed(3))
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    outs = {}
    for name, (k_cache, v_cache, translate) in {"swa": (k_swa, v_swa, lambda locs: mapping[locs]),
                                                "full": (k_full, v_full, None)}.items():
        out = torch.empty_like(query)
        backend._run_sdpa_forward_decode(
            query, out, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)), torch.tensor(seq_lens),
            scaling=dim ** -0.5, enable_gqa=True, causal=False, sliding_window_size=window, kv_loc_translate=translate)
        outs[name] = out
    assert torch.equal(outs["swa"], outs["full"])
    for r, n in enumerate(seq_lens):
        idx = req_to_token[r, :n]
        ref = _windowed_reference(query[r : r + 1], k_full[idx], v_full[idx], [n - 1], window, heads)
        torch.testing.assert_close(outs["swa"][r : r + 1], ref, rtol=1e-5, atol=1e-5)


def test_swa_loc_translate_only_for_the_swa_pools_sliding_layers():
    """p12: the backend translates for a layer whose KV the SWA pool holds, for no other."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    pool = SimpleNamespace(layers_mapping={0: (0, True), 1: (0, False), 2: (1, True)},
                           translate_loc_from_full_to_swa=lambda locs: locs + 100)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend.token_to_kv_pool, backend.use_sliding_window_kv_pool = pool, True

    def layer(i, cross=False):
        return SimpleNamespace(layer_id=i, is_cross_attention=cross)

    assert [backend._swa_loc_translate(layer(i)) is not None for i in range(3)] == [True, False, True]
    assert backend._swa_loc_translate(layer(0))(torch.tensor([1])).item() == 101
    assert backend._swa_loc_translate(layer(0, cross=True)) is None
    backend.use_sliding_window_kv_pool = False  # a plain pool (--disable-hybrid-swa-memory)
    assert all(backend._swa_loc_translate(layer(i)) is None for i in range(3))


def test_swa_pool_patch_on_a_copy_applies_once_and_fails_loudly(tmp_path, monkeypatch):
    """p12 on a copy of the installed file with its edits taken out: applied, then found; without
    an anchor nothing is written."""
    import p12_torch_native_swa_pool as p12

    installed = _patchlib.installed_file("sglang", "sglang/srt/layers/attention/torch_native_backend.py").read_text()
    unpatched = installed
    for edit in reversed(p12.EDITS):
        assert unpatched.count(edit.replacement) == 1, edit.anchor
        unpatched = unpatched.replace(edit.replacement, edit.anchor)
    assert p12.MARKER not in unpatched
    copy = tmp_path / "torch_native_backend.py"
    copy.write_text(unpatched)
    monkeypatch.setattr(p12, "installed_file", lambda dist, rel: copy)
    assert p12.apply()[0] == _patchlib.APPLIED
    patched = copy.read_text()
    assert patched == installed
    compile(patched, "torch_native_backend.py", "exec")
    assert p12.apply()[0] == _patchlib.ALREADY and copy.read_text() == patched
    broken = unpatched.replace("is_cross_attn=layer.is_cross_attention,\n            sliding_window_size=(\n"
                               "                layer.sliding_window_size\n                if causal",
                               "is_cross_attn=layer.is_cross_attention,\n            sliding_window_size=(\n"
                               "                layer.window\n                if causal")
    assert broken != unpatched
    copy.write_text(broken)
    with pytest.raises(_patchlib.PatchError, match="anchor missing"):
        p12.apply()
    assert copy.read_text() == broken

DP_ATTENTION_PROBE = """
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
rope = RotaryEmbedding(64, 64, 128, 10000, True, torch.float32)
q, k = torch.empty(0, 4 * 64), torch.empty(0, 64)
q2, k2 = rope.forward_native(torch.empty(0, dtype=torch.long), q, k)
x = torch.randn(3, 64)
q3, k3 = rope.forward_native(torch.tensor([0, 1, 2]), x.clone(), x.clone())
print(TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value(None), tuple(q2.shape), tuple(k2.shape),
      torch.equal(q3[0], x[0]), not torch.equal(q3[1], x[1]))
"""


def test_dp_attention_cpu_fill_value_and_idle_rank_rotary():
    """p08: the torch-native backend answers DP attention's padding fill value (1, as Intel AMX's),
    and the rotary embedding passes an idle DP rank's empty batch through (position 0 is the
    identity rotation, later positions still rotate)."""
    out = probe(DP_ATTENTION_PROBE, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "1 (0, 256) (0, 64) True True", out.stdout


# ---------------------------------------------------------------------------------------------
# p13: per-head attention sinks (gpt-oss) in the torch-native backend
# ---------------------------------------------------------------------------------------------

def _sinks_reference(query, k, v, positions, window, sinks):
    """gpt-oss's attention as HF transformers' `eager_attention_forward` computes it, in float64:
    queries at `positions` over keys 0..len(k)-1, each seeing keys `pos - window .. pos` (every
    earlier key without a window); each head's scores get the head's sink logit appended, the
    softmax runs over both, and the sink's column is dropped."""
    heads, rep = query.shape[1], query.shape[1] // k.shape[1]
    q = query.double().movedim(0, 1)
    keys = k.double().movedim(0, 1).repeat_interleave(rep, 0)
    values = v.double().movedim(0, 1).repeat_interleave(rep, 0)
    scores = q @ keys.transpose(1, 2) * query.shape[-1] ** -0.5
    q_pos, k_pos = torch.tensor(positions)[:, None], torch.arange(k.shape[0])[None, :]
    visible = (k_pos <= q_pos) & ((k_pos >= q_pos - window) if window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, len(positions), 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs @ values).movedim(0, 1).float()


def _sinks(heads: int, seed: int = 4) -> torch.Tensor:
    """Per-head sink logits as gpt-oss's SGLang model holds them (bfloat16), large enough to matter."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


@pytest.mark.parametrize("prefix_lens,extend_lens,window", [
    ([0, 0], [20, 33], None),  # stock's full causal attention (no prefix)
    ([0, 48, 16], [20, 9, 33], None),  # p04: new queries only after a cached prefix
    ([0, 48, 16], [20, 9, 33], 7),  # p12: a sliding layer reads its window
    ([96], [1], 31),
    ([5], [7], 31),
])  # fmt: skip
def test_extend_attention_with_sinks_matches_the_reference(prefix_lens, extend_lens, window):
    """p13: every extend path applies the sinks as HF transformers' gpt-oss does; with a window, the
    SWA pool's translated reads (p12) give the full pool's numbers; the sinks change the output."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    heads, dim = 8, 32
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_full, v_full, req_to_token, full_size = _swa_case(seq_lens, dim=dim)
    query = torch.randn(sum(extend_lens), heads, dim, generator=torch.Generator().manual_seed(2))
    sinks = _sinks(heads)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    pools = {"full": (k_full, v_full, None)}
    if window is not None:
        k_swa, v_swa, mapping = _swa_pool(k_full, v_full, req_to_token,
                                          [(max(0, p - window), n) for p, n in zip(prefix_lens, seq_lens)], full_size)
        pools["swa"] = (k_swa, v_swa, lambda locs: mapping[locs])
    outs = {}
    for name, (k_cache, v_cache, translate) in pools.items():
        for with_sinks in (True, False):
            out = torch.empty_like(query)
            backend._run_sdpa_forward_extend(
                query, out, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)), torch.tensor(seq_lens),
                torch.tensor(prefix_lens), torch.tensor(extend_lens), scaling=dim ** -0.5, enable_gqa=True,
                causal=True, sliding_window_size=window, kv_loc_translate=translate,
                sinks=sinks if with_sinks else None)
            outs[name, with_sinks] = out
    if window is not None:
        assert torch.equal(outs["swa", True], outs["full", True])
    start = 0
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        idx = req_to_token[r, : p + e]
        ref = _sinks_reference(query[start : start + e], k_full[idx], v_full[idx], list(range(p, p + e)), window, sinks)
        torch.testing.assert_close(outs["full", True][start : start + e], ref, rtol=1e-5, atol=1e-5)
        start += e
    assert not torch.allclose(outs["full", True], outs["full", False], atol=1e-3)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_with_sinks_matches_the_reference(window):
    """p13: decode applies the sinks over all keys, or over its window (p12's reads, SWA pool or not)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    heads, dim = 8, 32
    seq_lens = [1, 8, 9, 40, 100]
    k_full, v_full, req_to_token, full_size = _swa_case(seq_lens, dim=dim)
    query = torch.randn(len(seq_lens), heads, dim, generator=torch.Generator().manual_seed(3))
    sinks = _sinks(heads, seed=5)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    pools = {"full": (k_full, v_full, None)}
    if window is not None:
        k_swa, v_swa, mapping = _swa_pool(k_full, v_full, req_to_token,
                                          [(max(0, n - 1 - window), n) for n in seq_lens], full_size)
        pools["swa"] = (k_swa, v_swa, lambda locs: mapping[locs])
    outs = {}
    for name, (k_cache, v_cache, translate) in pools.items():
        out = torch.empty_like(query)
        backend._run_sdpa_forward_decode(
            query, out, k_cache, v_cache, req_to_token, torch.arange(len(seq_lens)), torch.tensor(seq_lens),
            scaling=dim ** -0.5, enable_gqa=True, causal=False, sliding_window_size=window,
            kv_loc_translate=translate, sinks=sinks)
        outs[name] = out
    if window is not None:
        assert torch.equal(outs["swa"], outs["full"])
    for r, n in enumerate(seq_lens):
        idx = req_to_token[r, :n]
        ref = _sinks_reference(query[r : r + 1], k_full[idx], v_full[idx], [n - 1], window, sinks)
        torch.testing.assert_close(outs["full"][r : r + 1], ref, rtol=1e-5, atol=1e-5)


def test_sinks_helper_keeps_sdpa_without_sinks_and_keeps_the_dtype():
    """p13: no sinks, SDPA itself (nothing changes for other models); with sinks, a bfloat16 query
    gets a bfloat16 output (computed in float32), and a very negative sink is no sink at all."""
    from sglang.srt.layers.attention import torch_native_backend as tnb

    assert tnb._sdpa_for(None) is tnb.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=gen) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    no_sink = tnb._sdpa_for(torch.full((4,), -1e4))(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(no_sink, tnb.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25))
    causal = tnb._sdpa_for(torch.full((4,), -1e4))(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(causal, no_sink)
    out = tnb._sdpa_for(torch.zeros(4))(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_forward_extend_and_decode_pass_the_layers_sinks():
    """p13: `forward_extend` / `forward_decode` take gpt-oss's `sinks=` (stock: TypeError) and hand
    them to the attention; without them, None."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend.use_sliding_window_kv_pool, backend.swa_out_cache_loc = False, None
    backend.token_to_kv_pool = SimpleNamespace(get_key_buffer=lambda i: None, get_value_buffer=lambda i: None)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=None)
    seen = []
    backend._run_sdpa_forward_extend = lambda *a, **kw: seen.append(("extend", kw["sinks"]))
    backend._run_sdpa_forward_decode = lambda *a, **kw: seen.append(("decode", kw["sinks"]))
    layer = SimpleNamespace(qk_head_dim=16, v_head_dim=16, tp_q_head_num=4, tp_k_head_num=2, layer_id=0,
                            is_cross_attention=False, attn_type=AttentionType.DECODER, scaling=0.25,
                            sliding_window_size=31)  # fmt: skip
    batch = SimpleNamespace(out_cache_loc=None, req_pool_indices=None, seq_lens=None, extend_prefix_lens=None,
                            extend_seq_lens=None, encoder_lens=None)  # fmt: skip
    sinks, q = torch.zeros(4), torch.zeros(3, 4 * 16)
    backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False, sinks=sinks)
    backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False, sinks=sinks)
    backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    assert seen == [("extend", sinks), ("decode", sinks), ("extend", None)]


GPTOSS_RESOLUTION_PROBE = """
import argparse, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", sys.argv[1], "--device", "cpu",
    "--attention-backend", "torch_native", "--max-total-tokens", "4096", "--dtype", "float32"]))
args.resolve_once()
print("resolved", args.attention_backend)
"""


def test_sglang_resolution_accepts_gpt_oss_on_torch_native(tmp_path):
    """p13: SGLang's flag resolution accepts gpt-oss with --attention-backend torch_native (stock:
    AssertionError 'GptOssForCausalLM requires one of [...] attention backend'); config.json only."""
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000,
              "max_position_embeddings": 2048, "torch_dtype": "float32", "sliding_window": 32,
              "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = f"import sys; sys.argv = ['probe', {str(tmp_path)!r}]\n" + GPTOSS_RESOLUTION_PROBE
    out = probe(code, {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "resolved torch_native", out.stdout


def test_sinks_patch_on_copies_applies_once_and_fails_loudly(tmp_path, monkeypatch):
    """p13 on copies of the two installed files with its edits taken out: applied (p12's text left
    whole), then found; without an anchor, or without p12, nothing is written."""
    import p12_torch_native_swa_pool as p12
    import p13_torch_native_sinks as p13

    copies, installed, unpatched = {}, {}, {}
    for rel, edits in ((p13.BACKEND_REL, p13.BACKEND_EDITS), (p13.MODEL_HOOK_REL, p13.MODEL_HOOK_EDITS)):
        installed[rel] = text = _patchlib.installed_file("sglang", rel).read_text()
        for edit in reversed(edits):
            assert text.count(edit.replacement) == 1, edit.anchor
            text = text.replace(edit.replacement, edit.anchor)
        assert p13.MARKER not in text
        unpatched[rel] = text
        copies[rel] = tmp_path / Path(rel).name
        copies[rel].write_text(text)
    assert all(installed[p13.BACKEND_REL].count(edit.replacement) == 1 for edit in p12.EDITS)
    monkeypatch.setattr(p13, "installed_file", lambda dist, rel: copies[rel])
    assert p13.apply()[0] == _patchlib.APPLIED
    patched = {rel: copy.read_text() for rel, copy in copies.items()}
    assert patched == installed
    for rel, text in patched.items():
        compile(text, rel, "exec")
    assert p13.apply()[0] == _patchlib.ALREADY and {rel: c.read_text() for rel, c in copies.items()} == patched
    # an anchor missing in the second file: neither file is written
    backend, hook = copies[p13.BACKEND_REL], copies[p13.MODEL_HOOK_REL]
    backend.write_text(unpatched[p13.BACKEND_REL])
    hook.write_text(unpatched[p13.MODEL_HOOK_REL].replace('                "aiter",\n            ]\n',
                                                          '                "aiter_v2",\n            ]\n'))
    with pytest.raises(_patchlib.PatchError, match="anchor missing"):
        p13.apply()
    assert backend.read_text() == unpatched[p13.BACKEND_REL] and p13.MARKER not in hook.read_text()
    # p12 not applied: refused before anything is written
    hook.write_text(unpatched[p13.MODEL_HOOK_REL])
    without_p12 = unpatched[p13.BACKEND_REL]
    for edit in reversed(p12.EDITS):
        without_p12 = without_p12.replace(edit.replacement, edit.anchor)
    assert p12.MARKER not in without_p12
    backend.write_text(without_p12)
    with pytest.raises(_patchlib.PatchError, match="p12"):
        p13.apply()
    assert backend.read_text() == without_p12 and hook.read_text() == unpatched[p13.MODEL_HOOK_REL]
