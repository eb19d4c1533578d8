"""The simulated engine's KV events: vLLM 0.32's publisher, byte for byte.

Owns: the ``--kv-events-config`` the simulator takes, the event types it publishes and the ZMQ
publisher (a PUB socket and a replay ROUTER socket).
Must not: know the prefix cache's internals (the cache hands it events; the server flushes
them once per engine step).

Read from vLLM's ``vllm/distributed/kv_events.py`` and ``vllm/config/kv_events.py`` (0.32):

* a batch is ``KVEventBatch`` (an array: ``[ts, events, data_parallel_rank]``) encoded with
  msgspec's msgpack encoder; each event a map tagged ``"type": "BlockStored" | "BlockRemoved" |
  "AllBlocksCleared"``, fields left out where they hold their default;
* each batch goes out as three frames ``(topic, seq, payload)`` on a PUB socket, ``seq`` an
  8-byte big-endian counter from 0 for the process's life, and is kept in a buffer of the last
  ``buffer_steps`` batches;
* on the replay ROUTER socket, a request ``(b"", start_seq)`` (8 bytes big-endian) is answered
  with every buffered batch of ``seq >= start_seq``, each ``(b"", topic, seq, payload)``, then
  the end marker ``(b"", b"", -1 as 8 signed bytes, b"")``;
* an endpoint with ``*`` (or ``ipc://``, ``inproc://``) is bound, any other is connected to;
  ``tcp://*:0`` is bound on the node's address and the bound endpoint reported. The simulator
  binds ``tcp://*:0`` on its own listen address (tests talk only to 127.0.0.1);
* one batch per engine step that changed the cache (vLLM's scheduler publishes what
  ``take_events`` returned, if anything); ``AllBlocksCleared`` on ``reset_prefix_cache`` (which
  sleep and a refit's pause call too), in the next step's batch: an idle engine's reset is
  published at its next request (seen on vLLM 0.32: nothing came between the reset and it).
  A restart is a new process: a new publisher whose sequence starts again at 0 with an empty
  replay buffer, and no event says the cache went; a subscriber sees the sequence go back.

The block hashes are the simulator's own, salted per process as vLLM's are per hash seed: a
consumer cannot recompute them from tokens, and must key blocks by their ``token_ids``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from fleetwarden.sim.config import KVEventsConfig

__all__ = ["END_SEQ", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored",
           "KVEventBatch", "KVEventsConfig", "Publisher"]

#: The replay stream's end marker: -1 as 8 signed big-endian bytes (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: vLLM's medium of a block in GPU memory (``MEDIUM_GPU``); the simulator has no other tier.
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged: ``"type"`` names the class)."""


class BlockStored(KVCacheEvent):
    # Field for field vLLM's, in its order: the encoding is the order of the fields.
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket[bytes], endpoint: str, host: str) -> str:
    """Bind ``endpoint``; ``tcp://*:0`` on ``host`` at a free port, returned resolved. A bind
    that fails (the port is taken) is an OSError naming the endpoint, as a taken HTTP port is."""
    try:
        if endpoint != "tcp://*:0":
            sock.bind(endpoint)
            return endpoint
        sock.bind(f"tcp://{host}:0")
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise OSError(e.errno, f"kv_events_config: cannot bind {endpoint} ({e})") from None
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class Publisher:
    """vLLM's ``ZmqEventPublisher``: a thread sends each batch queued by :meth:`publish` with the
    next sequence number, keeps the last ``buffer_steps`` for replay and answers replay
    requests between sends."""

    def __init__(self, config: KVEventsConfig, host: str = "127.0.0.1") -> None:
        self._queue: queue.Queue[KVEventBatch | str | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        endpoint = config.endpoint
        if _is_bind_endpoint(endpoint):
            endpoint = _bind(self._pub, endpoint, host)
        else:
            self._pub.connect(endpoint)
        replay = config.replay_endpoint
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            replay = _bind(self._replay, replay, host)
        #: What ``/kv_event_sources`` reports: the config with the endpoints as bound.
        self.config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
            replay_endpoint=replay, buffer_steps=config.buffer_steps, hwm=config.hwm,
            max_queue_size=config.max_queue_size, topic=config.topic)
        self._topic = config.topic.encode()
        self._seq = count()
        #: Batches sent since the start (all processes), for tests and /sim/stats.
        self.sent = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-kv-events")
        self._thread.start()

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Queue one batch (one engine step's events), stamped now, as data-parallel rank 0."""
        if events and self._running:
            self._queue.put(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def new_process(self) -> None:
        """A restart: the new process's publisher counts from 0 and has nothing to replay."""
        if self._running:
            self._queue.put("restart")

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            if item == "restart":
                self._seq = count()
                self._buffer.clear()
                continue
            assert isinstance(item, KVEventBatch)
            seq = next(self._seq)
            payload = encoder.encode(item)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # vLLM logs and ignores a malformed request
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
