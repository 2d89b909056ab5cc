"""A context cut in OpenAI answers (hiradix.sglang_plugin.openai_cut), without a server: the hook
functions over SGLang's own response classes and converters (the server test is in
tests/e2e/test_e2e_context_overflow.py)."""

from __future__ import annotations

import asyncio
import json

from sglang.srt.entrypoints.openai import utils
from sglang.srt.entrypoints.openai.protocol import (
    CachedTokensDetails,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    SglExt,
    UsageInfo,
)

from hiradix.sglang_plugin import openai_cut
from hiradix.sglang_plugin.openai_cut import CutTokensDetails

CUT = {"device": 32, "host": 0, "context_truncated_tokens": 160, "context_shifted_tokens": 96}
PLAIN = {"device": 32, "host": 16}
original_dump = ChatCompletionResponse.model_dump_json  # whether hooked in this process or not: same output


def from_dict(details: dict):
    """The converter as the hook installs it."""
    return openai_cut.around_cached_tokens_details_from_dict(utils.cached_tokens_details_from_dict, details)


def answer(details) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id="x", model="m", created=1, usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="hi"),
                                              finish_reason="stop")],
        sglext=SglExt(cached_tokens_details=details) if details is not None else None)


def dumped(response) -> dict:
    return json.loads(openai_cut.around_model_dump_json(type(response).model_dump_json, response, by_alias=True))


def test_a_cut_keeps_its_keys_in_the_answer_json():
    details = from_dict(CUT)
    assert isinstance(details, CutTokensDetails)
    assert dumped(answer(details))["sglext"]["cached_tokens_details"] == CUT
    stream = ChatCompletionStreamResponse(id="x", model="m", created=1, choices=[],
                                          sglext=SglExt(cached_tokens_details=details))
    assert dumped(stream)["sglext"]["cached_tokens_details"] == CUT
    assert answer(details).model_dump()["sglext"]["cached_tokens_details"] == {"device": 32, "host": 0}  # why the hook
    with_storage = from_dict({**CUT, "storage": 0, "storage_backend": "nvme=0"})
    assert json.loads(with_storage.model_dump_json()) == {**CUT, "storage": 0, "storage_backend": "nvme=0"}


def test_an_answer_without_a_cut_is_sglangs_byte_for_byte():
    plain = from_dict(PLAIN)
    assert type(plain) is CachedTokensDetails
    for response in (answer(plain), answer(None)):
        assert openai_cut.around_model_dump_json(type(response).model_dump_json, response) == original_dump(response)


def test_a_client_that_did_not_ask_is_told_of_a_cut_only():
    unasked = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    asked = unasked.model_copy(update={"return_cached_tokens_details": True})
    after = openai_cut.after_process_cached_tokens_details_from_ret
    cut_ret, plain_ret = {"meta_info": {"cached_tokens_details": CUT}}, {"meta_info": {"cached_tokens_details": PLAIN}}
    assert after(None, cut_ret, unasked).model_dump(exclude_none=True) == CUT
    assert after(None, plain_ret, unasked) is None  # SGLang's None stays
    assert after(from_dict(CUT), cut_ret, asked) is None  # SGLang's result (the hooked converter's) stays


def fake_stream(request, details: dict):
    """SGLang's stream in short: content chunks, then the cache details if the client asked."""

    async def stream(serving, adapted_request, request_, raw_request):
        yield "data: first\n\n"
        yield "data: second\n\n"
        if request_.return_cached_tokens_details:
            converted = from_dict(details)
            if converted is not None:
                yield f"data: {SglExt(cached_tokens_details=converted).model_dump_json(serialize_as_any=True)}\n\n"
        yield "data: [DONE]\n\n"

    return openai_cut.around_generate_stream(stream, None, None, request, None)


def collect(stream) -> list[str]:
    """The first step in one task and the others in another, as SGLang's HTTP handler does."""

    async def run() -> list[str]:
        first = await asyncio.create_task(stream.__anext__())

        async def rest() -> list[str]:
            return [chunk async for chunk in stream]

        return [first] + await asyncio.create_task(rest())

    return asyncio.run(run())


def test_a_stream_reports_a_cut_also_to_a_client_that_did_not_ask():
    unasked = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    asked = unasked.model_copy(update={"return_cached_tokens_details": True})
    cut = collect(fake_stream(unasked, CUT))
    assert len(cut) == 4 and json.loads(cut[2][len("data: "):])["cached_tokens_details"] == CUT
    assert collect(fake_stream(unasked, PLAIN)) == ["data: first\n\n", "data: second\n\n", "data: [DONE]\n\n"]
    plain = collect(fake_stream(asked, PLAIN))
    assert json.loads(plain[2][len("data: "):])["cached_tokens_details"] == PLAIN
    assert not unasked.return_cached_tokens_details  # the client's request is not changed
    assert from_dict(PLAIN) is not None  # nothing left set after the streams
