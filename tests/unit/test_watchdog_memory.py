"""What the watchdog keeps per URL is dropped once the URL is gone (memory that
only grows is a leak). No engine needed: a round of no targets still forgets."""

from __future__ import annotations

import asyncio

from fleetwarden.judge import EngineWatch
from fleetwarden.watchdog import FORGET_AFTER_S, Watchdog, _Memory


class Clock:
    now = 10_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_url_not_read_for_an_hour_is_forgotten() -> None:
    clock = Clock()
    async with Watchdog(clock=clock) as watchdog:
        watchdog._memory["http://old:1"] = _Memory(EngineWatch(), visited_at=clock.now)
        clock.now += FORGET_AFTER_S / 2
        watchdog._memory["http://new:1"] = _Memory(EngineWatch(), visited_at=clock.now)
        await watchdog.round([])
        assert set(watchdog._memory) == {"http://old:1", "http://new:1"}
        clock.now += FORGET_AFTER_S / 2 + 1
        await watchdog.round([])
        assert set(watchdog._memory) == {"http://new:1"}


async def test_a_canary_that_timed_out_waited_its_whole_timeout() -> None:
    """asyncio fires a timer up to its clock resolution early. A canary measured 0.4 ms under
    the timeout it was sized to (the stall limit less what its held requests had waited) fell
    short of the limit, and a hedged idle wedge was not condemned: it was routed again and
    held new requests for 10 s more. A timed-out canary reports at least its timeout."""
    silent: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)  # reads nothing, answers nothing: a wedged engine

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # The canary's start, then every later reading: its end 1 ms under the 0.05 s timeout.
    ticks = [100.0]

    def clock() -> float:
        return ticks.pop() if ticks else 100.049

    async with server, Watchdog(model="m", clock=clock) as watchdog:
        result = await watchdog.canary(f"http://127.0.0.1:{port}", timeout_s=0.05)
    assert not result.ok and result.status is None and "no answer" in result.error
    assert result.latency_s == 0.05
    for w in silent:
        w.close()
