"""The simulated engine gives what continuing a generation needs, as vLLM 0.32 does.

Shapes are compared key by key, event by event, with the real captures in
``tests/fixtures/vllm/continuation-and-sleep/`` (``return_token_ids`` streamed and not, a
prompt of token ids, ``continue_final_message``). Values are checked against the simulator's
own uninterrupted runs: its output depends only on the context, so a generation continued from
its first tokens (as ids, or as text) must end exactly as the uninterrupted one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.sim import Sim, SimConfig, wire

pytestmark = pytest.mark.scenario

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm" / "continuation-and-sleep"


def capture(name: str) -> tuple[dict[str, Any], int, dict[str, str], str]:
    """(request body, status, headers, body) of one capture in that folder's format."""
    text = (CAPTURES / name).read_bytes().decode()
    request, _, answer = text.partition("\n\n")
    head, _, body = answer.partition("\n\n")
    lines = head.split("\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return json.loads(request.split("\n", 1)[1]), int(lines[0].split()[1]), headers, body


def events(body: str) -> list[Any]:
    assert body.endswith("data: [DONE]\n\n"), body[-80:]
    parts = body.split("\n\n")[:-1]
    assert all(p.startswith("data: ") for p in parts)
    return [json.loads(p[len("data: "):]) for p in parts[:-1]]


def keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return [(k, keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [keys(v) for v in obj[:1]]
    return None  # values differ (ids, text); presence and order of keys must not


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    async with Sim(SimConfig(slots=4, steps_per_s=200)) as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               path: str = "/v1/completions") -> tuple[int, str]:
    async with http.post(url + path, json=body) as r:
        return r.status, await r.text()


def ids_of(chunks: list[Any]) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]


def text_of(chunks: list[Any]) -> str:
    return "".join(ch.get("text", ch.get("delta", {}).get("content", "")) or ""
                   for c in chunks for ch in c["choices"])


@pytest.mark.parametrize("name,path", [
    ("completions-stream-token-ids.http", "/v1/completions"),
    ("chat-stream-token-ids.http", "/v1/chat/completions"),
    ("completions-stream-token-prompt.http", "/v1/completions"),
    ("chat-stream-continue-final.http", "/v1/chat/completions"),
])
async def test_streams_have_the_captured_shape(sim: Sim, http: aiohttp.ClientSession,
                                               name: str, path: str) -> None:
    request, status, _, body = capture(name)
    ours_status, ours_body = await post(http, sim.url, request, path)
    assert ours_status == status == 200
    ours, real = events(ours_body), events(body)
    assert [keys(e) for e in ours] == [keys(e) for e in real]
    # The values that matter to a router: where the ids are, and where they are null.
    for o, r in zip(ours, real, strict=True):
        for field in ("prompt_token_ids", "prompt_text"):
            assert (o.get(field) is None) == (r.get(field) is None), (field, o, r)
        for oc, rc in zip(o["choices"], r["choices"], strict=True):
            for field in ("prompt_token_ids", "token_ids"):
                assert (oc.get(field) is None) == (rc.get(field) is None), (field, o, r)
            if rc.get("token_ids") is not None:  # one token per chunk, as in the capture
                assert len(oc["token_ids"]) == len(rc["token_ids"])


async def test_a_non_streamed_completion_returns_its_ids_where_vllm_does(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    request, status, _, body = capture("completions-token-ids.http")
    ours_status, ours_body = await post(http, sim.url, request)
    ours, real = json.loads(ours_body), json.loads(body)
    assert ours_status == status and keys(ours) == keys(real)
    choice = ours["choices"][0]
    assert choice["prompt_token_ids"] == wire.encode("hello there")
    assert len(choice["token_ids"]) == 6 and wire.decode(choice["token_ids"]) == choice["text"]
    # without return_token_ids, the same keys hold null, as in completions.http
    _, plain = await post(http, sim.url, {**request, "return_token_ids": False})
    assert json.loads(plain)["choices"][0]["token_ids"] is None


async def test_a_completion_continued_from_its_token_ids_ends_as_the_uninterrupted_one(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    whole = {"model": "tiny", "prompt": "hello there", "max_tokens": 9, "stream": True,
             "return_token_ids": True}
    _, body = await post(http, sim.url, whole)
    chunks = events(body)
    prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
    out = ids_of(chunks)
    assert len(out) == 9 and prompt_ids == wire.encode("hello there")
    for cut in (1, 4, 8):
        _, body = await post(http, sim.url, {**whole, "prompt": prompt_ids + out[:cut],
                                             "max_tokens": 9 - cut})
        rest = events(body)
        assert rest[0]["choices"][0]["prompt_token_ids"] == prompt_ids + out[:cut]
        assert ids_of(rest) == out[cut:]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        # and from text: the prompt and the text produced so far
        _, body = await post(http, sim.url, {**whole, "prompt": "hello there" + wire.decode(
            out[:cut]), "max_tokens": 9 - cut})
        assert ids_of(events(body)) == out[cut:]


async def test_a_chat_continues_as_a_completion_of_its_ids_or_as_its_final_message(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    whole = {"model": "tiny", "messages": messages, "max_tokens": 8, "stream": True,
             "return_token_ids": True}
    _, body = await post(http, sim.url, whole, "/v1/chat/completions")
    chunks = events(body)
    prompt_ids = chunks[0]["prompt_token_ids"]
    assert prompt_ids == wire.encode("<|user|>\nhi\n<|assistant|>\n")
    out = ids_of(chunks)
    text = text_of(chunks)
    assert len(out) == 8 and wire.decode(out) == text
    cut = 3
    # exact: a completion whose prompt is the rendered chat and the ids produced so far
    _, body = await post(http, sim.url, {"model": "tiny", "prompt": prompt_ids + out[:cut],
                                         "max_tokens": 8 - cut, "stream": True,
                                         "return_token_ids": True})
    assert ids_of(events(body)) == out[cut:]
    # from text: the partial assistant message, continued
    partial = wire.decode(out[:cut])
    _, body = await post(http, sim.url, {
        "model": "tiny", "stream": True, "max_tokens": 8 - cut,
        "messages": [*messages, {"role": "assistant", "content": partial}],
        "continue_final_message": True, "add_generation_prompt": False,
    }, "/v1/chat/completions")
    rest = events(body)
    assert rest[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert partial + text_of(rest) == text


async def test_both_generation_prompts_at_once_are_refused(sim: Sim,
                                                           http: aiohttp.ClientSession) -> None:
    status, body = await post(http, sim.url, {
        "model": "tiny", "messages": [{"role": "assistant", "content": "x"}],
        "continue_final_message": True, "max_tokens": 2}, "/v1/chat/completions")
    assert status == 400
    assert "continue_final_message" in json.loads(body)["error"]["message"]
