"""The simulated engine is as strict as vLLM 0.32 on what the exactness oracle grades.

Checked against the real captures in ``tests/fixtures/vllm/defaults-and-stops/`` (vLLM 0.32.0,
``--max-model-len 256``): ``max_tokens`` absent (16 for a completion; the context left for a
chat), and a stop string's hold-back (chunks whose ``token_ids`` run ahead of their empty
``text``; the matched string never sent; ``stop_reason`` the string). The rules the simulator
follows beyond the captures (stop ids, ``min_tokens``, ``ignore_eos``, penalties) are tested on
:mod:`fleetwarden.sim.sampling` itself, from vLLM's source.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.sim import Sim, SimConfig, wire
from fleetwarden.sim.config import FaultMode
from fleetwarden.sim.sampling import EOS, Generation, Params, parse_params
from scenario.test_sim_continuation import keys

pytestmark = pytest.mark.scenario

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm" / "defaults-and-stops"


def captured(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(request body, the stream's chunks) of one capture."""
    text = (CAPTURES / name).read_bytes().decode()
    request, _, answer = text.partition("\n\n")
    body = answer.partition("\n\n")[2]
    assert body.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[len("data: "):]) for e in body.split("\n\n")[:-2]]
    return json.loads(request.split("\n", 1)[1]), chunks


def tokens(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]


def text(chunks: list[dict[str, Any]]) -> str:
    return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                   for c in chunks for ch in c["choices"])


def finish(chunks: list[dict[str, Any]]) -> tuple[Any, Any]:
    last = [ch for c in chunks for ch in c["choices"] if ch.get("finish_reason")][-1]
    return last["finish_reason"], last.get("stop_reason")


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    async with Sim(SimConfig(steps_per_s=1000, max_model_len=256)) as s:
        yield s


async def stream(http: aiohttp.ClientSession, sim: Sim, body: dict[str, Any],
                 path: str) -> list[dict[str, Any]]:
    async with http.post(sim.url + path, json=body) as r:
        raw = (await r.read()).decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    return [json.loads(e[len("data: "):]) for e in raw.split("\n\n")[:-2]]


@pytest.mark.parametrize(("name", "path"), [
    ("completions-stream-no-max-tokens.http", "/v1/completions"),
    ("chat-stream-no-max-tokens.http", "/v1/chat/completions"),
])
async def test_without_max_tokens_the_sim_generates_what_vllm_does(
        sim: Sim, http: aiohttp.ClientSession, name: str, path: str) -> None:
    request, real = captured(name)
    ours = await stream(http, sim, request, path)
    assert [keys(c) for c in ours[:2]] == [keys(c) for c in real[:2]]
    assert finish(ours) == finish(real) == ("length", None)
    if path == "/v1/completions":
        assert len(tokens(ours)) == len(tokens(real)) == 16
    else:  # the context (256) less the rendered prompt, whatever the template's length
        assert len(tokens(real)) == 256 - len(real[0]["prompt_token_ids"]) == 248
        assert len(tokens(ours)) == 256 - len(ours[0]["prompt_token_ids"])


async def test_a_stop_string_is_held_back_and_never_sent_as_vllm_does(
        sim: Sim, http: aiohttp.ClientSession) -> None:
    request, real = captured("completions-stream-stop-string.http")
    _, real_reference = captured("completions-stream-reference-60.http")
    # What the capture shows: token ids running ahead of empty text, the stop string absent,
    # and the text the reference's up to where the string begins.
    assert sum(1 for c in real if c["choices"][0]["token_ids"] and
               not c["choices"][0]["text"]) == 5
    stop = request["stop"][0]
    assert finish(real) == ("stop", stop) and stop not in text(real)
    assert text(real_reference).startswith(text(real))
    # The same on the sim: a stop string made of its reference's text across chunks 20-21.
    body = {**request, "stop": None}
    reference = await stream(http, sim, body, "/v1/completions")
    pieces = [c["choices"][0]["text"] for c in reference]
    ours_stop = pieces[19][-3:] + pieces[20][:3]
    assert len(ours_stop) == 6
    ours = await stream(http, sim, {**request, "stop": [ours_stop]}, "/v1/completions")
    assert [keys(c) for c in ours[:2]] == [keys(c) for c in real[:2]]
    assert finish(ours) == ("stop", ours_stop) and ours_stop not in text(ours)
    assert text(reference).startswith(text(ours))
    assert text(ours) + ours_stop == text(reference)[:len(text(ours)) + len(ours_stop)]
    assert tokens(ours) == tokens(reference)[:len(tokens(ours))]
    assert len(tokens(ours)) == 21
    held = [c for c in ours if c["choices"][0]["token_ids"] and not c["choices"][0]["text"]]
    assert held  # ids ahead of empty text while the string might begin


async def test_bad_sampling_fields_are_refused_as_vllm_refuses_them(
        sim: Sim, http: aiohttp.ClientSession) -> None:
    for bad in ({"max_tokens": 0}, {"min_tokens": 9, "max_tokens": 4},
                {"presence_penalty": 3}, {"logprobs": 99}, {"stop": 7}, {"n": 0}):
        async with http.post(sim.url + "/v1/completions",
                             json={"model": "tiny", "prompt": "x", **bad}) as r:
            assert r.status == 400, bad
            assert (await r.json())["error"]["type"] == "BadRequestError"


# ---------------------------------------------------------------------- the rules themselves


def run(params: Params, prompt: str = "hello there", eos_period: int = 0) -> Generation:
    g = Generation(wire.encode(prompt), params, eos_period)
    while g.sample() is not None:
        pass
    return g


def test_a_stop_token_ends_with_its_id_and_its_text_only_where_asked() -> None:
    free = run(Params(max_tokens=40))
    stop_id = free.output[5]
    first = free.output.index(stop_id)
    g = run(Params(max_tokens=40, stop_token_ids=frozenset({stop_id})))
    assert (g.finish_reason, g.stop_reason, len(g.output)) == ("stop", stop_id, first + 1)
    assert g.text == wire.decode(free.output[:first])
    kept = run(Params(max_tokens=40, stop_token_ids=frozenset({stop_id}),
                      include_stop_str_in_output=True))
    assert kept.text == wire.decode(free.output[:first + 1])
    later = run(Params(max_tokens=40, stop_token_ids=frozenset({stop_id}),
                       min_tokens=first + 1))
    # before min_tokens the stop id is masked (never sampled), as vLLM's logits processor does
    assert stop_id not in later.output[:first + 1] and len(later.output) > first + 1


def test_eos_ends_a_generation_unless_ignored_or_before_min_tokens() -> None:
    g = run(Params(max_tokens=150), eos_period=8)
    assert g.finish_reason == "stop" and g.output[-1] == EOS and g.stop_reason is None
    n = len(g.output)
    assert EOS not in run(Params(max_tokens=150, ignore_eos=True), eos_period=8).output
    late = run(Params(max_tokens=150, min_tokens=n + 2), eos_period=8)
    assert EOS not in late.output[:n + 2]


def test_penalties_depend_on_the_output_so_far() -> None:
    plain = run(Params(max_tokens=40))
    penalised = run(Params(max_tokens=40, presence_penalty=1.5))
    assert plain.output != penalised.output
    # the same prompt and output as a prompt: without the counts the next token differs
    cut = 10
    resumed = Generation(wire.encode("hello there") + penalised.output[:cut],
                         Params(max_tokens=30, presence_penalty=1.5))
    while resumed.sample() is not None:
        pass
    assert resumed.output != penalised.output[cut:]


def test_include_stop_str_in_output_sends_the_match_and_holds_nothing_back() -> None:
    free = run(Params(max_tokens=40))
    stop = free.text[20:26]
    g = run(Params(max_tokens=40, stop=(stop,), include_stop_str_in_output=True))
    assert g.hold_back == 0 and g.text.endswith(stop) and g.stop_reason == stop
    held = Generation(wire.encode("hello there"), Params(max_tokens=40, stop=(stop,)))
    assert held.hold_back == len(stop) - 1


@pytest.mark.parametrize("engine", ["sglang", "llamacpp"])
async def test_other_dialects_refuse_what_openais_api_does_not_take(
        http: aiohttp.ClientSession, engine: str) -> None:
    async with Sim(SimConfig(steps_per_s=1000, engine=engine)) as s:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3}
        for path, body, field in [
            ("/v1/completions", {"model": "tiny", "prompt": "x", "return_token_ids": True},
             "return_token_ids"),
            ("/v1/chat/completions", {**chat, "continue_final_message": True},
             "continue_final_message"),
            ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]}, "prompt"),
        ]:
            async with http.post(s.url + path, json=body) as r:
                assert r.status == 400, field
                error = (await r.json())["error"]
                assert error["type"] == "invalid_request_error" and field in error["message"]
        async with http.post(s.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200  # what OpenAI's API takes, it takes


async def test_several_choices_of_a_greedy_sample_are_refused_as_vllm_refuses_them(
        sim: Sim, http: aiohttp.ClientSession) -> None:
    body = {"model": "tiny", "prompt": "x", "n": 2, "max_tokens": 3}
    async with http.post(sim.url + "/v1/completions", json={**body, "temperature": 0}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == (
            "n must be 1 when using greedy sampling, got 2.")  # real vLLM 0.32's words
    async with http.post(sim.url + "/v1/completions", json={**body, "temperature": 0.5}) as r:
        assert r.status == 200 and len((await r.json())["choices"]) == 2


async def test_a_crashed_engine_takes_no_sleep_wake_or_cache_call(
        http: aiohttp.ClientSession) -> None:
    """vLLM's sleep, wake-up, is-sleeping and prefix-cache endpoints call into its engine
    core; with the core dead each raises EngineDeadError, answered 500 as a generation is
    (vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py). A sim that slept a
    crashed engine let the fleet model sleep, then credit, an engine that had died."""
    async with Sim(SimConfig(steps_per_s=1000, crash_exit_s=30)) as s:
        async with http.post(s.url + "/sleep", params={"level": "1"}) as r:
            assert r.status == 200
        async with http.post(s.url + "/wake_up") as r:
            assert r.status == 200
        await s.set_fault(FaultMode.CRASH)
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache")):
            async with http.request(method, s.url + path) as r:
                assert r.status == 500, path
                assert "EngineCore encountered an issue" in (await r.json())["error"]["message"]
        assert s.sleep_level == 0


async def test_a_crash_not_yet_noticed_holds_its_requests_then_fails_them(
        http: aiohttp.ClientSession) -> None:
    """vLLM 0.32's API server learns that its core died from a monitor thread: until then it
    holds what it took, answers /health 200, and its gauges stay where the kill left them;
    then every request in it ends 500 (``crash_notice_s``)."""
    import asyncio

    async with Sim(SimConfig(steps_per_s=50, crash_exit_s=30, crash_notice_s=0.5)) as s:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}
        held = asyncio.ensure_future(http.post(s.url + "/v1/completions", json=body))
        await asyncio.sleep(0.1)  # it runs
        await s.set_fault(FaultMode.CRASH)
        def engine_lines(text: str) -> list[str]:
            return [line for line in text.splitlines() if line.startswith("vllm:")]

        async with http.get(s.url + "/metrics") as r:
            frozen = engine_lines(await r.text())
        async with http.get(s.url + "/health") as r:
            assert r.status == 200  # not noticed yet
        await asyncio.sleep(0.2)
        async with http.get(s.url + "/metrics") as r:
            assert engine_lines(await r.text()) == frozen  # no step since the kill
        assert not held.done()
        async with await held as r:
            assert r.status == 500
            assert "EngineCore encountered an issue" in (await r.json())["error"]["message"]
        async with http.get(s.url + "/health") as r:
            assert r.status == 503


def test_server_caps_limit_the_output_as_vllms_get_max_tokens_does() -> None:
    """vLLM's ``get_max_tokens``: the override's ``max_new_tokens`` caps even a request that
    names more; the generation config's is only the default of a chat that names none."""
    def limit(body: dict[str, Any], chat: bool, **caps: int) -> int:
        params = parse_params(body, chat=chat, prompt_tokens=10, max_model_len=100,
                              reasoning_parser=False, **caps)
        assert isinstance(params, Params), params
        return params.max_tokens

    assert limit({"max_tokens": 50}, False, override_max_new_tokens=20) == 20
    assert limit({"max_tokens": 50}, True, override_max_new_tokens=20) == 20
    assert limit({"max_tokens": 5}, True, override_max_new_tokens=20) == 5
    assert limit({}, True, override_max_new_tokens=20) == 20
    assert limit({}, True, override_max_new_tokens=200) == 90  # the context left
    assert limit({}, False, override_max_new_tokens=20) == 16  # a completion's default
    assert limit({"max_tokens": 50}, True, default_max_new_tokens=20) == 50
    assert limit({}, True, default_max_new_tokens=20) == 20
    # the override replaces the model's default
    assert limit({}, True, default_max_new_tokens=20, override_max_new_tokens=30) == 30
