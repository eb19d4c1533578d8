"""The router: the OpenAI API on one URL, in front of the backends it is told may serve.

Owns: the router's start and stop (its listeners, a drain's hand-over, the control port), the
serving set it is told and the controller's other calls on it, and its status; beside it, the
data port's routes (:mod:`~fleetwarden.router.routes`) and the attempt loop
(:mod:`~fleetwarden.router.forward`).
Must not: decide health: a controller pushes the serving set; the router counts and obeys.

It counts and obeys; it never decides health. A controller pushes the serving set
(:meth:`Router.set_serving_backends`, the whole list every tick), drains what happened to the
requests (its pool's ``drain_outcomes``), and moves requests off a backend it condemned
(:meth:`WaitingRequests.rescue <fleetwarden.router.waiting.WaitingRequests.rescue>`): the control
operations of :data:`~fleetwarden.router.ops.OPERATIONS`, each a row naming its call here. The
same calls are served on an optional control port
(:mod:`fleetwarden.router.control`), so one controller can drive several router processes.

Several routers can run in one event loop: each has its own server, client and Prometheus
registry. The data port is served by :mod:`fleetwarden.router.serve` (the event loop's
protocols and httptools), the control API by aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from aiohttp import web

from fleetwarden.router import serve
from fleetwarden.router.affinity import Affinity, Predicted
from fleetwarden.router.control import make_control_app
from fleetwarden.router.forward import Forwarder
from fleetwarden.router.keys import KeysFile
from fleetwarden.router.links import InProcessRouter
from fleetwarden.router.ops import Evidence, Holding
from fleetwarden.router.pool import BackendFacts, Pool, RetryBudget
from fleetwarden.router.routes import Routes
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import RouterStats, make_registry
from fleetwarden.router.waiting import EvidenceFeed

__all__ = ["Router", "runner_url"]

log = logging.getLogger("fleetwarden.router")

#: While a router drains (:meth:`Router.drain`), a keep-alive connection idle this long is
#: closed. Clients reuse an idle connection at once or not for a while (httpx, and with it the
#: ``openai`` client, keeps one 5 s); a close that raced a request sent at this very moment is
#: the one way a drain could fail one, so it waits well past the back-to-back case.
IDLE_CLOSE_S = 2.0
_DRAIN_POLL_S = 0.05
#: Between a drain's listener close and its first ``Connection: close``: the time the other
#: routers replaced at the same moment take to close theirs (microseconds; a loaded machine).
HANDOVER_SETTLE_S = 0.5

DISARMED_WARNING = (
    "reflex drop disarmed: fleet health does not drive this router's membership, so a "
    "backend dropped on a failure would never be put back. Failing backends stay in the "
    "list; retries still move their requests elsewhere."
)


class Router:
    """An OpenAI-compatible reverse proxy over a changing set of backend URLs.

    ``health_managed``: a controller pushes the serving set from the fleet's health. Only then
    does a failure drop its backend from the local list at once (the reflex), since only then
    does a later push put it back.

    ``worker``: this router is worker N of several processes sharing one port; its
    ``/metrics`` series carry ``worker="N"``.

    ``engine_key``: the engines' own key, sent to them as ``Authorization: Bearer`` in the
    client key's place when the router checks keys (``settings.keys_file``); without it, the
    client's key is removed and nothing is sent in its place. Raises
    :class:`~fleetwarden.router.keys.KeysFileError` for a keys file that cannot be used.
    """

    def __init__(
        self,
        backends: Iterable[str] = (),
        settings: RouterSettings | None = None,
        *,
        health_managed: bool = False,
        worker: int | None = None,
        engine_key: str | None = None,
    ) -> None:
        self.settings = settings if settings is not None else RouterSettings()
        self.health_managed = health_managed
        if not health_managed:
            log.warning(DISARMED_WARNING)
        s = self.settings
        self.pool = Pool(
            backends,
            retry_budget=RetryBudget(s.retry_budget_ratio, s.retry_budget_min),
            affinity_load_factor=s.affinity_load_factor,
            affinity_virtual_nodes=s.affinity_virtual_nodes,
        )
        self.stats = RouterStats()
        self.worker = worker
        self.forwarder = Forwarder(self.pool, s, self.stats, health_managed=health_managed)
        self.registry = make_registry(self.stats, self.pool, worker, self.forwarder.affinity)
        self.forwarder.tally.on_failure = self._failed
        self._evidence: list[Callable[[str, str], None]] = []
        #: The failed attempts as a long poll (the control operation ``evidence``).
        self.feed = EvidenceFeed(self.listen, self.silent_backends)
        #: The client keys in force, when the router checks them (router/keys.py); ``None``:
        #: the data port is open.
        self.keys = KeysFile(s.keys_file) if s.keys_file is not None else None
        self._keys_watch: asyncio.Task[None] | None = None
        #: The data port's routes, behind the keys when there are keys.
        self.routes = Routes(self.forwarder, self.pool, self.stats, self.registry, self.keys,
                             engine_key)
        self._server = serve.Server(self.routes.handler, max_body_bytes=s.max_body_bytes,
                                    settings=s, closed_for=self.stats.connections_closed)
        #: The data port's listeners (several: the sockets a replaced router handed over).
        self._listeners: list[asyncio.Server] = []
        self._started = False
        self._control_runner: web.AppRunner | None = None
        self._url: str | None = None
        self._control_url: str | None = None

    # ------------------------------------------------------------------ the controller's calls

    @property
    def reflex_armed(self) -> bool:
        return self.health_managed

    def arm_reflex(self) -> None:
        """A controller drives this router from the fleet's health (its first push over the
        control API): a failure may now drop its backend at once, since the next push puts
        it back."""
        if not self.health_managed:
            log.info("a controller drives this router: reflex drop armed")
        self.health_managed = True
        self.forwarder.tally.health_managed = True

    def set_serving_backends(self, urls: Iterable[str],
                             facts: Mapping[str, BackendFacts] | None = None, *,
                             coming_back: int = 0) -> None:
        """Replace the whole serving list; URLs never seen before are welcome (a restarted
        engine comes back on a new port). Requests in flight elsewhere finish where they are.

        ``facts``: each backend's shard index and weight version, as the ledger has them; a
        push without them (an older controller) leaves them unknown. ``coming_back``: how many
        engines the controller expects back soon; while it is not 0, a request that finds no
        backend waits for one (``comeback_wait_s``) instead of a 409 at once."""
        self.pool.replace(urls, facts)
        self.forwarder.waiting.forget_idle(set(self.pool.serving))
        self.forwarder.sync_affinity()
        self.forwarder.learner.forget()
        self.forwarder.pushed(coming_back)

    def set_trial_backends(self, urls: Iterable[str]) -> list[str]:
        """Backends on probation: each takes one request at a time (the ledger lifts it).
        Returns them, sorted."""
        self.pool.set_trial(urls)
        return self.trial_backends()

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """Call ``callback(backend, cause)`` for every failed attempt, as it happens (the
        evidence stream: refused, reset, timeout, server_error). Returns the unsubscribe."""
        self._evidence.append(callback)

        def unsubscribe() -> None:
            if callback in self._evidence:
                self._evidence.remove(callback)

        return unsubscribe

    def _failed(self, backend: str, cause: str) -> None:
        for callback in list(self._evidence):
            try:
                callback(backend, cause)
            except Exception:
                # A listener never breaks the data path.
                log.exception("an evidence listener failed on %s %s", backend, cause)

    def silent_backends(self, after_s: float) -> dict[str, float]:
        """Backends holding a request that has received nothing for ``after_s`` seconds or
        more, with the oldest such wait: a wedge shows here before any timeout."""
        return self.forwarder.waiting.silent(after_s)

    async def evidence(self, wait_s: float, silent_after_s: float,
                       after: int | None = None) -> Evidence:
        """Up to ``wait_s``: the failed attempts since the count ``after`` (``None``: from
        now) and the backends silent for ``silent_after_s``, as soon as there is any."""
        return await self.feed.wait(after, wait_s, silent_after_s)

    def serving_backends(self) -> list[str]:
        return list(self.pool.serving)

    def trial_backends(self) -> list[str]:
        """Backends on probation, sorted."""
        return sorted(self.pool.trial)

    def backend_facts(self) -> dict[str, BackendFacts]:
        """The last push's facts, per serving backend it gave them for."""
        return self.pool.all_facts()

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per backend, counted from dispatch to the last byte."""
        return self.pool.in_flight()

    def holding(self, silent_after_s: float = 0.0) -> Holding:
        """What this router holds on each backend, in one read: :meth:`in_flight` and
        :meth:`silent_backends` (the control operation ``holding``)."""
        return Holding(self.in_flight(), self.silent_backends(silent_after_s))

    def set_retry_after(self, seconds: float | None) -> float | None:
        """When the caller expects a backend back in ``seconds``, the router's deliberate
        answers carry ``Retry-After``; ``None`` removes it."""
        if seconds is not None and (not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"retry_after must be a finite number >= 0 or None, got {seconds}")
        self.forwarder.answers.retry_after = seconds
        return seconds

    def control(self) -> InProcessRouter:
        """This router behind the async methods a controller calls on any router."""
        return InProcessRouter(self)

    def status(self) -> dict[str, Any]:
        """What the router is doing now, as plain JSON-able data."""
        return {
            "url": self._url,
            "serving": self.serving_backends(),
            # False once it stopped accepting (a reload's predecessor, draining what it holds:
            # it gets no pushes any more, and its replacement serves the port).
            "accepting": bool(self._listeners),
            "trial": sorted(self.pool.trial),
            "facts": {url: f.to_dict() for url, f in self.backend_facts().items()},
            "in_flight": self.in_flight(),
            "health_managed": self.health_managed,
            "reflex_armed": self.reflex_armed,
            "retry_after": self.forwarder.answers.retry_after,
            "requests": self.stats.requests,
            "worker": self.worker,
            "stats": self.stats.summary(),
            "routing": self.settings.routing,
            # The data port's keys file: how many keys are in force, and why its last change
            # was not taken (the keys before it stay in force); None: no keys.
            "keys_file": None if self.keys is None else {
                "path": str(self.keys.path), "keys": len(self.keys.ring),
                "error": self.keys.error},
            # The cache-aware policy's predicted hits per backend (router/affinity.py).
            "cache": {url: {"requests": t.requests, "blocks": t.blocks,
                            "predicted_hit_blocks": t.hit_blocks}
                      for url, t in sorted(self.cache_predictions().items())},
        }

    def cache_predictions(self) -> dict[str, Predicted]:
        """Per backend: requests the cache-aware policy placed, their prompt blocks, and the
        blocks it predicted the backend held (empty under least in flight)."""
        affinity = self.forwarder.affinity
        return {} if affinity is None else affinity.predicted()

    @property
    def affinity(self) -> Affinity | None:
        """The cache-aware policy's index, or ``None`` under least in flight."""
        return self.forwarder.affinity

    # ------------------------------------------------------------------ lifecycle

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        control_port: int | None = None,
        control_token: str | None = None,
        control_host: str = "127.0.0.1",
        reuse_port: bool = False,
        control_reuse_port: bool = False,
        sockets: Sequence[socket.socket] = (),
    ) -> None:
        """Listen on ``host:port`` (0: any free port; read :attr:`url` or :attr:`port`). With a
        ``control_port``, also serve the control API there, behind ``control_token``.
        ``reuse_port``: ``SO_REUSEPORT``, so that several router processes share the port (the
        kernel spreads connections over them); ``control_reuse_port``: the same on the control
        port (the launcher holds it bound until the API answers there). ``sockets``: listen on
        these listening sockets instead (taken from the router this one replaces:
        :mod:`fleetwarden.router.handover`); ``host``, ``port`` and ``reuse_port`` are then not
        used."""
        if self._started:
            raise RuntimeError("Router.start() was already called")
        if control_port is not None and not control_token:
            raise ValueError("a control port needs a control token")
        await self.forwarder.open()
        loop = asyncio.get_running_loop()
        try:
            if sockets:
                for sock in sockets:
                    self._listeners.append(
                        await loop.create_server(self._server, sock=sock, backlog=1024))
            else:
                self._listeners.append(await loop.create_server(
                    self._server, host, port, backlog=1024, reuse_port=reuse_port or None))
        except BaseException:
            for listener in self._listeners:
                listener.close()
            self._listeners = []
            await self.forwarder.close()
            raise
        self._started = True
        self._url = serve.listening_url(self._listeners)
        if self.keys is not None:
            self._keys_watch = loop.create_task(self.routes.watch_keys(), name="keys-file")
        if control_port is not None:
            assert control_token is not None
            control = web.AppRunner(make_control_app(self, control_token), access_log=None,
                                    shutdown_timeout=self.settings.shutdown_grace_s)
            try:
                await control.setup()
                await web.TCPSite(control, control_host, control_port,
                                  reuse_port=control_reuse_port or None).start()
            except BaseException:
                await control.cleanup()
                await self.stop()
                raise
            self._control_runner = control
            self._control_url = runner_url(control)

    async def drain(self, bound_s: float) -> None:
        """Hand over to another router on the same port without failing a request: stop
        accepting at once (the port's other listeners take new connections), answer every
        request that still comes on an open connection with ``Connection: close``, close a
        connection once it has been idle for :data:`IDLE_CLOSE_S`, and return when no
        connection is left or ``bound_s`` has passed (then :meth:`stop` cuts what is left).
        The control API keeps answering meanwhile."""
        if not self._started:
            return
        if await self.stop_accepting():
            # Only now, and after the other replaced routers closed theirs (they got the same
            # signal at the same moment): a client told to reconnect must find only new
            # listeners. A connection waiting in a listener's queue when it closes is reset by
            # the kernel. A reload closes every old router's listeners first and waits for each
            # to say so (:meth:`stop_accepting` over the control API): then nothing is guessed.
            await asyncio.sleep(HANDOVER_SETTLE_S)
        self._server.draining = True
        server = self._server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        idle_since: dict[int, float] = {}
        log.info("draining: %d connection(s) open, up to %g s",
                 len(server.connections), bound_s)
        idle_closed = 0
        while server.connections and loop.time() < deadline:
            now = loop.time()
            for conn in list(server.connections):
                if conn.busy:
                    idle_since.pop(id(conn), None)
                elif now - idle_since.setdefault(id(conn), now) >= IDLE_CLOSE_S:
                    conn.close_idle()  # idle that long: no keep-alive client's request races it
                    idle_closed += 1
            await asyncio.sleep(_DRAIN_POLL_S)
        left = len(server.connections)
        log.info("drained: %d idle connection(s) closed by the router, %d left at the bound",
                 idle_closed, left)

    def listening_sockets(self) -> list[socket.socket]:
        """The sockets the router listens on now (none once it stopped accepting): what a
        replacement takes over (:class:`~fleetwarden.router.handover.ListenerHandover`)."""
        return [s for listener in self._listeners
                for s in listener.sockets]

    async def stop_accepting(self) -> bool:
        """Close the listeners (the port's other routers take every new connection); the
        connections open here go on. Returns whether any was open until now.

        In a reload the replacement listens on these very sockets (it took them:
        :mod:`fleetwarden.router.handover`), so the close only drops this process's reference
        and nothing queued is lost. A replacement that could not take them bound its own, and
        then closing a ``SO_REUSEPORT`` listener resets every connection the kernel completed
        in its queue that this process had not accepted yet (unless
        ``net.ipv4.tcp_migrate_req`` is 1; it is 0 by default): so the queue is emptied first,
        then the listener closed with no await between (only a handshake completing in those
        microseconds is then reset), and what was taken is served here like any open
        connection."""
        if not self._listeners:
            return False
        queued: list[socket.socket] = []
        for listener in self._listeners:
            queued += _accept_queued(listener)
            listener.close()  # closes the listening sockets at once, no await before it
        self._listeners = []
        loop = asyncio.get_running_loop()
        handler = self._server  # the protocol factory every listener serves with
        served = 0
        for conn in queued:
            try:
                await loop.connect_accepted_socket(handler, conn)
                served += 1
            except OSError as exc:  # the client gave up meanwhile
                log.info("a queued connection closed before it was served: %s", exc)
                conn.close()
        open_now = len(handler.connections)
        log.info("stopped accepting: %d queued connection(s) taken and served here, %d open",
                 served, open_now)
        return True

    async def stop(self) -> None:
        """Stop listening, end the requests in flight, close the client session."""
        if self._keys_watch is not None:
            self._keys_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keys_watch
            self._keys_watch = None
        if self._control_runner is not None:
            await self._control_runner.cleanup()
            self._control_runner = None
        if self._started:
            for listener in self._listeners:
                listener.close()
            self._listeners = []
            await self._server.shutdown(self.settings.shutdown_grace_s)
            self._started = False
        await self.forwarder.close()

    async def __aenter__(self) -> Router:
        if not self._started:
            await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    def reload_keys(self) -> bool:
        """Reread the keys file if it changed (:meth:`Routes.reload_keys`)."""
        return self.routes.reload_keys()

    @property
    def url(self) -> str:
        """``http://host:port`` the router listens on (after :meth:`start`)."""
        if self._url is None:
            raise RuntimeError("the router is not started")
        return self._url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def control_url(self) -> str | None:
        """``http://127.0.0.1:port`` of the control API, if one was started."""
        return self._control_url


def runner_url(runner: web.AppRunner) -> str:
    """The URL a started runner listens on (aiohttp's public ``addresses``)."""
    host, port = runner.addresses[0][:2]
    return serve.http_url(host, port)


def _accept_queued(listener: asyncio.Server) -> list[socket.socket]:
    """Every connection waiting in ``listener``'s sockets' queues, accepted now, without
    waiting (see :meth:`Router.stop_accepting`)."""
    taken: list[socket.socket] = []
    for listening in listener.sockets:
        dup = socket.socket(fileno=os.dup(listening.fileno()))  # the same queue
        try:
            dup.setblocking(False)
            while True:
                try:
                    conn, _ = dup.accept()
                except (BlockingIOError, InterruptedError):
                    break
                conn.setblocking(False)
                taken.append(conn)
        finally:
            dup.close()  # the listener itself stays open until it is closed
    return taken
