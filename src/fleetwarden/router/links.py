"""The links a controller drives routers through: one interface, wherever the router runs.

Owns: :class:`RouterLink` (every call a controller makes on a router), its implementations
(:class:`InProcessRouter` for a router in this process, :class:`RemoteRouter` across the
control API of :mod:`fleetwarden.router.control`).
Must not: decide anything: a link carries the controller's pushes and drains.

Each control operation is a row of :data:`~fleetwarden.router.ops.OPERATIONS`, and each
:class:`RouterLink` method a call of :meth:`RouterLink.call` with that row: a link implements
:meth:`~RouterLink.call` once (an HTTP request built from the row's route, or the row's target
called on the router in this process), never an operation by itself. Where a router runs tells
one thing apart, :attr:`RouterLink.in_process`: a router in this process calls
:meth:`RouterLink.listen`'s callbacks inside its request path as each attempt fails, and its
silent requests are an in-memory read; a router across a socket is asked with
:meth:`RouterLink.evidence` (the operation ``evidence``, answered from the router's
:class:`~fleetwarden.router.waiting.EvidenceFeed`), one long poll held open at a time.

This module imports no router at run time, so that ``app`` may hand out its own link without
an import circle.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast
from urllib.parse import urlencode

import aiohttp

from fleetwarden.router.ops import (
    DRAIN,
    EVIDENCE,
    EVIDENCE_WAIT_S,
    HEDGE,
    HOLDING,
    RESCUE,
    RETRY_AFTER,
    SERVING,
    STATUS,
    TRIAL,
    WEIGHTS_CHANGING,
    Holding,
    Operation,
    Outcomes,
)
from fleetwarden.router.pool import BackendFacts

if TYPE_CHECKING:
    from fleetwarden.router.app import Router

__all__ = ["CONTROL_TIMEOUT_S", "EVIDENCE_WAIT_S", "ControlError", "InProcessRouter",
           "RemoteRouter", "RouterLink"]

R = TypeVar("R")

#: How long a control call may take. The calls are in-memory operations on the router, so
#: seconds without an answer mean the router process is gone or stuck; the tick moves on.
CONTROL_TIMEOUT_S = 5.0


class RouterLink(Protocol):
    """Every call a controller makes on a router, in this process or another. A link
    implements :meth:`call`, :meth:`listen` and :meth:`evidence`; the operations below are
    each one :meth:`call` (their arguments named as the table's rows name them)."""

    @property
    def name(self) -> str:
        """How logs and errors name this router."""

    @property
    def in_process(self) -> bool:
        """Whether the router runs in this process: :meth:`listen`'s callbacks then come as
        each attempt fails; otherwise evidence is pulled with :meth:`evidence`."""

    async def call(self, op: Operation[R], **args: Any) -> R:
        """Operation ``op`` on this router, its arguments by the names of ``op.args``."""

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """``callback(backend, cause)`` for each failed attempt; returns the unsubscribe."""

    #: The router's count of failed attempts at the last evidence answer (``None``: none yet,
    #: and the first poll counts from its own time).
    _evidence_seen: int | None = None

    async def evidence(self, wait_s: float, silent_after_s: float
                       ) -> tuple[int, dict[str, float]]:
        """Up to ``wait_s``: (failed attempts since the last answer, backends holding a
        request silent for ``silent_after_s``), answered as soon as there is any."""
        answer = await self.call(EVIDENCE, wait_s=wait_s, silent_after_s=silent_after_s,
                                 after=self._evidence_seen)
        self._evidence_seen = answer.failures
        self._heard(answer.failed)
        return answer.failed, answer.silent

    def _heard(self, failed: int) -> None:
        """``failed`` attempts an evidence answer counted, for :meth:`listen`'s callbacks
        where the router is in another process (in this one they heard each as it failed)."""
        return None

    async def set_serving_backends(self, urls: Sequence[str],
                                   facts: Mapping[str, BackendFacts] | None = None, *,
                                   coming_back: int = 0) -> None:
        """The serving set, each backend's facts, and how many engines are coming back
        (:meth:`~fleetwarden.router.app.Router.set_serving_backends`)."""
        await self.call(SERVING, urls=list(urls), facts=facts, coming_back=coming_back)

    async def set_trial_backends(self, urls: Sequence[str]) -> None:
        """Backends on probation: one request at a time each."""
        await self.call(TRIAL, urls=list(urls))

    async def set_retry_after(self, seconds: float | None) -> None:
        """The ``Retry-After`` of the router's deliberate answers; ``None`` removes it."""
        await self.call(RETRY_AFTER, seconds=seconds)

    async def drain_outcomes(self) -> Outcomes:
        """The outcomes since the last drain (:data:`~fleetwarden.router.ops.Outcomes`)."""
        return await self.call(DRAIN)

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        """Move what waits on ``url`` elsewhere (:meth:`WaitingRequests.rescue
        <fleetwarden.router.waiting.WaitingRequests.rescue>`); how many were moved."""
        return await self.call(RESCUE, backend=url, streams=streams)

    async def weights_changing(self, url: str, version: int) -> int:
        """``url`` loads ``version`` with its requests kept; how many were marked."""
        return await self.call(WEIGHTS_CHANGING, backend=url, version=version)

    async def hedge(self, url: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        """Send what has waited on ``url`` for ``held_s`` to another backend as well
        (:meth:`~fleetwarden.router.waiting.WaitingRequests.hedge`); how many."""
        return await self.call(HEDGE, backend=url, held_s=held_s,
                               lost_race_fails=lost_race_fails)

    async def holding(self, silent_after_s: float = 0.0) -> Holding:
        """What the router holds on each backend, in one read (:class:`Holding`)."""
        return await self.call(HOLDING, silent_after_s=silent_after_s)

    async def status(self) -> dict[str, Any]:
        """What the router is doing now (:meth:`Router.status
        <fleetwarden.router.app.Router.status>`)."""
        return await self.call(STATUS)


class ControlError(Exception):
    """A control call was refused or failed; the message carries the router's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"router control answered {status}: {message}")
        self.status = status


class InProcessRouter(RouterLink):
    """A router in this process, behind the async :class:`RouterLink` calls: each operation
    is its row's ``target`` called on the router."""

    name = "router in this process"
    in_process = True

    def __init__(self, router: Router) -> None:
        self.router = router

    async def call(self, op: Operation[R], **args: Any) -> R:
        result = attrgetter(op.target)(self.router)(**args)
        if inspect.isawaitable(result):  # a wait (the evidence long poll)
            result = await result
        return cast("R", result)

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """Every failed attempt, as it happens: ``callback(backend, cause)``."""
        return self.router.listen(callback)


class RemoteRouter(RouterLink):
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

    async def call(self, op: Operation[R], **args: Any) -> R:
        """``op``'s route, its arguments written as the row says; a drain acknowledges the
        batch the last drain answered."""
        body: dict[str, Any] = {}
        for arg in op.args:
            body.update(arg.write(args[arg.name]))
        if op is DRAIN:
            body["ack"] = self._last_batch
        if op.method == "GET":
            # a long poll may take its whole wait, and then the answer's round trip
            waits = args["wait_s"] + (self._timeout.total or CONTROL_TIMEOUT_S) \
                if op is EVIDENCE else None
            answer = await self._call("GET", op.path + ("?" + urlencode(body) if body else ""),
                                      timeout_s=waits)
        else:
            answer = await self._call(op.method, op.path, body)
        if op is DRAIN:
            self._last_batch = answer.get("batch")
        return op.decode(answer if op.answer is None else answer[op.answer])

    def _heard(self, failed: int) -> None:
        for callback in list(self._listeners) * failed:
            callback("", "remote")

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """``callback(backend, cause)`` for each failed attempt an :meth:`evidence` answer
        counts, as it answers: the API counts them without naming the backend (``""``, cause
        ``"remote"``). Returns the unsubscribe."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    async def stop_accepting(self) -> None:
        """Close the router's listeners; returns once they are closed (a reload's first
        step: no client told to reconnect may find an old listener)."""
        await self._call("POST", "/stop-accepting")
