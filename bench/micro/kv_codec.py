"""Measure the KV page codec (hiradix/dataplane/kv_codec.py) on real KV pages (issue 21 item 2).

KV source: the forward of ``models/trained`` (falls back to ``models/tiny``), run here in plain
torch from its safetensors weights (``scripts/train_small_llama.SmallLlama``, the model that
trained them) over ShareGPT chats (``bench.common.conversations``; ChatML, the local tokenizer),
``--num-tokens`` tokens per chat. Per layer, hooks on ``k_proj``/``v_proj`` take K (then rotated
with the model's RoPE tables: post-RoPE, as the KV pool holds it) and V; the tokens are cut
into pages of ``--page-size`` in the pool's page-major order. The trained weights give
realistic KV statistics (outlier key channels); random weights would not.

Per source dtype (float32, the model's dtype; bfloat16, SGLang's usual KV dtype) and format:

- ratio = page_bytes / encoded_bytes;
- encode and decode throughput in MB/s of source (page) bytes, median (and best) of ``--repeats`` over
  all pages at once (``encode_pages``/``decode_pages``), with 1 torch thread and with ``nproc``;
- relative RMSE ``||x - x'|| / ||x||`` over K elements and V elements.

Lossless candidates (per page, so each page decodes alone; sizes vary per page): byte-plane
split (each element's bytes regrouped into ``itemsize`` planes, high bytes together), then
zstd (levels 1, 3) or lz4 (default, hc level 9); plain zstd-1 without the split as the
baseline. Same ratio/MB/s columns (split and merge included); "all threads" runs pages in a
thread pool of ``nproc`` (zstd and lz4 release the GIL). Reproduce (< 3 minutes on 2 cores)::

    flock -x /tmp/hiradix-machine.lock .venv/bin/python bench/micro/kv_codec.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lz4.frame
import numpy as np
import torch
import zstandard
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hiradix.dataplane.kv_codec import FORMATS, PageCodec, format_bytes_per_token
from hiradix.dataplane.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
from train_small_llama import SmallLlama, apply_rope, record_to_messages, render_chatml  # noqa: E402

SIZE_SHAPES = {  # (num_layers, num_kv_heads, head_dim, rope_dim) of the local models (make_model presets)
    "tiny": (2, 2, 64, 0),
    "trained": (4, 2, 64, 0),
    "small": (8, 4, 64, 0),
    "tiny-deepseek-v2 (MLA 64+16)": (2, 1, 80, 16),
    "DeepSeek-V3 shape (MLA 512+64, 61 layers)": (61, 1, 576, 64),
}


def load_model(model_dir: Path) -> SmallLlama:
    """The model's weights in :class:`SmallLlama` (float32, eval)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    shape = argparse.Namespace(
        num_hidden_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], rope_theta=cfg.get("rope_theta", 10000.0))
    model = SmallLlama(shape, cfg["vocab_size"], max_positions=4096, eps=cfg.get("rms_norm_eps", 1e-5))
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    return model.eval()


def chat_token_ids(model_dir: Path, num_chats: int, num_tokens: int) -> list[list[int]]:
    """The first ``num_tokens`` token ids of the first ``num_chats`` ShareGPT chats that are that long."""
    from bench.common.conversations import iter_sharegpt_records

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = []
    for record in iter_sharegpt_records():
        messages = record_to_messages(record)
        if messages is None:
            continue
        ids = tokenizer.encode(render_chatml(messages), add_special_tokens=False).ids
        if len(ids) >= num_tokens:
            out.append(ids[:num_tokens])
        if len(out) == num_chats:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT chats of >= {num_tokens} tokens")


def real_kv(model: SmallLlama, token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE K and V of every layer: float32 ``[L, B, T, H, D]`` each."""
    keys, values = [], []
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        hooks.append(attn.k_proj.register_forward_hook(lambda m, i, o: keys.append(o)))
        hooks.append(attn.v_proj.register_forward_hook(lambda m, i, o: values.append(o)))
    ids = torch.tensor(token_ids)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    attn = model.model.layers[0].self_attn
    b, t = ids.shape
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    k = torch.stack([apply_rope(x.view(b, t, attn.num_kv_heads, -1).transpose(1, 2), cos, sin).transpose(1, 2)
                     for x in keys])
    v = torch.stack([x.view(b, t, attn.num_kv_heads, -1) for x in values])
    return k, v


def to_pages(k: torch.Tensor, v: torch.Tensor, page_size: int, dtype: torch.dtype) -> tuple[KVLayout, torch.Tensor]:
    """Cut ``[L, B, T, H, D]`` K/V into page-major pages: uint8 ``[n, page_bytes]`` of ``[L, 2, ps, H, D]``."""
    num_layers, b, t, h, d = k.shape
    kv = torch.stack([k, v], dim=1)  # [L, 2, B, T, H, D]
    kv = kv.view(num_layers, 2, b, t // page_size, page_size, h, d)
    pages = kv.permute(2, 3, 0, 1, 4, 5, 6).reshape(b * (t // page_size), -1).to(dtype).contiguous()
    return KVLayout(num_layers, page_size, h, d, dtype), pages.view(torch.uint8)


def times_s(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, minimum) wall time of ``fn`` in seconds over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def mb_per_s(num_bytes: int, fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) throughput in MB/s of ``num_bytes`` per call."""
    median, best = times_s(fn, repeats)
    return num_bytes / 1e6 / median, num_bytes / 1e6 / best


def rel_rmse(layout: KVLayout, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Relative RMSE of K and of V between pages ``x`` and ``y`` (uint8 ``[n, page_bytes]``)."""
    shape = (x.shape[0], layout.num_layers, 2, -1)
    a, b = x.view(layout.dtype).float().view(shape), y.view(layout.dtype).float().view(shape)
    return tuple(((a[:, :, i] - b[:, :, i]).norm() / a[:, :, i].norm()).item() for i in (0, 1))


def bench_codec(layout: KVLayout, pages: torch.Tensor, fmt: str, repeats: int, threads: list[int]) -> dict:
    codec = PageCodec(layout, fmt)
    encoded = codec.encode_pages(pages)
    out = torch.empty_like(pages)
    codec.decode_pages(encoded, out)
    row = {"format": fmt, "ratio": layout.page_bytes / codec.encoded_bytes, "rmse": rel_rmse(layout, pages, out)}
    for n in threads:
        torch.set_num_threads(n)
        row[f"enc{n}"] = mb_per_s(pages.numel(), lambda: codec.encode_pages(pages), repeats)
        row[f"dec{n}"] = mb_per_s(pages.numel(), lambda: codec.decode_pages(encoded, out), repeats)
    return row


def split_planes(page: torch.Tensor, itemsize: int) -> np.ndarray:
    """Byte-plane split of one page: ``[E, itemsize]`` bytes -> ``[itemsize, E]`` (most significant plane last)."""
    return np.ascontiguousarray(page.numpy().reshape(-1, itemsize).T)


def merge_planes(data: bytes, out: torch.Tensor, itemsize: int) -> None:
    """Inverse of :func:`split_planes` into ``out`` (uint8 ``[page_bytes]``)."""
    np.copyto(out.numpy().reshape(-1, itemsize), np.frombuffer(data, np.uint8).reshape(itemsize, -1).T)


def lossless_codecs(itemsize: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (compress(page) -> bytes, decompress(bytes, out)) per page."""
    local = threading.local()  # zstd contexts are not thread-safe: one per thread

    def zc(level: int) -> zstandard.ZstdCompressor:
        if not hasattr(local, "zc"):
            local.zc = {lvl: zstandard.ZstdCompressor(level=lvl) for lvl in (1, 3)}
        return local.zc[level]

    def zd() -> zstandard.ZstdDecompressor:
        if not hasattr(local, "zd"):
            local.zd = zstandard.ZstdDecompressor()
        return local.zd

    return {
        "zstd-1 (no split)": (lambda p: zc(1).compress(p.numpy()),
                              lambda d, o: np.copyto(o.numpy(), np.frombuffer(zd().decompress(d), np.uint8))),
        "split+zstd-1": (lambda p: zc(1).compress(split_planes(p, itemsize)),
                         lambda d, o: merge_planes(zd().decompress(d), o, itemsize)),
        "split+zstd-3": (lambda p: zc(3).compress(split_planes(p, itemsize)),
                         lambda d, o: merge_planes(zd().decompress(d), o, itemsize)),
        "split+lz4": (lambda p: lz4.frame.compress(split_planes(p, itemsize)),
                      lambda d, o: merge_planes(lz4.frame.decompress(d), o, itemsize)),
        "split+lz4hc-9": (lambda p: lz4.frame.compress(split_planes(p, itemsize), compression_level=9),
                          lambda d, o: merge_planes(lz4.frame.decompress(d), o, itemsize)),
    }


def bench_lossless(pages: torch.Tensor, itemsize: int, repeats: int, threads: list[int]) -> list[dict]:
    rows = []
    for name, (compress, decompress) in lossless_codecs(itemsize).items():
        blobs = [compress(p) for p in pages]
        out = torch.empty_like(pages)
        for i, blob in enumerate(blobs):
            decompress(blob, out[i])
        assert torch.equal(out, pages), name
        row = {"format": name, "ratio": pages.numel() / sum(len(b) for b in blobs), "rmse": (0.0, 0.0)}
        torch.set_num_threads(1)
        for n in threads:
            with ThreadPoolExecutor(n) as pool:
                row[f"enc{n}"] = mb_per_s(pages.numel(), lambda: list(pool.map(compress, pages)), repeats)
                row[f"dec{n}"] = mb_per_s(pages.numel(), lambda: list(pool.map(decompress, blobs, out)), repeats)
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict], threads: list[int]) -> None:
    print(f"\n{title}")
    cols = "".join(f" | enc MB/s {n}t | dec MB/s {n}t" for n in threads)
    print(f"| format | ratio{cols} | rel RMSE K | rel RMSE V |")
    print("|---" * (4 + 2 * len(threads)) + "|")
    for r in rows:
        speeds = "".join(f" | {r[key][0]:,.0f} ({r[key][1]:,.0f})" for n in threads for key in (f"enc{n}", f"dec{n}"))
        print(f"| {r['format']} | {r['ratio']:.2f}{speeds} | {r['rmse'][0]:.4f} | {r['rmse'][1]:.4f} |")


def print_sizes(page_size: int) -> None:
    print(f"\nEncoded page sizes, page_size {page_size}, bytes per page (bytes per token):")
    for label, (num_layers, heads, dim, rope) in SIZE_SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            layout = KVLayout(num_layers, page_size, heads, dim, dtype, rope_dim=rope)
            cells = ", ".join(f"{fmt} {PageCodec(layout, fmt).encoded_bytes:,} "
                              f"({format_bytes_per_token(layout, fmt):,.0f})" for fmt in FORMATS)
            print(f"  {label} {str(dtype).removeprefix('torch.')}: page {layout.page_bytes:,}; {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default models/trained, else models/tiny)")
    parser.add_argument("--num-chats", type=int, default=4)
    parser.add_argument("--num-tokens", type=int, default=512, help="tokens per chat (a multiple of page size)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else REPO / "models" / "trained"
    if not (model_dir / "config.json").exists():
        model_dir = REPO / "models" / "tiny"
    nproc = os.cpu_count() or 1
    threads = [1] if nproc == 1 else [1, nproc]
    started = time.perf_counter()
    print(f"nproc {nproc}, load average {os.getloadavg()}, torch {torch.__version__}")
    torch.set_num_threads(nproc)
    k, v = real_kv(load_model(model_dir), chat_token_ids(model_dir, args.num_chats, args.num_tokens))
    print(f"KV of {model_dir.name}: {args.num_chats} ShareGPT chats x {args.num_tokens} tokens, "
          f"K {tuple(k.shape)} (post-RoPE), |K| max {k.abs().max():.2f}, |V| max {v.abs().max():.2f}")
    for dtype in (torch.bfloat16, torch.float32):
        layout, pages = to_pages(k, v, args.page_size, dtype)
        rows = [bench_codec(layout, pages, fmt, args.repeats, threads) for fmt in FORMATS]
        rows += bench_lossless(pages, dtype.itemsize, args.repeats, threads)
        print_table(f"{dtype}: {pages.shape[0]} pages of {layout.page_bytes:,} B "
                    f"({pages.numel() / 1e6:.1f} MB); MB/s of source bytes: median (best) of {args.repeats}",
                    rows, threads)
    print_sizes(args.page_size)
    print(f"\nload average at the end {os.getloadavg()}; took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
