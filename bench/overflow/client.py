"""One `/generate` call of the context-overflow benchmarks, and what its answer says.

SGLang 0.5.23's native endpoint with ``input_ids`` (no tokenizer round trip) and greedy sampling.
``meta_info.prompt_tokens`` is the prompt the server ran (the cut length L when it cut);
``meta_info.cached_tokens_details`` (with ``--enable-cache-report``) carries hiradix's ``context_truncated_tokens`` and
``context_shifted_tokens`` (``hiradix.sglang_plugin.overflow.details_of``).

With ``logprob_start_len = s`` SGLang 0.5.23 returns ``input_token_logprobs`` for the run
prompt's positions ``s .. L-1`` as ``[logprob, token_id, text]`` (the log-probability of that
token given everything before it) and ``input_top_logprobs`` as the top predictions there; the
entry of position ``s`` itself is always None (``logprob_result_processor.py``:
``[None] + input_token_logprobs[:-1]``), so the log-probabilities of the last ``n`` tokens need
``s = L - n - 1``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class Answer:
    """What one request returned (``elapsed_s`` from send to the full response)."""

    prompt_tokens: int
    cached_tokens: int
    truncated_tokens: int
    shifted_tokens: int
    elapsed_s: float
    token_logprobs: list = field(default_factory=list)  # [(logprob, token_id)] per returned input position
    top1: list = field(default_factory=list)  # (logprob, token_id) of the top-1 prediction per position
    cached_details: dict = field(default_factory=dict)  # meta_info.cached_tokens_details (device/host/storage tokens)


def generate(base_url: str, input_ids: Sequence[int], logprob_start_len: Optional[int] = None,
             timeout_s: float = 600.0) -> Answer:
    """One greedy 1-token ``/generate``; with ``logprob_start_len``, the input's log-probabilities
    from there on and the top-1 prediction at each position.

    Raises:
        urllib.error.URLError / HTTPError: the server failed or refused the request.
        KeyError: the answer lacks ``meta_info``.
    """
    body: dict = {"input_ids": list(input_ids), "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    if logprob_start_len is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_start_len, top_logprobs_num=1)
    request = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        out = json.loads(resp.read())
    elapsed = time.perf_counter() - start
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    answer = Answer(meta["prompt_tokens"], meta.get("cached_tokens", 0), details.get("context_truncated_tokens", 0),
                    details.get("context_shifted_tokens", 0), elapsed, cached_details=dict(details))
    if logprob_start_len is not None:
        answer.token_logprobs = [(e[0], e[1]) for e in meta.get("input_token_logprobs") or []]
        answer.top1 = [((e[0][0], e[0][1]) if e else None) for e in meta.get("input_top_logprobs") or []]
    return answer
