"""A round spread over the interval: engines in slices of ``concurrency``, each slice not
begun before its share of the interval, engines never read first and at once, each target
made afresh just before its read. No engine needed: the visits are recorded, not made."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from fleetwarden.judge import CanaryRule, Evidence, Health, Report, Target, Verdict
from fleetwarden.watchdog import Watchdog, read_offsets


class Recording(Watchdog):
    """A watchdog whose visits record when they began and what they were given."""

    def __init__(self, concurrency: int) -> None:
        super().__init__(concurrency=concurrency)
        self.visits: list[tuple[float, Target]] = []
        self.open = 0
        self.most_open = 0

    async def probe(self, target: Target) -> Report:
        self._remember(target)  # read: known from now on, as a real visit makes it
        self.visits.append((asyncio.get_running_loop().time(), target))
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        await asyncio.sleep(0)
        self.open -= 1
        return Report(target.url, Verdict.IDLE, Evidence("idle"), Health.UNPROVEN,
                      CanaryRule.NEVER, None, None, None, None)


async def test_the_slices_of_a_spread_round_begin_at_their_share_of_the_interval() -> None:
    async with Recording(concurrency=4) as watchdog:
        targets = [Target(f"http://engine-{k}:8000") for k in range(10)]  # 3 slices
        await watchdog.round(targets)  # read once: the steady reads are spread
        watchdog.visits.clear()
        begun = asyncio.get_running_loop().time()
        reports = await watchdog.round(targets, spread_s=0.3)
    assert set(reports) == {t.url for t in targets}  # every engine read once
    assert watchdog.most_open <= 4
    for at, target in watchdog.visits:
        k = int(target.url.split("-")[1].split(":")[0])
        # clock resolution aside, never before its slice's start
        assert at - begun >= (k // 4) * 0.1 - 0.005, (k, at - begun)


async def test_each_target_is_made_afresh_before_its_read_or_left_out() -> None:
    async def fresh(t: Target) -> Target | None:
        if t.url.endswith("gone:8000"):
            return None  # condemned since the round began
        return replace(t, in_flight=3, held_s=1.5)

    async with Recording(concurrency=2) as watchdog:
        reports = await watchdog.round([Target("http://a:8000"), Target("http://gone:8000")],
                                       fresh=fresh)
    assert list(reports) == ["http://a:8000"]
    assert [(t.in_flight, t.held_s) for _, t in watchdog.visits] == [(3, 1.5)]


def test_engines_never_read_are_due_at_once_and_the_others_spread() -> None:
    # 2 engines never read, 6 read before, 4 readers: the new ones at once, the 6 in two
    # slices over the interval (4 in the first, 2 in the second), in their order
    known = [False, True, True, True, False, True, True, True]
    assert read_offsets(known, 4, 1.0) == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    # a new fleet: every engine at once, however large (the readers are the only bound)
    assert read_offsets([False] * 1000, 64, 5.0) == [0.0] * 1000
    assert read_offsets([True] * 10, 4, 0.3) == pytest.approx([0.0] * 4 + [0.1] * 4 + [0.2] * 2)


async def test_a_round_reads_the_engines_never_read_first() -> None:
    async with Recording(concurrency=1) as watchdog:
        old = [Target(f"http://old-{k}:8000") for k in range(3)]
        await watchdog.round(old)
        watchdog.visits.clear()
        new = Target("http://new:8000")
        await watchdog.round([*old, new], spread_s=0.03)
    assert watchdog.visits[0][1].url == new.url


async def test_each_read_is_handed_on_as_it_finishes_and_a_failing_hand_on_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """``on_report`` gets each read before the round goes on to the next (one reader: in
    order), never a read left out; one that raises is logged, and the round still ends."""
    told: list[tuple[str, int]] = []

    def on_report(url: str, report: Report) -> None:
        told.append((url, len(watchdog.visits)))
        if url.endswith("b:8000"):
            raise RuntimeError("deciding failed")

    async with Recording(concurrency=1) as watchdog:
        reports = await watchdog.round(
            [Target("http://a:8000"), Target("http://b:8000"), Target("http://c:8000")],
            on_report=on_report)
    assert told == [("http://a:8000", 1), ("http://b:8000", 2), ("http://c:8000", 3)]
    assert list(reports) == ["http://a:8000", "http://b:8000", "http://c:8000"]
    failed = [r.getMessage() for r in caplog.records if "deciding" in r.getMessage()]
    assert failed == ["http://b:8000: deciding on its read failed"]
