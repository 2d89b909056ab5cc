"""A context cut reported in OpenAI answers (``--hiradix-context-overflow``; the launcher process).

The scheduler puts ``context_truncated_tokens`` and ``context_shifted_tokens`` into a cut
request's ``cached_tokens_details`` (:func:`hiradix.sglang_plugin.overflow.details_of`), which
``/generate`` answers in ``meta_info``. SGLang 0.5.23's ``/v1/chat/completions`` and
``/v1/completions`` answer cache details in ``sglext.cached_tokens_details``, only for a client
that asked (``return_cached_tokens_details``), and copy only the keys they know
(``entrypoints/openai/utils.py::cached_tokens_details_from_dict``). These hooks

* keep the two keys: a cut's details become a :class:`CutTokensDetails`, and an answer that
  carries one is serialized with the fields of what it holds (pydantic's ``serialize_as_any``;
  ``SglExt`` declares the field as SGLang's ``CachedTokensDetails``, whose fields alone it would
  write);
* report a cut to every client, also one that did not ask for cache details (it cannot know
  that its history will be cut): a non-streamed answer through
  ``process_cached_tokens_details_from_ret``; a streamed one runs as if the client had asked,
  and its details are left out again unless they carry a cut (:data:`_UNASKED`, set around
  each step of the stream: SGLang takes a stream's first step in the request's task and the
  others in the response's).

An answer to a request that was not cut is SGLang's, byte for byte.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, AsyncIterator, Optional

from pydantic import model_serializer
from sglang.srt.entrypoints.openai.protocol import CachedTokensDetails

CUT_KEYS = ("context_truncated_tokens", "context_shifted_tokens")
_OPTIONAL_KEYS = ("storage", "storage_backend", *CUT_KEYS)  # left out of the JSON when None

# True while a stream whose client did not ask for cache details takes a step.
_UNASKED: ContextVar[bool] = ContextVar("hiradix_cache_details_unasked", default=False)


class CutTokensDetails(CachedTokensDetails):
    """SGLang's cache details of a request whose prompt was cut for the context, with the cut."""

    context_truncated_tokens: Optional[int] = None  # prompt tokens dropped by the cut
    context_shifted_tokens: Optional[int] = None  # kept tokens whose cached KV was reused at new positions

    @model_serializer(mode="wrap")
    def _serialize_cut(self, handler: Any) -> dict:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in _OPTIONAL_KEYS}


def cut_of(details: Optional[dict]) -> dict:
    """The cut's keys of a request's raw ``cached_tokens_details`` (empty: not cut)."""
    if not details:
        return {}
    return {k: details[k] for k in CUT_KEYS if details.get(k) is not None}


def around_cached_tokens_details_from_dict(original: Any, details: dict, *args: Any, **kwargs: Any) -> Any:
    """A cut's details keep its keys; in a stream whose client did not ask, other details are None."""
    cut = cut_of(details)
    if not cut:
        return None if _UNASKED.get() else original(details, *args, **kwargs)
    return with_cut(original(details, *args, **kwargs), cut)


def with_cut(known: CachedTokensDetails, cut: dict) -> CutTokensDetails:
    """SGLang's details of a request (``known``) with its cut's keys."""
    return CutTokensDetails(**{**known.model_dump(), **cut})


def after_process_cached_tokens_details_from_ret(result: Any, ret_item: dict, request: Any, *args: Any,
                                                 **kwargs: Any) -> Any:
    """A non-streamed answer reports a cut also when its client did not ask for cache details."""
    if result is not None or getattr(request, "return_cached_tokens_details", True):
        return None  # SGLang's result
    details = ret_item.get("meta_info", {}).get("cached_tokens_details")
    cut = cut_of(details)
    if not cut:
        return None
    from sglang.srt.entrypoints.openai import utils

    return with_cut(utils.cached_tokens_details_from_dict(details), cut)


async def around_generate_stream(original: Any, serving: Any, adapted_request: Any, request: Any, *args: Any,
                                 **kwargs: Any) -> AsyncIterator[str]:
    """A streamed answer reports a cut also when its client did not ask for cache details."""
    if getattr(request, "return_cached_tokens_details", True):
        async for chunk in original(serving, adapted_request, request, *args, **kwargs):
            yield chunk
        return
    asked = request.model_copy(update={"return_cached_tokens_details": True})
    stream = original(serving, adapted_request, asked, *args, **kwargs)
    try:
        while True:
            token = _UNASKED.set(True)
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _UNASKED.reset(token)
            yield chunk
    finally:
        await stream.aclose()


def around_model_dump_json(original: Any, response: Any, *args: Any, **kwargs: Any) -> str:
    """An answer that carries a cut writes the cut's keys (the fields of what it holds)."""
    sglext = getattr(response, "sglext", None)
    if sglext is not None and isinstance(getattr(sglext, "cached_tokens_details", None), CutTokensDetails):
        kwargs["serialize_as_any"] = True
    return original(response, *args, **kwargs)
