"""The router's background reads, one per backend at a time.

Owns: :class:`TaskPerBackend`, at most one background task per backend (a read of its
``/v1/models``, of its ``/kv_event_sources``), forgotten when it ends or is cancelled (one
backend's, or all when the router closes).
Must not: decide what a task reads or when (its owner does); outlive the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["TaskPerBackend"]


class TaskPerBackend:
    """At most one background task per backend, of one ``kind`` (its tasks' name prefix): a
    second asked while one runs is not started, since it would ask the same again."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __contains__(self, backend: object) -> bool:
        return backend in self._tasks

    def start(self, backend: str, coro: Coroutine[Any, Any, None]) -> bool:
        """Run ``coro`` for ``backend`` unless one runs for it already (then ``coro`` is closed
        unrun); whether it started."""
        if backend in self._tasks:
            coro.close()
            return False
        task = asyncio.create_task(coro, name=f"{self.kind}:{backend}")
        self._tasks[backend] = task
        task.add_done_callback(lambda done: self._ended(backend, done))
        return True

    def _ended(self, backend: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(backend) is task:
            del self._tasks[backend]

    def cancel(self, backend: str) -> None:
        """Cancel ``backend``'s task, if one runs: what it would learn is no longer true (a
        new process answers there); the next one asked starts at once."""
        task = self._tasks.pop(backend, None)
        if task is not None:
            task.cancel()

    def cancel_all(self) -> None:
        """Cancel every task still running (the router closes): none is asked again."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
