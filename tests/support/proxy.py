"""A tiny least-connections HTTP proxy, as a load balancer in front of engines would be.

Each request goes to the backend with the fewest requests in flight (ties rotate), so two reads
in a row may well come from two different engines — which is why the watchdog never reads
``/metrics`` through a proxy (note 002). It records what it forwarded, and where.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web


class LeastConnectionsProxy:
    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self.in_flight = dict.fromkeys(backends, 0)
        self.forwarded: list[tuple[str, str, str]] = []  # (method, path, backend)
        self._turn = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    def _pick(self) -> str:
        n = len(self.backends)
        order = [self.backends[(self._turn + k) % n] for k in range(n)]
        self._turn += 1
        return min(order, key=lambda b: self.in_flight[b])

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        backend = self._pick()
        self.forwarded.append((request.method, request.path, backend))
        self.in_flight[backend] += 1
        try:
            async with self._session.request(
                request.method, backend + request.path_qs, data=await request.read(),
                headers={k: v for k, v in request.headers.items()
                         if k.lower() in ("content-type", "x-request-id")},
            ) as upstream:
                body = await upstream.read()
                headers = {"Content-Type": upstream.headers.get("content-type",
                                                                "application/octet-stream")}
                return web.Response(status=upstream.status, body=body, headers=headers)
        finally:
            self.in_flight[backend] -= 1

    async def __aenter__(self) -> LeastConnectionsProxy:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server  # the bound port of port 0
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
