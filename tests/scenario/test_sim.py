"""The simulated engine is faithful to real vLLM where a watchdog looks (docs/design.md section 10).

Shapes are compared with the real captures in tests/fixtures/vllm/; faults with what
REAL-ENGINES.md reports real vLLM doing. Most tests run the simulator in-process (the same class
the `fleetwarden sim` command runs); the process-level ones (ready line, signals, crash exit)
run the command.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.engine_metrics import JUDGED, Sample, parse
from fleetwarden.sim import FaultMode, Sim, SimConfig
from support.sim import SimProcess, metrics, set_fault, stats, until

pytestmark = pytest.mark.scenario

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"


def http_capture(name: str) -> tuple[int, dict[str, str], str]:
    head, _, body = (FIXTURES / name).read_bytes().decode().partition("\r\n\r\n")
    lines = head.split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def keys(obj: Any) -> Any:
    """The shape of a JSON value: its keys, recursively, in order."""
    if isinstance(obj, dict):
        return [(k, keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [keys(v) for v in obj[:1]]
    return type(obj).__name__ if obj is not None else None


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    async with Sim(SimConfig(slots=2, steps_per_s=50)) as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, path: str, body: Any
               ) -> tuple[int, str, str]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with http.post(url + path, data=data,
                         headers={"content-type": "application/json"}) as r:
        return r.status, r.headers.get("content-type", ""), await r.text()


# ------------------------------------------------------------------ /metrics


def families(text: str) -> dict[str, tuple[str, set[str], set[frozenset[str]]]]:
    """family -> (type, sample names, label-name sets), from prometheus-client's parser."""
    out = {}
    for f in text_string_to_metric_families(text):
        out[f.name] = (f.type, {s.name for s in f.samples},
                       {frozenset(s.labels) for s in f.samples})
    return out


async def test_the_sim_metrics_match_the_real_capture_family_by_family(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": "hello", "max_tokens": 3}) as r:
        assert r.status == 200
    async with http.get(sim.url + "/metrics") as r:
        assert r.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
        ours = families(await r.text())
    real = families((FIXTURES / "metrics-busy-1.txt").read_text())
    judged = {name.removesuffix("_total") if f.type == "counter" else name
              for name, f in JUDGED.items()}
    assert judged <= set(ours) and judged <= set(real)
    for name in sorted(judged):
        assert ours[name] == real[name], name  # type, sample names, label names
    # Beyond what the judge reads: every vllm family, except the engine's config-info gauge,
    # whose labels are the whole CacheConfig.
    vllm = {n for n in real if n.startswith("vllm:")} - {"vllm:cache_config_info"}
    for name in sorted(vllm):
        assert name in ours, name
        assert ours[name][0] == real[name][0] and ours[name][2] == real[name][2], name
    assert "vllm:cache_config_info" in ours
    assert {n for n in ours if n.startswith("vllm:")} == vllm | {"vllm:cache_config_info"}


async def test_an_engine_takes_steps_only_while_it_has_work(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    before = await metrics(http, sim.url)
    assert before.idle and before.steps == 0
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": "hello", "max_tokens": 5}) as r:
        body = await r.json()
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 11, "completion_tokens": 5,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    after = await metrics(http, sim.url)
    # One step reads the prompt and samples the first token; four more decode the rest.
    assert (after.steps, after.generation_tokens, after.prompt_tokens,
            after.finished_requests) == (5, 5, 6, 1)
    assert after.idle
    await asyncio.sleep(0.2)  # an idle engine takes no steps, however long it sits
    assert await metrics(http, sim.url) == after


async def test_requests_beyond_the_slots_wait(sim: Sim, http: aiohttp.ClientSession) -> None:
    tasks = [asyncio.create_task(post(http, sim.url, "/v1/completions",
                                      {"prompt": "x", "max_tokens": 4000})) for _ in range(5)]

    async def queued() -> bool:
        s = await metrics(http, sim.url)
        return (s.running, s.waiting) == (2, 3)

    try:
        await until(queued)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def aborted() -> bool:  # a client that goes away aborts its request in the engine
        return (await metrics(http, sim.url)).idle

    await until(aborted)
    assert (await metrics(http, sim.url)).finished_requests == 0  # an abort is no success


async def test_a_client_that_leaves_a_stream_aborts_its_request(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": "x", "max_tokens": 4000, "stream": True}) as r:
        assert (await r.content.readline()).startswith(b"data: ")
        assert (await metrics(http, sim.url)).running == 1
    # the response is closed unread: the connection goes, and the engine drops the request

    async def idle() -> bool:
        return (await metrics(http, sim.url)).idle

    await until(idle)


async def test_a_long_prompt_prefills_over_several_steps_without_output_tokens(
    http: aiohttp.ClientSession,
) -> None:
    async with Sim(SimConfig(steps_per_s=50, max_num_batched_tokens=100)) as sim:
        status, _, body = await post(http, sim.url, "/v1/completions",
                                     {"prompt": "y" * 999, "max_tokens": 2})
        assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 1000
        s = await metrics(http, sim.url)
    assert s.steps == 11  # ten chunks of 100 prompt tokens (the last samples a token), 1 decode
    assert (s.generation_tokens, s.prompt_tokens) == (2, 1000)


# ------------------------------------------------------------------ the OpenAI API


async def test_completions_and_chat_have_vllm_shapes(sim: Sim, http: aiohttp.ClientSession
                                                     ) -> None:
    for path, capture, body in [
        ("/v1/completions", "completions.http",
         {"model": "tiny", "prompt": "hello", "max_tokens": 8}),
        ("/v1/chat/completions", "chat.http",
         {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}),
    ]:
        status, ctype, text = await post(http, sim.url, path, body)
        real_status, real_headers, real_body = http_capture(capture)
        assert (status, ctype) == (real_status, real_headers["content-type"])
        assert keys(json.loads(text)) == keys(json.loads(real_body)), path
        assert ",\"" in text and ", \"" not in text  # compact, as vLLM writes it


@pytest.mark.parametrize("path,capture,body", [
    ("/v1/completions", "completions-stream.http",
     {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}),
    ("/v1/completions", "completions-stream-usage.http",
     {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", "chat-stream.http",
     {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
      "stream": True}),
])
async def test_streams_are_vllm_sse(sim: Sim, http: aiohttp.ClientSession, path: str,
                                    capture: str, body: dict[str, Any]) -> None:
    status, ctype, text = await post(http, sim.url, path, body)
    _, real_headers, real_body = http_capture(capture)
    assert (status, ctype) == (200, real_headers["content-type"])
    ours, real = sse_events(text), sse_events(real_body)
    assert ours[-1] == real[-1] == "[DONE]"
    # One event per token (8), the chat role first, the usage chunk when asked for: event by
    # event, the same keys in the same order.
    assert [keys(json.loads(e)) for e in ours[:-1]] == [keys(json.loads(e)) for e in real[:-1]]


@pytest.mark.parametrize("capture,body", [
    ("error-bad-json.http", "this is not json"),
    ("error-unknown-model.http", {"model": "nope", "prompt": "hello", "max_tokens": 8}),
    ("error-max-tokens.http", {"model": "tiny", "prompt": "hello", "max_tokens": 10000}),
])
async def test_errors_have_vllm_statuses_and_bodies(
    http: aiohttp.ClientSession, capture: str, body: Any
) -> None:
    async with Sim(SimConfig(max_model_len=512)) as sim:  # the captured server's context
        status, ctype, text = await post(http, sim.url, "/v1/completions", body)
    real_status, real_headers, real_body = http_capture(capture)
    assert (status, ctype) == (real_status, real_headers["content-type"])
    assert json.loads(text) == json.loads(real_body)


async def test_a_prompt_longer_than_the_context_is_vllms_400(http: aiohttp.ClientSession
                                                             ) -> None:
    async with Sim(SimConfig(max_model_len=512)) as sim:
        status, _, text = await post(http, sim.url, "/v1/completions",
                                     {"model": "tiny", "prompt": "hello world " * 600,
                                      "max_tokens": 8})
    real_status, _, real_body = http_capture("error-context-length.http")
    assert status == real_status and json.loads(text) == json.loads(real_body)


async def test_models_health_tokenize_and_detokenize(sim: Sim, http: aiohttp.ClientSession
                                                     ) -> None:
    async with http.get(sim.url + "/v1/models") as r:
        assert keys(await r.json()) == keys(json.loads(http_capture("models.http")[2]))
    async with http.get(sim.url + "/health") as r:
        assert (r.status, await r.read()) == (200, b"")
    status, _, text = await post(http, sim.url, "/tokenize", {"prompt": "héllo"})
    tokens = json.loads(text)["tokens"]
    assert status == 200 and json.loads(text)["count"] == len(tokens) == 7
    status, _, text = await post(http, sim.url, "/detokenize", {"tokens": tokens})
    assert (status, json.loads(text)) == (200, {"prompt": "héllo"})
    async with http.get(sim.url + "/no/such/path") as r:
        assert (r.status, await r.json()) == (404, {"detail": "Not Found"})


# ------------------------------------------------------------------ faults


async def test_a_wedged_engine_accepts_never_answers_and_freezes_every_metric(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    long = [asyncio.create_task(post(http, sim.url, "/v1/completions",
                                     {"prompt": "x", "max_tokens": 60})) for _ in range(2)]

    async def running() -> bool:
        return (await metrics(http, sim.url)).running == 2

    await until(running)
    await set_fault(http, sim.url, "wedge")
    frozen = await metrics(http, sim.url)
    held = asyncio.create_task(post(http, sim.url, "/v1/completions",
                                    {"prompt": "x", "max_tokens": 2}))
    await asyncio.sleep(0.5)  # 25 steps' worth of time: nothing may move
    assert await metrics(http, sim.url) == frozen and frozen.running == 2
    assert not any(t.done() for t in [*long, held])
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    assert (await stats(http, sim.url))["engine"]["held"] == 1

    await set_fault(http, sim.url, None)  # as SIGCONT: everything held completes
    results = await asyncio.wait_for(asyncio.gather(*long, held), 20)
    assert [status for status, _, _ in results] == [200, 200, 200]


async def test_a_fault_with_a_duration_clears_itself(sim: Sim, http: aiohttp.ClientSession
                                                     ) -> None:
    await set_fault(http, sim.url, "wedge", duration_s=0.3)
    status, _, _ = await asyncio.wait_for(
        post(http, sim.url, "/v1/completions", {"prompt": "x", "max_tokens": 2}), 20)
    assert status == 200 and sim.fault.mode is None


async def test_crash_answers_in_flight_requests_with_vllms_500_then_the_process_exits(
    spawn: Any, http: aiohttp.ClientSession
) -> None:
    proc: SimProcess = spawn("--slots", "2")
    long = [asyncio.create_task(post(http, proc.url, "/v1/completions",
                                     {"prompt": "x", "max_tokens": 4000})) for _ in range(2)]

    async def running() -> bool:
        return (await metrics(http, proc.url)).running == 2

    await until(running)
    await set_fault(http, proc.url, "crash")
    results = await asyncio.wait_for(asyncio.gather(*long), 20)
    _, headers, body = http_capture("engine-dead.http")
    for status, ctype, text in results:
        assert (status, ctype, text) == (500, headers["content-type"], body)
    assert await asyncio.to_thread(proc.wait, 20) != 0
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(proc.url + "/health"):
            pass


async def test_refuse_closes_the_listening_socket_and_the_process_stays(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    await set_fault(http, sim.url, "refuse")
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with fresh.get(sim.url + "/health"):
                pass
        await sim.set_fault(None)  # its control endpoint is behind the closed socket too
        async with fresh.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_restart_is_a_new_process_with_counters_from_zero(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    await post(http, sim.url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    old = await metrics(http, sim.url)
    in_flight = asyncio.create_task(post(http, sim.url, "/v1/completions",
                                         {"prompt": "x", "max_tokens": 4000}))

    async def running() -> bool:
        return (await metrics(http, sim.url)).running == 1

    await until(running)
    await set_fault(http, sim.url, "restart")
    with pytest.raises(aiohttp.ClientError):  # dropped with the old process's connections
        await asyncio.wait_for(in_flight, 20)
    new = await metrics(http, sim.url)
    assert old.start_time is not None and new.start_time is not None
    assert new.start_time > old.start_time
    assert new == Sample(running=0, waiting=0, steps=0, generation_tokens=0,
                         start_time=new.start_time, sleep_level=0)
    assert sim.fault.mode is None  # a restart is an event, not a state


async def test_slow_divides_the_step_rate(http: aiohttp.ClientSession) -> None:
    async with Sim(SimConfig(steps_per_s=20)) as sim:
        await sim.set_fault(FaultMode.SLOW, factor=10)  # 2 steps per second
        task = asyncio.create_task(post(http, sim.url, "/v1/completions",
                                        {"prompt": "x", "max_tokens": 1000}))
        try:
            await asyncio.sleep(1.0)
            slow_steps = (await metrics(http, sim.url)).steps
            await sim.set_fault(None)
            await asyncio.sleep(1.0)
            fast_steps = (await metrics(http, sim.url)).steps - slow_steps
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert 1 <= slow_steps <= 4  # never faster than the rate; a slow machine only slows it
    assert fast_steps > 2 * slow_steps


async def test_error5xx_fails_generations_and_nothing_else(sim: Sim,
                                                           http: aiohttp.ClientSession) -> None:
    await set_fault(http, sim.url, "error5xx")
    status, _, text = await post(http, sim.url, "/v1/completions", {"prompt": "x"})
    assert status == 500 and json.loads(text) == json.loads(http_capture("engine-dead.http")[2])
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    assert isinstance(await metrics(http, sim.url), Sample)


async def test_no_metrics_and_garbage_metrics(sim: Sim, http: aiohttp.ClientSession) -> None:
    await set_fault(http, sim.url, "no_metrics")
    async with http.get(sim.url + "/metrics") as r:
        assert r.status == 404
    await set_fault(http, sim.url, "garbage_metrics")
    async with http.get(sim.url + "/metrics") as r:
        assert r.status == 200 and not isinstance(parse(await r.read()), Sample)


async def test_a_bad_fault_is_refused_with_the_allowed_modes(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/sim/fault", json={"mode": "melt"}) as r:
        assert r.status == 400 and "wedge" in (await r.json())["error"]
    async with http.delete(sim.url + "/sim/fault") as r:
        assert (await r.json())["fault"]["mode"] is None


async def test_stats_list_every_request_with_its_request_id(
    http: aiohttp.ClientSession,
) -> None:
    async with Sim(SimConfig(stats_log_size=3)) as sim:
        for i in range(4):
            async with http.get(sim.url + "/health", headers={"x-request-id": f"r{i}"}):
                pass
        await post(http, sim.url, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        s = await stats(http, sim.url)
    assert s["by_path"] == {"/health": 4, "/v1/completions": 1, "/sim/stats": 1}
    assert s["received"] == 6
    assert [(e["method"], e["path"], e["request_id"]) for e in s["log"]] == [
        ("GET", "/health", "r3"), ("POST", "/v1/completions", None), ("GET", "/sim/stats", None)]


# ------------------------------------------------------------------ the process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_the_sim_command_prints_ready_and_exits_cleanly_on_a_signal(
    spawn: Any, http: aiohttp.ClientSession, sig: int
) -> None:
    proc: SimProcess = spawn("--slots", "1", "--model", "m")
    async with http.get(proc.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "m"
    busy = asyncio.create_task(post(http, proc.url, "/v1/completions",
                                    {"model": "m", "prompt": "x", "max_tokens": 4000}))

    async def running() -> bool:
        return (await metrics(http, proc.url)).running == 1

    await until(running)
    proc.terminate(sig)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    await asyncio.gather(busy, return_exceptions=True)


async def test_the_sim_command_can_start_with_a_fault(spawn: Any,
                                                      http: aiohttp.ClientSession) -> None:
    proc: SimProcess = spawn("--fault", "no_metrics")
    async with http.get(proc.url + "/metrics") as r:
        assert r.status == 404
    async with http.get(proc.url + "/sim/fault") as r:
        assert (await r.json())["fault"]["mode"] == "no_metrics"


# ------------------------------------------------------------------ sleep mode


def sleep_family(text: str) -> list[str]:
    """The ``vllm:engine_sleep_state`` lines, HELP and TYPE included."""
    return [line for line in text.splitlines() if "vllm:engine_sleep_state" in line]


async def test_sleep_mode_is_vllms_endpoints_and_metric_and_holds_generations_until_woken(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    capture = (FIXTURES / "continuation-and-sleep" / "metrics-sleeping.txt").read_text()
    async with http.get(sim.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    long = asyncio.create_task(post(http, sim.url, "/v1/completions",
                                    {"prompt": "x", "max_tokens": 40}))

    async def running() -> bool:
        return (await metrics(http, sim.url)).running == 1

    await until(running)
    async with http.post(sim.url + "/sleep?level=1") as r:
        assert r.status == 200 and await r.json() == {"status": "sleeping", "level": 1}
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    assert sleep_family(text) == sleep_family(capture)  # byte for byte, as vLLM 0.32 writes it
    asleep = await metrics(http, sim.url)
    assert asleep.sleep_level == 1 and asleep.idle  # 0 running, 0 waiting: it shows nothing
    held = asyncio.create_task(post(http, sim.url, "/v1/completions",
                                    {"prompt": "x", "max_tokens": 2}))
    await asyncio.sleep(0.5)  # 25 steps' worth of time: nothing moves, nothing is answered
    assert await metrics(http, sim.url) == asleep
    assert not long.done() and not held.done()
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    async with http.get(sim.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    async with http.post(sim.url + "/sleep?level=3") as r:
        assert r.status == 400
    async with http.post(sim.url + "/sleep?level=2") as r:
        assert await r.json() == {"status": "sleeping", "level": 2}
    assert (await metrics(http, sim.url)).sleep_level == 2

    async with http.post(sim.url + "/wake_up") as r:
        assert r.status == 200
    results = await asyncio.wait_for(asyncio.gather(long, held), 20)
    assert [status for status, _, _ in results] == [200, 200]
    woke = await metrics(http, sim.url)
    assert woke.sleep_level == 0 and woke.steps > asleep.steps
    async with http.get(sim.url + "/metrics") as r:
        assert sleep_family(await r.text())[2:] == [
            'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 1.0',
            'vllm:engine_sleep_state{engine="0",model_name="tiny",'
            'sleep_state="weights_offloaded"} 0.0',
            'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="discard_all"} 0.0']


# ------------------------------------------------------------------ the prefix cache


def prefix_counters(text: str) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from a /metrics body."""
    found = {s.name: s.value for f in text_string_to_metric_families(text)
             for s in f.samples if s.name.startswith("vllm:prefix_cache_")}
    return found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"]


async def test_the_prefix_cache_counts_hits_as_vllm_and_empties_on_reset_sleep_and_restart(
    sim: Sim, http: aiohttp.ClientSession
) -> None:
    prompt = {"prompt": "s" * 99, "max_tokens": 1}  # 100 tokens with the BOS: 6 full blocks

    async def counters() -> tuple[float, float]:
        async with http.get(sim.url + "/metrics") as r:
            return prefix_counters(await r.text())

    async def send_twice() -> tuple[float, float]:
        for _ in range(2):
            status, _, _ = await post(http, sim.url, "/v1/completions", prompt)
            assert status == 200
        return await counters()

    assert await send_twice() == (200, 96)  # the second finds 6 blocks
    # What a watchdog reads of them: the engine's actual hit rate.
    assert (await metrics(http, sim.url)).prefix_cache_hit_rate == 96 / 200
    async with http.post(sim.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    assert await send_twice() == (400, 192)  # the first after the reset found nothing
    async with http.post(sim.url + "/sleep?level=1") as r:
        assert r.status == 200
    async with http.post(sim.url + "/wake_up") as r:
        assert r.status == 200
    assert await send_twice() == (600, 288)
    await set_fault(http, sim.url, "restart")
    assert await send_twice() == (200, 96)  # a new process: counters and cache from zero
