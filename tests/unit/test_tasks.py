"""A task owner: every background task of a long-lived object kept, its crash seen, all
stopped with the object."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleetwarden.tasks import TaskOwner


async def _fail() -> None:
    raise RuntimeError("boom")


async def test_a_task_that_crashes_is_logged_with_its_name(
        caplog: pytest.LogCaptureFixture) -> None:
    owner = TaskOwner()
    with caplog.at_level(logging.ERROR, logger="fleetwarden.tasks"):
        task = owner.start(_fail(), "push")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # its done callbacks run
    assert len(owner) == 0
    assert [r.getMessage() for r in caplog.records] == ["background task push failed"]


async def test_a_task_whose_starter_collects_its_result_is_not_logged_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    owner = TaskOwner()
    with caplog.at_level(logging.ERROR, logger="fleetwarden.tasks"):
        task = owner.start(_fail(), "restart:0:1", collected=True)
        await owner.wait_all()
    assert isinstance(task.exception(), RuntimeError)
    assert caplog.records == []


async def test_cancel_all_stops_every_task_and_awaits_its_end() -> None:
    owner = TaskOwner()
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    tasks = [owner.start(forever(n), n) for n in ("a", "b")]
    await asyncio.sleep(0)  # both under way
    await owner.cancel_all()
    assert all(t.cancelled() for t in tasks)
    assert sorted(ended) == ["a", "b"] and len(owner) == 0


def test_outside_an_event_loop_nothing_is_started_and_the_coroutine_is_closed() -> None:
    owner = TaskOwner()
    coro = _fail()
    assert owner.start_if_running(coro, "push") is None
    assert coro.cr_frame is None  # closed: no "never awaited" warning, nothing run
    assert len(owner) == 0
