"""A router link that does nothing: the base of the tests' router doubles.

A test double states only the calls its test is about and inherits the rest from
:class:`QuietLink`, so that every double implements the whole
:class:`~fleetwarden.router.links.RouterLink` (mypy checks it where a controller takes one):
each operation answers its row's ``quiet`` value (:data:`~fleetwarden.router.ops.OPERATIONS`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fleetwarden.router.links import RouterLink
from fleetwarden.router.ops import EVIDENCE, Operation

R = TypeVar("R")


class QuietLink(RouterLink):
    """A router in another process that serves nothing, holds nothing and never fails."""

    name = "quiet router"
    in_process = False

    async def call(self, op: Operation[R], **args: Any) -> R:
        if op is EVIDENCE:
            await asyncio.sleep(args["wait_s"])  # a long poll nothing answers: empty at wait_s
        return op.quiet()

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        return lambda: None  # no evidence ever comes
