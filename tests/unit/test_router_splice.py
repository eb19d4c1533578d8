"""The pure parts of continuing a stream (router/splice.py): reading requests, cutting SSE,
rewriting chunks, and the request that continues a stream. Wire shapes from the real vLLM
captures in tests/fixtures/vllm/continuation-and-sleep/."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest

from fleetwarden.router.continuation import Mode, UnknownCap, read_stream_request
from fleetwarden.router.limits_learning import LimitsLearner
from fleetwarden.router.models import ModelCard
from fleetwarden.router.pool import BackendFacts, Pool
from fleetwarden.router.splice import (
    DONE,
    CompletionDefault,
    EngineLimits,
    EventAction,
    Splice,
    SseSplitter,
    assembled_answer,
    error_answer,
)
from fleetwarden.router.upstream import Address, UpstreamClient

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm" / "continuation-and-sleep"


def captured_events(name: str) -> list[bytes]:
    body = (CAPTURES / name).read_bytes().split(b"\n\n", 2)[2]
    return [e for e in body.split(b"\n\n") if e]


def request(body: dict[str, Any], path: str = "/v1/completions",
            headers: dict[str, str] | None = None) -> Any:
    read = read_stream_request(path, json.dumps(body).encode(), headers or {})
    assert read is not None
    return read


def test_only_streamed_completions_and_chats_are_read() -> None:
    assert read_stream_request("/v1/completions", b'{"prompt": "x"}', {}) is None
    assert read_stream_request("/v1/completions", b'{"stream": false}', {}) is None
    assert read_stream_request("/v1/embeddings", b'{"stream": true}', {}) is None
    assert read_stream_request("/v1/completions", b'{"stream": true', {}) is None  # not JSON
    read = request({"prompt": "x", "stream": True})
    assert read.refusal is None and not read.wants_ids
    assert json.loads(read.upstream_body) == {"prompt": "x", "stream": True,
                                              "return_token_ids": True}


@pytest.mark.parametrize("extra,headers,why", [
    ({"n": 2}, {}, "several choices (n > 1)"),
    ({"best_of": 3}, {}, "several choices (n > 1)"),
    ({"echo": True}, {}, "echo"),
    ({"prompt_logprobs": 1}, {}, "prompt logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, {}, "structured output"),
    ({"structured_outputs": {"regex": "a+"}}, {}, "structured output"),
    ({"tools": [{"type": "function"}]}, {}, "tools"),
    ({"prompt": ["a", "b"]}, {}, "several prompts"),
    ({}, {"X-Fleetwarden-Continuation": "off"},
     "the client opted out (x-fleetwarden-continuation)"),
])
def test_what_may_not_be_continued_says_why_and_goes_upstream_untouched(
        extra: dict[str, Any], headers: dict[str, str], why: str) -> None:
    from multidict import CIMultiDict

    body = {"prompt": "x", "stream": True, **extra}
    read = read_stream_request("/v1/completions", json.dumps(body).encode(),
                               CIMultiDict(headers))
    assert read is not None and read.refusal == why
    assert read.upstream_body == json.dumps(body).encode()
    assert Splice(read).cut().continuation() == why


def test_plain_choices_are_continuable() -> None:
    for extra in ({"n": 1}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
                  {"logprobs": 2}):
        assert request({"prompt": "x", "stream": True, **extra}).refusal is None


def test_the_splitter_makes_whole_events_whatever_the_reads() -> None:
    events = captured_events("completions-stream-token-ids.http")
    wire = b"".join(e + b"\n\n" for e in events)
    for size in (1, 7, 64, len(wire)):
        splitter = SseSplitter()
        got = []
        for i in range(0, len(wire), size):
            got += splitter.feed(wire[i:i + size])
        assert got == events
    assert SseSplitter().feed(b"data: 1\r\n\r\ndata: 2\n\n") == [b"data: 1", b"data: 2"]


def test_the_first_attempt_strips_only_what_the_router_added() -> None:
    events = captured_events("completions-stream-token-ids.http")
    splice = Splice(request({"prompt": "hello there", "max_tokens": 6, "stream": True}))
    splice.begin_attempt(None)
    out = [splice.on_event(e) for e in events]
    assert out[-1] == (EventAction.DONE, DONE)
    for (outcome, data), event in zip(out[:-1], events, strict=False):
        assert outcome is EventAction.SEND
        # byte for byte what vLLM sends unasked: the same keys, null
        assert data == event.replace(b'"prompt_token_ids":[1,283,83,303,310,293]',
                                     b'"prompt_token_ids":null').replace(
            b'"token_ids":[267]', b'"token_ids":null').replace(
            b'"token_ids":[120]', b'"token_ids":null').replace(
            b'"token_ids":[91]', b'"token_ids":null') + b"\n\n"
    assert splice.prompt_ids == [1, 283, 83, 303, 310, 293]
    assert splice.output_ids == [267, 120, 91, 91, 91, 91] and splice.produced == 6
    assert splice.finish_reason == "length"
    # a client that asked for the ids gets the engine's bytes untouched
    mine = Splice(request({"prompt": "hello there", "stream": True, "return_token_ids": True}))
    mine.begin_attempt(None)
    assert [mine.on_event(e)[1] for e in events[:-1]] == [e + b"\n\n" for e in events[:-1]]


def test_a_completion_continues_from_its_ids_with_what_is_left() -> None:
    events = captured_events("completions-stream-token-ids.http")
    read = request({"model": "tiny", "prompt": "hello there", "max_tokens": 9, "min_tokens": 4,
                    "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}})
    splice = Splice(read)
    splice.begin_attempt(None)
    for e in events[:3]:  # three tokens, then the engine is gone
        splice.on_event(e)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    assert (plan.path, plan.mode, plan.as_completion) == ("/v1/completions", Mode.TOKENS, False)
    body = json.loads(plan.body)
    assert body["prompt"] == [1, 283, 83, 303, 310, 293, 267, 120, 91]
    assert (body["max_tokens"], body["min_tokens"], body["temperature"]) == (6, 1, 0)
    # the continuation's chunks, as the client's stream goes on
    splice.begin_attempt(plan)
    cont = captured_events("completions-stream-token-prompt.http")
    outcome, data = splice.on_event(cont[0])
    chunk = json.loads(data.removeprefix(b"data: "))
    assert outcome is EventAction.SEND
    assert chunk["id"] == "cmpl-9ecf665361bdd0e3" and chunk["created"] == 1796051753
    assert chunk["choices"][0]["prompt_token_ids"] is None  # once was enough
    assert chunk["choices"][0]["token_ids"] is None  # the client did not ask
    usage = {"id": "cmpl-b9", "object": "text_completion", "created": 1, "model": "tiny",
             "choices": [], "usage": {"prompt_tokens": 9, "total_tokens": 15,
                                      "completion_tokens": 6}}
    _, data = splice.on_event(b"data: " + json.dumps(usage).encode())
    assert json.loads(data.removeprefix(b"data: "))["usage"] == {
        "prompt_tokens": 6, "total_tokens": 15, "completion_tokens": 9}


def test_a_chat_continues_as_a_completion_and_its_chunks_become_chat_chunks_again() -> None:
    events = captured_events("chat-stream-token-ids.http")
    read = request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 6, "temperature": 0, "top_k": 3,
                    "stream": True}, "/v1/chat/completions")
    splice = Splice(read)
    splice.begin_attempt(None)
    for e in events[:3]:  # the role chunk and two tokens
        splice.on_event(e)
    assert splice.produced == 2 and splice.prompt_ids == [4, 79, 80, 7, 5]
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.as_completion and plan.mode is Mode.TOKENS
    assert json.loads(plan.body) == {
        "model": "tiny", "temperature": 0, "top_k": 3, "max_tokens": 4,
        "prompt": [4, 79, 80, 7, 5, 738, 26], "stream": True, "return_token_ids": True}
    splice.begin_attempt(plan)
    last = captured_events("completions-stream-token-prompt.http")[-2]
    _, data = splice.on_event(last)
    assert json.loads(data.removeprefix(b"data: ")) == {
        "id": "chatcmpl-af9d6532e76be588", "object": "chat.completion.chunk",
        "created": 1796051754, "model": "tiny",
        "choices": [{"index": 0, "delta": {"content": "t"}, "logprobs": None,
                     "finish_reason": "length", "stop_reason": None, "token_ids": None}],
        "system_fingerprint": "vllm-0.32.0-bc0018f7"}


def test_without_ids_a_chat_continues_its_final_message_and_its_role_chunk_is_not_repeated(
) -> None:
    events = captured_events("chat-stream-continue-final.http")  # no ids in these chunks
    read = request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 10, "stream": True}, "/v1/chat/completions")
    splice = Splice(read)
    splice.begin_attempt(None)
    for e in events[:4]:
        splice.on_event(e)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.mode is Mode.TEXT and not plan.as_completion
    body = json.loads(plan.body)
    assert body["messages"][-1] == {"role": "assistant", "content": "\ufffdate3"}
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert body["max_tokens"] == 7
    splice.begin_attempt(plan)
    assert splice.on_event(events[0]) == (EventAction.SKIP, b"")  # the role chunk, once was enough


def test_a_server_error_event_is_a_failure_and_a_client_error_event_is_the_clients() -> None:
    splice = Splice(request({"prompt": "x", "stream": True}))
    splice.begin_attempt(None)
    dead = b'data: {"error":{"message":"EngineCore encountered an issue.","code":500}}'
    assert splice.on_event(dead) == (EventAction.ENGINE_ERROR, b"")
    bad = b'data: {"error":{"message":"bad","code":400}}'
    assert splice.on_event(bad) == (EventAction.CLIENT_ERROR, bad + b"\n\n")
    # an answer being assembled ends as that error, with its code
    assert error_answer(splice) == (400, b'{"error":{"message":"bad","code":400}}')


def test_a_token_id_prompt_without_ids_back_cannot_go_on() -> None:
    splice = Splice(request({"prompt": [1, 2, 3], "stream": True}))
    splice.begin_attempt(None)
    splice.on_event(b'data: {"id":"c","created":1,"choices":[{"index":0,"text":"a"}]}')
    assert splice.cut().continuation() == "a prompt of token ids, and no token ids from the engine"


def test_an_answer_assembled_from_vllms_stream_is_vllms_own_answer_byte_for_byte() -> None:
    # the same request, captured streamed and not: the stream assembled is the answer
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "return_token_ids": True,
            "temperature": 0}
    read = read_stream_request("/v1/completions", json.dumps(body).encode(), {},
                               assemble_answers=True)
    assert read is not None and read.assemble
    assert json.loads(read.upstream_body) == {**body, "stream": True,
                                              "stream_options": {"include_usage": True}}
    splice = Splice(read)
    splice.begin_attempt(None)
    for event in captured_events("completions-stream-token-ids.http"):
        splice.on_event(event)
    # that capture did not ask for usage; this is the chunk vLLM sends when asked
    splice.on_event(b'data: {"id":"cmpl-9ecf665361bdd0e3","object":"text_completion",'
                    b'"created":1796051753,"model":"tiny","choices":[],"usage":{'
                    b'"prompt_tokens":6,"total_tokens":12,"completion_tokens":6}}')
    whole = (CAPTURES / "completions-token-ids.http").read_bytes().split(b"\n\n", 2)[2]
    ours = assembled_answer(splice)
    real = json.loads(whole)
    assert json.loads(ours)["id"] == "cmpl-9ecf665361bdd0e3"
    assert ours.replace(b"cmpl-9ecf665361bdd0e3", real["id"].encode()).replace(
        b"1796051753", str(real["created"]).encode()) == whole
    # without the assemble setting, or with logprobs, a non-streamed request is not read
    assert read_stream_request("/v1/completions", json.dumps(body).encode(), {}) is None
    assert read_stream_request("/v1/completions", json.dumps({**body, "logprobs": 1}).encode(),
                               {}, assemble_answers=True) is None


# ---------------------------------------------------------------------- exact, or refused


def _cut_after(body: dict[str, Any], path: str, name: str, n: int) -> Splice:
    splice = Splice(request(body, path))
    splice.begin_attempt(None)
    for e in captured_events(name)[:n]:
        splice.on_event(e)
    return splice


def test_a_completion_without_max_tokens_keeps_vllms_default_of_16() -> None:
    splice = _cut_after({"model": "tiny", "prompt": "hello there", "stream": True},
                        "/v1/completions", "completions-stream-token-ids.http", 3)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    assert json.loads(plan.body)["max_tokens"] == 16 - 3


def _llamacpp_cut(body: dict[str, Any], texts: list[str]) -> Splice:
    """A completion streamed by llama-server (its chunks carry no token ids), cut after
    ``texts``: a stream of that shape, one token a chunk."""
    splice = Splice(request(body))
    splice.begin_attempt(None)
    for text in texts:
        splice.on_event(b"data: " + json.dumps({
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
            "created": 1, "model": "tiny", "system_fingerprint": "b1-x",
            "object": "text_completion", "id": "chatcmpl-x"}).encode())
    return splice


def test_a_completion_without_max_tokens_on_llamacpp_keeps_its_default_not_16() -> None:
    """llama.cpp gives a completion that names no limit its own default (``-n``), as a chat,
    not vLLM's 16: cut at 3 tokens on a server started with ``-n 40``, it goes on for 37
    (vLLM's rule would give the client 16 where the engine gave 40). Its default pushed, or
    the context left where the ids tell it; neither known (``-n`` -1, no ids): refused."""
    engine = CompletionDefault.ENGINE
    body = {"model": "tiny", "prompt": "Once upon", "stream": True, "temperature": 0}
    splice = _llamacpp_cut(body, [" a", " time", ","])
    assert splice.request.names_no_limit(engine) and not splice.request.names_no_limit()
    plan = splice.cut().continuation(upstream_fields=False, output_cap=40, completion=engine)
    assert not isinstance(plan, str) and plan.mode is Mode.TEXT
    assert json.loads(plan.body) == {**body, "prompt": "Once upon a time,", "max_tokens": 37}
    refusal = splice.cut().continuation(upstream_fields=False, completion=engine)
    assert isinstance(refusal, str) and "completion sent without max_tokens" in refusal
    assert "context length" in refusal
    # a limit it names is its own, whatever the engine's default
    named = _llamacpp_cut({**body, "max_tokens": 20}, [" a", " time", ","])
    assert not named.request.names_no_limit(engine)
    plan = named.cut().continuation(upstream_fields=False, output_cap=40, completion=engine)
    assert not isinstance(plan, str) and json.loads(plan.body)["max_tokens"] == 17
    # with the prompt's ids and the context known, the context left, as a chat's
    cut = _cut_after({"model": "tiny", "prompt": "hello there", "stream": True},
                     "/v1/completions", "completions-stream-token-ids.http", 3)
    assert cut.prompt_ids is not None
    plan = cut.cut().continuation(max_model_len=256, completion=engine)
    assert not isinstance(plan, str) and plan.mode is Mode.TOKENS
    assert json.loads(plan.body)["max_tokens"] == 256 - len(cut.prompt_ids) - 3


def test_a_completion_without_max_tokens_on_an_engine_of_no_known_kind_is_refused() -> None:
    """What an engine of no known kind (``openai``, or ``auto`` not recognised yet) gives a
    completion naming no limit is not known (16 on vLLM, its ``-n`` on llama.cpp, the
    context on TGI): such a completion, cut, ends with why, never goes on to a guess; one
    that names its limit goes on."""
    unknown = CompletionDefault.UNKNOWN
    body = {"model": "tiny", "prompt": "Once upon", "stream": True, "temperature": 0}
    refusal = _llamacpp_cut(body, [" a", " time"]).cut().continuation(
        upstream_fields=False, output_cap=40, completion=unknown)
    assert isinstance(refusal, str) and "no known kind" in refusal
    named = _llamacpp_cut({**body, "max_tokens": 9}, [" a", " time"])
    plan = named.cut().continuation(upstream_fields=False, completion=unknown)
    assert not isinstance(plan, str) and json.loads(plan.body)["max_tokens"] == 7
    # nothing of it reached the client: the request itself goes again, whatever its limit
    fresh = _llamacpp_cut(body, [])
    plan = fresh.cut().continuation(upstream_fields=False, completion=unknown)
    assert not isinstance(plan, str) and plan.mode is Mode.RESTART


def test_the_push_says_each_backends_completion_rule_else_the_routers_setting() -> None:
    """The rule comes with each backend's facts (its profile's word); a push that says
    nothing of it leaves what its ``upstream_fields`` says (vLLM's fields: vLLM's 16; not:
    not known), and, saying neither, the router's own assumption (:attr:`unsaid`)."""
    limits = EngineLimits(unsaid=CompletionDefault.UNKNOWN)
    pool, learner = _learner(limits)
    pool.replace(["http://l", "http://v", "http://o", "http://n"], {
        "http://l": BackendFacts(0, 1, completion_default=CompletionDefault.ENGINE,
                                 output_default=40),
        "http://v": BackendFacts(1, 1, upstream_fields=True),
        "http://o": BackendFacts(2, 1, upstream_fields=False),
        "http://n": BackendFacts(3, 1)})
    learner.forget()
    assert [limits.completion_rule(u) for u in ("http://l", "http://v", "http://o",
                                                "http://n", None)] == [
        CompletionDefault.ENGINE, CompletionDefault.FIXED, CompletionDefault.UNKNOWN,
        CompletionDefault.UNKNOWN, CompletionDefault.UNKNOWN]
    # llama.cpp's default binds a completion that names no limit there, as a chat's
    assert limits.output_cap("http://l", True) == 40
    pool.replace(["http://v"], {"http://v": BackendFacts(1, 1)})
    learner.forget()
    assert limits.completion == {}


def test_a_chat_without_max_tokens_keeps_the_context_left_or_refuses() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    splice = _cut_after(body, "/v1/chat/completions", "chat-stream-token-ids.http", 3)
    assert splice.request.names_no_limit()
    # vLLM's chat default: the context less the rendered prompt (5 ids), less what came (2)
    plan = splice.cut().continuation(max_model_len=256)
    assert not isinstance(plan, str) and plan.as_completion
    assert json.loads(plan.body)["max_tokens"] == 256 - 5 - 2
    refusal = splice.cut().continuation()
    assert isinstance(refusal, str) and "context length" in refusal


@pytest.mark.parametrize(("extra", "cause"), [
    # held back at the cut, in a sampled generation: its tokens would not come again the same
    ({"stop": ["\n\n\n\n"]}, "stop strings in a sampled generation"),
    ({"stop": ["\n\n\n\n"], "logprobs": 1, "temperature": 0},
     "logprobs, at a cut where stop strings held text back"),
    ({"presence_penalty": 0.5}, "penalties"),
    ({"frequency_penalty": -1}, "penalties"),
    ({"seed": 7, "temperature": 0.8}, "seed"),
    ({"seed": 7}, "seed"),  # vLLM's temperature 1: sampled
])
def test_what_a_new_prompt_cannot_carry_is_refused_with_its_cause(extra: dict[str, Any],
                                                                   cause: str) -> None:
    splice = _cut_after({"model": "tiny", "prompt": "hello there", "max_tokens": 9,
                         "stream": True, **extra},
                        "/v1/completions", "completions-stream-token-ids.http", 3)
    plan = splice.cut().continuation()
    assert isinstance(plan, str) and cause in plan


def test_a_seeded_greedy_generation_goes_on_and_a_seeded_sampled_one_starts_again() -> None:
    """At temperature 0 a seed draws nothing. A seeded sampled generation is reproducible
    only from its start: nothing of it has reached the client, it is sent again whole."""
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 9, "stream": True}
    splice = _cut_after({**body, "seed": 7, "temperature": 0},
                        "/v1/completions", "completions-stream-token-ids.http", 3)
    assert not isinstance(splice.cut().continuation(), str)
    splice = Splice(request({**body, "seed": 7, "temperature": 0.8}))
    splice.begin_attempt(None)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.mode is Mode.RESTART


def test_a_length_finish_short_of_the_limit_reveals_a_server_cap_the_continuation_keeps(
) -> None:
    """The capture asked 6 and got 6: asked 30, those 6 tokens ending ``"length"`` tell a cap
    of 6 on every request (vLLM's ``--override-generation-config`` ``max_new_tokens``)."""
    events = captured_events("completions-stream-token-ids.http")
    body = {"model": "tiny", "prompt": "hello there", "stream": True}
    assert _cut_after({**body, "max_tokens": 6}, "/v1/completions",
                      "completions-stream-token-ids.http", len(events)).revealed_cap(None) is None
    whole = _cut_after({**body, "max_tokens": 30}, "/v1/completions",
                       "completions-stream-token-ids.http", len(events))
    assert whole.revealed_cap(None) == (6, True)
    limits = EngineLimits()
    limits.learn_cap("a", (6, True))
    limits.learn_cap("b", (9, False))  # a chat with no limit: its default, for such chats only
    assert limits.output_cap("a", False) == 6 and limits.output_cap("b", False) is None
    assert limits.output_cap("b", True) == 9
    cut = _cut_after({**body, "max_tokens": 30}, "/v1/completions",
                     "completions-stream-token-ids.http", 3)
    plan = cut.cut().continuation(output_cap=6)
    assert not isinstance(plan, str) and json.loads(plan.body)["max_tokens"] == 6 - 3
    refusal = cut.cut().continuation(output_cap=20, next_output_cap=5)
    assert isinstance(refusal, str) and "server cap" in refusal
    # a chat with no limit: a finish short of the context left reveals its default's cap
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    whole = _cut_after(chat, "/v1/chat/completions", "chat-stream-token-ids.http", 8)
    assert whole.revealed_cap(256) == (6, False) and whole.revealed_cap(None) is None
    limits.forget({"b"})
    assert limits.output_cap("a", True) is None


def test_an_unknown_server_cap_continues_only_as_far_as_its_floor_proves() -> None:
    """Where a cap is not known, learn it or refuse (docs/design.md 4.1): the push says an
    attached engine's cap is unknown; what requests there produced proves a floor (vLLM ends
    every request at its cap). A cut whose limit the floor of the engine that began it does
    not cover, or whose tokens left the next one's does not, is refused with why and the fix;
    covered, it goes on; a stream of which nothing reached the client is sent again whole; a
    ``"length"`` finish that reveals the cap (on every request) makes it known."""
    limits = EngineLimits(unknown={"a": "no GET /server_info"})
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 30, "stream": True}
    cut = _cut_after(body, "/v1/completions", "completions-stream-token-ids.http", 3)

    def plan(began_on: str, backend: str) -> object:
        return cut.cut().continuation(began_unknown=limits.unknown_cap(began_on),
                                      next_unknown=limits.unknown_cap(backend))

    for began_on, backend, which, needed in (("a", "b", "the engine that began it", 30),
                                             ("b", "a", "the next engine", 27)):
        refusal = plan(began_on, backend)
        assert isinstance(refusal, str), refusal
        assert f"the server cap of {which} is unknown (no GET /server_info; 0 tokens proven " \
               f"of the {needed} needed" in refusal
        assert "output_cap" in refusal and "VLLM_SERVER_DEV_MODE=1" in refusal
    assert limits.unknown_cap("b") is None and limits.unknown_cap(None) is None
    # a floor one short of each need refuses; one that covers it continues
    limits.produced("a", 29, False)
    limits.produced("a", 5, False)  # a shorter generation proves less: the floor stays
    assert limits.unknown_cap("a") == UnknownCap(29, "no GET /server_info")
    assert isinstance(plan("a", "b"), str) and not isinstance(plan("b", "a"), str)
    limits.produced("a", 30, False)
    continued = plan("a", "b")
    assert not isinstance(continued, str) and json.loads(continued.body)["max_tokens"] == 27
    limits.floor["a"] = 26
    assert isinstance(plan("b", "a"), str)
    fresh = Splice(request(body))
    fresh.begin_attempt(None)
    whole = fresh.cut().continuation(began_unknown=limits.unknown_cap("a"))
    assert not isinstance(whole, str) and whole.mode is Mode.RESTART
    limits.learn_cap("a", (20, False))  # a chat's default: the cap on every request unknown
    assert limits.unknown_cap("a") is not None
    limits.learn_cap("a", (24, True))
    assert limits.unknown_cap("a") is None
    known = cut.cut().continuation(output_cap=limits.output_cap("a", False),
                                   began_unknown=limits.unknown_cap("a"))
    assert not isinstance(known, str) and json.loads(known.body)["max_tokens"] == 24 - 3
    limits.unknown["c"] = "why"
    limits.floor["c"] = 7
    limits.forget({"a"})
    assert limits.unknown == {} and limits.floor == {"a": 26}


ENGINE, SPARE = "http://127.0.0.1:8100", "http://127.0.0.1:8101"


def _learner(limits: EngineLimits) -> tuple[Pool, LimitsLearner]:
    pool = Pool([])
    return pool, LimitsLearner(pool, limits)


def _push(pool: Pool, learner: LimitsLearner, incarnation: str | None,
          models: tuple[ModelCard, ...] | None = None) -> None:
    """A push of an attached engine whose server cap is unknown, beside a spare with none."""
    pool.replace([ENGINE, SPARE], {
        ENGINE: BackendFacts(0, 1, incarnation=incarnation, models=models,
                             output_cap_unknown="no GET /server_info"),
        SPARE: BackendFacts(1, 1)})
    learner.forget()


def test_a_new_process_on_the_same_url_is_held_to_nothing_the_old_one_proved() -> None:
    """An engine restarted on its URL (attached, or started again with other flags) may have
    a smaller cap: a floor its old process proved must not let a continuation ask past the
    new one's, nor may a cap a finish revealed there or its context length outlive it. The
    push names the new process (its incarnation): all of it is forgotten before the push's
    own facts are taken, and learnt again."""
    limits = EngineLimits()
    pool, learner = _learner(limits)
    _push(pool, learner, "1795973023.5")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 30, "stream": True}
    cut = _cut_after(body, "/v1/completions", "completions-stream-token-ids.http", 3)

    def plan() -> object:
        return cut.cut().continuation(began_unknown=limits.unknown_cap(ENGINE),
                                      next_unknown=limits.unknown_cap(SPARE))

    limits.produced(ENGINE, 30, True)  # the old process ended a 30-token request: cap >= 30
    limits.context[ENGINE] = 256
    assert not isinstance(plan(), str)
    _push(pool, learner, "1795973023.5")  # the same process: it keeps all it proved
    assert not isinstance(plan(), str) and limits.context == {ENGINE: 256}
    _push(pool, learner, "1795979999.0")  # started again: its cap may now be 20
    refusal = plan()
    assert isinstance(refusal, str) and "0 tokens proven of the 30 needed" in refusal
    assert (limits.floor, limits.default_floor, limits.context) == ({}, {}, {})
    assert limits.unknown == {ENGINE: "no GET /server_info"}  # the push's own word, taken
    # a cap a finish revealed goes too (the push says it is unknown again)
    limits.learn_cap(ENGINE, (24, True))
    limits.learn_cap(ENGINE, (12, False))
    _push(pool, learner, "1795979999.0")
    assert limits.output_cap(ENGINE, True) == 12
    _push(pool, learner, "restart-seen-1")
    assert limits.output_cap(ENGINE, True) is None and limits.unknown_cap(ENGINE) is not None


@pytest.mark.parametrize("before,after,forgotten", [
    (None, None, False),  # no name either time: nothing tells a new process
    ("1795973023.5", None, True),  # a new process the ledger names no more (not read yet)
    (None, "restart-seen-1", True),  # a restart the ledger saw, named by it
    ("launch-3", "launch-3", False)])
def test_a_process_named_or_unnamed_anew_is_a_new_one(before: str | None, after: str | None,
                                                      forgotten: bool) -> None:
    """``None`` compares as a name: a change from or to it is a new process (forgetting
    costs only what is learnt again; keeping could ask past a new cap)."""
    limits = EngineLimits()
    pool, learner = _learner(limits)
    _push(pool, learner, before)
    limits.produced(ENGINE, 30, True)
    limits.produced(SPARE, 9, False)
    _push(pool, learner, after)
    assert limits.floor == ({SPARE: 9} if forgotten else {ENGINE: 30, SPARE: 9})
    # one that left and came back was forgotten when it left, whatever it is named
    limits.produced(ENGINE, 30, True)
    pool.replace([SPARE], {SPARE: BackendFacts(1, 1)})
    learner.forget()
    _push(pool, learner, after)
    assert limits.floor == {SPARE: 9}


class _Answer:
    def __init__(self, body: bytes, ready: asyncio.Event) -> None:
        self.body, self.ready = body, ready

    async def read(self) -> bytes:
        await self.ready.wait()
        return self.body

    def close(self) -> None:
        pass


class _Models:
    """An engine's ``/v1/models``, answered once ``ready`` is set."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len, self.asked = max_model_len, 0
        self.ready = asyncio.Event()

    async def request(self, target: object, method: str, headers: object,
                      body: bytes) -> _Answer:
        self.asked += 1
        card = {"id": "tiny", "max_model_len": self.max_model_len}
        return _Answer(json.dumps({"data": [card]}).encode(), self.ready)


async def test_a_new_process_has_its_context_read_again_not_the_old_ones_list() -> None:
    """Its context length is read again, from the engine, while the push still carries the
    old process's model list (the watchdog reads the new one's after the push that names
    it); a read of the old process under way when the new one is named is dropped."""
    limits = EngineLimits()
    pool, learner = _learner(limits)
    engine = _Models(512)
    learner.open(cast(UpstreamClient, engine), Address.parse)
    old = (ModelCard("tiny", max_model_len=256),)
    _push(pool, learner, "1795973023.5", old)
    learner.learn_context(ENGINE)
    assert limits.context == {ENGINE: 256} and engine.asked == 0  # the push said it
    _push(pool, learner, "1795979999.0", old)
    assert limits.context == {}
    learner.learn_context(ENGINE)  # the push's list is the old process's: asked
    await asyncio.sleep(0)
    assert engine.asked == 1
    _push(pool, learner, "restart-seen-1", old)  # restarted again while it was asked
    engine.ready.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert limits.context == {}  # that answer may be the process before
    learner.learn_context(ENGINE)
    for _ in range(3):
        await asyncio.sleep(0)
    assert limits.context == {ENGINE: 512} and engine.asked == 2
    new = (ModelCard("tiny", max_model_len=1024),)
    _push(pool, learner, "restart-seen-2", new)
    learner.learn_context(ENGINE)  # a list that is not the old one's: the push says it
    assert limits.context == {ENGINE: 1024} and engine.asked == 2
    learner.close()


def test_an_unknown_default_binds_only_a_chat_that_names_no_limit() -> None:
    """A model's default limit (its generation config's ``max_new_tokens``) not known here:
    only a chat that names no limit is held to it, by the floor of such chats there; the cap
    on every request and its floor are apart; a finish that reveals the default ends it."""
    limits = EngineLimits(default_unknown={"a": "not readable here"})
    assert limits.unknown_cap("a") is None  # a request that names a limit: not bound
    assert limits.unknown_cap("a", True) == UnknownCap(0, "not readable here", default=True)
    limits.produced("a", 40, False)  # a request naming a limit proves nothing of the default
    limits.produced("a", 12, True)
    assert limits.unknown_cap("a", True) == UnknownCap(12, "not readable here", default=True)
    limits.unknown["a"] = "no GET /server_info"  # both unknown: the lower floor binds
    assert limits.unknown_cap("a", True).default  # type: ignore[union-attr]
    limits.produced("a", 50, True)
    assert limits.unknown_cap("a", True) == UnknownCap(50, "no GET /server_info")
    refusal = UnknownCap(12, "x", default=True).short_of(40, "the engine that began it")
    assert refusal is not None and "the default limit of the engine that began it" in refusal
    assert "output_default" in refusal
    limits.learn_cap("a", (60, False))
    assert "a" not in limits.default_unknown and limits.default_cap == {"a": 60}
    limits.forget(set())
    assert limits.default_floor == {} and limits.floor == {}


def test_a_whole_generation_proves_its_engines_floor() -> None:
    """The tokens an attempt produced, counted by their ids, are the least its engine's cap
    can be; a continuation's attempt counts only its own; without ids, one a chunk but the
    final one (which may carry none); with several choices, nothing."""
    events = captured_events("completions-stream-token-ids.http")
    body = {"model": "tiny", "prompt": "hello there", "stream": True, "max_tokens": 30}
    whole = _cut_after(body, "/v1/completions", "completions-stream-token-ids.http",
                       len(events))
    assert whole.produced_here() == whole.produced == 6
    cut = _cut_after(body, "/v1/completions", "completions-stream-token-ids.http", 3)
    produced = cut.produced
    continuation = cut.cut().continuation()
    assert not isinstance(continuation, str)
    cut.begin_attempt(continuation)
    assert cut.produced_here() == 0 and cut.produced == produced
    cut.ids_complete = False  # counted by chunks: the final one may carry no token
    assert cut.produced_here() == 0
    whole.ids_complete = False
    assert whole.produced_here() == 5
    assert Splice(request({**body, "n": 2})).produced_here() is None


def _client_sees(outs: list[tuple[EventAction, bytes]], chat: bool) -> tuple[str, list[int]]:
    """The text and token ids a client reads from what the splice sent it."""
    text, ids = [], []
    for outcome, out in outs:
        if outcome is not EventAction.SEND:
            continue
        for c in json.loads(out.removeprefix(b"data: "))["choices"]:
            text.append((c["delta"].get("content") or "") if chat else c["text"])
            ids.extend(c.get("token_ids") or [])
    return "".join(text), ids


def _as_completion(event: bytes) -> bytes:
    """A chat chunk as vLLM writes the completion chunk of the same tokens."""
    if event.endswith(b"[DONE]"):
        return event
    chunk = json.loads(event.removeprefix(b"data: "))
    return b"data: " + json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": chunk["model"],
        "choices": [{"index": c["index"], "text": c["delta"].get("content") or "",
                     "logprobs": None, "finish_reason": c["finish_reason"],
                     "stop_reason": c.get("stop_reason"), "token_ids": c.get("token_ids")}
                    for c in chunk["choices"]]}).encode()


@pytest.mark.parametrize("wants_ids", [False, True])
@pytest.mark.parametrize(("path", "name", "inside", "body"), [
    # vLLM's own captures: a token that begins a character comes with empty text, and the
    # next one writes the character ("\ufffd": the tiny model's bytes are not valid UTF-8).
    ("/v1/completions", "completions-stream-token-ids.http", 2,
     {"model": "tiny", "prompt": "hello there", "max_tokens": 9, "stream": True,
      "temperature": 0}),
    ("/v1/chat/completions", "chat-stream-token-ids.http", 4,
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
      "stream": True, "temperature": 0}),
])
def test_a_cut_inside_a_character_continues_before_it_and_sends_nothing_twice(
        path: str, name: str, inside: int, body: dict[str, Any], wants_ids: bool) -> None:
    # Continued from ids ending inside a character, vLLM's detokenizer would start with no
    # prefix and write the whole decoded prompt in front of its first chunk: the prompt stops
    # before the token with no text, which is generated again and not sent twice.
    body = {**body, "return_token_ids": True} if wants_ids else body
    events = captured_events(name)
    chat = path.endswith("chat/completions")
    reference = _client_sees([(EventAction.SEND, e + b"\n\n") for e in events
                              if not e.endswith(b"[DONE]")], chat)
    splice = Splice(request(body, path))
    splice.begin_attempt(None)
    first = [splice.on_event(e) for e in events[:inside]]
    assert splice.unwritten == 1
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.mode is Mode.TOKENS
    sent = json.loads(plan.body)
    assert sent["prompt"] == (splice.prompt_ids or []) + splice.output_ids[:-1]
    assert plan.replay == (splice.output_ids[-1],)
    assert sent["max_tokens"] == 9 - (splice.produced - 1)
    splice.begin_attempt(plan)
    # The next engine gives the uninterrupted run's tokens from the one with no text on (a
    # chat's as a completion's chunks).
    rest = [splice.on_event(_as_completion(e) if chat else e) for e in events[inside - 1:]]
    assert rest[0] == (EventAction.SKIP, b"")  # the client had that token's chunk
    text, ids = _client_sees(first + rest, chat)
    assert text == reference[0] and "\ufffd" in text
    assert ids == (reference[1] if wants_ids else [])
    assert splice.output_ids == reference[1] and splice.produced == len(reference[1])


def test_a_chunk_of_several_tokens_is_generated_again_and_its_text_not_sent_twice() -> None:
    # Under load vLLM puts several tokens in a chunk: one with text may still end inside a
    # character, so only a one-token chunk with text marks where the engine wrote everything.
    events = captured_events("completions-stream-token-ids.http")
    reference = _client_sees([(EventAction.SEND, e + b"\n\n") for e in events
                              if not e.endswith(b"[DONE]")], False)
    merged = events[2].replace(b'"token_ids":[91]', b'"token_ids":[120,91]')
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 9, "stream": True,
            "temperature": 0, "return_token_ids": True}
    splice = Splice(request(body))
    splice.begin_attempt(None)
    first = [splice.on_event(e) for e in (events[0], merged)]
    assert splice.unwritten == 2
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    assert json.loads(plan.body)["prompt"] == (splice.prompt_ids or []) + [267]
    assert (plan.replay, plan.replay_text) == ((120, 91), "\ufffdt")
    splice.begin_attempt(plan)
    rest = [splice.on_event(e) for e in events[1:]]
    assert rest[:2] == [(EventAction.SKIP, b""), (EventAction.SKIP, b"")]
    assert _client_sees(first + rest, False) == reference
    # A replay whose text came out otherwise is refused.
    splice = Splice(request(body))
    splice.begin_attempt(None)
    for e in (events[0], merged):
        splice.on_event(e)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    splice.begin_attempt(plan)
    splice.on_event(events[1])
    assert splice.on_event(events[2].replace(b'"text":"\xef\xbf\xbdt"', b'"text":"xt"'))[0] is (
        EventAction.ENGINE_ERROR)
    assert "other tokens" in str(splice.cut().continuation())


def test_a_token_generated_again_otherwise_is_refused_where_the_client_had_its_id() -> None:
    events = captured_events("completions-stream-token-ids.http")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 9, "stream": True,
            "temperature": 0, "return_token_ids": True}
    splice = _cut_after(body, "/v1/completions", "completions-stream-token-ids.http", 2)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    splice.begin_attempt(plan)
    other = events[1].replace(b'"token_ids":[120]', b'"token_ids":[121]')
    assert splice.on_event(other) == (EventAction.ENGINE_ERROR, b"")
    refusal = splice.cut().continuation()
    assert isinstance(refusal, str) and "other tokens" in refusal
    # Sampled, the token would not come again the same: refused before it is tried.
    splice = _cut_after({**body, "temperature": 0.7}, "/v1/completions",
                        "completions-stream-token-ids.http", 2)
    assert "sampled" in str(splice.cut().continuation())
    # Logprobs' offsets for a token generated again are not rebuilt: refused.
    splice = _cut_after({**body, "logprobs": 1}, "/v1/completions",
                        "completions-stream-token-ids.http", 2)
    assert "inside a character" in str(splice.cut().continuation())


def test_reasoning_and_images_in_a_chat_are_refused() -> None:
    image = {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}
    splice = _cut_after({"model": "tiny", "messages": [image], "max_tokens": 9, "stream": True},
                        "/v1/chat/completions", "chat-stream-token-ids.http", 3)
    assert "non-text content" in str(splice.cut().continuation())
    splice = Splice(request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 9, "stream": True}, "/v1/chat/completions"))
    splice.begin_attempt(None)
    splice.on_event(captured_events("chat-stream-token-ids.http")[0])
    splice.on_event(b'data: {"id":"c","created":1,"choices":[{"index":0,"delta":'
                    b'{"reasoning_content":"hmm"},"token_ids":[7]}]}')
    assert "reasoning" in str(splice.cut().continuation())


def test_a_chat_cut_after_its_role_chunk_alone_is_sent_again_as_it_was() -> None:
    splice = _cut_after({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "stream": True, "stop": ["x"], "presence_penalty": 1},
                        "/v1/chat/completions", "chat-stream-token-ids.http", 1)
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    assert (plan.mode, plan.path, plan.body) == (Mode.RESTART, "/v1/chat/completions",
                                                 splice.request.upstream_body)
    splice.begin_attempt(plan)
    assert splice.on_event(captured_events("chat-stream-token-ids.http")[0]) == (
        EventAction.SKIP, b"")  # the role chunk, once was enough


def test_a_generation_whose_final_chunk_came_is_whole() -> None:
    events = captured_events("completions-stream-token-ids.http")
    final = next(i for i, e in enumerate(events) if b'"finish_reason":"length"' in e)
    splice = _cut_after({"model": "tiny", "prompt": "hello there", "stream": True,
                         "stream_options": {"include_usage": True}},
                        "/v1/completions", "completions-stream-token-ids.http", final)
    assert not splice.finished()
    splice.on_event(events[final])
    assert splice.finished()
    closing = splice.closing_usage()
    assert closing is not None and closing.startswith(b"data: ")
    usage = json.loads(closing.removeprefix(b"data: "))["usage"]
    assert usage["completion_tokens"] == splice.produced == final + 1
    assert usage["prompt_tokens"] == len(splice.prompt_ids or [])


def test_a_completions_logprobs_go_on_with_their_offsets_moved_past_the_clients_text() -> None:
    splice = _cut_after({"model": "tiny", "prompt": "hello there", "max_tokens": 9,
                         "logprobs": 1, "stream": True},
                        "/v1/completions", "completions-stream-token-ids.http", 3)
    had = len("".join(splice.text))
    plan = splice.cut().continuation()
    assert not isinstance(plan, str) and plan.mode is Mode.TOKENS
    splice.begin_attempt(plan)
    chunk = {"id": "cmpl-x", "object": "text_completion", "created": 2, "model": "tiny",
             "choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
                          "logprobs": {"text_offset": [0, 1], "token_logprobs": [-1.0, -2.0],
                                       "tokens": ["a", "b"], "top_logprobs": [{"a": -1.0},
                                                                              {"b": -2.0}]},
                          "finish_reason": None}]}
    _, data = splice.on_event(b"data: " + json.dumps(chunk).encode())
    logprobs = json.loads(data.removeprefix(b"data: "))["choices"][0]["logprobs"]
    assert had and logprobs["text_offset"] == [had, had + 1]
    assert logprobs["tokens"] == ["a", "b"]
    chat = _cut_after({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 9, "logprobs": True, "stream": True},
                      "/v1/chat/completions", "chat-stream-token-ids.http", 3)
    assert "logprobs" in str(chat.cut().continuation())


def test_logprobs_offsets_go_on_from_the_token_strings_not_the_text() -> None:
    # vLLM advances a completion's text_offset by each token's own string (decoded alone):
    # two tokens of one character are "" and "\ufffd\ufffd" there, one character of text.
    splice = Splice(request({"model": "tiny", "prompt": "hi", "max_tokens": 9, "logprobs": 0,
                             "temperature": 0, "stream": True}))
    splice.begin_attempt(None)

    def chunk(text: str, ids: list[int], tokens: list[str], offsets: list[int]) -> bytes:
        return b"data: " + json.dumps({
            "id": "c", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None,
                         "prompt_token_ids": [1, 2] if ids == [7] else None,
                         "logprobs": {"text_offset": offsets, "tokens": tokens,
                                      "token_logprobs": [-1.0] * len(ids),
                                      "top_logprobs": [{t: -1.0} for t in tokens]}}]}).encode()

    splice.on_event(chunk("a", [7], ["a"], [0]))
    splice.on_event(chunk("", [8], [""], [1]))
    splice.on_event(chunk("\u00e9", [9], ["\ufffd\ufffd"], [1]))
    assert "".join(splice.text) == "a\u00e9"  # 2 characters; the tokens' strings count 3
    plan = splice.cut().continuation()
    assert not isinstance(plan, str)
    splice.begin_attempt(plan)
    _, data = splice.on_event(chunk("b", [10], ["b"], [0]))
    assert json.loads(data.removeprefix(b"data: "))["choices"][0]["logprobs"][
        "text_offset"] == [3]


def test_several_choices_are_whole_only_once_each_has_finished() -> None:
    splice = Splice(request({"model": "tiny", "prompt": "x", "n": 2, "stream": True}))
    splice.begin_attempt(None)

    def final(index: int) -> bytes:
        return (b'data: {"id":"c","created":1,"choices":[{"index":%d,"text":"a",'
                b'"finish_reason":"length"}]}' % index)

    splice.on_event(final(0))
    assert not splice.finished()  # choice 1 may still be going: cut there, it is refused
    splice.on_event(final(1))
    assert splice.finished()


def test_a_cap_a_push_said_is_replaced_by_the_next_push_of_the_same_process() -> None:
    """The controller's word on a cap changes for one process only for a reason (a
    declaration changed or removed; a controller started afresh that has not read the engine
    yet): the next push's word replaces it, unknown or none included, rather than a cap no
    one vouches for any more being kept (too big: a continuation asks past the engine's cap;
    too small: it stops short). A cap a finish revealed is the process's own proof: kept
    while the push's changes, the least of the two holding."""
    limits = EngineLimits()
    pool, learner = _learner(limits)

    def push(cap: int | None, unknown: str | None, default: int | None = None) -> None:
        pool.replace([ENGINE], {ENGINE: BackendFacts(
            0, 1, incarnation="1795973023.5", output_cap=cap, output_cap_unknown=unknown,
            output_default=default,
            output_default_unknown=None if default is not None else unknown)})
        learner.forget()

    push(64, None, 48)
    assert (limits.cap, limits.default_cap, limits.unknown) == ({ENGINE: 64}, {ENGINE: 48}, {})
    push(None, "not read from the new process yet")  # the controller no longer says it
    assert (limits.cap, limits.default_cap) == ({}, {})
    assert limits.unknown == limits.default_unknown == {
        ENGINE: "not read from the new process yet"}
    assert limits.unknown_cap(ENGINE) is not None  # refused past its floor, not guessed
    push(32, None, 24)
    push(None, None)  # declared "none": it caps nothing
    assert (limits.cap, limits.default_cap, limits.unknown, limits.default_unknown) == (
        {}, {}, {}, {})
    # a finish revealed 20 under the pushed 64: the least holds, and outlives the push's word
    push(64, None)
    limits.learn_cap(ENGINE, (20, True))
    push(64, None)
    assert limits.cap == {ENGINE: 20}
    push(None, "no GET /server_info")
    assert limits.cap == {ENGINE: 20} and limits.unknown == {}
