"""A router in front of scripted engines, on real sockets on 127.0.0.1, and a client for it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from fleetwarden.router import Router, RouterSettings
from fleetwarden.router.waiting import WaitingRequests
from support import wait
from support.scripted_engine import ScriptedEngine


@dataclass
class Rig:
    router: Router
    engines: list[ScriptedEngine]
    http: aiohttp.ClientSession
    #: Default requests sent so far: each one's prompt is its own ("hello 1", "hello 2"...),
    #: as distinct clients' are, so that cache-aware routing (the default) places them by
    #: load as least in flight does. One prompt repeated is an RL group, kept on one engine
    #: on purpose: a test about that names its payload.
    sent: int = 0

    @property
    def waiting(self) -> WaitingRequests:
        """The router's waiting requests, where the controller's commands act."""
        return self.router.forwarder.waiting

    async def post(self, path: str = "/v1/completions", payload: Any = None,
                   **kwargs: Any) -> tuple[int, aiohttp.typedefs.LooseHeaders, bytes]:
        """POST through the router; (status, headers, body)."""
        if payload is None and "data" not in kwargs:
            self.sent += 1
            payload = {"model": "tiny", "prompt": f"hello {self.sent}", "max_tokens": 8}
        url = URL(self.router.url + path, encoded=True)  # the path exactly as written
        async with self.http.post(url, json=payload, **kwargs) as response:
            return response.status, response.headers, await response.read()

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.http.get(self.router.url + path) as response:
            return response.status, await response.read()


@contextlib.asynccontextmanager
async def rig(engines: int = 1, *, health_managed: bool = False, control_token: str | None = None,
              **settings: Any) -> AsyncIterator[Rig]:
    """``engines`` scripted engines behind one started :class:`Router` (with its control API
    on a free port when a ``control_token`` is given)."""
    started: list[ScriptedEngine] = []
    router = None
    try:
        for _ in range(engines):
            started.append(await ScriptedEngine().start())
        router = Router([e.url for e in started], RouterSettings(**settings),
                        health_managed=health_managed)
        if control_token is None:
            await router.start()
        else:
            await router.start(control_port=0, control_token=control_token)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            yield Rig(router, started, http)
    finally:
        if router is not None:
            await router.stop()
        for e in started:
            await e.stop()


#: The router's counters change within milliseconds: poll them often.
until = functools.partial(wait.until, every_s=0.002)
