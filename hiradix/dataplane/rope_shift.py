"""RoPE shift: move cached post-RoPE keys to new positions without recomputing them.

When the oldest part of a conversation is dropped, the kept tail's keys sit ``delta`` positions
too far right (``delta < 0``). RoPE rotations compose, ``R(p + delta) k = R(delta) R(p) k``, so
rotating each rotary pair of a cached key by ``delta * omega_i`` gives the key RoPE would have
produced at ``p + delta``; V and the non-rotary dims do not change. This is the context shift of
CachedAttention / AttentionStore (USENIX ATC '24, section 3.4) and of llama.cpp.

SGLang 0.5.23 stores post-RoPE K in its pools (``sglang/srt/mem_cache/memory_pool.py``): per layer
``k_buffer[l]`` of shape ``(slots, H, D)`` for MHA/GQA, and for MLA one latent row
``kv_buffer[l]`` of shape ``(slots, 1, kv_lora_rank + qk_rope_head_dim)`` whose last
``qk_rope_head_dim`` columns are the rotated ``k_pe``. The rotary variants and their frequencies
follow ``sglang/srt/layers/rotary_embedding/`` (``base.py``, ``yarn.py``, ``rope_variant.py``,
``factory.py::get_rope``) and ``sglang/srt/models/deepseek_v2.py``. Variants whose rotation is not a
function of the position difference alone (LongRoPE, multimodal MRoPE) raise
:class:`ShiftUnsupported`: the caller recomputes those tokens instead.

YaRN's attention scale (``mscale``) is baked into SGLang's cos/sin cache, so a cached key is
``mscale * R(p) k``; a pure rotation keeps that factor, which is why the shift uses cos/sin of
``delta * omega`` without any ``mscale``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

TWO_PI = 2.0 * math.pi

# rope_scaling types whose rotation depends on more than the position difference.
_REFUSED_TYPES = {
    "longrope": "it switches between short and long cos/sin caches by sequence length",
    "su": "it is LongRoPE (switches cos/sin caches by sequence length)",
    "mrope": "multimodal RoPE rotates by several position sections",
}


class ShiftUnsupported(ValueError):
    """This RoPE variant cannot be shifted; the caller recomputes the tokens instead."""

    def __init__(self, variant: str, reason: str) -> None:
        super().__init__(f"RoPE variant {variant!r} cannot be shifted ({reason}): falls back to recompute")
        self.variant = variant


@dataclass(frozen=True)
class RopeShift:
    """What a shift needs to know about one model's RoPE.

    Attributes:
        rotary_dim: rotated elements per head (even); SGLang's ``rotary_dim``.
        rotary_offset: first rotated column of a key row: 0 for MHA/GQA (rotary dims first),
            ``kv_lora_rank`` for an MLA latent row.
        is_neox_style: pairing: neox pairs dim ``i`` with ``i + rotary_dim/2``; otherwise GPT-J
            pairs ``2i`` with ``2i + 1``.
        inv_freq: ``rotary_dim/2`` angular frequencies, radians per position, scaling folded in.
        variant: the scaling's name, for messages.
    """

    rotary_dim: int
    rotary_offset: int
    is_neox_style: bool
    inv_freq: tuple[float, ...]
    variant: str = "default"

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and > 0, got {self.rotary_dim}")
        if self.rotary_offset < 0:
            raise ValueError(f"rotary_offset must be >= 0, got {self.rotary_offset}")
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(f"inv_freq has {len(self.inv_freq)} entries, rotary_dim/2 = {self.rotary_dim // 2}")


@functools.lru_cache(maxsize=256)
def _cos_sin(inv_freq: tuple[float, ...], delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * inv_freq`` as float32 ``(rotary_dim/2,)`` CPU tensors.

    The angle is formed and reduced mod 2*pi in float64 (Python floats), so a large ``|delta|``
    loses no accuracy before the cast.
    """
    angles = [math.fmod(delta * omega, TWO_PI) for omega in inv_freq]
    cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float32)
    sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float32)
    return cos, sin


def shift_keys(k: torch.Tensor, delta: int, spec: RopeShift) -> torch.Tensor:
    """Keys rotated as if RoPE had placed them ``delta`` positions later (earlier if < 0).

    Args:
        k: post-RoPE keys, shape ``(num_tokens, num_heads, head_dim)``, any floating dtype.
        delta: position change in tokens (negative after dropping the oldest tokens).
        spec: the model's :class:`RopeShift`.

    Returns:
        A new tensor of ``k``'s shape, dtype and device. Columns
        ``[rotary_offset, rotary_offset + rotary_dim)`` are rotated by ``delta * inv_freq``
        (cos/sin from float64 angles, the rotation in float32, rounded once to ``k.dtype``);
        every other element is bitwise equal to ``k``.

    Raises:
        TypeError: ``k`` is not floating point (e.g. SGLang's uint8 view of an fp8 pool).
        ValueError: ``k`` is not 3-D or its rows are too short for the rotary columns.
    """
    if not k.is_floating_point():
        raise TypeError(f"shift_keys needs floating-point keys, got {k.dtype}")
    lo, hi = spec.rotary_offset, spec.rotary_offset + spec.rotary_dim
    if k.dim() != 3 or k.shape[-1] < hi:
        raise ValueError(f"k must be (num_tokens, num_heads, head_dim >= {hi}), got {tuple(k.shape)}")
    out = k.clone()
    if delta == 0 or k.numel() == 0:
        return out
    cos, sin = (t.to(k.device) for t in _cos_sin(spec.inv_freq, int(delta)))
    rot = k[..., lo:hi].float()
    half = spec.rotary_dim // 2
    if spec.is_neox_style:
        x1, x2 = rot[..., :half], rot[..., half:]
        out[..., lo : lo + half] = x1 * cos - x2 * sin
        out[..., lo + half : hi] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out[..., lo:hi:2] = x1 * cos - x2 * sin
        out[..., lo + 1 : hi : 2] = x2 * cos + x1 * sin
    return out


def shift_slots(buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, delta: int, spec: RopeShift) -> None:
    """Write the keys of slots ``src``, shifted by ``delta`` positions, into slots ``dst``.

    This runs on the device after a page is loaded (on the buffer's device and current
    stream), so lower-tier copies (DRAM, NVMe, cluster store) stay as written, at their
    original positions; only the device copy moves.

    Args:
        buffer: one layer's key buffer, modified in place: SGLang's ``k_buffer[l]``
            ``(pool_slots, num_heads, head_dim)``, or for MLA ``kv_buffer[l]``
            ``(pool_slots, 1, kv_lora_rank + qk_rope_head_dim)`` (spec.rotary_offset =
            ``kv_lora_rank``). V buffers are never passed: V does not depend on position.
        src: int64 slot ids to read, shape ``(n,)``, on ``buffer``'s device.
        dst: int64 slot ids to write, shape ``(n,)``; disjoint from ``src`` and without
            repeats (not checked: checking would synchronise the device). All of ``src`` is read
            before any of ``dst`` is written.
        delta: position change in tokens.
        spec: the model's :class:`RopeShift`.

    Raises:
        ValueError: ``src``/``dst`` are not 1-D int64 of equal length, or ``buffer`` is not 3-D.
        TypeError: ``buffer`` is not floating point.
    """
    if buffer.dim() != 3:
        raise ValueError(f"buffer must be (pool_slots, num_heads, head_dim), got {tuple(buffer.shape)}")
    for name, ids in (("src", src), ("dst", dst)):
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"{name} must be 1-D int64 slot ids, got {ids.dtype} {tuple(ids.shape)}")
    if src.shape != dst.shape:
        raise ValueError(f"src and dst differ in length: {src.shape[0]} vs {dst.shape[0]}")
    if src.numel() == 0:
        return
    buffer.index_copy_(0, dst, shift_keys(buffer.index_select(0, src), delta, spec))


# ----------------------------------------------------------------------------- from config.json


def _base_inv_freq(theta: float, rotary_dim: int) -> list[float]:
    """theta ** (-2i / rotary_dim) for i < rotary_dim/2, float64 (``base.py::_compute_inv_freq``)."""
    return [theta ** (-(2.0 * i) / rotary_dim) for i in range(rotary_dim // 2)]


def _llama3_inv_freq(theta: float, rotary_dim: int, rs: dict[str, Any], max_position: int) -> list[float]:
    """Llama 3.1 scaling (``rope_variant.py::Llama3RotaryEmbedding``): long waves / factor,
    short waves kept, a linear blend in wavelength between."""
    factor = float(rs.get("factor", 1.0))
    low_ff, high_ff = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    orig = float(rs.get("original_max_position_embeddings", max_position))
    out = []
    for omega in _base_inv_freq(theta, rotary_dim):
        wavelen = TWO_PI / omega
        if wavelen < orig / high_ff:
            out.append(omega)
        elif wavelen > orig / low_ff:
            out.append(omega / factor)
        else:
            blend = (orig / wavelen - low_ff) / (high_ff - low_ff) if low_ff != high_ff else 0.0
            out.append((1.0 - blend) * omega / factor + blend * omega)
    return out


def _yarn_inv_freq(theta: float, rotary_dim: int, rs: dict[str, Any], max_position: int, truncate: bool) -> list[float]:
    """YaRN frequencies (``yarn.py``, ``rope_variant.py::DeepseekScalingRotaryEmbedding``):
    per pair, a ramp between the interpolated (omega / factor) and the original omega,
    over the pairs whose wavelength falls between ``beta_fast`` and ``beta_slow`` rotations of the
    original context. The magnitude factor (mscale) is not a rotation and is left out."""
    factor = float(rs.get("factor", 1.0))
    orig = float(rs.get("original_max_position_embeddings", max_position))
    extrapolation = float(rs.get("extrapolation_factor", 1.0))

    def pair_index(num_rotations: float) -> float:
        return rotary_dim * math.log(orig / (num_rotations * TWO_PI)) / (2.0 * math.log(theta))

    low, high = pair_index(float(rs.get("beta_fast", 32))), pair_index(float(rs.get("beta_slow", 1)))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, omega in enumerate(_base_inv_freq(theta, rotary_dim)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = (1.0 - ramp) * extrapolation  # share of the original (extrapolated) frequency
        out.append(omega / factor * (1.0 - keep) + omega * keep)
    return out


def _scaled_inv_freq(kind: str, theta: float, rotary_dim: int, rs: dict[str, Any], max_position: int) -> list[float]:
    """Frequencies of one rope_scaling ``kind``; raises ShiftUnsupported for the others."""
    if kind in _REFUSED_TYPES:
        raise ShiftUnsupported(kind, _REFUSED_TYPES[kind])
    factor = float(rs.get("factor", 1.0))
    exponent = rotary_dim / (rotary_dim - 2) if rotary_dim > 2 else 1.0
    builders: dict[str, Callable[[], list[float]]] = {
        "default": lambda: _base_inv_freq(theta, rotary_dim),
        "linear": lambda: [w / factor for w in _base_inv_freq(theta, rotary_dim)],
        # SGLang fixes one NTK base at init (max_len = max_position * factor), so it shifts.
        "dynamic": lambda: _base_inv_freq(
            theta * (float(rs["alpha"]) ** exponent if "alpha" in rs else (factor * factor - factor + 1.0) ** exponent),
            rotary_dim,
        ),
        "llama3": lambda: _llama3_inv_freq(theta, rotary_dim, rs, max_position),
        "yarn": lambda: _yarn_inv_freq(theta, rotary_dim, rs, max_position, bool(rs.get("truncate", True))),
        "deepseek_yarn": lambda: _yarn_inv_freq(theta, rotary_dim, rs, max_position, True),
    }
    if kind not in builders:
        raise ShiftUnsupported(kind, f"unknown rope scaling; shiftable: {sorted(builders)}")
    return builders[kind]()


def _rope_params(config: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) as SGLang's models read them (``rope_parameters`` first)."""
    params = config.get("rope_parameters")
    if params:
        return float(params.get("rope_theta", config.get("rope_theta", 10000))), dict(params)
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000)), (dict(scaling) if scaling else None)


def rope_shift_from_config(config: dict[str, Any]) -> RopeShift:
    """The :class:`RopeShift` of a Hugging Face ``config.json`` dict, as SGLang 0.5.23 builds RoPE.

    MHA/GQA (Llama/Qwen2 style): ``head_dim`` (else ``hidden_size // num_attention_heads``),
    ``partial_rotary_factor``, ``rope_is_neox_style`` (default True), ``rope_theta``,
    ``rope_scaling`` / ``rope_parameters`` with ``rope_type`` or ``type`` in default, linear,
    dynamic, llama3, yarn, deepseek_yarn. MLA (DeepSeek V2/V3: ``kv_lora_rank`` set): the rotary
    part is ``qk_rope_head_dim`` columns after ``kv_lora_rank``; any rope_scaling is
    ``deepseek_yarn`` and the pairing is GPT-J unless ``rope_interleave`` is false
    (``models/deepseek_v2.py``).

    Raises:
        ShiftUnsupported: LongRoPE, multimodal RoPE (``mrope_section``, ``video_rope``), Fourier
            RoPE, dual-chunk attention, or an unknown scaling type.
    """
    theta, scaling = _rope_params(config)
    max_position = int(config.get("max_position_embeddings", 8192))
    if config.get("original_max_position_embeddings") and scaling is not None:
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    if config.get("kv_lora_rank"):
        rotary_dim, offset = int(config["qk_rope_head_dim"]), int(config["kv_lora_rank"])
        is_neox = not config.get("rope_interleave", True)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        kind = "deepseek_yarn" if scaling else "default"
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rotary_dim, offset = int(float(config.get("partial_rotary_factor", 1.0)) * head_dim), 0
        is_neox = bool(config.get("rope_is_neox_style", True))
        if config.get("dual_chunk_attention_config"):
            raise ShiftUnsupported("dual_chunk", "dual-chunk attention rotates by chunk-relative positions")
        kind = "default" if scaling is None else str(scaling.get("rope_type", scaling.get("type", "default")))
        if scaling is not None and ("mrope_section" in scaling or scaling.get("video_rope")):
            raise ShiftUnsupported("mrope", _REFUSED_TYPES["mrope"])
        if scaling is not None and scaling.get("use_fope"):
            raise ShiftUnsupported("fope", "Fourier RoPE mixes frequencies per head")
    inv_freq = _scaled_inv_freq(kind, theta, rotary_dim, scaling or {}, max_position)
    return RopeShift(rotary_dim, offset, is_neox, tuple(inv_freq), kind)
