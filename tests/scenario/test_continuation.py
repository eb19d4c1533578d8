"""Streams that survive their engine: a generation cut mid-answer goes on elsewhere.

The real router on real sockets, in front of simulated engines (in-process, and one real
process killed with SIGKILL). The simulated engine's output depends only on its context, so
an uninterrupted run on a healthy engine is the reference: a client whose stream was cut by a
crash, a reset or a wedge (rescued, as the controller does at condemnation) must receive
exactly that generation: every token once, in order, one ``[DONE]``, a final ``finish_reason``
and ``usage`` covering the whole, and none of the fields the router asked the engine for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.router import Router, RouterSettings
from fleetwarden.router.models import ModelCard
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.splice import CompletionDefault
from fleetwarden.sim import FaultMode, Sim, SimConfig
from fleetwarden.sim.server import FAULT_HEADER, FAULT_ID_HEADER, directive_fired
from support.sim import SimProcess, until

pytestmark = pytest.mark.scenario

COMPLETION = {"model": "tiny", "prompt": "tell me about engines", "max_tokens": 30,
              "stream": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about engines"}],
        "max_tokens": 30, "stream": True}
USAGE = {"stream_options": {"include_usage": True}}
#: Events the client reads before the fault: the stream has well begun.
CUT_AFTER = 8


@contextlib.asynccontextmanager
async def fleet(n: int = 3, settings: RouterSettings | None = None,
                **config: Any) -> AsyncIterator[tuple[Router, list[Sim]]]:
    sims = [Sim(SimConfig(**{"steps_per_s": 40, **config})) for _ in range(n)]
    router = Router([], settings or RouterSettings(), health_managed=True)
    try:
        for sim in sims:
            await sim.start()
        router.set_serving_backends([s.url for s in sims])
        await router.start()
        yield router, sims
    finally:
        await router.stop()
        for sim in sims:
            await sim.stop()


async def read_stream(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                      cut: Callable[[], Awaitable[None]] | None = None,
                      headers: dict[str, str] | None = None) -> list[bytes]:
    """Every event the client receives (raw, without its blank line); ``cut`` runs once
    :data:`CUT_AFTER` events have arrived."""
    events: list[bytes] = []
    async with http.post(url + path, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        while True:
            event = await r.content.readuntil(b"\n\n")  # at the end: what is left
            if not event:
                break
            assert event.endswith(b"\n\n"), event  # a stream ends between events
            events.append(event[:-2])
            if len(events) == CUT_AFTER and cut is not None:
                await cut()
    return events


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    assert events[-1] == b"data: [DONE]"
    assert events.count(b"data: [DONE]") == 1
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


def text(cs: list[dict[str, Any]]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for chunk in cs for c in chunk["choices"])


def ids(cs: list[dict[str, Any]]) -> list[int]:
    return [t for chunk in cs for c in chunk["choices"] for t in c.get("token_ids") or []]


def holder(router: Router) -> str:
    """The one backend the stream is on."""
    busy = [url for url, n in router.in_flight().items() if n]
    assert len(busy) == 1, router.in_flight()
    return busy[0]


def sim_at(sims: list[Sim], url: str) -> Sim:
    return next(s for s in sims if s.url == url)


def router_metric(text_: str, name: str) -> dict[tuple[str, ...], float]:
    out = {}
    for family in text_string_to_metric_families(text_):
        for s in family.samples:
            if s.name == name:
                out[tuple(s.labels.values())] = s.value
    return out


async def continuations(http: aiohttp.ClientSession, router: Router) -> dict[str, float]:
    async with http.get(router.url + "/metrics") as r:
        found = router_metric(await r.text(), "fleetwarden_router_continuations_total")
    return {k[0]: v for k, v in found.items()}


def assert_whole(got: list[bytes], reference: list[bytes], *, chat: bool,
                 wants_ids: bool = False) -> None:
    """``got`` is the reference generation, as one unbroken stream."""
    ours, ref = chunks(got), chunks(reference)
    assert not any("error" in c for c in ours), ours
    assert text(ours) == text(ref) and text(ours)
    assert {c["id"] for c in ours} == {ours[0]["id"]}  # one stream, one id
    assert {c["created"] for c in ours} == {ours[0]["created"]}
    finishes = [c["choices"][0]["finish_reason"] for c in ours if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = [c["usage"] for c in ours if c.get("usage")]
    ref_usage = [c["usage"] for c in ref if c.get("usage")]
    assert usage == ref_usage
    if chat:
        roles = [c for c in ours if c["choices"] and "role" in c["choices"][0]["delta"]]
        assert roles == [ours[0]]  # the role chunk once, first
    for raw, chunk in zip(got, ours, strict=False):
        if wants_ids:
            continue
        # added upstream, stripped before the client: null, as vLLM writes them unasked
        assert b'"token_ids":[' not in raw and b'"prompt_token_ids":[' not in raw, raw
        assert all(c.get("token_ids") is None for c in chunk["choices"])
    if wants_ids:
        assert ids(ours) == ids(ref)
        prompts = [c for chunk in ours for c in [chunk, *chunk["choices"]]
                   if c.get("prompt_token_ids")]
        assert len(prompts) == 1  # the prompt's ids once, where vLLM puts them


# ---------------------------------------------------------------------- faults mid-stream


async def crash(sim: Sim) -> None:
    await sim.set_fault(FaultMode.CRASH)  # in-flight streams get vLLM's error event


async def reset(sim: Sim) -> None:
    await sim.set_fault(FaultMode.RESTART)  # a new process: in-flight connections dropped


@pytest.mark.parametrize("fault", [crash, reset])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_stream_cut_by_its_engine_goes_on_elsewhere_exactly(
    http: aiohttp.ClientSession, fault: Callable[[Sim], Awaitable[None]], chat: bool
) -> None:
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    body = {**body, **USAGE}
    async with fleet() as (router, sims):
        reference = await read_stream(http, sims[0].url, path, body)

        async def cut() -> None:
            await fault(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, path, body, cut)
        assert_whole(got, reference, chat=chat)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}
        assert router.stats.streams_ended == {}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_stream_on_a_wedged_engine_is_rescued_and_goes_on_elsewhere(
    http: aiohttp.ClientSession, chat: bool
) -> None:
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    async with fleet() as (router, sims):
        reference = await read_stream(http, sims[0].url, path, body)
        rescued = []

        async def wedge_then_condemn() -> None:
            url = holder(router)
            await sim_at(sims, url).set_fault(FaultMode.WEDGE)  # /health 200, nothing moves
            await asyncio.sleep(0.3)  # the stream hangs, as it would for backend_timeout_s
            rescued.append(router.forwarder.waiting.rescue(url))  # the controller condemns it

        got = await read_stream(http, router.url, path, body, wedge_then_condemn)
        assert rescued == [1]
        assert_whole(got, reference, chat=chat)
        assert router.stats.rescues == 1
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_stream_on_a_wedge_is_held_there_and_continued_exactly(
    http: aiohttp.ClientSession, chat: bool
) -> None:
    # No condemnation here: the stream alone says its engine holds it. Reported silent like a
    # request waiting for its head, then moved (the controller's hedge of an engine that takes
    # no step), it goes on elsewhere from its tokens.
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    body = {**body, **USAGE}
    async with fleet() as (router, sims):
        reference = await read_stream(http, sims[0].url, path, body)
        held: list[dict[str, float]] = []

        async def wedge_then_hedge() -> None:
            url = holder(router)
            await sim_at(sims, url).set_fault(FaultMode.WEDGE)  # /health 200, nothing moves
            await until(lambda: url in router.silent_backends(0.3), what="the stream silent")
            held.append(router.silent_backends(0.3))
            assert router.forwarder.waiting.hedge(url, 0.3) == 1

        got = await read_stream(http, router.url, path, body, wedge_then_hedge)
        assert len(held) == 1 and len(held[0]) == 1
        assert_whole(got, reference, chat=chat)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}
        assert (router.stats.hedges, router.stats.rescues) == (0, 1)
        assert [cause for (_, cause) in router.stats.backend_failures] == ["hedged"]
        assert router.silent_backends(0.0) == {}


async def test_a_slow_stream_that_progresses_is_never_held(http: aiohttp.ClientSession) -> None:
    # 10 tokens a second: an event every 0.1 s, for 3 s, three times silent_after_s' default.
    async with fleet(n=2, steps_per_s=10) as (router, _sims):
        ages: list[float] = []
        silent: list[dict[str, float]] = []
        hedged: list[int] = []
        done = asyncio.Event()

        async def watch() -> None:  # what the controller asks, every 0.05 s
            while not done.is_set():
                if any(router.in_flight().values()):
                    ages.extend(router.silent_backends(0.0).values())
                    silent.append(router.silent_backends(1.0))
                    hedged.append(router.forwarder.waiting.hedge(holder(router), 1.0))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            async with http.post(router.url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200
                events = (await r.read()).count(b"\n\n")
        finally:
            done.set()
            await watcher
        assert events == 31  # 30 tokens and [DONE]: it went through
        assert len(ages) >= 20 and max(ages) < 1.0  # held each time, never for long
        assert all(s == {} for s in silent) and set(hedged) == {0}
        assert router.stats.rescues == 0 and router.stats.backend_failures == {}


async def test_a_stream_whose_engine_is_killed_goes_on_elsewhere(
    http: aiohttp.ClientSession, spawn: Callable[..., SimProcess]
) -> None:
    engines = [spawn("--steps-per-s", "40") for _ in range(2)]
    router = Router([e.url for e in engines], RouterSettings(), health_managed=True)
    await router.start()
    try:
        body = {**COMPLETION, **USAGE}
        reference = await read_stream(http, engines[0].url, "/v1/completions", body)

        async def kill() -> None:
            url = holder(router)
            victim = next(e for e in engines if e.url == url)
            os.killpg(victim.pid, signal.SIGKILL)  # no goodbye: the connection just breaks

        got = await read_stream(http, router.url, "/v1/completions", body, kill)
        assert_whole(got, reference, chat=False)
        assert sum(n for (_, cause), n in router.stats.backend_failures.items()
                   if cause == "reset") == 1
    finally:
        await router.stop()


async def test_ids_the_client_asked_for_are_the_whole_generations_once(
    http: aiohttp.ClientSession
) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        body = {**body, "return_token_ids": True}
        async with fleet() as (router, sims):
            reference = await read_stream(http, sims[0].url, path, body)

            async def cut() -> None:
                await crash(sim_at(sims, holder(router)))

            got = await read_stream(http, router.url, path, body, cut)
            assert_whole(got, reference, chat=path.endswith("chat/completions"),
                         wants_ids=True)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_without_token_ids_a_stream_goes_on_from_its_text(
    http: aiohttp.ClientSession, chat: bool
) -> None:
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    async with fleet(token_ids=False) as (router, sims):  # engines that ignore the field
        reference = await read_stream(http, sims[0].url, path, body)

        async def cut() -> None:
            await crash(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, path, body, cut)
        # This engine's output depends on the text alone, so the text path is exact here.
        assert_whole(got, reference, chat=chat)
        assert await continuations(http, router) == {"tokens": 0, "text": 1, "restart": 0}
        # With usage asked for, it is refused: from text, the prompt's tokens (the text
        # re-read) are not the tokens produced, and the usage could only be estimated.
        got = await read_stream(http, router.url, path, {**body, **USAGE}, cut)
        error = json.loads(got[-2].removeprefix(b"data: "))["error"]
        assert "usage" in error["reason"], error


async def test_the_openai_client_reads_one_unbroken_stream(http: aiohttp.ClientSession) -> None:
    async with fleet() as (router, sims):
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            whole = await client.chat.completions.create(
                model="tiny", messages=CHAT["messages"], max_tokens=30, stream=True,
                stream_options={"include_usage": True})
            expected = [c async for c in whole]
            stream = await client.chat.completions.create(
                model="tiny", messages=CHAT["messages"], max_tokens=30, stream=True,
                stream_options={"include_usage": True})
            got = []
            async for chunk in stream:
                got.append(chunk)
                if len(got) == CUT_AFTER:
                    await crash(sim_at(sims, holder(router)))
        finally:
            await client.close()
        assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "".join(
            c.choices[0].delta.content or "" for c in expected if c.choices)
        assert got[-1].usage == expected[-1].usage and got[-1].usage is not None
        assert got[-1].usage.completion_tokens == 30
        assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "length"


# ---------------------------------------------------------------------- not continued


@pytest.mark.parametrize("extra,headers,reason", [
    ({"n": 2}, None, "several choices (n > 1)"),
    ({"echo": True}, None, "echo"),
    ({"response_format": {"type": "json_object"}}, None, "structured output"),
    ({}, {"x-fleetwarden-continuation": "off"},
     "the client opted out (x-fleetwarden-continuation)"),
])
async def test_a_stream_that_may_not_go_on_ends_with_an_error_event_naming_why(
    http: aiohttp.ClientSession, extra: dict[str, Any], headers: dict[str, str] | None,
    reason: str
) -> None:
    async with fleet() as (router, sims):

        async def cut() -> None:
            await crash(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, "/v1/completions", {**COMPLETION, **extra},
                                cut, headers)
        assert got[-1] == b"data: [DONE]" and got.count(b"data: [DONE]") == 1
        error = json.loads(got[-2].removeprefix(b"data: "))["error"]
        assert error["reason"] == reason and error["cause"] == "stream_error"
        assert error["code"] == 500 and error["type"] == "stream_interrupted"
        assert "EngineCore encountered an issue" in error["message"]
        assert len(got) == CUT_AFTER + 2  # what came before the cut, then the end
        assert router.stats.streams_ended == {reason: 1}
        assert await continuations(http, router) == {"tokens": 0, "text": 0, "restart": 0}
        # the body went upstream as the client wrote it: nothing added
        assert all(b"return_token_ids" not in e for e in got)


async def test_the_openai_client_raises_the_error_event() -> None:
    async with fleet(n=1) as (router, sims):
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            stream = await client.completions.create(model="tiny", prompt="hello",
                                                     max_tokens=30, stream=True)
            seen = 0
            with pytest.raises(openai.APIError, match="could not be continued"):
                async for _ in stream:
                    seen += 1
                    if seen == CUT_AFTER:
                        await crash(sims[0])
        finally:
            await client.close()
        assert seen == CUT_AFTER


@pytest.mark.parametrize("others", [{"b": 8, "c": 7}, {"b": 8}])
async def test_a_stream_goes_on_only_on_the_same_weights(
    http: aiohttp.ClientSession, others: dict[str, int]
) -> None:
    async with fleet() as (router, sims):
        urls = {name: s.url for name, s in zip("abc", sims, strict=True)}
        reference = await read_stream(http, urls["a"], "/v1/completions", COMPLETION)
        router.set_serving_backends([urls["a"]], {urls["a"]: BackendFacts(0, 7)})

        async def cut() -> None:
            assert holder(router) == urls["a"]
            # the next push: a on weights 7, and the others on theirs
            facts = {urls["a"]: BackendFacts(0, 7)}
            facts |= {urls[k]: BackendFacts(i + 1, v) for i, (k, v) in enumerate(others.items())}
            router.set_serving_backends(list(facts), facts)
            await crash(sims[0])

        got = await read_stream(http, router.url, "/v1/completions", COMPLETION, cut)
        assert sims[1].stats()["by_path"].get("/v1/completions") is None  # weights 8: never
        if "c" in others:
            assert_whole(got, reference, chat=False)
            assert sims[2].stats()["by_path"].get("/v1/completions") == 1
        else:  # weights 7 have no other engine: the stream ends, saying why
            error = json.loads(got[-2].removeprefix(b"data: "))["error"]
            assert error["reason"] == "no other backend with the same weights"


# ---------------------------------------------------------------------- non-streamed answers


def shape(obj: Any) -> Any:
    if isinstance(obj, dict):
        return [(k, shape(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [shape(v) for v in obj[:1]]
    return None


async def generated(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        text_ = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text_) for s in f.samples
               if s.name == "vllm:generation_tokens_total")


@pytest.mark.parametrize("fault", ["crash", "wedge", None])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_non_streamed_answer_goes_on_elsewhere_and_keeps_vllms_shape(
    http: aiohttp.ClientSession, fault: str | None, chat: bool
) -> None:
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    body = {k: v for k, v in body.items() if k != "stream"}
    async with fleet(settings=RouterSettings(continue_answers=True)) as (router, sims):
        async with http.post(sims[0].url + path, json=body) as r:
            reference = await r.json()

        async def cut() -> None:
            async def dispatched() -> bool:
                return any(router.in_flight().values())

            await until(dispatched, every_s=0.01)
            sim = sim_at(sims, holder(router))
            before = await generated(http, sim.url)

            async def well_into_its_answer() -> bool:
                return await generated(http, sim.url) >= before + 8

            await until(well_into_its_answer, every_s=0.01)
            if fault == "crash":
                await crash(sim)
            else:
                await sim.set_fault(FaultMode.WEDGE)
                assert router.forwarder.waiting.rescue(sim.url) == 1  # the controller condemns it

        task = asyncio.create_task(cut()) if fault else None
        async with http.post(router.url + path, json=body) as r:
            assert r.status == 200 and r.content_type == "application/json"
            raw = await r.read()
        if task is not None:
            await task
        answer = json.loads(raw)
        assert shape(answer) == shape(reference)  # vLLM's non-streamed shape, key by key
        assert b", " not in raw[:40]  # compact, as vLLM writes it
        for key in ("id", "created"):
            answer.pop(key), reference.pop(key)
        assert answer == reference  # the same generation, the same usage
        assert await continuations(http, router) == (
            {"tokens": 1 if fault else 0, "text": 0, "restart": 0})



# ---------------------------------------------------------------------- only what engines take


async def test_an_engine_whose_profile_takes_no_vllm_fields_is_sent_none(
    http: aiohttp.ClientSession,
) -> None:
    """A strict OpenAI-compatible engine (the sim's SGLang dialect) answers 400 to
    ``return_token_ids``; the router, told by the push that it takes none of vLLM's own fields,
    sends the client's request as it came, continues a completion from its text, and ends a
    chat it cannot continue with an error event naming why."""
    async with fleet(engine="sglang") as (router, sims):
        async with http.post(sims[0].url + "/v1/completions",
                             json={**COMPLETION, "return_token_ids": True}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == (
                "Unrecognized request argument supplied: return_token_ids")
        router.set_serving_backends([s.url for s in sims], {
            s.url: BackendFacts(upstream_fields=False) for s in sims})
        reference = await read_stream(http, sims[0].url, "/v1/completions", COMPLETION)

        async def cut() -> None:
            await reset(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, "/v1/completions", COMPLETION, cut)
        assert text(chunks(got)) == text(chunks(reference))
        assert await continuations(http, router) == {"tokens": 0, "text": 1, "restart": 0}
        got = await read_stream(http, router.url, "/v1/chat/completions", CHAT, cut)
        error = json.loads(got[-2].removeprefix(b"data: "))["error"]
        assert "continue_final_message" in error["reason"], error


@pytest.mark.parametrize("rule", ["engine", "unknown"])
async def test_a_completion_naming_no_limit_goes_on_to_its_engines_own_default(
    http: aiohttp.ClientSession, rule: str,
) -> None:
    """llama.cpp gives a completion that names no limit its default (``-n``, here 12) as a
    chat, not vLLM's 16 (the sim's llama.cpp dialect too): the push says so (its profile's
    rule, and the default its command sets), and a cut one is continued from its text to the
    12 the uninterrupted one made, not to 16. Where the push says the engine's kind is not
    known, such a completion, cut, ends with the error event naming why."""
    body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
    async with fleet(engine="llamacpp", default_max_new_tokens=12) as (router, sims):
        router.set_serving_backends([s.url for s in sims], {
            s.url: BackendFacts(i, upstream_fields=False, output_default=12,
                                completion_default=CompletionDefault(rule))
            for i, s in enumerate(sims)})
        reference = await read_stream(http, sims[0].url, "/v1/completions", body)
        assert len(chunks(reference)) == 12  # a token a chunk: the engine's default, not 16

        async def cut() -> None:
            await reset(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, "/v1/completions", body, cut)
        if rule == "engine":
            assert_whole(got, reference, chat=False)
            assert await continuations(http, router) == {"tokens": 0, "text": 1, "restart": 0}
        else:
            error = json.loads(got[-2].removeprefix(b"data: "))["error"]
            assert "a completion sent without max_tokens, on an engine of no known kind" in (
                error["reason"]), error


async def test_a_stream_whose_final_chunk_came_is_whole_and_its_engine_not_blamed(
    http: aiohttp.ClientSession,
) -> None:
    """Cut after its final chunk and usage, before ``[DONE]``: the client gets the reference
    and one ``[DONE]``, nothing more is generated, and the engine counts a success, no
    failure, and stays in the serving set."""
    body = {**COMPLETION, **USAGE, "max_tokens": 12}
    async with fleet() as (router, sims):
        reference = await read_stream(http, sims[0].url, "/v1/completions", body)
        router.pool.drain_outcomes()
        headers = {FAULT_HEADER: "after_final", FAULT_ID_HEADER: "whole-1"}
        got = await read_stream(http, router.url, "/v1/completions", body, headers=headers)
        assert directive_fired("whole-1")
        assert_whole(got, reference, chat=False)
        outcomes = router.pool.drain_outcomes()
        assert [(s, f) for s, f, _ in outcomes.values()] == [(1, 0)], outcomes
        assert sorted(router.pool.serving) == sorted(s.url for s in sims)
        assert await continuations(http, router) == {"tokens": 0, "text": 0, "restart": 0}


# ---------------------------------------------------------------------- how a request ends


async def test_an_assembled_answer_whose_stream_ends_in_a_client_error_is_that_error(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM codes the exceptions its stream generators catch 400: an answer the router
    assembles from a stream that ends so is that error, with its code, never a 200 with the
    content so far and no ``finish_reason``."""
    body = {k: v for k, v in COMPLETION.items() if k != "stream"}
    async with fleet(settings=RouterSettings(continue_answers=True)) as (router, _):
        headers = {FAULT_HEADER: "error@5", FAULT_ID_HEADER: "assembled-400"}
        async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
            status, answer = r.status, await r.json()
        assert directive_fired("assembled-400")
        assert status == 400, answer
        assert answer["error"]["code"] == 400 and answer["error"]["message"] == (
            "the request failed while it was generated")
        assert await continuations(http, router) == {"tokens": 0, "text": 0, "restart": 0}


async def test_a_whole_generation_whose_usage_cannot_be_counted_ends_with_done() -> None:
    """Cut after its final chunk, before the usage event, on an engine that gives no token
    ids: the router cannot count the usage, but the answer is whole: the stream ends with
    ``[DONE]`` and the ``openai`` client reads it to its end without raising."""
    async with fleet(n=2, token_ids=False) as (router, sims):
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused",
                                    max_retries=0)
        reference = openai.AsyncOpenAI(base_url=sims[0].url + "/v1", api_key="unused",
                                       max_retries=0)
        try:
            expected = [c async for c in await reference.completions.create(
                model="tiny", prompt="hello", max_tokens=12, stream=True,
                stream_options={"include_usage": True})]
            stream = await client.completions.create(
                model="tiny", prompt="hello", max_tokens=12, stream=True,
                stream_options={"include_usage": True},
                extra_headers={FAULT_HEADER: "before_usage", FAULT_ID_HEADER: "no-usage-1"})
            got = [c async for c in stream]
        finally:
            await client.close()
            await reference.close()
        assert directive_fired("no-usage-1")
        assert "".join(c.choices[0].text for c in got if c.choices) == "".join(
            c.choices[0].text for c in expected if c.choices)
        assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "length"
        assert router.stats.streams_ended == {}


async def test_a_seeded_sampled_answer_is_sent_again_whole_and_a_stream_of_one_refused(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM draws a seeded request's tokens from one generator seeded once: a continuation's
    draws would start again at the cut. An answer being assembled, of which its client has
    nothing, is sent again from the start; a stream that began ends naming why."""
    seeded = {"seed": 7, "temperature": 0.8}
    body = {k: v for k, v in COMPLETION.items() if k != "stream"} | seeded
    async with fleet(settings=RouterSettings(continue_answers=True)) as (router, sims):
        async with http.post(sims[0].url + "/v1/completions", json=body) as r:
            reference = await r.json()
        headers = {FAULT_HEADER: "crash@8", FAULT_ID_HEADER: "seeded-answer"}
        async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
            answer = await r.json()
        assert directive_fired("seeded-answer")
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert answer["usage"] == reference["usage"]
        assert await continuations(http, router) == {"tokens": 0, "text": 0, "restart": 0}
        headers = {FAULT_HEADER: "crash@8", FAULT_ID_HEADER: "seeded-stream"}
        got = await read_stream(http, router.url, "/v1/completions", {**COMPLETION, **seeded},
                                headers=headers)
        error = json.loads(got[-2].removeprefix(b"data: "))["error"]
        assert "seed" in error["reason"], error


@pytest.mark.parametrize(("directive", "stream"), [
    ("after_final", True), ("crash@20", True), ("after_final", False)],
    ids=["whole-end-lost", "broken-off", "assembled-end-lost"])
async def test_an_answer_whose_end_is_lost_after_a_weight_load_still_names_every_version(
    http: aiohttp.ClientSession, directive: str, stream: bool,
) -> None:
    """An answer on an engine that loaded new weights under it (``keep``: its tokens may come
    from both), whose connection is lost before its end, and which no other engine on its
    weights can continue: the router ends it itself, and that end still names every version
    its tokens may come from, where anything can still be sent. A stream's last events name
    them (before the error a client library raises on); an answer the router assembles names
    them in its headers, as one that ended well does."""
    body = {**COMPLETION, **USAGE}
    if not stream:
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    async with fleet(n=1, settings=RouterSettings(continue_answers=True)) as (router, sims):
        url = sims[0].url
        router.set_serving_backends([url], {url: BackendFacts(0, 7)})
        headers = {FAULT_HEADER: directive, FAULT_ID_HEADER: f"lost-end-{directive}-{stream}"}

        async def load() -> None:  # the weights change under it (refit_from's keep pause)
            await until(lambda: router.forwarder.waiting.weights_changing(url, 8) == 1)

        if stream:
            async def cut() -> None:
                await load()

            got = await read_stream(http, router.url, "/v1/completions", body, cut, headers)
            assert got[-1] == b"data: [DONE]"
            events = [json.loads(e.removeprefix(b"data: ")) for e in got[:-1]]
            named = [e["fleetwarden_weight_versions"] for e in events
                     if "fleetwarden_weight_versions" in e]
            assert named == [[7, 8]], events[-3:]
            at = next(i for i, e in enumerate(events) if "fleetwarden_weight_versions" in e)
            # Before the error a client library raises on (and stops reading at).
            assert not any("error" in e for e in events[:at])
            if directive.startswith("crash"):
                assert "error" in events[-1], events[-1]
        else:
            loading = asyncio.ensure_future(load())
            async with http.post(router.url + "/v1/completions", json=body,
                                 headers=headers) as r:
                assert r.status == 200, await r.text()
                answer, named = await r.json(), r.headers.get("x-fleetwarden-weight-versions")
                single = r.headers.get("x-fleetwarden-weight-version")
            await loading
            assert answer["choices"][0]["finish_reason"] == "length", answer
            assert (named, single) == ("7,8", None)
        assert directive_fired(f"lost-end-{directive}-{stream}")


# ---------------------------------------------------------------------- the engine's limits


async def test_a_chat_without_a_limit_keeps_the_context_of_the_engine_that_began_it(
    http: aiohttp.ClientSession,
) -> None:
    """Engines of one model with different context lengths: a chat sent without a limit gets
    vLLM's default on the engine that began it (its context less the prompt), and its
    continuation keeps that, not the next engine's. The context is read in the background
    when such a chat begins on an engine."""
    short = Sim(SimConfig(steps_per_s=40, max_model_len=64))
    long_ = Sim(SimConfig(steps_per_s=40, max_model_len=128))
    router = Router([], RouterSettings(), health_managed=True)
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    try:
        await short.start()
        await long_.start()
        await router.start()
        router.set_serving_backends([short.url])
        reference = await read_stream(http, short.url, "/v1/chat/completions", body)
        # the first such chat on the engine: its context is read beside it
        first = await read_stream(http, router.url, "/v1/chat/completions", body)
        assert text(chunks(first)) == text(chunks(reference))
        await until(lambda: short.url in router.forwarder.limits.context)

        async def cut() -> None:
            router.set_serving_backends([short.url, long_.url])
            await crash(short)

        got = await read_stream(http, router.url, "/v1/chat/completions", body, cut)
        assert_whole(got, reference, chat=True)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}
    finally:
        await router.stop()
        await short.stop()
        await long_.stop()


async def test_a_server_cap_a_length_finish_revealed_is_kept_by_the_continuation(
    http: aiohttp.ClientSession,
) -> None:
    """Engines started with vLLM's ``--override-generation-config '{"max_new_tokens": 12}'``
    end a request that asks 30 at 12, a cap no endpoint tells. A whole generation that ends
    ``"length"`` short of its limit reveals it; a stream cut later is continued to that cap,
    not to the client's 30."""
    async with fleet(n=2, override_max_new_tokens=12) as (router, sims):
        reference = await read_stream(http, sims[0].url, "/v1/completions", COMPLETION)
        assert len(chunks(reference)) == 12
        # one whole generation on each engine (least in flight spreads two at once)
        await asyncio.gather(*(read_stream(http, router.url, "/v1/completions", COMPLETION)
                               for _ in sims))

        async def cut() -> None:
            await crash(sim_at(sims, holder(router)))

        got = await read_stream(http, router.url, "/v1/completions", COMPLETION, cut)
        assert_whole(got, reference, chat=False)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}


@pytest.mark.parametrize("cap", [12, None])
async def test_a_cut_where_the_cap_is_unknown_goes_on_only_as_far_as_finishes_prove(
    http: aiohttp.ClientSession, cap: int | None,
) -> None:
    """Engines that say nothing of their cap (attached, no vLLM dev mode, nothing declared):
    the push says their caps are unknown. Where a cap is not known, learn it or refuse: a
    stream cut before any finish there ends with the error event naming why (continued to the
    client's 30, it would run past a cap of 12 the engine would have stopped at). Then one
    whole generation on each of the others: capped at 12, its ``"length"`` finish short of 30
    reveals the cap; uncapped, its 30 tokens prove a floor of 30. A cut then is continued
    exactly, to the cap or to the client's limit. Least in flight: two generations of one
    prompt must reach both engines, where cache-aware routing keeps a shared prefix on one."""
    async with fleet(n=3, settings=RouterSettings(routing="least_in_flight"),
                     override_max_new_tokens=cap) as (router, sims):
        facts = {s.url: BackendFacts(i, output_cap_unknown="no GET /server_info")
                 for i, s in enumerate(sims)}
        router.set_serving_backends([s.url for s in sims], facts)
        reference = await read_stream(http, sims[0].url, "/v1/completions", COMPLETION)
        assert len(chunks(reference)) == (cap or 30)
        crashed, cut, reason = await _a_refused_cut(http, router, sims, "/v1/completions",
                                                    COMPLETION)
        assert ("server cap of the engine that began it is unknown (no GET /server_info; "
                "0 tokens proven of the 30 needed") in reason, reason
        # the two left: one whole generation on each (least in flight spreads two at once)
        left = [s.url for s in sims if s.url != crashed[0]]
        router.set_serving_backends(left, facts)
        await asyncio.gather(*(read_stream(http, router.url, "/v1/completions", COMPLETION)
                               for _ in range(2)))
        limits = router.forwarder.limits  # the crashed one left the set
        if cap is not None:
            assert limits.unknown == {} and limits.cap == {url: cap for url in left}
        else:
            assert set(limits.unknown) == set(left) and limits.floor == {url: 30 for url in left}
        got = await read_stream(http, router.url, "/v1/completions", COMPLETION, cut)
        assert_whole(got, reference, chat=False)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}


@pytest.mark.parametrize("default", [12, None])
async def test_a_chat_naming_no_limit_where_the_models_default_is_unknown(
    http: aiohttp.ClientSession, default: int | None,
) -> None:
    """The push says the engines' default limit is unknown (their model is no folder on this
    host, nothing declared). A chat naming no limit cut before any such chat finished there is
    refused, naming why (continued to the context left, it would run past a generation
    config's 12). Then one whole such chat on each of the others: with a default, its
    ``"length"`` finish at 12, short of the context left, reveals it; with none, its finish at
    the context left proves a floor that covers it. A cut then is continued exactly."""
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    async with fleet(n=3, settings=RouterSettings(routing="least_in_flight"), max_model_len=64,
                     default_max_new_tokens=default) as (router, sims):
        card = (ModelCard("tiny", max_model_len=64),)
        facts = {s.url: BackendFacts(i, models=card, output_default_unknown="not on this host")
                 for i, s in enumerate(sims)}
        router.set_serving_backends([s.url for s in sims], facts)
        reference = await read_stream(http, sims[0].url, "/v1/chat/completions", body)
        produced = len(chunks(reference)) - 1  # the role chunk
        assert produced == default or default is None
        crashed, cut, reason = await _a_refused_cut(http, router, sims,
                                                    "/v1/chat/completions", body)
        assert "default limit of the engine that began it is unknown (not on this host; " \
               "0 tokens proven" in reason, reason
        left = [s.url for s in sims if s.url != crashed[0]]
        router.set_serving_backends(left, facts)
        await asyncio.gather(*(read_stream(http, router.url, "/v1/chat/completions", body)
                               for _ in range(2)))
        limits = router.forwarder.limits
        if default is not None:
            assert limits.default_unknown == {} and limits.default_cap == {
                url: default for url in left}
        else:
            assert set(limits.default_unknown) == set(left)
            assert limits.default_floor == {url: produced for url in left}
        got = await read_stream(http, router.url, "/v1/chat/completions", body, cut)
        assert_whole(got, reference, chat=True)
        assert await continuations(http, router) == {"tokens": 1, "text": 0, "restart": 0}


async def _a_refused_cut(http: aiohttp.ClientSession, router: Router, sims: list[Sim],
                         path: str, body: dict[str, Any],
                         ) -> tuple[list[str], Callable[[], Awaitable[None]], str]:
    """A stream through ``router`` whose engine crashes mid-answer and that ends with the
    error event: the engines crashed (this one, and each later ``cut``'s), the cut, and why."""
    crashed: list[str] = []

    async def cut() -> None:
        crashed.append(holder(router))
        await crash(sim_at(sims, crashed[-1]))

    got = await read_stream(http, router.url, path, body, cut)
    error = json.loads(got[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "stream_interrupted" and got[-1] == b"data: [DONE]"
    return crashed, cut, str(error["reason"])
