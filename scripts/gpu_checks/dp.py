"""Check 5 of ``scripts/gpu_check``: stock SGLang's DP attention (``--tp-size 2 --attn-dp-size 2``).

hiradix refuses ``--attn-dp-size``; this check asks whether *stock* SGLang serves DP attention on
the GPU machine, the precondition of ever building per-DP-rank trees. On this project's CPU path
stock SGLang 0.5.23 does not (docs/compatibility.md, DP attention).

What it does, on a machine with >= 2 NVIDIA GPUs and SGLang importable:

1. builds the tiny DeepSeek-V2 model (``scripts/make_model.py --preset tiny-deepseek-v2``, a few
   seconds) into a temporary directory. Not the dense ``tiny`` (Llama) model: SGLang 0.5.23's
   ``LlamaAttention`` shards heads by the full TP size and ``LlamaModel.embed_tokens`` reduces over
   the full TP group (``models/llama.py``), so Llama is not DP-attention aware on any device; DeepSeek
   V2 is (``get_embedding_tp_kwargs``, attention-TP head split);
2. starts stock ``--tp-size 2`` (GPUs 0 and 1), sends ``PROMPTS`` one at a time (greedy,
   ``MAX_NEW_TOKENS`` each), stops it;
3. starts stock ``--tp-size 2 --attn-dp-size 2`` on the same GPUs, sends the same prompts, then
   the same prompts all at once (both DP ranks busy), stops it;
4. records per server: start time, whether it became healthy, per-request latency, the outputs,
   the log tail on failure; and ``outputs_match`` (DP outputs == TP 2 outputs, prompt by prompt).

Skipped, with the reason, when fewer than 2 GPUs are visible (``needs 2 GPUs (TP 2 x DP 2)``; the
lent GPU machine has one, and the CPU dry run has none), when SGLang is not importable, or when
too little time is left for two server starts. On a 2-GPU machine run it alone for the full
budget: ``scripts/gpu_check --checks dp --out "$OUT"``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpu_checks.common import REPO_ROOT, Ctx

NEEDS_GPUS_REASON = "needs 2 GPUs (TP 2 x DP 2)"
PRESET = "tiny-deepseek-v2"
PROMPTS = ["The capital of France is", "Once upon a time there was a little", "1 2 3 4 5 6 7 8 9",
           "hello world " * 7, "A quick brown fox", "def main():"]
MAX_NEW_TOKENS = 16
LEAST_FOR_SERVERS_S = 100.0  # two server starts (~30-40 s each on a GPU machine) and the requests
COMMON_FLAGS = ["--max-total-tokens", "4096", "--disable-cuda-graph", "--attention-backend", "triton",
                "--mem-fraction-static", "0.5", "--dtype", "bfloat16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_sglang(env: dict[str, str]) -> dict[str, Any]:
    """SGLang's version in a child (importing it here would initialise CUDA in the check process)."""
    code = "import importlib.metadata as m, sglang; print(m.version('sglang'))"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "import sglang timed out (60 s)"}
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"ok": True, "version": p.stdout.strip().splitlines()[-1]}


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _generate(base: str, prompt: str, timeout: float) -> dict[str, Any]:
    body = json.dumps({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}})
    req = urllib.request.Request(base + "/generate", body.encode(), {"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.load(r)
    return {"text": out["text"], "latency_s": round(time.time() - t, 3),
            "dp_rank": out.get("meta_info", {}).get("dp_rank")}


def _serve(ctx: Ctx, name: str, model: Path, extra: list[str], env: dict[str, str], work: Path,
           parallel_too: bool) -> dict[str, Any]:
    """Start one stock server, send PROMPTS, stop it (its whole process group, also on failure)."""
    port = _free_port()
    log = work / f"{name}.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--nccl-port", str(_free_port()), *COMMON_FLAGS, *extra]
    res: dict[str, Any] = {"cmd": " ".join(cmd[1:])}
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=str(REPO_ROOT))
    try:
        # leave time for the other server and the requests
        ready_by = t0 + max(20.0, min(150.0, ctx.left() - (60.0 if name == "tp2" else 20.0)))
        while time.time() < ready_by and proc.poll() is None:
            if _get(base + "/health", 5.0) == 200:
                break
            time.sleep(1.0)
        res["start_s"] = round(time.time() - t0, 1)
        if _get(base + "/health", 5.0) != 200:
            res.update(status="failed", reason=f"not healthy after {res['start_s']} s (exit code {proc.poll()})")
            return res
        timeout = max(10.0, min(60.0, ctx.left() - 10.0))
        res["sequential"] = [_generate(base, p, timeout) for p in PROMPTS]
        if parallel_too:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                res["parallel"] = list(ex.map(lambda p: _generate(base, p, timeout), PROMPTS))
        res["status"] = "ok"
    except Exception as exc:
        res.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        res["wall_s"] = round(time.time() - t0, 1)
        if res.get("status") != "ok":
            try:
                res["log_tail"] = log.read_text(errors="replace")[-3000:]
            except OSError:
                pass
    return res


def check_dp(ctx: Ctx) -> None:
    gpus = _gpu_count()
    ctx.result.update(gpus=gpus, needs_gpus=2, tp_size=2, attn_dp_size=2, model_preset=PRESET)
    if gpus < 2:
        ctx.result.update(status="skipped", reason=f"{NEEDS_GPUS_REASON}; {gpus} visible")
        ctx.log(f"skipped: {ctx.result['reason']}")
        return
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES") or "0,1"
    sg = _probe_sglang(env)
    ctx.result["sglang"] = sg
    if not sg["ok"]:
        ctx.result.update(status="skipped", reason=f"SGLang is not importable on this machine: {sg['error']}")
        ctx.log(f"skipped: {ctx.result['reason']}")
        return
    work = Path(tempfile.mkdtemp(prefix="gpu_check_dp_"))
    model = work / PRESET
    t = time.time()
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_model.py"), "--preset", PRESET,
                        "--out", str(model)], capture_output=True, text=True, timeout=max(10.0, min(90.0, ctx.left())),
                       env=env)
    ctx.result["model_build_s"] = round(time.time() - t, 1)
    if p.returncode != 0:
        ctx.result.update(status="failed", reason="scripts/make_model.py failed: " + (p.stdout + p.stderr)[-600:])
        return
    if ctx.left() < LEAST_FOR_SERVERS_S:
        ctx.result.update(status="skipped", reason=f"time budget: {ctx.left():.0f}s left for two server starts, "
                          f"needs >= {LEAST_FOR_SERVERS_S:.0f}s (run `scripts/gpu_check --checks dp` alone)")
        return
    servers: dict[str, Any] = {}
    ctx.result["servers"] = servers
    servers["tp2"] = _serve(ctx, "tp2", model, ["--tp-size", "2"], env, work, parallel_too=False)
    ctx.log(f"tp2: {servers['tp2'].get('status')} {servers['tp2'].get('reason', '')}")
    ctx.save()
    servers["tp2_dp2"] = _serve(ctx, "tp2_dp2", model, ["--tp-size", "2", "--attn-dp-size", "2"], env, work,
                                parallel_too=True)
    dp = servers["tp2_dp2"]
    ctx.log(f"tp2_dp2: {dp.get('status')} {dp.get('reason', '')}")
    if dp.get("status") != "ok":
        ctx.result.update(status="failed", reason=f"stock DP attention: {dp.get('reason')}")
        return
    if servers["tp2"].get("status") != "ok":
        ctx.result.update(status="failed", reason=f"stock TP 2 reference: {servers['tp2'].get('reason')}")
        return
    ref = [r["text"] for r in servers["tp2"]["sequential"]]
    got = [r["text"] for r in dp["sequential"]]
    par = [r["text"] for r in dp.get("parallel", [])]
    ctx.result["matching_sequential"] = sum(a == b for a, b in zip(got, ref))
    ctx.result["matching_parallel"] = sum(a == b for a, b in zip(par, ref))
    ctx.result["requests"] = len(PROMPTS)
    ctx.result["dp_ranks_used"] = sorted({r["dp_rank"] for r in dp["sequential"] + dp.get("parallel", [])
                                          if r["dp_rank"] is not None})
    ctx.result["outputs_match"] = got == ref and par == ref
    ctx.log(f"outputs: sequential {ctx.result['matching_sequential']}/{len(PROMPTS)}, parallel "
            f"{ctx.result['matching_parallel']}/{len(PROMPTS)} equal to TP 2; DP ranks used {ctx.result['dp_ranks_used']}")
    ctx.result["status"] = "ok"
