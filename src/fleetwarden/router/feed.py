"""The failed attempts of one router as a long poll: what ``GET /evidence`` and an in-process
link's :meth:`~fleetwarden.router.links.RouterLink.evidence` answer from.

Owns: :class:`EvidenceFeed` (the router's count of failed attempts since it began, and a wait
for the next one or a silent backend) and :class:`Evidence`, one answer.
Must not: decide anything, or reach the network: the router feeds it, a link asks it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EVIDENCE_SCAN_S", "Evidence", "EvidenceFeed"]

#: How often a held evidence poll looks for requests that turned silent (failures wake it at
#: once): the in-process controller's own evidence_poll_s is 0.5 s.
EVIDENCE_SCAN_S = 0.25


@dataclass(frozen=True)
class Evidence:
    """One answer of the long poll: ``failed`` attempts since the count the caller named,
    ``failures`` the router's count now (what the caller names next time), and the backends
    holding a request silent for the poll's ``silent_after_s``, with that wait."""

    failed: int = 0
    failures: int = 0
    silent: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"failed": self.failed, "failures": self.failures, "silent": self.silent}

    @classmethod
    def of_json(cls, raw: Mapping[str, Any]) -> Evidence:
        return cls(int(raw["failed"]), int(raw["failures"]),
                   {url: float(x) for url, x in raw["silent"].items()})


class EvidenceFeed:
    """The failed attempts of one router, counted from the router's start, so that a caller
    that names the count it last saw misses none between two polls.

    ``listen`` subscribes a callback to each failed attempt (the router's own
    :meth:`~fleetwarden.router.app.Router.listen`); ``silent`` reads the backends holding a
    request silent for so long (:meth:`~fleetwarden.router.app.Router.silent_backends`)."""

    def __init__(self, listen: Callable[[Callable[[str, str], None]], Callable[[], None]],
                 silent: Callable[[float], dict[str, float]]) -> None:
        self._silent = silent
        #: Failed attempts since this feed began: what a poll's ``after`` counts against.
        self.failures = 0
        self._came = asyncio.Event()  # set at each failure, cleared as a poll takes it
        self._closing = False
        self._unlisten = listen(self._failed)

    def _failed(self, backend: str, cause: str) -> None:
        self.failures += 1
        self._came.set()

    def close(self) -> None:
        """The router is stopping: held polls are answered now, not at their wait."""
        self._closing = True
        self._came.set()
        self._unlisten()

    async def wait(self, after: int | None, wait_s: float, silent_after_s: float) -> Evidence:
        """Up to ``wait_s``: the failed attempts since the count ``after`` (``None``: from
        now) and the backends holding a request silent for ``silent_after_s``, answered as
        soon as there is any."""
        if after is None:
            after = self.failures
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            # ``after`` above the count: the caller counted in an earlier router process
            new = self.failures - after if self.failures >= after else self.failures
            silent = self._silent(silent_after_s)
            left = deadline - loop.time()
            if new or silent or left <= 0 or self._closing:
                return Evidence(new, self.failures, silent)
            self._came.clear()
            # a request turns silent without an event: looked for again every EVIDENCE_SCAN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._came.wait(), min(left, EVIDENCE_SCAN_S))
