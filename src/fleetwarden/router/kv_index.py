"""The precise prefix index: what each engine's KV cache holds, as its own KV events say.

Owns: decoding vLLM's KV-event batches, the per-engine block sets they build, and the sequence
numbers that tell a batch missed, a new process or a duplicate.
Must not: do I/O, await or read a clock (pure: router/kv_events.py is the shell that feeds it).

An engine started with ``--kv-events-config`` publishes one batch per step that changed its
cache (docs/design.md 4.3, "Precise routing"): ``BlockStored`` (the blocks' hashes, their parent
block's hash, their ``token_ids``), ``BlockRemoved`` (hashes) and ``AllBlocksCleared``, each
batch numbered from 0 for the process's life. The rules here:

* **Keys by tokens, never by the engine's hashes.** Engine hashes are seeded (vLLM's hash seed,
  a ``cache_salt``), so nothing outside the engine can compute them from a prompt. A stored
  block is keyed by the router's own hash chain over its ``token_ids`` from its parent's key
  (:func:`fleetwarden.router.affinity.token_keys`' chain, ``token_block`` tokens a key): the
  keys a request's prompt of token ids gives are the keys looked up, and any engine's seed is
  irrelevant. An engine block of several router blocks (a block size of 32) holds each of them.
  A block whose parent the index does not know (stored before it listened), or that belongs to
  a LoRA adapter, carries extra keys (images, a ``cache_salt``) or a KV-cache group other than
  the first is not keyed: no plain prompt's chain can reach it.
* **Sequence numbers.** The next batch must be the one expected. A later one means batches were
  missed (:meth:`KVIndex.receive` says ``GAP``: the shell asks the engine's replay endpoint for
  them and feeds them in, then the batch again); one the replay cannot give any more (past the
  engine's buffer) makes :meth:`KVIndex.lost` drop the engine's entries, and the engine is not
  routed by its events until ``resync_s`` of them have passed without a gap (by then what it
  held before the gap is, by the approximate index's own lifetime, gone): the approximate
  index serves it meanwhile. The first batch heard from an engine is a gap from 0 (a replay
  from 0 teaches a router started late the engine's whole history, where the buffer still
  holds it). An earlier number than expected is a new process (its numbers start again at 0):
  its cache is empty, the engine's entries go. (A replay never gives a batch the live stream
  gives too: the shell feeds it only the batches before the live one that showed the gap.)
* **Restarts obey the ledger.** :meth:`KVIndex.forget` is called where the push says the cache
  went (a new incarnation, a refit, a sleep, out of the serving set), before any event says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["GAP", "OK", "AllBlocksCleared", "BlockRemoved", "BlockStored",
           "KVIndex", "decode_batch"]


class _Event(msgspec.Struct, tag=True, gc=False):
    pass


class BlockStored(_Event, kw_only=True):
    """vLLM's ``BlockStored``, the fields read (the rest are ignored by the decoder)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(_Event, kw_only=True):
    block_hashes: list[bytes | int]
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)

Event = BlockStored | BlockRemoved | AllBlocksCleared

#: What :meth:`KVIndex.receive` says of a batch.
OK = "ok"
GAP = "gap"


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch as vLLM's publisher encodes it (msgspec's msgpack, the batch an
    array ``[ts, events, data_parallel_rank]``, each event a map tagged by ``type``); raises
    ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on anything else."""
    return _DECODER.decode(payload).events


def _chain(parent: int, ids: Sequence[int], block: int) -> list[int]:
    """The router's keys of ``ids``' full blocks after ``parent`` (affinity.token_keys' chain)."""
    keys = []
    for start in range(0, len(ids) - len(ids) % block, block):
        parent = hash((parent, *ids[start:start + block]))
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Engine:
    url: str
    #: router key -> the engines that hold it, shared by every engine of the index (a
    #: request's lookup is one probe per block, whatever the fleet's size).
    holders: dict[int, set[str]]
    #: engine block hash -> the router keys of its tokens.
    by_hash: dict[bytes | int, tuple[int, ...]] = field(default_factory=dict)
    #: router key -> how many engine blocks hold it (two KV groups may hold the same tokens).
    held: dict[int, int] = field(default_factory=dict)
    #: The sequence number expected next (0: nothing heard yet from this process).
    expected: int = 0
    #: None: every block the engine holds is known. Else when the entries were last dropped
    #: for a gap no replay could fill: the engine is not routed by its events before
    #: ``resync_s`` after it.
    lost_at: float | None = None
    #: A batch heard yet (the first one is a gap from 0 unless it is 0).
    heard: bool = False

    def hold(self, keys: Iterable[int]) -> None:
        """One more engine block holds ``keys``."""
        held = self.held
        for key in keys:
            count = held.get(key, 0)
            held[key] = count + 1
            if not count:
                self.holders.setdefault(key, set()).add(self.url)

    def release(self, keys: Iterable[int]) -> None:
        """One engine block holding ``keys`` went."""
        held = self.held
        for key in keys:
            count = held.get(key, 0) - 1
            if count > 0:
                held[key] = count
            elif held.pop(key, None) is not None:
                self._unhold(key)

    def _unhold(self, key: int) -> None:
        owners = self.holders.get(key)
        if owners is not None:
            owners.discard(self.url)
            if not owners:
                del self.holders[key]

    def clear(self) -> None:
        for key in self.held:
            self._unhold(key)
        self.by_hash.clear()
        self.held.clear()


@dataclass(slots=True)
class Tallies:
    """Counters of the index's life, for /metrics and the tests."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unkeyed: int = 0
    gaps: int = 0
    lost: int = 0
    restarts: int = 0


class KVIndex:
    """Per engine, the router keys of the blocks its events say it holds."""

    def __init__(self, block: int = 16, resync_s: float = 120.0) -> None:
        if block < 1 or not resync_s >= 0:
            raise ValueError(f"block must be >= 1 and resync_s >= 0, got {block}, {resync_s}")
        self.block = block
        self.resync_s = resync_s
        self._engines: dict[str, _Engine] = {}
        self._holders: dict[int, set[str]] = {}
        self.tallies = Tallies()
        #: Engines whose own events said their whole cache went (numbers starting again, an
        #: ``AllBlocksCleared``), in order, until the reader takes them: the guess beside this
        #: index (router/affinity.py) drops its entries of them too, as it does at a push that
        #: says so, so that no prompt goes to them for a cache they said they lost.
        self.emptied: list[str] = []

    def _engine(self, backend: str) -> _Engine:
        engine = self._engines.get(backend)
        if engine is None:
            engine = self._engines[backend] = _Engine(backend, self._holders)
        return engine

    # ------------------------------------------------------------------ the stream

    def receive(self, backend: str, seq: int, events: Sequence[Event], now: float) -> str:
        """Batch number ``seq`` of ``backend``: applied (``OK``), or not applied because batches
        before it are missing (``GAP``: replay from :meth:`expected`, then give this one
        again)."""
        engine = self._engine(backend)
        if seq < engine.expected:
            # The numbers went back: a new process, whose cache starts empty.
            self.tallies.restarts += 1
            self.emptied.append(backend)
            engine.clear()
            engine.lost_at = None if seq == 0 else now
            engine.expected = seq
        elif seq > engine.expected:
            self.tallies.gaps += 1
            return GAP
        engine.heard = True
        engine.expected = seq + 1
        self.tallies.batches += 1
        for event in events:
            self._apply(engine, event)
        return OK

    def lost(self, backend: str, seq: int, now: float) -> None:
        """Batches before ``seq`` cannot be had: drop the engine's entries and take its events
        again from ``seq``; it is routed by the approximate index for ``resync_s``."""
        engine = self._engine(backend)
        self.tallies.lost += 1
        engine.clear()
        engine.lost_at = now
        engine.expected = seq

    def expected(self, backend: str) -> int:
        """The sequence number the index waits for next from ``backend``."""
        engine = self._engines.get(backend)
        return 0 if engine is None else engine.expected

    def forget(self, backend: str) -> None:
        """The ledger says ``backend``'s cache went (a restart, a refit, a sleep) or it left:
        drop its entries at once. Its next batches are those of its new cache, which starts
        empty: what it holds is known again (a gap before it no longer matters)."""
        engine = self._engines.get(backend)
        if engine is not None:
            engine.clear()
            engine.lost_at = None

    def drop(self, backend: str) -> None:
        """No longer listened to: forget everything of ``backend``, its numbers too."""
        engine = self._engines.pop(backend, None)
        if engine is not None:
            engine.clear()

    def _apply(self, engine: _Engine, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(engine, event)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                keys = engine.by_hash.pop(h, None)
                if keys is None:
                    continue
                self.tallies.removed += 1
                engine.release(keys)
        else:
            self.tallies.cleared += 1
            self.emptied.append(engine.url)
            engine.clear()
            # Emptied: all it holds from here is what its next events say, so a gap lost
            # before no longer hides anything (a reset, a sleep, a refit's pause resync it).
            engine.lost_at = None

    def _stored(self, engine: _Engine, event: BlockStored) -> None:
        size = event.block_size
        hashes = event.block_hashes
        block = self.block
        if (event.lora_name is not None or event.lora_id is not None
                or event.group_idx not in (None, 0) or size % block
                or len(event.token_ids) != size * len(hashes)
                or (event.extra_keys and any(k is not None for k in event.extra_keys))):
            self.tallies.unkeyed += len(hashes)
            return
        if event.parent_block_hash is None:
            parent = 0
        else:
            parent_keys = engine.by_hash.get(event.parent_block_hash)
            if not parent_keys:
                self.tallies.unkeyed += len(hashes)
                return
            parent = parent_keys[-1]
        per = size // block
        keys = _chain(parent, event.token_ids, block)
        for i, h in enumerate(hashes):
            mine = tuple(keys[i * per:(i + 1) * per])
            if engine.by_hash.get(h) == mine:
                continue  # stored again (a reuse report): held once
            old = engine.by_hash.get(h)
            if old is not None:  # the same hash for other tokens: the engine reused it
                engine.release(old)
            engine.by_hash[h] = mine
            engine.hold(mine)
            self.tallies.stored += 1

    # ------------------------------------------------------------------ reading

    def synced(self, backend: str, now: float) -> bool:
        """Whether ``backend``'s events tell all it holds (else the approximate index serves
        it): heard from, and no gap went unfilled in the last ``resync_s``."""
        engine = self._engines.get(backend)
        if engine is None or not engine.heard:
            return False
        return engine.lost_at is None or now - engine.lost_at >= self.resync_s

    def matched(self, keys: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``keys`` each of ``backends`` holds, by its events (0 left out)."""
        allowed = set(backends)
        return self._walk(keys, allowed.__contains__)

    def told(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Leading blocks of ``keys`` each engine holds whose events are whole (:meth:`synced`),
        0 left out: one probe per block, the fleet's size aside."""
        synced: dict[str, bool] = {}

        def whole(url: str) -> bool:
            found = synced.get(url)
            if found is None:
                found = synced[url] = self.synced(url, now)
            return found

        return self._walk(keys, whole)

    def _walk(self, keys: Sequence[int], accept: Callable[[str], bool]) -> dict[str, int]:
        holders = self._holders
        alive: dict[str, int] = {}
        for depth, key in enumerate(keys):
            owners = holders.get(key)
            if not owners:
                break
            if not depth:
                alive = {u: 1 for u in owners if accept(u)}
            else:
                still = [u for u, n in alive.items() if n == depth and u in owners]
                if not still:
                    break
                for u in still:
                    alive[u] = depth + 1
            if not alive:
                break
        return alive

    def backends(self) -> list[str]:
        """The engines heard from, sorted."""
        return sorted(u for u, e in self._engines.items() if e.heard)

    def blocks(self, backend: str) -> int:
        """Router blocks ``backend`` holds by its events."""
        engine = self._engines.get(backend)
        return 0 if engine is None else len(engine.held)

    def holds(self, backend: str) -> frozenset[int]:
        """The router keys ``backend`` holds (tests compare two routers' views)."""
        engine = self._engines.get(backend)
        return frozenset() if engine is None else frozenset(engine.held)
