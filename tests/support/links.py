"""A router link that does nothing: the base of the tests' router doubles.

A test double states only the calls its test is about and inherits the rest from
:class:`QuietLink`, so that every double implements the whole
:class:`~fleetwarden.router.links.RouterLink` (mypy checks it where a controller takes one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetwarden.router.pool import BackendFacts


class QuietLink:
    """A router in another process that serves nothing, holds nothing and never fails."""

    name = "quiet router"
    in_process = False

    async def set_serving_backends(self, urls: Sequence[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None:
        pass

    async def set_trial_backends(self, urls: Sequence[str]) -> None:
        pass

    async def set_retry_after(self, seconds: float | None) -> None:
        pass

    async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
        return {}

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        return 0

    async def weights_changing(self, url: str, version: int) -> int:
        return 0

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        return 0

    async def in_flight(self) -> dict[str, int]:
        return {}

    async def silent_backends(self, after_s: float) -> dict[str, float]:
        return {}

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        return lambda: None  # no evidence ever comes

    async def evidence(self, wait_s: float, silent_after_s: float
                       ) -> tuple[int, dict[str, float]]:
        await asyncio.sleep(wait_s)  # a long poll that nothing answers: empty at wait_s
        return 0, {}

    async def status(self) -> dict[str, Any]:
        return {}
