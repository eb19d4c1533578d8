"""``Load.carried_on``, the fault scenarios' wait after a detection: it returns once every
request sent before it is answered and as many after it as the load has clients, never while
one sent before is held, and at its limit when the load never carries on. The engine is
:class:`~support.scripted_engine.ScriptedEngine`: wedged, it holds what reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleetwarden.testing.load import Load
from support.scripted_engine import ScriptedEngine
from support.wait import until

pytestmark = pytest.mark.scenario

CLIENTS = 2


@pytest.fixture
async def wedged() -> AsyncIterator[tuple[ScriptedEngine, Load]]:
    """A load whose first requests (one per client) are held by a wedged engine."""
    engine = await ScriptedEngine().start()
    engine.wedge()
    load = Load(engine.url, concurrency=CLIENTS, max_tokens=1, think_s=0.01)
    load.start()
    try:
        await until(lambda: engine.held == CLIENTS, what="a request of each client held")
        yield engine, load
    finally:
        engine.unwedge()
        await load.stop()
        await engine.stop()


async def test_it_waits_for_the_held_requests_then_for_as_many_more_as_clients(
        wedged: tuple[ScriptedEngine, Load]) -> None:
    engine, load = wedged
    carried = asyncio.ensure_future(load.carried_on(30.0))
    done, _ = await asyncio.wait([carried], timeout=0.5)
    assert not done, "returned while the requests sent before it were held"
    engine.unwedge()
    took = await asyncio.wait_for(carried, 30)
    assert took < 30, "returned at its limit, not when the load carried on"
    assert len(load.results) >= 2 * CLIENTS  # the held ones, then as many more as clients
    assert load.failures == []
    print(f"\ncarried on after {took:.2f} s (0.5 s of it held)")


async def test_it_gives_up_at_its_limit_when_the_load_never_carries_on(
        wedged: tuple[ScriptedEngine, Load]) -> None:
    engine, load = wedged
    took = await load.carried_on(0.3)
    assert 0.3 <= took < 5, took
    assert load.results == []  # still held: it went on regardless, as a fixed wait would
    engine.unwedge()
    await until(lambda: len(load.results) >= CLIENTS, what="the held requests answered")
    assert load.failures == []
