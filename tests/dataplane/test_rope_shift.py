"""RoPE shift (hiradix.dataplane.rope_shift): shift(rope(k, p), d) == rope(k, p + d).

Two references: an independent float64 RoPE written here (complex rotation of each pair, the
frequency formulas vectorised in torch), and SGLang 0.5.23's own rotary embeddings
(``sglang.srt.layers.rotary_embedding.get_rope`` + ``forward_native`` on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from hiradix.dataplane.rope_shift import RopeShift, ShiftUnsupported, rope_shift_from_config, shift_keys, shift_slots

# (position p, shift d): negative and positive, and |d| = 30000.
SHIFTS = [(100, -37), (5, 1000), (31000, -30000), (17, 30000), (4096, -4000)]

LLAMA = {"hidden_size": 512, "num_attention_heads": 4, "rope_theta": 10000.0, "max_position_embeddings": 65536}
MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "rope_theta": 10000.0, "max_position_embeddings": 163840}
DS_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
CONFIGS = {
    "default_neox": LLAMA,
    "default_gptj": {**LLAMA, "rope_is_neox_style": False},
    "partial_neox": {**LLAMA, "head_dim": 96, "partial_rotary_factor": 0.5},
    "partial_gptj": {**LLAMA, "head_dim": 96, "partial_rotary_factor": 0.5, "rope_is_neox_style": False},
    "linear": {**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "dynamic": {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "llama3": {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "yarn": {**LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
             "original_max_position_embeddings": 32768}},
    "deepseek_mla_yarn": {**MLA, "rope_scaling": DS_YARN},
    "deepseek_mla_plain_neox": {**MLA, "rope_interleave": False},
}  # fmt: skip
DTYPE_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}


def ref_inv_freq(cfg: dict) -> tuple[torch.Tensor, int, int, bool]:
    """(inv_freq float64, rotary_dim, rotary_offset, neox) from the published formulas."""
    theta, rs = cfg["rope_theta"], dict(cfg.get("rope_scaling") or {})
    if "kv_lora_rank" in cfg:
        rd, off, neox = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], not cfg.get("rope_interleave", True)
    else:
        head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        rd, off, neox = int(head_dim * cfg.get("partial_rotary_factor", 1.0)), 0, cfg.get("rope_is_neox_style", True)
    kind, f = rs.get("rope_type", rs.get("type")), rs.get("factor", 1.0)
    if kind == "dynamic":
        theta = theta * (f * f - f + 1) ** (rd / (rd - 2))
    omega = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if kind == "linear":
        omega = omega / f
    elif kind == "llama3":
        wl, orig = 2 * math.pi / omega, rs["original_max_position_embeddings"]
        s = ((orig / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])).clamp(0, 1)
        omega = (1 - s) * omega / f + s * omega
    elif kind == "yarn":
        orig = rs["original_max_position_embeddings"]
        dims = [rd * math.log(orig / (b * 2 * math.pi)) / (2 * math.log(theta)) for b in (32, 1)]
        low, high = max(math.floor(dims[0]), 0), min(math.ceil(dims[1]), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        omega = omega / f * ramp + omega * (1 - ramp)
    return omega, rd, off, neox


def ref_rope(x: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor, rd: int, off: int, neox: bool) -> torch.Tensor:
    """float64 RoPE of x (n, H, D) at per-token positions pos (n,): each pair times exp(i pos omega)."""
    x = x.double().clone()
    idx = torch.arange(rd // 2)
    a, b = (off + idx, off + idx + rd // 2) if neox else (off + 2 * idx, off + 2 * idx + 1)
    z = torch.complex(x[..., a], x[..., b]) * torch.exp(1j * pos.double()[:, None] * omega)[:, None, :]
    x[..., a], x[..., b] = z.real, z.imag
    return x


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_matches_reference(name: str) -> None:
    spec = rope_shift_from_config(CONFIGS[name])
    omega, rd, off, neox = ref_inv_freq(CONFIGS[name])
    assert (spec.rotary_dim, spec.rotary_offset, spec.is_neox_style) == (rd, off, neox)
    torch.testing.assert_close(torch.tensor(spec.inv_freq, dtype=torch.float64), omega, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", list(DTYPE_TOL), ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shift_equals_rope_at_new_position(name: str, dtype: torch.dtype) -> None:
    cfg, gen = CONFIGS[name], torch.Generator().manual_seed(7)
    spec = rope_shift_from_config(cfg)
    omega, rd, off, neox = ref_inv_freq(cfg)
    heads, width = (1, off + rd) if off else (2, cfg.get("head_dim", 128))
    k = torch.randn(6, heads, width, generator=gen, dtype=torch.float64)
    rotary = torch.zeros(width, dtype=torch.bool)
    rotary[off : off + rd] = True
    for p, d in SHIFTS:
        pos = p + torch.arange(6)
        cached = ref_rope(k, pos, omega, rd, off, neox).to(dtype)
        shifted = shift_keys(cached, d, spec)
        assert shifted.dtype == dtype and shifted.shape == cached.shape
        assert rel_err(shifted, ref_rope(k, pos + d, omega, rd, off, neox)) <= DTYPE_TOL[dtype], (p, d)
        assert torch.equal(shifted[..., ~rotary], cached[..., ~rotary])  # latent / pass dims bitwise


def test_shift_zero_and_round_trip() -> None:
    spec = rope_shift_from_config(CONFIGS["default_gptj"])
    k = torch.randn(4, 2, 128, dtype=torch.float32)
    same = shift_keys(k, 0, spec)
    assert torch.equal(same, k) and same.data_ptr() != k.data_ptr()  # a new tensor
    back = shift_keys(shift_keys(k, -30000, spec), 30000, spec)
    assert rel_err(back, k.double()) < 1e-6


def test_shift_slots_moves_only_dst() -> None:
    spec = rope_shift_from_config(CONFIGS["partial_neox"])
    buf = torch.randn(32, 2, 96, dtype=torch.float16)
    before = buf.clone()
    src, dst = torch.tensor([3, 4, 5, 6]), torch.tensor([20, 21, 9, 30])
    shift_slots(buf, src, dst, -1000, spec)
    assert torch.equal(buf[dst], shift_keys(before[src], -1000, spec))
    others = torch.ones(32, dtype=torch.bool)
    others[dst] = False
    assert torch.equal(buf[others], before[others])  # src and every other slot untouched
    assert not torch.equal(buf[dst], before[dst])


def test_shift_slots_rejects_bad_ids() -> None:
    spec = rope_shift_from_config(LLAMA)
    buf = torch.zeros(8, 1, 128)
    with pytest.raises(ValueError, match="int64"):
        shift_slots(buf, torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1, spec)
    with pytest.raises(ValueError, match="length"):
        shift_slots(buf, torch.tensor([1, 2]), torch.tensor([3]), 1, spec)
    with pytest.raises(TypeError):
        shift_keys(torch.zeros(2, 1, 128, dtype=torch.uint8), 1, spec)
    with pytest.raises(ValueError):
        RopeShift(rotary_dim=8, rotary_offset=0, is_neox_style=True, inv_freq=(1.0,))


@pytest.mark.parametrize(
    "scaling, variant",
    [
        ({"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
          "original_max_position_embeddings": 4096}, "longrope"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}, "longrope"),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, "mrope"),
        ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "mrope"),
        ({"type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]}, "mrope"),
        ({"type": "no_such_rope"}, "no_such_rope"),
    ],
)  # fmt: skip
def test_refusals_name_the_variant(scaling: dict, variant: str) -> None:
    with pytest.raises(ShiftUnsupported, match=variant) as info:
        rope_shift_from_config({**LLAMA, "rope_scaling": scaling})
    assert info.value.variant == variant and "recompute" in str(info.value)
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------- against SGLang's own RoPE (CPU)

# name -> (config, get_rope kwargs); caches kept at <= 65536 rows. DeepSeek: the MLA attention
# forces rope_type deepseek_yarn and is_neox_style = not rope_interleave (models/deepseek_v2.py).
SGL_CASES = {
    "default": ({**LLAMA, "rope_is_neox_style": False}, dict(is_neox_style=False)),
    "linear": ({**LLAMA, "max_position_embeddings": 16384, "rope_scaling": {"type": "linear", "factor": 4.0}}, {}),
    "dynamic": ({**LLAMA, "max_position_embeddings": 32768, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, {}),
    "llama3": (CONFIGS["llama3"], {}),
    "yarn": ({**LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 16.0,
              "original_max_position_embeddings": 4096}}, {}),
    "deepseek_yarn": ({**MLA, "kv_lora_rank": 32, "rope_scaling": {**DS_YARN, "factor": 16, "mscale": 0.707}},
                      dict(is_neox_style=False)),
}  # fmt: skip


@pytest.fixture
def sglang_rope(monkeypatch: pytest.MonkeyPatch):
    """SGLang's get_rope on a CPU-only machine: the CPU engine path (no vllm fallback kernel)."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # read by sglang's is_cpu() at import and in get_device()
    from sglang.srt.layers.rotary_embedding import base, get_rope_wrapper

    monkeypatch.setattr(base, "_is_cpu", True)  # whichever module imported sglang first
    return get_rope_wrapper


def _build_sglang(get_rope_wrapper, cfg: dict, kwargs: dict):
    """SGLang's rotary embedding for cfg; DeepSeek as its CPU path builds it (get_rope_cpu, device="cpu")."""
    spec = rope_shift_from_config(cfg)
    head = spec.rotary_dim if spec.rotary_offset else cfg["hidden_size"] // cfg["num_attention_heads"]
    rs = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if spec.rotary_offset and rs:
        rs["rope_type"] = "deepseek_yarn"
        kwargs = {**kwargs, "device": "cpu"}
    emb = get_rope_wrapper(head, spec.rotary_dim, cfg["max_position_embeddings"], cfg["rope_theta"],
                           rope_scaling=rs, dtype=torch.float32, **kwargs)  # fmt: skip
    return spec, emb, head


@pytest.mark.parametrize("name", sorted(SGL_CASES))
def test_inv_freq_matches_sglang(name: str, sglang_rope) -> None:
    spec, emb, _ = _build_sglang(sglang_rope, *SGL_CASES[name])
    cos, sin = emb.cos_sin_cache[1].double().chunk(2)
    omega = torch.tensor(spec.inv_freq, dtype=torch.float64)
    assert (torch.atan2(sin, cos) - omega).abs().max().item() < 2e-7  # angle of position 1
    if name not in ("linear", "dynamic"):  # these fold the scaling into the cache, not inv_freq
        arg = emb.scaling_factor if name in ("yarn", "deepseek_yarn") else emb.base
        torch.testing.assert_close(emb._compute_inv_freq(arg).double(), omega, rtol=2e-6, atol=0)
    mscale = torch.hypot(cos, sin).mean().item()  # YaRN bakes mscale into SGLang's cos/sin cache
    ln16 = math.log(16.0)
    want = {"yarn": 0.1 * ln16 + 1, "deepseek_yarn": (0.1 * 0.707 * ln16 + 1) / (0.1 * ln16 + 1)}
    assert mscale == pytest.approx(want.get(name, 1.0), rel=1e-6)


@pytest.mark.parametrize("name", sorted(SGL_CASES))
def test_shift_maps_sglang_rope_p_to_p_plus_d(name: str, sglang_rope) -> None:
    spec, emb, head = _build_sglang(sglang_rope, *SGL_CASES[name])
    gen = torch.Generator().manual_seed(3)
    for p, d in SHIFTS:
        pos = p + torch.arange(4)
        k = torch.randn(4, 1 if spec.rotary_offset else 2, head, generator=gen)
        q = torch.randn_like(k)
        k_p = emb.forward_native(pos, q, k)[1].reshape(k.shape)
        k_pd = emb.forward_native(pos + d, q, k)[1].reshape(k.shape)
        if spec.rotary_offset:  # MLA row: latent, then k_pe
            latent = torch.randn(4, 1, spec.rotary_offset, generator=gen)
            k_p, k_pd = torch.cat((latent, k_p), -1), torch.cat((latent, k_pd), -1)
        # SGLang forms p*omega in float32: its own angle error is ~2^-24 * position * omega.
        tol = 1e-6 + 2.0**-24 * (2 * p + 2 * abs(d)) * max(spec.inv_freq)
        assert rel_err(shift_keys(k_p, d, spec), k_pd.double()) <= tol, (p, d)
        assert torch.equal(shift_keys(k_p, d, spec)[..., : spec.rotary_offset], k_p[..., : spec.rotary_offset])
