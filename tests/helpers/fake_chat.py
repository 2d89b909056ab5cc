"""A fake OpenAI-style chat server for the benchmark-client tests (aiohttp, SGLang-shaped SSE).

Cached tokens = the longest prefix (in characters of the JSON messages) shared with an earlier
prompt; every answer is the same `answer` deltas; `requests` keeps the bodies in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

from hiradix.testing.server import pick_free_port


class FakeChatServer:
    """An aiohttp server streaming SGLang-shaped chunks; cached tokens = longest seen prefix."""

    def __init__(self, answer: tuple[str, ...] = ("ok", " fine")):
        self.port = pick_free_port()
        self.answer = answer  # content deltas of every answer
        self.requests: list[dict] = []  # bodies, in arrival order
        self.events: list[tuple[str, str, int]] = []  # ("start"|"end", first user text, n messages)
        self.seen_prompts: list[str] = []

    async def handle_models(self, request):
        from aiohttp import web

        return web.json_response({"data": [{"id": "fake-model"}]})

    async def handle_chat(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        key = (body["messages"][0]["content"], len(body["messages"]))
        self.events.append(("start", *key))
        prompt = json.dumps(body["messages"])[:-1]  # drop "]" so history is a prefix
        cached = max((len(os.path.commonprefix([p, prompt])) for p in self.seen_prompts), default=0)
        self.seen_prompts.append(prompt)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(0.02)
        for word in self.answer:
            await send({"choices": [{"index": 0, "delta": {"content": word}}]})
        await send({"choices": [], "sglext": {"cached_tokens_details": {"device": cached, "host": 0}}})
        await send({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(self.answer),
                                             "prompt_tokens_details": {"cached_tokens": cached}}})
        await resp.write(b"data: [DONE]\n\n")
        self.events.append(("end", *key))
        return resp

    def __enter__(self):
        from aiohttp import web

        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_get("/v1/models", self.handle_models)
            app.router.add_post("/v1/chat/completions", self.handle_chat)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
