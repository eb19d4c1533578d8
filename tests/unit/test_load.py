"""The load's judgement of a stream: whole in vLLM's shape and in llama.cpp's, never when cut."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from fleetwarden.testing.load import Load


def _chunk(text: str, finish: str | None = None, usage: int | None = None,
           choices: bool = True) -> bytes:
    body: dict[str, Any] = {"id": "c", "object": "text_completion", "created": 1,
                            "model": "tiny", "choices": []}
    if choices:
        body["choices"] = [{"text": text, "index": 0, "finish_reason": finish}]
    if usage is not None:
        body["usage"] = {"completion_tokens": usage, "prompt_tokens": 1,
                         "total_tokens": usage + 1}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


#: Three tokens, as each engine streams them.
STREAMS = {
    # vLLM: one chunk per token, the last with the finish; then usage without choices
    "vllm": [_chunk("a"), _chunk("b"), _chunk("c", "length"), _chunk("", usage=3, choices=False)],
    # llama.cpp: one chunk per token, then a closing chunk: the finish and usage, no text
    "llamacpp": [_chunk("a"), _chunk("b"), _chunk("c"), _chunk("", "length", usage=3)],
    # cut: no finish
    "cut": [_chunk("a"), _chunk("b")],
}


async def _served(shape: str) -> list[str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in STREAMS[shape]:
            await response.write(event)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        load = Load(f"http://127.0.0.1:{port}", concurrency=1, max_tokens=3, stream=True,
                    total=2)
        load.start()
        await load.wait()
        await load.stop()
        return [r.incomplete for r in load.results]
    finally:
        await runner.cleanup()


async def test_a_whole_stream_is_whole_in_vllm_s_shape_and_in_llama_cpp_s() -> None:
    assert await _served("vllm") == ["", ""]
    assert await _served("llamacpp") == ["", ""]


async def test_a_cut_stream_is_incomplete() -> None:
    assert all(await _served("cut"))
