"""A bounded, closed-loop load of OpenAI completions: what tests, the demo and benchmarks drive.

Owns: a closed-loop load of OpenAI clients and each request's result.
Must not: judge the fleet: it measures, the caller asserts or prints.

Each of ``concurrency`` workers sends one request, waits for its answer, and sends the next,
until the load is stopped or ``total`` requests were sent. The client is the official
``openai`` package with its own retries **off**: a failure the router lets through must be seen,
never re-sent quietly by the client. Every request carries ``x-request-id: load-N`` (its
``id_prefix`` and number), so an engine's log (and the simulator's ``/sim/stats``) says which
requests it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Imported here, not when a load starts: importing openai takes most of a second of CPU, and a
# load that starts beside a fleet in the same event loop would stall that loop for as long
# (a canary's timer runs on while the loop is blocked).
import openai
from openai import AsyncOpenAI
from openai._constants import DEFAULT_CONNECTION_LIMITS

#: The openai client's connection limits, an idle connection kept 4 s where it keeps it 5 s:
#: uvicorn (vLLM's server) and the router's data port close one idle 5 s, and a client that
#: reuses it at that moment (no retries here, so every failure shows) fails a request that
#: no engine or router refused (the router keeps its own engine connections 4 s for the same
#: reason). The limits' class is the openai client's transport's, whichever it is.
_LIMITS = type(DEFAULT_CONNECTION_LIMITS)(
    max_connections=DEFAULT_CONNECTION_LIMITS.max_connections,
    max_keepalive_connections=DEFAULT_CONNECTION_LIMITS.max_keepalive_connections,
    keepalive_expiry=4.0)
#: Each Load's number in this process: its prompts are its own (``Load.numbered``).
_LOADS = itertools.count(1)

__all__ = ["Load", "RequestResult"]


@dataclass(frozen=True, slots=True)
class RequestResult:
    request_id: str
    started: float  # time.monotonic()
    latency_s: float
    status: int  # 200, the HTTP status of a refusal, or 0 when no answer came
    error: str = ""
    max_tokens: int = 0  # what the request asked for (its generation's length)
    #: A stream that began (200) but was not whole: why (cut, too few tokens, no finish).
    incomplete: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.incomplete


@dataclass
class Load:
    base_url: str  # the router's URL, without /v1
    concurrency: int = 8
    max_tokens: int = 16
    #: Draw each request's max_tokens uniformly from this range (inclusive) instead: a mix of
    #: short and long generations. Seeded by ``seed``, so two runs send the same sequence.
    max_tokens_range: tuple[int, int] | None = None
    seed: int = 0
    model: str = "tiny"
    prompt: str = "hello"
    #: Each request's prompt is ``prompt``, this load's number in the process and the
    #: request's ("hello 3.17"), as distinct clients' are: cache-aware routing (the default)
    #: then places them by load, and a later load's prompts are new too. False: the same
    #: ``prompt`` every time, which that routing keeps where its cache is (one engine, or a
    #: few in a large fleet), as it does an RL group's siblings.
    numbered: bool = True
    #: Streamed completions, with usage: a stream counts as answered only when it is whole
    #: (one chunk per token, as vLLM and the simulator send them, plus llama.cpp's closing
    #: chunk without text; a finish; the usage's count of tokens equal to the chunks of tokens
    #: received, and to max_tokens when it finished on length).
    stream: bool = False
    #: Stop after this many requests in all (None: until stopped).
    total: int | None = None
    #: Seconds between one worker's requests (0: closed loop, back to back).
    think_s: float = 0.0
    #: Seconds a worker waits after a failed request before its next one (the failed one is
    #: never re-sent), as a real client backs off; 0: at once. Keeps a router that fails fast
    #: from turning the closed loop into a busy loop.
    pause_after_failure_s: float = 0.0
    #: A request unanswered after this long is a failure (status 0).
    timeout_s: float = 120.0
    #: Each request's ``x-request-id`` is this and its number: two loads side by side (streams
    #: and waiting requests, say) are told apart in an engine's log.
    id_prefix: str = "load-"
    #: The key each request carries (``Authorization: Bearer``): the engines' own when they
    #: are started with ``--api-key``; a placeholder otherwise (the client library wants one).
    api_key: str = field(default="none", repr=False)
    results: list[RequestResult] = field(default_factory=list)
    _sent: int = 0
    _serial: int = field(default_factory=lambda: next(_LOADS))
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> Load:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        self._client = AsyncOpenAI(base_url=self.base_url.rstrip("/") + "/v1", api_key=self.api_key,
                                   max_retries=0, timeout=self.timeout_s,
                                   http_client=openai.DefaultAsyncHttpxClient(limits=_LIMITS))
        self._t0 = time.monotonic()
        self._rng = random.Random(self.seed)
        self._tasks = [asyncio.create_task(self._worker(), name=f"load-{i}")
                       for i in range(self.concurrency)]

    async def stop(self) -> None:
        """Stop sending; wait for the requests in flight to be answered (up to their timeout)."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._client.close()

    async def wait(self) -> None:
        """Until ``total`` requests were answered."""
        await asyncio.gather(*self._tasks)

    async def _worker(self) -> None:
        while not self._stop.is_set():
            if self.total is not None and self._sent >= self.total:
                return
            self._sent += 1
            prompt = (f"{self.prompt} {self._serial}.{self._sent}" if self.numbered
                      else self.prompt)
            result = await self._one(f"{self.id_prefix}{self._sent}", prompt)
            pause = self.think_s + (0.0 if result.ok else self.pause_after_failure_s)
            if pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), pause)

    async def _one(self, request_id: str, prompt: str) -> RequestResult:
        max_tokens = (self._rng.randint(*self.max_tokens_range)
                      if self.max_tokens_range is not None else self.max_tokens)
        started = time.monotonic()
        status, error, incomplete = 200, "", ""
        try:
            headers = {"x-request-id": request_id}
            if self.stream:
                stream = await self._client.completions.create(
                    model=self.model, prompt=prompt, max_tokens=max_tokens,
                    stream=True, stream_options={"include_usage": True},
                    extra_headers=headers)
                chunks, finish, usage, closing = 0, None, None, False
                async for chunk in stream:
                    if chunk.choices:
                        chunks += 1
                        finish = chunk.choices[0].finish_reason or finish
                        # llama.cpp ends with a chunk of its own: the finish, no text, no token
                        closing = bool(chunk.choices[0].finish_reason) and not (
                            getattr(chunk.choices[0], "text", None) or "")
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                if closing and usage == chunks - 1:
                    chunks -= 1
                if finish is None or usage != chunks or (finish == "length"
                                                         and usage != max_tokens):
                    incomplete = (f"{chunks} token chunks, finish {finish}, usage {usage}, "
                                  f"max_tokens {max_tokens}")
            else:
                await self._client.completions.create(
                    model=self.model, prompt=prompt, max_tokens=max_tokens,
                    extra_headers=headers)
        except openai.APIStatusError as exc:
            status, error = exc.status_code, str(exc)[:300]
        except openai.APIError as exc:  # no answer: connection error or timeout
            status, error = 0, f"{type(exc).__name__}: {exc}{_causes(exc)}"[:600]
        result = RequestResult(request_id, started, time.monotonic() - started, status, error,
                               max_tokens, incomplete)
        self.results.append(result)
        return result

    # ------------------------------------------------------------------ reading results

    @property
    def failures(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    def since(self, t: float) -> list[RequestResult]:
        return [r for r in self.results if r.started >= t]

    async def carried_on(self, limit_s: float) -> float:
        """Until every request sent before the call has its answer and as many sent after it
        as the load has clients have theirs: what a fault or a stop held is finished (rescued,
        retried, re-sent) and the engines left carry the load. At most ``limit_s``; past it
        the caller goes on as after a fixed wait, and :meth:`stop` waits for the rest (a
        failure among them is the load's). Returns the seconds it took: a wait on the load's
        own answers, where a fixed sleep would wait its whole length every time."""
        # A worker counts a request sent and stamps its start with no await between: the two
        # reads below, with none between them either, split the requests exactly.
        since, before = time.monotonic(), self._sent
        deadline = since + limit_s
        while time.monotonic() < deadline:
            answered_before = sum(1 for r in self.results if r.started < since)
            if answered_before >= before and len(self.since(since)) >= self.concurrency:
                break
            await asyncio.sleep(0.05)
        return time.monotonic() - since

    def summary(self) -> dict[str, Any]:
        lat = sorted(r.latency_s for r in self.results if r.ok)
        by_status: dict[str, int] = {}
        for r in self.results:
            key = "incomplete" if r.incomplete else str(r.status)
            by_status[key] = by_status.get(key, 0) + 1
        return {
            "sent": len(self.results), "ok": sum(r.ok for r in self.results),
            "failed": len(self.failures), "by_status": by_status,
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "max_s": lat[-1] if lat else None,
            "slower_than_10s": sum(1 for x in lat if x > 10),
        }


def _causes(exc: BaseException) -> str:
    """What lay under a connection error (the openai client says only "Connection error."):
    ``" <- httpx.ReadError: ... <- ConnectionResetError: ..."``, which tells a refused
    connection from one the server closed or reset."""
    out, seen = "", {id(exc)}
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        out += f" <- {type(cause).__module__}.{type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    return out
