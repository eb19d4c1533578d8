"""The router's subscriptions to its engines' KV events: ZMQ sockets feeding the precise index.

Owns: one SUB socket per engine that publishes KV events, the replay requests that fill a gap,
and reading where an engine publishes (vLLM's ``GET /kv_event_sources``).
Must not: decide anything about an event (router/kv_index.py does, purely).

Every router worker subscribes for itself (docs/design.md 4.3, "One view for every worker"):
ZMQ's PUB socket copies each batch to every subscriber at no cost to the engine's step, and the
precise index is a function of the engine's event stream alone, so N workers that hear the
same stream hold the same index, batch for batch, with no channel between them to fail or
lag. A worker started late, or one whose connection dropped, fills what it missed from the
engine's replay endpoint like any subscriber.

The wire (vLLM 0.32's ``ZmqEventPublisher``): a batch is three frames ``(topic, seq, payload)``,
``seq`` 8 bytes big-endian; a replay request on a DEALER socket is ``(b"", start_seq)``, answered
with ``(b"", topic, seq, payload)`` per buffered batch from ``start_seq`` on, then
``(b"", b"", -1, b"")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from fleetwarden.router.kv_index import GAP, KVIndex, decode_batch

__all__ = ["REPLAY_TIMEOUT_S", "KVEvents", "Source", "sources_of"]

log = logging.getLogger("fleetwarden.router")

#: How long a replay request may take before the gap counts as unfillable. One second: the
#: publisher answers between two sends of its thread (every 0.1 s at the latest, its queue's
#: wait), so a second without an answer means no replay endpoint listens.
REPLAY_TIMEOUT_S = 1.0
_END_SEQ = -1
#: The catch-up replay's last batches kept to tell their live copies: only those sent between
#: the subscription taking and the replay answering (a few steps) can come again.
_CAUGHT_UP_KEPT = 256


@dataclass(frozen=True, slots=True)
class Source:
    """Where one engine publishes: its PUB endpoint, its replay endpoint, its topic."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


def _resolve(endpoint: str, backend: str) -> str:
    """An endpoint as the engine bound it (``tcp://*:5557``: every address of its host), as the
    router reaches it: the backend's own host in place of a wildcard."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = urlsplit(backend).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


def sources_of(answer: Any, backend: str) -> Source | None:
    """The source of one engine from its ``/kv_event_sources`` answer (vLLM: each
    data-parallel rank's ``KVEventsConfig``), or None: no ZMQ publisher, a malformed answer,
    or several ranks (each publishes its own stream for its own cache, which one front end's
    requests are spread over: the approximate index serves such an engine)."""
    if not isinstance(answer, dict) or len(answer) != 1:
        return None
    config = next(iter(answer.values()))
    if not isinstance(config, dict) or config.get("enable_kv_cache_events") is not True:
        return None
    endpoint = config.get("endpoint")
    replay = config.get("replay_endpoint")
    topic = config.get("topic", "")
    if (config.get("publisher") != "zmq" or not isinstance(endpoint, str)
            or not isinstance(replay, str | None) or not isinstance(topic, str)):
        return None
    return Source(_resolve(endpoint, backend),
                  None if replay is None else _resolve(replay, backend), topic)


class KVEvents:
    """The subscriptions of one router process: :meth:`watch` an engine's source, and its
    batches go into ``index`` as they come."""

    def __init__(self, index: KVIndex, clock: Callable[[], float] | None = None) -> None:
        self.index = index
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Source, asyncio.Task[None]]] = {}
        self._clock = clock
        #: Batches that were not vLLM's batch (wrong frames, not decodable): counted, skipped
        #: as a gap would be.
        self.malformed = 0

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    @property
    def watched(self) -> Mapping[str, Source]:
        return {url: source for url, (source, _) in self._tasks.items()}

    def watch(self, backend: str, source: Source) -> None:
        """Listen to ``backend``'s events at ``source`` (again, if it moved)."""
        held = self._tasks.get(backend)
        if held is not None and held[0] == source and not held[1].done():
            return
        self.unwatch(backend)
        task = asyncio.create_task(self._listen(backend, source), name=f"kv-events:{backend}")
        task.add_done_callback(partial(self._ended, backend))
        self._tasks[backend] = (source, task)

    def _ended(self, backend: str, task: asyncio.Task[None]) -> None:
        """A subscription that ended by itself (a socket error): its engine is routed by the
        guess from now on, and the next :meth:`watch` of it listens again."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("KV events of %s: the subscription failed (%r); the guess routes it",
                  backend, task.exception())
        if self._tasks.get(backend, (None, None))[1] is task:
            self.index.drop(backend)

    def unwatch(self, backend: str) -> None:
        """Stop listening to ``backend`` and forget all its events told."""
        held = self._tasks.pop(backend, None)
        if held is not None:
            held[1].cancel()
        self.index.drop(backend)

    def keep(self, backends: set[str]) -> None:
        """Stop listening to every engine not in ``backends``."""
        for url in [u for u in self._tasks if u not in backends]:
            self.unwatch(url)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    async def _listen(self, backend: str, source: Source) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        #: The batches the catch-up replay gave, by number: the live stream may give some of
        #: them again (those sent after the subscription took, before the replay answered);
        #: the same number with the same bytes is that copy, not a new process.
        caught_up: dict[int, bytes] = {}
        try:
            if source.replay is not None:
                caught_up = await self._catch_up(backend, source)
            while True:
                frames = await sub.recv_multipart()
                if (len(frames) == 3 and len(frames[1]) == 8
                        and caught_up.get(int.from_bytes(frames[1], "big")) == frames[2]):
                    continue
                gap = self._received(backend, frames)
                if gap is not None:
                    await self._fill(backend, source, *gap)
        finally:
            sub.close(linger=0)

    async def _catch_up(self, backend: str, source: Source) -> dict[int, bytes]:
        """Learn what the engine's replay buffer holds from the expected batch on, at once: an
        idle engine publishes nothing until its next step (vLLM publishes when it steps), and
        its cache is what the batches before say. Past the buffer: lost, as a gap is."""
        index = self.index
        got = await self._replay(source, index.expected(backend), keep_bytes=True)
        now = self._now()
        for number, events, _ in got:
            if index.receive(backend, number, events, now) == GAP:
                index.lost(backend, number, now)
                index.receive(backend, number, events, now)
        return {number: payload for number, _, payload in got[-_CAUGHT_UP_KEPT:]}

    def _received(self, backend: str, frames: list[bytes]) -> tuple[int, list[Any]] | None:
        """Feed one live batch; on a gap, the batch (number, events) to give after the fill."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return None
        seq = int.from_bytes(frames[1], "big")
        try:
            events: list[Any] = list(decode_batch(frames[2]))
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Not vLLM's batch: its number still counts (its events are missed, as in a gap).
            self.malformed += 1
            events = []
        if self.index.receive(backend, seq, events, self._now()) == GAP:
            return seq, events
        return None

    async def _fill(self, backend: str, source: Source, seq: int, events: list[Any]) -> None:
        """Batches from the expected one up to ``seq`` were missed: ask the replay endpoint for
        them; what it cannot give is lost. Then batch ``seq`` itself."""
        index = self.index
        start = index.expected(backend)
        got = await self._replay(source, start) if source.replay is not None else []
        now = self._now()
        for number, replayed, _ in got:
            if number >= seq:
                break  # the live stream has it
            if index.receive(backend, number, replayed, now) == GAP:
                break  # the buffer no longer holds the first one missed
        if index.expected(backend) != seq:
            log.info("KV events of %s: batches %d-%d missed and not replayable; its events "
                     "route it again after %g s", backend, index.expected(backend), seq - 1,
                     index.resync_s)
            index.lost(backend, seq, now)
        index.receive(backend, seq, events, now)

    async def _replay(self, source: Source, start: int, keep_bytes: bool = False
                      ) -> list[tuple[int, list[Any], bytes]]:
        """The batches the engine's replay buffer holds from ``start`` on (number, events and,
        with ``keep_bytes``, the payload), in order; none if it does not answer within
        :data:`REPLAY_TIMEOUT_S`."""
        assert source.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(source.replay)
        got: list[tuple[int, list[Any], bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.malformed += 1
                    return got
                number = int.from_bytes(frames[2], "big", signed=True)
                if number == _END_SEQ:
                    return got
                try:
                    got.append((number, list(decode_batch(frames[3])),
                                frames[3] if keep_bytes else b""))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.malformed += 1
                    return got
        except TimeoutError:
            return got
        finally:
            dealer.close(linger=0)
