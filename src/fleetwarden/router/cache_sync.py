"""The cache-aware policy kept in step with the fleet: its index, and the engines' KV events.

Owns: :class:`CacheSync`: at each push, the policy's index forgets backends that left,
restarted or were refit, and the engines that publish KV events are listened to (asked where
at their ``/kv_event_sources`` once per incarnation, or where the settings say).
Must not: place a request: :class:`~fleetwarden.router.affinity.Affinity` chooses, the
attempt loop (:class:`~fleetwarden.router.forward.Forwarder`) asks it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from fleetwarden.router.affinity import Affinity
from fleetwarden.router.background import TaskPerBackend
from fleetwarden.router.exchange import with_key
from fleetwarden.router.kv_events import KVEvents, Source, sources_of
from fleetwarden.router.pool import Pool
from fleetwarden.router.relay import read_all
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.upstream import Address, UpstreamClient, UpstreamError

__all__ = ["CacheSync"]

log = logging.getLogger("fleetwarden.router")


class CacheSync:
    """One router's cache-aware index, kept in step with its serving set and its engines'
    KV events."""

    def __init__(self, pool: Pool, settings: RouterSettings, affinity: Affinity) -> None:
        self.pool = pool
        self.affinity = affinity
        #: The subscriptions to the engines' KV events (router/kv_events.py), opened with the
        #: router; None: not open, or ``kv_events`` off.
        self.kv_events: KVEvents | None = None
        #: Each backend whose ``/kv_event_sources`` was read, by the incarnation it was read
        #: at (asked again only when that changes), and the reads under way.
        self._kv_asked: dict[str, str | None] = {}
        self._kv_asking = TaskPerBackend("kv-sources")
        self._kv_configured = settings.kv_event_sources()
        self._client: UpstreamClient | None = None
        self._target: Callable[[str], Address] = Address.parse

    def open(self, client: UpstreamClient, target: Callable[[str], Address]) -> None:
        """The router opened: the reads go through ``client``, to ``target(url)``; the
        backends it was given are listened to at once."""
        self._client, self._target = client, target
        if self.affinity.precise is not None:
            self.kv_events = KVEvents(self.affinity.precise, clock=time.monotonic)
            self.sync()

    async def close(self) -> None:
        self._kv_asking.cancel_all()
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None
        self._client = None

    def sync(self) -> None:
        """A push arrived: the policy forgets backends that left, restarted or were refit, and
        the engines that publish KV events are listened to."""
        pool = self.pool
        facts = pool.all_facts()
        self.affinity.sync(pool.serving, {
            u: (f.incarnation, f.weight_version) for u, f in facts.items()})
        self._sync_kv_events()

    def _sync_kv_events(self) -> None:
        """Listen to the KV events of every serving backend that publishes them (asked at its
        ``/kv_event_sources`` once per incarnation); stop listening to those that left."""
        events = self.kv_events
        if events is None:
            return
        serving = set(self.pool.serving)
        events.keep(serving)
        for url in [u for u in self._kv_asked if u not in serving]:
            del self._kv_asked[url]
        configured = self._kv_configured
        for url in serving:
            named = configured.get(url.rstrip("/"))
            if named is not None:  # the configuration says where: nothing to ask
                events.watch(url, Source(*named))
                continue
            incarnation = self.pool.facts(url).incarnation
            if url in self._kv_asking or (url in self._kv_asked
                                          and self._kv_asked[url] == incarnation):
                continue
            self._kv_asked[url] = incarnation
            self._kv_asking.start(url, self._read_kv_sources(url))

    async def _read_kv_sources(self, backend: str) -> None:
        """Where ``backend`` publishes its KV events (vLLM's ``GET /kv_event_sources``), and
        listen there; an engine that does not say is routed by the guess."""
        assert self._client is not None, "CacheSync.open() was not called"
        try:
            answer = await self._client.request(
                self._target(backend + "/kv_event_sources"), "GET",
                with_key([], self.pool.facts(backend).key), b"")
            status = answer.status
            raw = await read_all(answer)
            source = sources_of(json.loads(raw), backend) if status == 200 else None
        except (UpstreamError, TimeoutError, ValueError):
            self._kv_asked.pop(backend, None)  # unreachable now: the next push asks again
            return
        if source is not None and self.kv_events is not None and backend in self.pool.serving:
            log.info("KV events of %s: listening at %s", backend, source.endpoint)
            self.kv_events.watch(backend, source)
