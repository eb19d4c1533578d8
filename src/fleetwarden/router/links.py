"""The links a controller drives routers through: one interface, wherever the router runs.

Owns: :class:`RouterLink` (every call a controller makes on a router), its two
implementations (:class:`InProcessRouter` for a router in this process, :class:`RemoteRouter`
across the control API of :mod:`fleetwarden.router.control`), and :class:`EvidenceFeed`, the
long poll of failed attempts both the in-process link and the control server answer from.
Must not: decide anything: a link carries the controller's pushes and drains.

Every link implements all of :class:`RouterLink`; the controller never asks whether a call
exists. Where a router runs tells one thing apart, :attr:`RouterLink.in_process`: a router in
this process calls :meth:`RouterLink.listen`'s callbacks inside its request path as each
attempt fails, and its silent requests are an in-memory read; a router across a socket is
asked with :meth:`RouterLink.evidence`, one long poll held open at a time.

This module imports no router: it names what it calls on one (:class:`LocalRouter`), which
:class:`~fleetwarden.router.app.Router` is, so that ``app`` may hand out its own link without
an import circle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

import aiohttp

from fleetwarden.router.pool import BackendFacts

__all__ = ["CONTROL_TIMEOUT_S", "EVIDENCE_WAIT_S", "ControlError", "EvidenceFeed",
           "InProcessRouter", "LocalRouter", "RemoteRouter", "RouterLink", "facts_json"]

#: How long a control call may take. The calls are in-memory operations on the router, so
#: seconds without an answer mean the router process is gone or stuck; the tick moves on.
CONTROL_TIMEOUT_S = 5.0
#: How long an evidence poll waits for evidence by default: a long poll held open, answered
#: at once when there is any.
EVIDENCE_WAIT_S = 20.0
#: How often a held evidence poll looks for requests that turned silent (failures wake it at
#: once): the in-process controller's own evidence_poll_s is 0.5 s.
EVIDENCE_SCAN_S = 0.25

#: ``{url: (successes, failures, trailing_failures)}``: one window of a router's outcomes.
Outcomes = dict[str, tuple[int, int, int]]


class RouterLink(Protocol):
    """Every call a controller makes on a router, in this process or another."""

    @property
    def name(self) -> str:
        """How logs and errors name this router."""

    @property
    def in_process(self) -> bool:
        """Whether the router runs in this process: :meth:`listen`'s callbacks then come as
        each attempt fails; otherwise evidence is pulled with :meth:`evidence`."""

    async def set_serving_backends(self, urls: Sequence[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None: ...
    async def set_trial_backends(self, urls: Sequence[str]) -> None: ...
    async def set_retry_after(self, seconds: float | None) -> None: ...
    async def drain_outcomes(self) -> Outcomes: ...
    async def rescue(self, url: str, *, streams: bool = True) -> int: ...
    async def weights_changing(self, url: str, version: int) -> int: ...
    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False
                    ) -> int: ...
    async def in_flight(self) -> dict[str, int]: ...
    async def silent_backends(self, after_s: float) -> dict[str, float]: ...
    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]: ...
    async def evidence(self, wait_s: float, silent_after_s: float
                       ) -> tuple[int, dict[str, float]]: ...
    async def status(self) -> dict[str, Any]: ...


class LocalRouter(Protocol):
    """What a link and the control API call on a router in this process
    (:class:`~fleetwarden.router.app.Router`): the same calls, synchronous."""

    def set_serving_backends(self, urls: Iterable[str],
                             facts: Mapping[str, BackendFacts] | None = None) -> None: ...
    def set_trial_backends(self, urls: Iterable[str]) -> None: ...
    def set_retry_after(self, seconds: float | None) -> None: ...
    def drain_outcomes(self) -> Outcomes: ...
    def rescue(self, url: str, *, streams: bool = True) -> int: ...
    def weights_changing(self, url: str, version: int) -> int: ...
    def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int: ...
    def in_flight(self) -> dict[str, int]: ...
    def silent_backends(self, after_s: float) -> dict[str, float]: ...
    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]: ...
    def status(self) -> dict[str, Any]: ...


class ControlError(Exception):
    """A control call was refused or failed; the message carries the router's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"router control answered {status}: {message}")
        self.status = status


def facts_json(facts: Mapping[str, BackendFacts]) -> dict[str, dict[str, Any]]:
    """``facts`` of a push as JSON (the control API's ``PUT /serving``)."""
    return {url: f.to_dict() for url, f in facts.items()}


class EvidenceFeed:
    """The failed attempts of one router in this process, as a long poll: counted from the
    router's start, so that a caller that names the count it last saw misses none between two
    polls. The control API's ``GET /evidence`` and :meth:`InProcessRouter.evidence` answer
    from it."""

    def __init__(self, router: LocalRouter) -> None:
        self.router = router
        #: Failed attempts since this feed began: what a poll's ``after`` counts against.
        self.failures = 0
        self._came = asyncio.Event()  # set at each failure, cleared as a poll takes it
        self._closing = False
        self._unlisten = router.listen(self._failed)

    def _failed(self, backend: str, cause: str) -> None:
        self.failures += 1
        self._came.set()

    def close(self) -> None:
        """The router is stopping: held polls are answered now, not at their wait."""
        self._closing = True
        self._came.set()
        self._unlisten()

    async def wait(self, after: int, wait_s: float, silent_after_s: float
                   ) -> tuple[int, dict[str, float]]:
        """Up to ``wait_s``: (failed attempts since the count ``after``, backends holding a
        request silent for ``silent_after_s``), answered as soon as there is any."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            # ``after`` above the count: the caller counted in an earlier router process
            new = self.failures - after if self.failures >= after else self.failures
            silent = self.router.silent_backends(silent_after_s)
            left = deadline - loop.time()
            if new or silent or left <= 0 or self._closing:
                return new, silent
            self._came.clear()
            # a request turns silent without an event: looked for again every EVIDENCE_SCAN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._came.wait(), min(left, EVIDENCE_SCAN_S))


class InProcessRouter:
    """A router in this process (:class:`LocalRouter`), behind the async :class:`RouterLink`
    calls."""

    name = "router in this process"
    in_process = True

    def __init__(self, router: LocalRouter) -> None:
        self.router = router
        self._feed: EvidenceFeed | None = None
        self._failures = 0  # the feed's count at the last evidence answer

    async def set_serving_backends(self, urls: Iterable[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None:
        self.router.set_serving_backends(urls, facts)

    async def set_trial_backends(self, urls: Iterable[str]) -> None:
        self.router.set_trial_backends(urls)

    async def set_retry_after(self, seconds: float | None) -> None:
        self.router.set_retry_after(seconds)

    async def drain_outcomes(self) -> Outcomes:
        return self.router.drain_outcomes()

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        return self.router.rescue(url, streams=streams)

    async def weights_changing(self, url: str, version: int) -> int:
        return self.router.weights_changing(url, version)

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        return self.router.hedge(url, held_s, lost_race_fails=lost_race_fails)

    async def in_flight(self) -> dict[str, int]:
        return self.router.in_flight()

    async def silent_backends(self, after_s: float) -> dict[str, float]:
        return self.router.silent_backends(after_s)

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """Every failed attempt, as it happens: ``callback(backend, cause)``."""
        return self.router.listen(callback)

    async def evidence(self, wait_s: float, silent_after_s: float
                       ) -> tuple[int, dict[str, float]]:
        """As :meth:`RemoteRouter.evidence`, counted from this link's first call."""
        if self._feed is None:
            self._feed = EvidenceFeed(self.router)
        failed, silent = await self._feed.wait(self._failures, wait_s, silent_after_s)
        self._failures = self._feed.failures
        return failed, silent

    async def status(self) -> dict[str, Any]:
        return self.router.status()


class RemoteRouter:
    """A router in another process, driven through its control API.

    ``url`` is the control API's base URL (``http://127.0.0.1:PORT``), ``token`` its bearer
    token. Use as ``async with RemoteRouter(url, token) as router:``, or call :meth:`close`.
    """

    in_process = False

    def __init__(self, url: str, token: str, *, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        #: The batch of the last drain answered: acknowledged by the next drain.
        self._last_batch: str | None = None
        #: The router's count of failed attempts at the last evidence answer.
        self._failures: int | None = None
        self._listeners: list[Callable[[str, str], None]] = []

    @property
    def name(self) -> str:
        return self.url

    async def __aenter__(self) -> RemoteRouter:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: object = None, *,
                    timeout_s: float | None = None) -> Any:
        return json.loads(await self._text(method, path, body, timeout_s=timeout_s))

    async def _text(self, method: str, path: str, body: object = None, *,
                    timeout_s: float | None = None) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.request(method, self.url + path, **kwargs) as response:
            text = await response.text()
            if response.status != 200:
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text
                raise ControlError(response.status, message)
            return text

    async def metrics_text(self) -> str:
        """The router's own ``/metrics``, in Prometheus' text format."""
        return await self._text("GET", "/metrics")

    async def set_serving_backends(self, urls: Iterable[str],
                                   facts: Mapping[str, BackendFacts] | None = None) -> None:
        body: dict[str, Any] = {"backends": list(urls)}
        if facts is not None:
            body["facts"] = facts_json(facts)
            # The engines' keys, apart from the facts: the facts are echoed in answers and
            # statuses, the keys never.
            keys = {url: f.key for url, f in facts.items() if f.key is not None}
            if keys:
                body["keys"] = keys
        await self._call("PUT", "/serving", body)

    async def drain_outcomes(self) -> Outcomes:
        answer = await self._call("POST", "/outcomes/drain", {"ack": self._last_batch})
        self._last_batch = answer.get("batch")
        return {url: (int(s), int(f), int(t)) for url, (s, f, t) in answer["outcomes"].items()}

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        answer = await self._call("POST", "/rescue", {"backend": url, "streams": streams})
        return int(answer["rescued"])

    async def weights_changing(self, url: str, version: int) -> int:
        answer = await self._call("POST", "/weights-changing",
                                  {"backend": url, "version": version})
        return int(answer["marked"])

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        answer = await self._call("POST", "/hedge", {"backend": url, "held_s": held_s,
                                                     "lost_race_fails": lost_race_fails})
        return int(answer["hedged"])

    async def in_flight(self) -> dict[str, int]:
        return {url: int(n) for url, n in (await self._call("GET", "/in-flight"))["in_flight"]
                .items()}

    async def set_retry_after(self, seconds: float | None) -> None:
        await self._call("PUT", "/retry-after", {"seconds": seconds})

    async def set_trial_backends(self, urls: Iterable[str]) -> None:
        await self._call("PUT", "/trial", {"backends": list(urls)})

    async def silent_backends(self, after_s: float) -> dict[str, float]:
        answer = await self._call("GET", f"/silent?after_s={after_s:g}")
        return {url: float(x) for url, x in answer["silent"].items()}

    async def evidence(self, wait_s: float, silent_after_s: float) -> tuple[int, dict[str, float]]:
        """Wait up to ``wait_s`` for evidence: (failed attempts since the last call's answer,
        silent backends). Answered at once when there is any."""
        query = f"wait_s={wait_s:g}&silent_after_s={silent_after_s:g}"
        if self._failures is not None:
            query += f"&after={self._failures}"
        answer = await self._call("GET", "/evidence?" + query,
                                  timeout_s=wait_s + (self._timeout.total or CONTROL_TIMEOUT_S))
        self._failures = int(answer["failures"])
        failed = int(answer["failed"])
        for callback in list(self._listeners) * failed:
            callback("", "remote")
        return failed, {url: float(x) for url, x in answer["silent"].items()}

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """``callback(backend, cause)`` for each failed attempt an :meth:`evidence` answer
        counts, as it answers: the API counts them without naming the backend (``""``, cause
        ``"remote"``). Returns the unsubscribe."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    async def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = await self._call("GET", "/status")
        return answer

    async def stop_accepting(self) -> None:
        """Close the router's listeners; returns once they are closed (a reload's first
        step: no client told to reconnect may find an old listener)."""
        await self._call("POST", "/stop-accepting")
