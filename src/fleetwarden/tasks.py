"""The owner of a long-lived object's background tasks.

Owns: starting each background task by name, keeping it until it ends, logging one that
crashes, and cancelling or awaiting them all when its object closes.
Must not: decide what a task does or when it starts (its object does), or let a task outlive
the object that started it.

The supervisor, the controller and its collaborators live from a fleet's start to its stop,
not within one ``async with``: an owner is their task group. Every task has one, so none is
fire-and-forget, none is dropped unawaited, and none crashes unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["TaskOwner", "sleep_unless"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskOwner:
    """Every background task one object starts: each kept until it ends, a crash logged (unless
    its starter collects the result itself), all cancelled or awaited on close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, T], name: str, *,
              collected: bool = False) -> asyncio.Task[T]:
        """Run ``coro`` as the task ``name``. ``collected``: its starter reads its result (and
        reports its error), so a crash is not logged here too."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if not collected:
            task.add_done_callback(_log_crash)
        return task

    def start_if_running(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T] | None:
        """As :meth:`start` inside a running event loop; outside one (a unit test of a
        synchronous mapping) ``coro`` is closed unrun and ``None`` returned: what it would have
        done, the object's next pass in a loop does."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            return None
        return self.start(coro, name)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait_all(self) -> None:
        """Await every task still running (a task started meanwhile is awaited too); their
        errors and cancellations are theirs: the caller collected what it needed."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel every task still running and await their ends."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_crash(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background task %s failed", task.get_name(), exc_info=exc)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
