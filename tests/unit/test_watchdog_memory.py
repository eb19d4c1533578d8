"""What the watchdog keeps per URL is dropped once the URL is gone (memory that
only grows is a leak). No engine needed: a round of no targets still forgets."""

from __future__ import annotations

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
