"""What the data port's limits cost a request, A/B in one process: another checkout's
``router/serve.py`` and ``router/upstream.py`` (``--baseline``, e.g. the main branch's) against
this one's, the same request and answer fed to each through a stand-in transport, in
interleaved blocks, so that a loaded machine slows both alike.

    python bench/limits_cost.py --baseline /path/to/main/src [--blocks 30] [--requests 4000]

The server side: a request's bytes fed to a connection, its handler (a fixed answer) run to
the end. The client side: an engine's answer fed to a pooled connection, its head awaited and
its body read. Sockets are left out on purpose: on a shared 2-core machine their noise
(±20 % between runs of bench/router_overhead.py) hides a difference of a few per cent; here
only the code that changed runs. Prints µs per request (median and best block) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = b'{"model": "tiny", "prompt": "hello", "max_tokens": 8}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: bench\r\n"
           b"Accept: */*\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
           % (len(PAYLOAD), PAYLOAD))
BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"text":"hi"}]}'
ANSWER = (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 02:00:00 GMT\r\nserver: uvicorn\r\n"
          b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(BODY), BODY))


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Transport:
    """Takes every write; never pauses, never closes."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


async def _server_block(serve: Any, n: int) -> float:
    async def handler(request: Any) -> Any:
        await request.read()
        return serve.Response(body=BODY, content_type="application/json")

    server = serve.Server(handler, max_body_bytes=1 << 20)
    connection = server()
    connection.connection_made(_Transport())
    started = time.process_time()
    for _ in range(n):
        connection.data_received(REQUEST)
        await connection.task
    used = time.process_time() - started
    sweep = getattr(server, "_sweep", None)
    if sweep is not None:
        sweep.cancel()
    return used / n * 1e6


async def _client_block(upstream: Any, n: int) -> float:
    client = upstream.UpstreamClient(connect_timeout_s=5, total_timeout_s=60,
                                     keepalive_timeout_s=4)
    connection = upstream._EngineConnection(client, ("engine", 1, False))
    connection.connection_made(_Transport())
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(n):
        head = loop.create_future()
        answer = upstream.Answer(connection, head, client._deadlines, loop.time() + 60)
        connection.answer = answer
        connection.data_received(ANSWER)
        await head
        await answer.read()
        client._idle.clear()  # the connection is taken again, not from the pool
    used = time.process_time() - started
    await client.close()
    return used / n * 1e6


async def _compare(label: str, block: Callable[[Any, int], Awaitable[float]],
                   sides: dict[str, ModuleType], blocks: int, n: int) -> None:
    results: dict[str, list[float]] = {name: [] for name in sides}
    for module in sides.values():  # warm
        await block(module, n // 2)
    names = list(sides)
    for i in range(blocks):
        for name in (names if i % 2 else names[::-1]):
            results[name].append(await block(sides[name], n))
    for name, figures in results.items():
        print(f"| {label} | {name} | {statistics.median(figures):.2f} | {min(figures):.2f} |")
    base, this = (statistics.median(results[n]) for n in names)
    print(f"| {label} | this / baseline | {this / base:.3f} | "
          f"{min(results[names[1]]) / min(results[names[0]]):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout's src")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--requests", type=int, default=4000, help="requests per block")
    args = parser.parse_args()
    here = ROOT / "src" / "fleetwarden" / "router"
    there = args.baseline / "fleetwarden" / "router"
    serve = {"baseline": _load("serve_baseline", there / "serve.py"),
             "this": _load("serve_this", here / "serve.py")}
    upstream = {"baseline": _load("upstream_baseline", there / "upstream.py"),
                "this": _load("upstream_this", here / "upstream.py")}
    print("| side | code | µs/request (median block) | µs/request (best block) |")
    print("|---|---|---|---|")

    async def run() -> None:
        await _compare("server (serve.py)", _server_block, serve, args.blocks, args.requests)
        await _compare("client (upstream.py)", _client_block, upstream, args.blocks,
                       args.requests)

    uvloop.run(run())


if __name__ == "__main__":
    main()
