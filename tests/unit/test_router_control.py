"""The router's control API and its clients: one controller drives routers in or out of its
process alike (docs/design.md section 4, last bullet). What it does in real time (long polls,
draining, ``fleetwarden route`` as a process) is in tests/scenario/test_router_control_timing.py."""

from __future__ import annotations

import ast
import asyncio
import inspect
from operator import attrgetter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import fleetwarden.router
from fleetwarden.launchers.routers import WorkerLink
from fleetwarden.router import (
    BackendFacts,
    ControlError,
    InProcessRouter,
    RemoteRouter,
    Router,
    RouterLink,
)
from fleetwarden.router.control import merge_outcomes
from fleetwarden.router.ops import IN_FLIGHT, OPERATIONS, SILENT, Holding
from fleetwarden.router.splice import CompletionDefault
from support.links import QuietLink
from support.router_rig import rig, until
from support.scripted_engine import ScriptedEngine
from support.source import runtime_nodes

TOKEN = "s3cret-token"


async def test_the_control_api_refuses_callers_without_the_token() -> None:
    router = Router([])
    await router.start(control_port=0, control_token=TOKEN)
    try:
        control = router.control_url
        assert control is not None and control.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as http:
            for method, path in [("GET", "/status"), ("PUT", "/serving"),
                                 ("POST", "/outcomes/drain"), ("POST", "/rescue"),
                                 ("GET", "/in-flight"), ("PUT", "/retry-after"),
                                 ("GET", "/holding"), ("POST", "/hedge"),
                                 ("GET", "/nowhere")]:
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": TOKEN}):
                    async with http.request(method, control + path, headers=headers,
                                            json={"backends": ["http://x:1"]}) as response:
                        assert response.status == 401, (method, path, headers)
                        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert router.serving_backends() == []  # nothing was pushed
        async with RemoteRouter(control, "wrong") as remote:
            with pytest.raises(ControlError) as refused:
                await remote.status()
            assert refused.value.status == 401
        with pytest.raises(ValueError, match="control token"):
            await Router([]).start(control_port=0, control_token="")
    finally:
        await router.stop()


async def test_a_remote_router_is_driven_like_an_in_process_one() -> None:
    async with rig(1, health_managed=True, control_token=TOKEN) as r:
        (old,) = r.engines
        new = await ScriptedEngine().start()
        router = r.router
        assert router.control_url is not None
        remote = RemoteRouter(router.control_url, TOKEN)
        try:
            handles: list[RouterLink] = [remote, router.control()]
            for handle in handles:
                await handle.set_serving_backends([old.url, new.url])
                assert router.serving_backends() == [old.url, new.url]
                status = await handle.status()
                assert status["serving"] == [old.url, new.url] and status["reflex_armed"]

            await remote.set_serving_backends([new.url])  # a URL it has never seen
            assert [(await r.post())[0] for _ in range(3)] == [200] * 3
            assert new.answered == 3
            assert await remote.drain_outcomes() == {new.url: (3, 0, 0)}
            assert await remote.drain_outcomes() == {}

            new.wedge()
            held = asyncio.create_task(r.post())
            await until(lambda: new.held == 1)
            holding = await remote.holding()  # silent for 0 s or more: every request held
            assert holding.in_flight == {new.url: 1} and list(holding.silent) == [new.url]
            # Marked as kept across a load there (a rescue sends it again from the start).
            assert await remote.weights_changing(new.url, 7) == 1
            assert await remote.weights_changing(old.url, 7) == 0
            await remote.set_serving_backends([old.url])
            assert await remote.rescue(new.url) == 1
            assert (await held)[0] == 200 and old.answered == 1

            await remote.set_serving_backends([])
            await remote.set_retry_after(12.5)
            status, headers, _ = await r.post()
            assert status == 409 and headers["Retry-After"] == "13"
            await router.control().set_retry_after(None)
            status, headers, _ = await r.post()
            assert status == 409 and "Retry-After" not in headers
        finally:
            await remote.close()
            await new.stop()


async def test_a_push_carries_each_backends_shard_and_weight_version_both_ways() -> None:
    router = Router([])
    await router.start(control_port=0, control_token=TOKEN)
    a, b = "http://127.0.0.1:9101", "http://127.0.0.1:9102"
    try:
        assert router.control_url is not None
        async with RemoteRouter(router.control_url, TOKEN) as remote:
            handles: list[RouterLink] = [remote, router.control()]
            for version, handle in enumerate(handles, start=3):
                facts = {a: BackendFacts(0, version, upstream_fields=True),
                         b: BackendFacts(1, version + 1, upstream_fields=False)}
                await handle.set_serving_backends([a, b], facts)
                assert router.backend_facts() == facts
                assert router.pool.facts(b) == BackendFacts(shard=1, weight_version=version + 1,
                                                            upstream_fields=False)
                assert (await handle.status())["facts"] == {
                    a: {"shard": 0, "weight_version": version, "upstream_fields": True},
                    b: {"shard": 1, "weight_version": version + 1, "upstream_fields": False}}
            # Facts for a URL not pushed are dropped; a push without facts (an older
            # controller) is served, and leaves every backend's facts unknown.
            await remote.set_serving_backends([a], {a: BackendFacts(0, 7),
                                                    b: BackendFacts(1, 7)})
            assert router.backend_facts() == {a: BackendFacts(0, 7)}
            old = await remote._call("PUT", "/serving", {"backends": [a, b]})
            assert old == {"serving": [a, b], "facts": {}}
            assert router.pool.facts(a) == BackendFacts(None, None)
            # A field left out or null is unknown, the other one kept.
            answer = await remote._call("PUT", "/serving", {
                "backends": [a, b], "facts": {a: {"shard": 0}, b: {"weight_version": 2,
                                                                 "shard": None}}})
            assert answer["facts"] == {
                a: {"shard": 0, "weight_version": None, "upstream_fields": None},
                b: {"shard": None, "weight_version": 2, "upstream_fields": None}}
            bad = {"backends": [a], "facts": {a: {"upstream_fields": "yes"}}}
            with pytest.raises(ControlError, match="upstream_fields"):
                await remote._call("PUT", "/serving", bad)
            # The incarnation (the cache-aware policy's restart signal) goes both ways.
            await remote.set_serving_backends(
                [a], {a: BackendFacts(0, 7, incarnation="1795973023.5")})
            assert router.pool.facts(a).incarnation == "1795973023.5"
            assert (await remote.status())["facts"][a]["incarnation"] == "1795973023.5"
            # The engines' keys (the router's own requests there) go apart from the facts,
            # both ways; no answer and no status carries one.
            key = "sk-pushed-5e1f"
            for handle in (remote, router.control()):
                await handle.set_serving_backends(
                    [a, b], {a: BackendFacts(0, 1, key=key), b: BackendFacts(1, 1)})
                assert router.pool.facts(a).key == key and router.pool.facts(b).key is None
                assert key not in str(await handle.status())
            answer = await remote._call("PUT", "/serving", {
                "backends": [a], "facts": {a: {"shard": 0}}, "keys": {a: key}})
            assert key not in str(answer) and router.pool.facts(a).key == key
            with pytest.raises(ControlError, match="'keys' must be"):
                await remote._call("PUT", "/serving", {"backends": [a], "keys": {a: 7}})
            # How many engines are coming back rides with the push (0 when left out).
            await remote.set_serving_backends([a], coming_back=2)
            assert router.forwarder.coming_back == 2
            await remote._call("PUT", "/serving", {"backends": [a]})
            assert router.forwarder.coming_back == 0
            with pytest.raises(ControlError, match="coming_back"):
                await remote._call("PUT", "/serving", {"backends": [a], "coming_back": -1})
            # An engine's server cap (read from its command): a continuation of a generation
            # begun there asks no more than it from the first request on, where before it knew
            # the cap only once a "length" finish revealed it, and ran past it until then.
            await remote.set_serving_backends([a, b], {a: BackendFacts(0, 1, output_cap=12),
                                                       b: BackendFacts(1, 1)})
            assert router.pool.facts(a).output_cap == 12
            limits = router.forwarder.limits
            assert (limits.output_cap(a, False), limits.output_cap(b, False)) == (12, None)
            assert (await remote.status())["facts"][a]["output_cap"] == 12
            with pytest.raises(ControlError, match="output_cap"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"output_cap": 0}}})
            # an engine that left takes its cap along (one started again may have another)
            await remote.set_serving_backends([b], {b: BackendFacts(1, 1)})
            assert limits.output_cap(a, False) is None
            # a model's default limit (its generation_config.json): only on a chat that names
            # no limit, apart from the cap on every request
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1, output_cap=12, output_default=8), b: BackendFacts(1, 1)})
            assert (limits.output_cap(a, False), limits.output_cap(a, True)) == (12, 8)
            assert (await remote.status())["facts"][a]["output_default"] == 8
            with pytest.raises(ControlError, match="output_default"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"output_default": True}}})
            await remote.set_serving_backends([b], {b: BackendFacts(1, 1)})
            assert limits.output_cap(a, True) is None
            # an unknown cap: carried both ways and shown; continuations there go only as far
            # as its floor proves
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1, output_cap_unknown="no GET /server_info"),
                b: BackendFacts(1, 1)})
            assert limits.unknown == {a: "no GET /server_info"}
            assert limits.unknown_cap(a) is not None and limits.unknown_cap(b) is None
            assert (await remote.status())["facts"][a]["output_cap_unknown"] == (
                "no GET /server_info")
            with pytest.raises(ControlError, match="output_cap_unknown"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"output_cap_unknown": 3}}})
            # an unknown model default too: only a chat that names no limit is bound by it
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1), b: BackendFacts(1, 1, output_default_unknown="hub")})
            assert limits.default_unknown == {b: "hub"} and limits.unknown == {}
            assert limits.unknown_cap(b) is None and limits.unknown_cap(b, True) is not None
            assert (await remote.status())["facts"][b]["output_default_unknown"] == "hub"
            with pytest.raises(ControlError, match="output_default_unknown"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"output_default_unknown": 3}}})
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1, output_cap=12), b: BackendFacts(1, 1)})
            assert limits.unknown == {} and limits.unknown_cap(a) is None
            # What each engine gives a completion naming no limit (its kind's rule): carried
            # both ways and shown; a push that says nothing leaves the router's assumption
            # (its upstream_fields setting, here on: vLLM's 16), an older controller's
            # upstream_fields off says not known.
            E, U = CompletionDefault.ENGINE, CompletionDefault.UNKNOWN
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1, completion_default=E),
                b: BackendFacts(1, 1, completion_default=U)})
            assert router.pool.facts(a).completion_default is E
            assert (limits.completion_rule(a), limits.completion_rule(b)) == (E, U)
            facts = (await remote.status())["facts"]
            assert (facts[a]["completion_default"], facts[b]["completion_default"]) == (
                "engine", "unknown")
            await remote.set_serving_backends([a, b], {
                a: BackendFacts(0, 1), b: BackendFacts(1, 1, upstream_fields=False)})
            assert (limits.completion_rule(a), limits.completion_rule(b)) == (
                CompletionDefault.FIXED, U)
            assert "completion_default" not in (await remote.status())["facts"][a]
            with pytest.raises(ControlError, match=r"facts\..*\.completion_default.*'fixed'"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"completion_default": "sixteen"}}})
            with pytest.raises(ControlError, match="completion_default"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"completion_default": 16}}})
    finally:
        await router.stop()


async def test_malformed_control_calls_are_400_and_change_nothing() -> None:
    router = Router(["http://127.0.0.1:9"])
    await router.start(control_port=0, control_token=TOKEN)
    try:
        assert router.control_url is not None
        async with RemoteRouter(router.control_url, TOKEN) as remote:
            for method, path, body in [("PUT", "/serving", {"backends": "http://x:1"}),
                                       ("PUT", "/serving", [1]),
                                       ("PUT", "/serving", {"backends": [], "facts": []}),
                                       ("PUT", "/serving", {"backends": [],
                                                            "facts": {"http://x:1": 3}}),
                                       ("PUT", "/serving", {"backends": [], "facts": {
                                           "http://x:1": {"weight_version": -1}}}),
                                       ("PUT", "/serving", {"backends": [], "facts": {
                                           "http://x:1": {"shard": True}}}),
                                       ("PUT", "/serving", {"backends": [], "facts": {
                                           "http://x:1": {"incarnation": 3}}}),
                                       ("POST", "/rescue", {}),
                                       ("POST", "/rescue", {"backend": "http://x:1",
                                                            "streams": "no"}),
                                       ("POST", "/weights-changing", {"version": 1}),
                                       ("POST", "/weights-changing", {"backend": "http://x:1",
                                                                      "version": True}),
                                       ("POST", "/weights-changing", {"backend": "http://x:1",
                                                                      "version": -1}),
                                       ("PUT", "/retry-after", {"seconds": -1}),
                                       ("PUT", "/retry-after", {}),
                                       ("POST", "/hedge", {"held_s": 1}),
                                       ("POST", "/hedge", {"backend": "http://x:1",
                                                           "held_s": -1}),
                                       ("POST", "/hedge", {"backend": "http://x:1",
                                                           "held_s": 1, "lost_race_fails": 1}),
                                       ("GET", "/holding?silent_after_s=x", None),
                                       ("GET", "/holding?silent_after_s=-1", None)]:
                with pytest.raises(ControlError) as bad:
                    await remote._call(method, path, body)
                assert bad.value.status == 400, (method, path, body)
        assert router.serving_backends() == ["http://127.0.0.1:9"]
    finally:
        await router.stop()


async def test_a_lost_drain_answer_loses_no_outcome() -> None:
    async with rig(1, control_token=TOKEN) as r:
        (engine,) = r.engines
        control = r.router.control_url
        assert control is not None
        auth = {"Authorization": f"Bearer {TOKEN}"}

        async def drain(body: dict[str, object] | None) -> dict[str, Any]:
            async with r.http.post(control + "/outcomes/drain", headers=auth,
                                   **({} if body is None else {"json": body})) as response:
                assert response.status == 200
                answer: dict[str, Any] = await response.json()
                return answer

        assert [(await r.post())[0] for _ in range(2)] == [200, 200]
        first = await drain({"ack": None})
        assert first["outcomes"] == {engine.url: [2, 0, 0]}
        # That answer never reached the controller: its next drain acknowledges nothing new,
        # and gets the lost batch again, merged with what happened since.
        assert (await r.post())[0] == 200
        second = await drain({"ack": None})
        assert second["outcomes"] == {engine.url: [3, 0, 0]}
        assert second["batch"] != first["batch"]
        # Acknowledged: handed over, never again.
        assert (await drain({"ack": second["batch"]}))["outcomes"] == {}
        # The client does the acknowledging itself.
        async with RemoteRouter(control, TOKEN) as remote:
            assert (await r.post())[0] == 200
            assert await remote.drain_outcomes() == {engine.url: (1, 0, 0)}
            assert await remote.drain_outcomes() == {}
        # An older controller (no "ack"): each window once, as before.
        assert (await r.post())[0] == 200
        assert (await drain(None))["outcomes"] == {engine.url: [1, 0, 0]}
        assert (await drain(None))["outcomes"] == {}
        async with r.http.post(control + "/outcomes/drain", headers=auth,
                               json={"ack": 7}) as response:
            assert response.status == 400 and "ack" in await response.text()


def test_two_windows_merge_as_one() -> None:
    older = {"a": (2, 1, 1), "b": (0, 2, 2)}
    newer = {"a": (0, 1, 1), "b": (1, 0, 0), "c": (0, 1, 1)}
    # a: the older trailing failure goes on (no success since); b: a success ended its run
    assert merge_outcomes(older, newer) == {"a": (2, 2, 2), "b": (1, 2, 0), "c": (0, 1, 1)}


async def test_a_router_driven_over_its_control_api_gets_the_reflex_drop() -> None:
    async with rig(2, health_managed=False, control_token=TOKEN) as r:  # as `route` starts
        good, bad = r.engines
        assert not r.router.reflex_armed
        assert r.router.control_url is not None
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            await remote.set_serving_backends([good.url, bad.url])
            assert (await remote.status())["reflex_armed"]
            await bad.crash()
            assert [(await r.post())[0] for _ in range(4)] == [200] * 4  # retried elsewhere
            assert r.router.serving_backends() == [good.url]  # dropped until the next push
            await remote.set_serving_backends([good.url, bad.url])
            assert r.router.serving_backends() == [good.url, bad.url]


async def test_the_control_api_binds_the_configured_host() -> None:
    router = Router([])
    # Another loopback address stands for "where a remote controller reaches it".
    await router.start(control_port=0, control_token=TOKEN, control_host="127.0.0.2")
    try:
        control = router.control_url
        assert control is not None and control.startswith("http://127.0.0.2:")
        async with RemoteRouter(control, "wrong") as remote:
            with pytest.raises(ControlError):
                await remote.status()  # still behind the token
        async with RemoteRouter(control, TOKEN) as remote:
            assert (await remote.status())["serving"] == []
    finally:
        await router.stop()


async def test_malformed_evidence_calls_are_400() -> None:
    async with rig(1, control_token=TOKEN) as r:
        assert r.router.control_url is not None
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            for query in ("wait_s=x", "wait_s=-1", "wait_s=61", "silent_after_s=nan",
                          "after=two"):
                async with http.get(f"{r.router.control_url}/evidence?{query}") as response:
                    assert response.status == 400, query
                    assert (await response.json())["error"]["type"] == "invalid_request"


async def test_stop_accepting_closes_the_listener_and_keeps_open_connections_serving() -> None:
    # A reload's first step, for every old router before any of them drains.
    async with rig(1, control_token=TOKEN) as r:
        assert r.router.control_url is not None
        assert (await r.post())[0] == 200  # the rig's session now holds a keep-alive connection
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            assert (await remote.status())["accepting"]
            await remote.stop_accepting()
            await remote.stop_accepting()  # again: nothing left to close, still answered
            assert not (await remote.status())["accepting"]  # what its status tells a reader
        assert (await r.post())[0] == 200  # on the connection it already had
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectorError):
                await fresh.get(r.router.url + "/v1/models")


def _calls(cls: type) -> set[str]:
    """The calls ``cls`` defines itself or inherits, never answered by ``__getattr__``."""
    return {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}


@pytest.mark.parametrize("link", [InProcessRouter, RemoteRouter, WorkerLink, QuietLink],
                         ids=lambda c: c.__name__)
def test_every_router_link_implements_the_whole_interface(link: type) -> None:
    # The controller calls every one of them on every link: none is optional, none forwarded.
    # A link implements the two calls below itself; every operation (the evidence long poll
    # too) is RouterLink's own, one ``call`` of its row, and no link writes one again.
    wanted = {name for name in vars(RouterLink) if not name.startswith("_")}
    assert {"hedge", "holding", "evidence", "listen", "in_process", "name", "call"} <= wanted
    assert wanted - _calls(link) == set()
    assert "__getattr__" not in _calls(link)
    own = {name for klass in link.__mro__ if klass not in (RouterLink, object)
           for name in vars(klass)}
    assert {"call", "listen"} <= own
    assert own & {op.name for op in OPERATIONS} == set()


def test_each_operation_is_a_router_call_that_takes_its_arguments() -> None:
    # The in-process link and the control server call a row's target with the row's
    # arguments by name: a renamed parameter would fail here, not in a fleet.
    router = Router([])
    links = {name for name in vars(RouterLink) if not name.startswith("_")}
    for op in OPERATIONS:
        target = attrgetter(op.target)(router)
        inspect.signature(target).bind(**{arg.name: None for arg in op.args})
        assert op.name in links or op in (IN_FLIGHT, SILENT), op.name  # those two: older callers
        assert op.path.startswith("/") and op.method in ("GET", "PUT", "POST")
    assert len({(op.method, op.path) for op in OPERATIONS}) == len(OPERATIONS)
    assert len({op.name for op in OPERATIONS}) == len(OPERATIONS)


async def test_a_holding_read_is_in_flight_and_silence_in_one_call() -> None:
    async with rig(1, control_token=TOKEN) as r:
        (engine,) = r.engines
        engine.wedge()
        held = asyncio.create_task(r.post())
        await until(lambda: engine.held == 1)
        control = r.router.control_url
        assert control is not None
        async with RemoteRouter(control, TOKEN) as remote:
            for link in (remote, r.router.control()):
                now = await link.holding()
                assert now.in_flight == {engine.url: 1} and list(now.silent) == [engine.url]
                assert (await link.holding(3600.0)).silent == {}  # not silent that long
        engine.unwedge()
        assert (await held)[0] == 200
        await until(lambda: r.router.holding() == Holding({engine.url: 0}, {}))


def test_no_router_module_imports_one_that_imports_it_back() -> None:
    # Each import is at the top of its module (none inside a function, which would hide a
    # circle), and the router's modules import one another in one direction only.
    package = Path(fleetwarden.router.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                hidden = [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
                assert not hidden, f"{path.name}: an import inside {node.name}()"
        imports[path.stem] = {  # those under ``if TYPE_CHECKING:`` never run
            node.module.rsplit(".", 1)[1] for node in runtime_nodes(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
            and node.module.startswith("fleetwarden.router.")}
    for module, names in imports.items():
        for other in names:
            assert module not in imports.get(other, set()), f"{module} <-> {other}"


async def test_a_worker_link_pushes_to_its_predecessor_until_released() -> None:
    """A reload's old worker takes requests until it exits: the slot's link pushes to it as
    to the new one; one that is gone fails its push quietly; once released, it gets none."""
    old, new = Router([]), Router([])
    for r in (old, new):
        await r.start(control_port=0, control_token=TOKEN)
    link = WorkerLink(0, TOKEN)
    try:
        assert old.control_url is not None and new.control_url is not None
        await link.connect(old.control_url)
        await link.connect(new.control_url, keep_predecessor=True)
        a, b = "http://127.0.0.1:9", "http://127.0.0.1:10"
        await link.set_serving_backends([a], {a: BackendFacts(0, 2)})
        await link.set_trial_backends([a])
        async with RemoteRouter(old.control_url, TOKEN) as o, \
                RemoteRouter(new.control_url, TOKEN) as n:
            for status in (await o.status(), await n.status()):
                assert status["serving"] == [a] and status["trial"] == [a]
            assert await link.rescue(a) == 0  # asked of both: nothing held on either
            await link.release(old.control_url)
            await link.set_serving_backends([b])
            assert (await o.status())["serving"] == [a]  # released: no more pushes
            assert (await n.status())["serving"] == [b]
        # A predecessor gone before its release: the slot's worker still gets the push.
        await link.connect(old.control_url, keep_predecessor=True)  # new is the predecessor
        await new.stop()
        await link.set_serving_backends([a])
        assert await link.rescue(a) == 0
        async with RemoteRouter(old.control_url, TOKEN) as o:
            assert (await o.status())["serving"] == [a]
    finally:
        await link.disconnect()
        for r in (old, new):
            await r.stop()
