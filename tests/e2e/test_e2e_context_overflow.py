"""Context overflow with shifted KV reuse, end to end (``--hiradix-context-overflow shift``; issue 20).

Real servers with ``--context-length 320`` (page 16). A conversation's second turn overflows the
context; the server cuts it (keeps the 32-token system prompt that another conversation shares,
drops half the rest in whole pages) and reuses the kept tail's cached KV, re-rotated by minus the
dropped length. The reference is the same server recomputing the cut prompt under another cache
salt (no reuse possible): SGLang's own token truncation (the paper's TT).

| server   | model (from models/tiny)                | what it shows                                         |
|----------|-----------------------------------------|-------------------------------------------------------|
| neox     | 1 layer, neox pairing                   | shifted reuse == recompute: same tokens, logprobs 1e-5 |
| gptj     | 1 layer, gptj pairing (rope_is_neox_style false) | the same                                     |
| partial  | 1 layer, partial_rotary_factor 0.5      | the same                                              |
| deep     | 2 layers (the tiny model)               | the approximation is real: logprobs differ            |
| tp2      | 1 layer, neox, TP 2 (each rank shifts its heads) | the same as neox                             |
| dram     | 1 layer, neox, HBM pool 640 tokens      | a kept tail in DRAM is promoted, then shifted: the same |

In a 1-layer model a token's K/V depend only on the token and its position, so reuse after a
shift must equal recomputing the cut prompt (AttentionStore §3.4's exactness case).

Through the OpenAI endpoints (``openai`` client; issue 30): chats sharing a system prompt, whose
answers re-tokenize differently, keep exactly that prompt at every cut (neox), and every answer,
chat or completion, streamed or not, reports the cut in ``sglext.cached_tokens_details`` (gptj).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from hiradix.core.context_overflow import plan_truncation
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import generate_with_logprobs, metric

pytestmark = pytest.mark.e2e

CONTEXT, PAGE, NEW = 320, 16, 8
SYSTEM_TOKENS = 32
VARIANTS = {  # name: (layers, config.json changes, TP, HBM pool tokens)
    "neox": (1, {}, 1, 4096),
    "gptj": (1, {"rope_is_neox_style": False}, 1, 4096),
    "partial": (1, {"partial_rotary_factor": 0.5}, 1, 4096),
    "deep": (2, {}, 1, 4096),
    "tp2": (1, {}, 2, 4096),
    "dram": (1, {}, 1, 640),  # a small pool: the history leaves HBM for DRAM before the overflow
}


def variant_model(tiny: Path, root: Path, layers: int, changes: dict) -> Path:
    """models/tiny with fewer layers or another RoPE pairing (SGLang skips weights of absent layers)."""
    out = root / f"l{layers}-{'-'.join(f'{k}={v}' for k, v in changes.items()) or 'neox'}"
    if not out.exists():
        out.mkdir(parents=True)
        for f in tiny.iterdir():
            if f.is_file() and f.name != "config.json":
                (out / f.name).symlink_to(f)
        config = json.loads((tiny / "config.json").read_text())
        config.update(num_hidden_layers=layers, **changes)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("overflow")
    found: dict[str, ServerProcess] = {}
    for name, (layers, changes, tp, pool) in VARIANTS.items():
        model = variant_model(tiny_model, root / "models", layers, changes)
        flags = cpu_args(pool) + ["--context-length", str(CONTEXT), "--page-size", str(PAGE), "--enable-hiradix",
                                  "--hiradix-dram-gb", "0.01", "--hiradix-context-overflow", "shift"]
        if tp > 1:
            flags += ["--tp-size", str(tp)]
        found[name] = ServerProcess(model, extra_args=flags, env={**cpu_env(tp_size=tp), "HIRADIX_CHECK_INTEGRITY": "1"},
                                    log_path=root / f"{name}.log", startup_timeout_s=600)
    try:
        for server in found.values():
            server.start(wait=False)
        for server in found.values():
            server.wait_healthy()
        yield found
    finally:
        stop_all(found.values())


def generate(base_url: str, input_ids: list[int], salt: str | None = None) -> dict:
    return generate_with_logprobs(base_url, input_ids, NEW, salt)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def overflowing_turn(server: ServerProcess, seed: int, flood: int = 0) -> tuple[list[int], dict, dict]:
    """Two conversations sharing a system prompt; the second's next turn overflows the context.

    Args:
        flood: unrelated 250-token prompts sent before the overflowing turn (they push the
            history out of a small HBM pool into DRAM).

    Returns ``(uncut prompt, answer through the cut and reuse, answer recomputing the cut prompt)``.
    """
    rng = random.Random(seed)
    system = tokens(rng, SYSTEM_TOKENS)
    generate(server.base_url, system + tokens(rng, 40))  # another conversation: the system prompt is shared
    first = system + tokens(rng, 230)
    answer = generate(server.base_url, first)["ids"]
    for i in range(flood):
        generate(server.base_url, tokens(rng, 250))
    prompt = first + answer + tokens(rng, CONTEXT - len(first) - len(answer))  # exactly the context: overflows
    shifted = generate(server.base_url, prompt)
    cut = plan_truncation(len(prompt), NEW, CONTEXT - 1, SYSTEM_TOKENS, 0.5, PAGE)
    recomputed = generate(server.base_url, cut.apply(prompt), salt=f"reference-{seed}")
    return prompt, shifted, recomputed


@pytest.mark.parametrize("name", ["neox", "gptj", "partial", "tp2"])
def test_one_layer_shifted_reuse_equals_recomputing_the_cut_prompt(servers, name):
    server = servers[name]
    prompt, shifted, recomputed = overflowing_turn(server, seed=7)
    cut = plan_truncation(len(prompt), NEW, CONTEXT - 1, SYSTEM_TOKENS, 0.5, PAGE)
    assert shifted["details"].get("context_truncated_tokens") == cut.drop_tokens, shifted
    assert shifted["prompt_tokens"] == cut.kept_tokens == recomputed["prompt_tokens"]
    # the first turn's pages after the cut were reused shifted: its prompt and answer but the last
    # token (no KV yet), in whole pages
    reused = (SYSTEM_TOKENS + 230 + NEW - 1) // PAGE * PAGE - cut.tail_start
    assert shifted["details"].get("context_shifted_tokens") == reused > 0, shifted
    assert shifted["cached"] >= SYSTEM_TOKENS + reused, shifted
    assert recomputed["cached"] == 0 and "context_truncated_tokens" not in recomputed["details"]
    assert shifted["ids"] == recomputed["ids"]
    worst = max(abs(a - b) for a, b in zip(shifted["logprobs"], recomputed["logprobs"]))
    assert worst <= 1e-5, (shifted["logprobs"], recomputed["logprobs"])
    assert metric(server.base_url, "sglang:hiradix_shifted_tokens_total") >= reused
    assert "Traceback" not in server.log_text() and "IntegrityError" not in server.log_text()


def test_deeper_layers_make_the_reuse_an_approximation(servers):
    """In layer 2 the kept tokens' KV was computed while they attended to the dropped ones."""
    _, shifted, recomputed = overflowing_turn(servers["deep"], seed=7)
    assert shifted["details"].get("context_shifted_tokens", 0) > 0
    worst = max(abs(a - b) for a, b in zip(shifted["logprobs"], recomputed["logprobs"]))
    assert worst > 1e-4, (shifted["logprobs"], recomputed["logprobs"])


def test_the_next_turn_keeps_the_cut_and_hits_its_branch(servers):
    """The turn after an overflow still overflows uncut; the earlier cut fits it, so the server
    keeps it (one truncated history per conversation) and the branch with the last answer hits."""
    server = servers["neox"]
    prompt, shifted, _ = overflowing_turn(server, seed=11)
    cut = plan_truncation(len(prompt), NEW, CONTEXT - 1, SYSTEM_TOKENS, 0.5, PAGE)
    rng = random.Random(99)
    nxt = prompt + shifted["ids"] + tokens(rng, 20)
    again = generate(server.base_url, nxt)
    assert again["details"].get("context_truncated_tokens") == cut.drop_tokens, again
    assert again["details"].get("context_shifted_tokens", 0) == 0  # nothing to shift: the branch holds it
    kept = cut.kept_tokens + len(shifted["ids"])
    assert again["cached"] >= kept // PAGE * PAGE - PAGE, again
    reference = generate(server.base_url, cut.apply(prompt) + shifted["ids"] + nxt[len(prompt) + len(shifted["ids"]):],
                         salt="reference-next")
    assert again["ids"] == reference["ids"]


@pytest.mark.parametrize("name", ["neox", "gptj"])
def test_a_client_that_dropped_old_messages_reuses_the_rest_shifted(servers, name):
    """The client cut the history itself: it sends system ‖ m3 ‖ m4 ‖ new where the tree holds
    system ‖ m1 ‖ m2 ‖ m3 ‖ m4 (message lengths are not whole pages). m3 ‖ m4 are found by the
    content of their pages below the system prompt, verified, and reused shifted by -(|m1| + |m2|)."""
    server = servers[name]
    rng = random.Random(23)
    system = tokens(rng, SYSTEM_TOKENS)
    generate(server.base_url, system + tokens(rng, 40))  # another conversation shares the system prompt
    messages = [tokens(rng, n) for n in (37, 45, 61, 53)]
    history = system + [t for m in messages for t in m]
    generate(server.base_url, history)  # the tree holds the whole conversation
    prompt = system + messages[2] + messages[3] + tokens(rng, 21)
    moved = generate(server.base_url, prompt)
    reference = generate(server.base_url, prompt, salt="reference-moved")
    shifted = moved["details"].get("context_shifted_tokens", 0)
    # m3 ‖ m4 up to the last whole page (the page holding the end of system and the start of m3
    # is copied from the system prompt's path and counted as a hit, not as shifted)
    assert shifted >= (61 + 53) // PAGE * PAGE - PAGE, moved
    assert "context_truncated_tokens" not in moved["details"]
    assert moved["cached"] >= SYSTEM_TOKENS + shifted, moved
    assert reference["cached"] == 0 and not reference["details"].get("context_shifted_tokens")
    assert moved["ids"] == reference["ids"]
    worst = max(abs(a - b) for a, b in zip(moved["logprobs"], reference["logprobs"]))
    assert worst <= 1e-5, (moved["logprobs"], reference["logprobs"])
    other_salt = generate(server.base_url, prompt, salt="another-salt")  # salts never cross
    assert other_salt["cached"] == 0 and not other_salt["details"].get("context_shifted_tokens")


def test_a_kept_tail_in_dram_is_promoted_then_shifted(servers):
    """The history left HBM (a 640-token pool, two other prompts since): the kept tail's DRAM copy
    is loaded into HBM first (its DRAM pages stay as written), then shifted like an HBM one."""
    server = servers["dram"]
    promoted_before = metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind="PROMOTE")
    prompt, shifted, recomputed = overflowing_turn(server, seed=7, flood=2)
    cut = plan_truncation(len(prompt), NEW, CONTEXT - 1, SYSTEM_TOKENS, 0.5, PAGE)
    reused = (SYSTEM_TOKENS + 230 + NEW - 1) // PAGE * PAGE - cut.tail_start
    assert shifted["details"].get("context_shifted_tokens") == reused, shifted
    deadline = time.monotonic() + 15  # the scheduler publishes its counters at its next step
    promoted = metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind="PROMOTE") - promoted_before
    while promoted < reused and time.monotonic() < deadline:
        time.sleep(0.5)
        promoted = metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind="PROMOTE") - promoted_before
    assert promoted >= reused, promoted
    assert shifted["ids"] == recomputed["ids"]
    worst = max(abs(a - b) for a, b in zip(shifted["logprobs"], recomputed["logprobs"]))
    assert worst <= 1e-5, (shifted["logprobs"], recomputed["logprobs"])
    assert "IntegrityError" not in server.log_text()


def test_a_request_whose_new_tokens_leave_no_room_is_refused_not_shortened(servers):
    """max_tokens close to the context: no cut can make room, so it is refused (HTTP 400, as stock
    refuses it), not answered with fewer new tokens than asked (found by a fresh tester)."""
    import urllib.error

    body = {"input_ids": list(range(100, 178)), "sampling_params": {"temperature": 0, "max_new_tokens": 310}}  # 78 + 310 > 319 by 69 > the 64 a cut can drop
    req = urllib.request.Request(f"{servers['neox'].base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 400
    assert "cannot be cut to fit a context" in refused.value.read().decode()
    assert generate(servers["neox"].base_url, list(range(100, 178)))["ids"]  # the server goes on


# ------------------------------------------------------------ OpenAI clients (issue 30, item 6)
CHAT_NEW = 16  # max_tokens of a chat turn


def openai_client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def system_prompt(tokenizer) -> tuple[str, int]:
    """A system prompt whose rendered message (``<|im_start|>system\\n...<|im_end|>\\n``) is whole
    pages, at least 3 (not the first page a cut keeps when nothing is shared); its length in tokens."""
    words = ["You", "answer", "in", "short", "plain", "sentences", "about", "any", "topic", "asked"]
    text = "You are a terse assistant. Answer every question in two short sentences, plainly and politely."
    for i in range(4 * PAGE):
        n = len(tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True, return_dict=False))
        if n % PAGE == 0 and n >= 3 * PAGE:
            return text, n
        text = f"{text} {words[i % len(words)]}"
    raise AssertionError(f"no system prompt of whole pages up to {text!r}")


def streamed_chat(client, messages: list[dict], **extra) -> tuple[str, list]:
    """A streamed chat turn: its text and the chunks' ``sglext`` (those that carry one)."""
    text, sglext = "", []
    for chunk in client.chat.completions.create(model="default", messages=messages, max_tokens=CHAT_NEW,
                                                temperature=0, stream=True, **extra):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if getattr(chunk, "sglext", None):
            sglext.append(chunk.sglext)
    return text, sglext


def test_chats_sharing_a_system_prompt_keep_exactly_it_over_the_openai_endpoint(servers):
    """Three chats share one system prompt; their answers come back re-tokenized (the template
    trims them), so every chat forks its own path once per turn. Every cut keeps exactly the system
    prompt (the old default kept up to the chat's deepest own fork) and drops the oldest turns after
    it: the answer equals recomputing ``uncut[:system] + uncut[system + dropped:]`` (a 1-layer model:
    shifted reuse is exact). The clients do not ask for cache details; a cut is reported anyway."""
    from transformers import AutoTokenizer

    server = servers["neox"]
    client = openai_client(server)
    system, system_tokens = system_prompt(AutoTokenizer.from_pretrained(server.model_path))
    histories = [[{"role": "system", "content": system}] for _ in range(3)]
    checked, retokenized, streamed_cuts = 0, 0, 0
    previous_end, previous_ids = 0, []  # chat 0's last prompt length and answer token ids
    for turn in range(7):
        for c, topic in enumerate(["rivers", "compilers", "gardens"]):
            filler = " ".join(f"{topic}{(turn * 5 + i) % 17}" for i in range(8))
            question = f"{topic.capitalize()} turn {turn}: tell me more. {filler}"
            histories[c].append({"role": "user", "content": question})
            if c == 2:  # streamed: the cut is reported in an sglext chunk
                text, sglext = streamed_chat(client, histories[c])
                streamed_cuts += any("context_truncated_tokens" in s["cached_tokens_details"] for s in sglext)
                assert all(set(s) == {"cached_tokens_details"} for s in sglext), sglext
                histories[c].append({"role": "assistant", "content": text})
                continue
            out = client.chat.completions.create(model="default", messages=histories[c], max_tokens=CHAT_NEW,
                                                 temperature=0, logprobs=True,
                                                 extra_body={"return_prompt_token_ids": True, "return_token_ids": True})
            choice, uncut = out.choices[0], out.choices[0].prompt_token_ids
            if c == 0 and turn > 0:
                retokenized += uncut[previous_end : previous_end + len(previous_ids)] != previous_ids
            previous_end, previous_ids = len(uncut), choice.response_token_ids
            histories[c].append({"role": "assistant", "content": choice.message.content})
            details = (getattr(out, "sglext", None) or {}).get("cached_tokens_details") or {}
            if len(uncut) + CHAT_NEW < CONTEXT:
                assert "context_truncated_tokens" not in details and getattr(out, "sglext", None) is None, out
                continue
            dropped = details["context_truncated_tokens"]
            assert out.usage.prompt_tokens == len(uncut) - dropped and details["context_shifted_tokens"] >= 0
            cut = uncut[:system_tokens] + uncut[system_tokens + dropped :]
            reference = generate_with_logprobs(server.base_url, cut, len(choice.response_token_ids),
                                               salt=f"ref-{c}-{turn}")
            assert choice.response_token_ids == reference["ids"], (turn, c, dropped)
            worst = max(abs(a.logprob - b) for a, b in zip(choice.logprobs.content, reference["logprobs"]))
            assert worst <= 1e-5, (turn, c, dropped, worst)
            checked += 1
    assert checked >= 6 and streamed_cuts >= 2, (checked, streamed_cuts)
    assert retokenized >= 1  # the answers did fork their chats (else the old default would pass too)
    assert "the kept head is the part shared with other conversations" in server.log_text()
    assert "Traceback" not in server.log_text() and "IntegrityError" not in server.log_text()


def test_openai_answers_report_the_cut_streamed_and_not(servers):
    """``/v1/completions`` and ``/v1/chat/completions``, streamed and not, asked for cache details
    or not: a cut answer carries ``context_truncated_tokens`` and ``context_shifted_tokens`` in
    ``sglext.cached_tokens_details``; an answer that was not cut is as stock SGLang writes it."""
    server = servers["gptj"]
    client = openai_client(server)
    rng = random.Random(31)
    prompt = tokens(rng, CONTEXT)  # overflows: a cut of half the prompt (no shared head: the first page kept)
    dropped = plan_truncation(len(prompt), NEW, CONTEXT - 1, PAGE, 0.5, PAGE).drop_tokens
    for asked in (False, True):
        extra = {"extra_body": {"return_cached_tokens_details": True}} if asked else {}
        out = client.completions.create(model="default", prompt=prompt, max_tokens=NEW, temperature=0, **extra)
        details = out.sglext["cached_tokens_details"]
        assert details["context_truncated_tokens"] == dropped and "context_shifted_tokens" in details, out
        assert {"device", "host"} <= set(details) and out.usage.prompt_tokens == len(prompt) - dropped
        chunks = list(client.completions.create(model="default", prompt=prompt, max_tokens=NEW, temperature=0,
                                                stream=True, **extra))
        sglext = [c.sglext for c in chunks if getattr(c, "sglext", None)]
        assert len(sglext) == 1 and sglext[0]["cached_tokens_details"]["context_truncated_tokens"] == dropped, chunks
        short = client.completions.create(model="default", prompt=prompt[:40], max_tokens=NEW, temperature=0,
                                          **extra).model_dump()  # not cut: SGLang's answer
        assert asked or short.get("sglext") is None, short
        assert "context_truncated_tokens" not in ((short.get("sglext") or {}).get("cached_tokens_details") or {})
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(400))}]  # overflows too
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=NEW, temperature=0)
    assert out.sglext["cached_tokens_details"]["context_truncated_tokens"] > 0, out
    _, sglext = streamed_chat(client, messages, extra_body={"return_cached_tokens_details": True})
    assert len(sglext) == 1 and sglext[0]["cached_tokens_details"]["context_truncated_tokens"] > 0, sglext
    assert "Traceback" not in server.log_text()
