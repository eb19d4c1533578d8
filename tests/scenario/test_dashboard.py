"""The dashboard's server side on a real fleet: the sign-in, the cookie, and the event stream
(a hello, a snapshot after every tick, transitions as they happen, bye when the fleet stops).
The page itself, in a real browser, is tests/browser."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.fleet import Fleet
from fleetwarden.ledger import ShardState
from support.fleet import fleet_config, running_fleet, stamp, until

pytestmark = pytest.mark.scenario


class EventStream:
    """Reads a text/event-stream response frame by frame: (event, data) pairs; comments and
    the retry hint are kept aside."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.retry: int | None = None
        self.comments: list[str] = []

    async def next(self, timeout: float = 20.0) -> tuple[str, Any]:
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> tuple[str, Any]:
        event, data = "message", []
        while True:
            raw = await self.resp.content.readline()
            if not raw:
                raise EOFError("the stream ended")
            line = raw.decode().rstrip("\n")
            if not line:
                if data:
                    return event, json.loads("\n".join(data))
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "":
                self.comments.append(value)
            elif name == "retry":
                self.retry = int(value)
            elif name == "event":
                event = value
            elif name == "data":
                data.append(value)

    async def until(self, kind: str, timeout: float = 30.0, **match: Any) -> Any:
        """The data of the next ``kind`` event whose data has ``match``'s values."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event, data = await self.next(max(0.1, deadline - loop.time()))
            if event == kind and all(data.get(k) == v for k, v in match.items()):
                return data


@contextlib.asynccontextmanager
async def event_stream(http: aiohttp.ClientSession, fleet: Fleet,
                       **headers: str) -> AsyncIterator[EventStream]:
    bearer = {"Authorization": f"Bearer {fleet.admin.token}"}
    async with http.get(fleet.admin_url + "/admin/events", headers=headers or bearer) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        yield EventStream(resp)


def set_cookie(resp: aiohttp.ClientResponse) -> SimpleCookie:
    jar: SimpleCookie = SimpleCookie()
    for header in resp.headers.getall("Set-Cookie", []):
        jar.load(header)
    return jar


async def test_a_cookie_signed_state_change_needs_our_origin_and_json(tmp_path: Path) -> None:
    """Cross-site requests: a page on another port of 127.0.0.1 is the
    same site for SameSite, so the browser sends it our cookie. It can post a form; it cannot
    set our Origin nor a JSON content type without a preflight that is never answered."""
    async with running_fleet(tmp_path) as fleet, \
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        url, cookie = fleet.admin_url, f"fleetwarden_token={fleet.admin.token}"
        other = "http://127.0.0.1:8888"  # a notebook, a Ray dashboard
        for headers, data in (
            ({"Cookie": cookie, "Origin": other,
              "Content-Type": "application/x-www-form-urlencoded"}, b""),
            ({"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"}, b""),
            ({"Cookie": cookie, "Origin": url, "Content-Type": "text/plain"}, b"{}"),
            ({"Cookie": cookie, "Origin": other, "Content-Type": "application/json"}, b"{}"),
        ):
            async with http.post(url + "/admin/shards/0/retire", headers=headers,
                                 data=data) as resp:
                assert resp.status == 403, headers
                assert "cookie" in (await resp.json())["error"]["message"]
        async with http.post(url + "/admin/refit/begin", data=b'{"version": 1}',
                             headers={"Cookie": cookie, "Origin": other,
                                      "Content-Type": "application/json"}) as resp:
            assert resp.status == 403 and fleet.refit.lease is None
        async with http.get(url + f"/admin/status?token={fleet.admin.token}") as resp:
            assert resp.status == 401  # a query token is the sign-in link's, nothing else's
        assert fleet.ledger.state(0) is ShardState.HEALTHY  # nothing was changed
        async with http.post(url + "/admin/shards/0/retire", data=b"{}", headers={
                "Cookie": cookie, "Origin": url, "Content-Type": "application/json"}) as resp:
            assert resp.status == 200  # the dashboard's own request
        assert fleet.ledger.state(0) is ShardState.RETIRED
        async with http.post(url + "/admin/refit/begin", data=b'{"version": 1}',
                             headers={"Authorization": f"Bearer {fleet.admin.token}"}) as resp:
            assert resp.status == 200  # a bearer token is never sent by a browser on its own


async def test_the_page_needs_the_token_and_the_link_trades_it_for_a_cookie(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_fleet(tmp_path, fleet={"engines": 1}) as fleet, \
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        url, token = fleet.admin_url, fleet.admin.token

        async with http.get(url + "/") as resp:  # no token: the sign-in form, no data
            page = await resp.text()
            assert resp.status == 200 and 'action="/login"' in page
            assert "dashboard.js" not in page and fleet.ledger.shard(0).base_url not in page
        for path in ("/admin/events", "/admin/shards", "/admin/status"):
            async with http.get(url + path) as resp:
                assert resp.status == 401, path
            async with http.get(url + path, headers={"Cookie": "fleetwarden_token=wrong"}) as r:
                assert r.status == 401, path

        async with http.get(url + "/?token=not-the-token") as resp:
            assert resp.status == 401 and "not accepted" in await resp.text()
            assert not set_cookie(resp)

        # the link: the cookie is set, and the token leaves the address bar
        async with http.get(url + f"/?token={token}", allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "/"
            morsel = set_cookie(resp)["fleetwarden_token"]
            assert morsel.value == token
            assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/"
        cookie = {"Cookie": f"fleetwarden_token={token}"}
        async with http.get(url + "/", headers=cookie) as resp:
            assert resp.status == 200 and "/static/dashboard.js" in await resp.text()
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
            assert resp.headers["Referrer-Policy"] == "same-origin"
        async with http.get(url + "/admin/shards", headers=cookie) as resp:
            assert resp.status == 200

        # the form
        async with http.post(url + "/login", data={"token": "nope"}) as resp:
            assert resp.status == 401 and not set_cookie(resp)
        async with http.post(url + "/login", data={"token": token},
                             headers={"Origin": "http://evil.example"}) as resp:
            assert resp.status == 403 and not set_cookie(resp)
        async with http.post(url + "/login", data={"token": token}, headers={"Origin": url},
                             allow_redirects=False) as resp:
            assert resp.status == 303 and set_cookie(resp)["fleetwarden_token"].value == token
        # another site's page cannot sign the browser out (a cross-site form post)
        async with http.post(url + "/logout", headers={**cookie, "Origin": "http://evil.example"},
                             allow_redirects=False) as resp:
            assert resp.status == 403 and not set_cookie(resp)
        async with http.post(url + "/logout", headers={**cookie, "Origin": url},
                             allow_redirects=False) as resp:
            assert resp.status == 303 and set_cookie(resp)["fleetwarden_token"].value == ""

        # the page's own files carry no data and need no token; nothing else does without one
        async with http.get(url + "/static/dashboard.js") as resp:
            assert resp.status == 200 and "EventSource" in await resp.text()
        async with http.get(url + "/static/../admin/shards") as resp:
            assert resp.status in (401, 404)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert token not in logged
    assert all(token not in p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir())


async def test_the_event_stream_follows_the_controller(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet, aiohttp.ClientSession() as http:
        async with event_stream(http, fleet) as stream:
            event, hello = await stream.next()
            assert event == "hello" and stream.retry is not None and stream.retry > 0
            assert [s["index"] for s in hello["shards"]] == [0, 1]
            assert {"transitions", "traffic", "refits", "fleet", "window_s"} <= set(hello)
            first = (await stream.until("snapshot"))["fleet"]["tick"]
            second = (await stream.until("snapshot"))["fleet"]["tick"]
            assert second > first  # one snapshot per tick

            await fleet.inject_fault(0, "crash", {})
            dead = await stream.until("transition", shard=0, to="DEAD")
            assert dead["record"]["state"] == "DEAD" and dead["seq"] > hello["seq"]
            await stream.until("transition", shard=0, to="RESTARTING")
            back = await stream.until("transition", timeout=60, shard=0, to="HEALTHY")
            assert back["record"]["restart_attempts"] == 1
            snap = await stream.until("snapshot")
            assert snap["shards"][0]["state"] == "HEALTHY"
            assert snap["shards"][0]["restart_budget_left"] == snap["max_restart_attempts"] - 1

            await fleet.begin_refit(1)  # what a trainer does around a weight sync
            assert (await stream.until("refit", phase="begin"))["version"] == 1
            await stamp(fleet, 1)
            await fleet.complete_refit(1)
            await stream.until("refit", phase="complete", version=1)
            refits = (await stream.until("snapshot"))["refits"]
            assert refits["lease"] is None and refits["current_version"] == 1
            assert [(r["version"], r["outcome"]) for r in refits["history"]] == [(1, "completed")]
            assert len(fleet.admin.events.listeners) == 1
        # the page went away: its listener goes at the next write (the next tick)
        await until(lambda: not fleet.admin.events.listeners,
                    what="the listener of a closed stream removed")


async def test_a_page_that_reconnects_starts_from_a_hello_with_the_history(
        tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as fleet, aiohttp.ClientSession() as http:
        await fleet.inject_fault(1, "crash", {})
        await until(lambda: fleet.ledger.state(1) is ShardState.HEALTHY
                    and fleet.ledger.shard(1).restart_attempts == 1, timeout=60, what="back")
        async with event_stream(http, fleet) as stream:
            event, hello = await stream.next()
        assert event == "hello"
        moves = [t["to"] for t in hello["transitions"] if t["shard"] == 1]
        assert moves[-4:] == ["DEAD", "RESTARTING", "STALE", "HEALTHY"]  # SUSPECT may come first
        assert all("record" not in t for t in hello["transitions"])  # the history stays small
        assert hello["traffic"] and hello["started_at"] <= hello["at"]


async def test_stopping_the_fleet_ends_open_event_streams(tmp_path: Path) -> None:
    fleet = Fleet(fleet_config(tmp_path, fleet={"engines": 1}))
    await fleet.start()
    loop = asyncio.create_task(fleet.run())
    try:
        async with aiohttp.ClientSession() as http, event_stream(http, fleet) as stream:
            assert (await stream.next())[0] == "hello"
            fleet.request_stop()
            await loop
            # Promptly: an open stream that did not end would hold the admin server's
            # shutdown for its whole grace period (a minute).
            await asyncio.wait_for(fleet.stop(), 20)
            assert (await stream.until("bye", timeout=5))["reason"]
            with pytest.raises(EOFError):
                await stream.next(timeout=5)
    finally:
        fleet.request_stop()
        await fleet.stop()


async def test_each_shard_shows_the_routers_predicted_cache_hit_rate(tmp_path: Path) -> None:
    """Beside the engine's own prefix-cache hit rate (its watchdog report), the rate the
    cache-aware router predicted for it: the same prompt twice is one predicted hit of two."""
    from fleetwarden.admin.views import shards_view

    async with running_fleet(tmp_path, router={"routing": "cache_aware"}) as fleet, \
            aiohttp.ClientSession() as http:
        body = {"model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "the same question " * 10}]}
        for _ in range(2):
            async with http.post(fleet.router.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        shards = shards_view(fleet.snapshot())
        rates = sorted((s["cache_predicted_hit_rate"] for s in shards),
                       key=lambda x: -1.0 if x is None else x)
        assert rates[0] is None and rates[1] == pytest.approx(0.5)  # one engine took both


def test_the_workers_cache_tallies_are_added_up() -> None:
    """Under several router workers each keeps its own index: the fleet adds their tallies."""
    from fleetwarden.launchers.routers import WorkerStatuses

    workers = WorkerStatuses()
    workers._last = {  # what each worker's GET /status said last, by its control URL
        "http://127.0.0.1:1": {"cache": {"http://a": {"requests": 2, "blocks": 10,
                                                      "predicted_hit_blocks": 4}}},
        "http://127.0.0.1:2": {"cache": {
            "http://a": {"requests": 1, "blocks": 6, "predicted_hit_blocks": 6},
            "http://b": {"requests": 1, "blocks": 3, "predicted_hit_blocks": 0}}},
        "http://127.0.0.1:3": {},  # a worker under least in flight, or one silent so far
    }
    got = {u: (t.requests, t.blocks, t.hit_blocks)
           for u, t in workers.cache_predictions().items()}
    assert got == {"http://a": (3, 16, 10), "http://b": (1, 3, 0)}
