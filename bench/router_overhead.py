"""What the router adds: latency at concurrency 1 and throughput at concurrency 64.

Three processes, so that none steals the others' event loop: a minimal HTTP backend (raw
asyncio, uvloop, a fixed vLLM completion body), the router under test (``fleetwarden route``,
a separate process, as it is deployed), and a load generator (raw asyncio, keep-alive
connections, closed loop). The same backend is measured directly and through each router, in
one run, and the figures are printed side by side.

    python bench/router_overhead.py [--requests 4000] [--seconds 6] [--peer sglang-router]
                                    [--workers 1 --workers 2] [--baseline /path/to/src]
                                    [--cache-aware]

``--peer sglang-router`` also measures sglang-router 0.3.2, installed on first use into its own
virtual environment under ``~/.cache/fleetwarden/bench-venvs/``. ``--workers N`` also measures
the router as ``fleetwarden up`` runs it: ``--backend`` (attach mode, the controller watching
the backend) with ``--router-workers N``, N router processes sharing the port.
``--baseline SRC`` also measures ``fleetwarden route`` from another checkout's ``src`` (e.g. the
main branch's, before a change), in the same run: a change's cost, side by side.

Beside latency and throughput, each path's CPU per request at concurrency 64: the CPU time
(user + system, all threads, read from /proc) of the router's processes, the process and every
descendant (for ``up``: the controller too), over the whole load run, warm-up included, divided
by the requests of that run. On a shared machine, where other processes take the cores and move
the req/s of every path, this is the figure that says what a router costs.

Targets: added p50 <= 0.5 ms; >= 3,000 req/s through one router process. The machine
is shared and small (2 cores hold all three processes): compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _peers import SGLANG_ROUTER, free_port, peer_python, process

ROOT = Path(__file__).resolve().parent.parent

#: The backend's answer: vLLM's real completion body (tests/fixtures/vllm/completions.http).
BODY = (ROOT / "tests/fixtures/vllm/completions.http").read_bytes().partition(b"\r\n\r\n")[2]
#: The environment variable whose value the load sends as its Bearer key, when set.
KEY_ENV = "FLEETWARDEN_BENCH_KEY"
PAYLOAD = b'{"model": "tiny", "prompt": "hello", "max_tokens": 8}'


def _loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ---------------------------------------------------------------------- the backend process

def _answer(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


#: What the backend answers besides completions, so that a controller (``fleetwarden up``)
#: judges it as the idle vLLM it imitates: vLLM's real /metrics of an idle engine and its model
#: list. (Without them ``up`` found no metrics, condemned the backend after three probes and
#: answered 409 from then on.)
_OTHER_ANSWERS = {
    b"GET /metrics ": _answer((ROOT / "tests/fixtures/vllm/metrics-idle.txt").read_bytes(),
                              b"text/plain; version=0.0.4"),
    b"GET /v1/models ": _answer(
        (ROOT / "tests/fixtures/vllm/models.http").read_bytes().partition(b"\r\n\r\n")[2]),
    b"GET /health ": _answer(b"", b"text/plain"),
}


async def _serve_backend(port: int) -> None:
    answer = _answer(BODY)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                headers = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in headers.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                other = None
                if headers.startswith(b"GET "):
                    other = _OTHER_ANSWERS.get(headers[:headers.index(b"HTTP/")])
                writer.write(other or answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------- the load process

async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = -1
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length > 0:
        await reader.readexactly(length)
    return status


async def _load(url: str, concurrency: int, requests: int, seconds: float) -> dict[str, object]:
    host, port = url.removeprefix("http://").split(":")
    # A client key on every request, where the run measures the data port's keys
    # (bench/router_ab.py --keys).
    key = os.environ.get(KEY_ENV)
    authorization = f"Authorization: Bearer {key}\r\n" if key else ""
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n{authorization}"
               f"Content-Type: application/json\r\nContent-Length: {len(PAYLOAD)}\r\n\r\n"
               ).encode() + PAYLOAD
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    counting = False
    done = 0
    warm = 0  # requests of the warm-up (they count in the CPU per request)
    stop_at = float("inf")

    async def worker() -> None:
        nonlocal done, warm
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.perf_counter() < stop_at and (requests == 0 or done < requests):
                start = time.perf_counter()
                writer.write(request)
                status = await _read_response(reader)
                if counting:
                    latencies.append(time.perf_counter() - start)
                    statuses[status] = statuses.get(status, 0) + 1
                    done += 1
                else:
                    warm += 1
        finally:
            writer.close()

    # warm up: connections open, caches filled, the router's JIT-free paths hot
    warm_until = time.perf_counter() + 1.0
    stop_at = warm_until
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    counting = True
    started = time.perf_counter()
    stop_at = started + seconds if requests == 0 else float("inf")
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "mean_ms": 1000 * statistics.fmean(latencies),
        "statuses": statuses,
        "warm_requests": warm,
    }


# ---------------------------------------------------------------------- the orchestrator

def _tree_cpu_s(root: int) -> float | None:
    """CPU seconds (user + system, all threads) of ``root`` and its living descendants; None
    where /proc cannot be read."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except (OSError, ValueError, AttributeError):
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # after the command name, which may hold spaces: state ppid ... utime stime
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # it ended meanwhile
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    if root not in cpu:
        return None
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def _run_load(url: str, concurrency: int, requests: int, seconds: float,
              router: int | None = None) -> dict[str, object]:
    """The load process's figures; with a ``router`` pid, its processes' CPU per request."""
    before = _tree_cpu_s(router) if router is not None else None
    out = subprocess.run(
        [sys.executable, __file__, "--role", "load", "--url", url,
         "--concurrency", str(concurrency), "--requests", str(requests),
         "--seconds", str(seconds)],
        capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, object] = json.loads(out.stdout)
    after = _tree_cpu_s(router) if router is not None else None
    if before is not None and after is not None:
        served = int(result["requests"]) + int(result["warm_requests"])  # type: ignore[call-overload]
        result["cpu_us"] = 1e6 * (after - before) / max(1, served)
    return result


def _wait_until_serving(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    host, port = url.removeprefix("http://").split(":")
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1) as s:
                key = os.environ.get(KEY_ENV)
                authorization = f"Authorization: Bearer {key}\r\n" if key else ""
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{authorization}"
                          f"Content-Type: application/json\r\n"
                          f"Content-Length: {len(PAYLOAD)}\r\nConnection: close\r\n\r\n"
                          .encode() + PAYLOAD)
                if s.recv(12)[9:12] == b"200":
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not start serving within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["bench", "backend", "load"], default="bench")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--url")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests measured at concurrency 1")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="seconds measured at concurrency 64")
    parser.add_argument("--peer", choices=["sglang-router"], action="append", default=[])
    parser.add_argument("--cache-aware", action="store_true",
                        help="also measure `fleetwarden route --routing cache_aware`: the "
                             "cache-aware policy's cost per request beside least in flight")
    parser.add_argument("--workers", type=int, action="append", default=[],
                        help="also measure `fleetwarden up --router-workers N` (repeatable)")
    parser.add_argument("--baseline", type=Path, action="append", default=[],
                        help="also measure `fleetwarden route` from this src folder")
    args = parser.parse_args()
    _loop_policy()
    if args.role == "backend":
        asyncio.run(_serve_backend(args.port))
        return
    if args.role == "load":
        print(json.dumps(asyncio.run(
            _load(args.url, args.concurrency, args.requests, args.seconds))))
        return

    with process([sys.executable, __file__, "--role", "backend"]) as backend:
        assert backend.stdout is not None
        backend_url = f"http://127.0.0.1:{backend.stdout.readline().strip()}"
        targets: dict[str, str] = {"direct": backend_url}
        pids: dict[str, int] = {}  # the router processes' root, per path
        with contextlib.ExitStack() as stack:
            router = stack.enter_context(process(
                [sys.executable, "-m", "fleetwarden", "route", "--port", "0",
                 "--backend", backend_url, "--log-level", "error"]))
            assert router.stdout is not None
            line = router.stdout.readline()
            targets["fleetwarden route"] = line.split(" on ", 1)[1].split(",")[0]
            pids["fleetwarden route"] = router.pid
            for src in args.baseline:
                env = {**os.environ, "PYTHONPATH": str(src.resolve())}
                base = stack.enter_context(process(
                    [sys.executable, "-m", "fleetwarden", "route", "--port", "0",
                     "--backend", backend_url, "--log-level", "error"], env=env))
                assert base.stdout is not None
                name = f"fleetwarden route (baseline {src})"
                targets[name] = base.stdout.readline().split(" on ", 1)[1].split(",")[0]
                pids[name] = base.pid
            if args.cache_aware:
                aware = stack.enter_context(process(
                    [sys.executable, "-m", "fleetwarden", "route", "--port", "0",
                     "--backend", backend_url, "--log-level", "error",
                     "--routing", "cache_aware"]))
                assert aware.stdout is not None
                name = "fleetwarden route --routing cache_aware"
                targets[name] = aware.stdout.readline().split(" on ", 1)[1].split(",")[0]
                pids[name] = aware.pid
            for workers in args.workers:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                port = free_port()
                up = stack.enter_context(process(
                    [sys.executable, "-m", "fleetwarden", "up", "--backend", backend_url,
                     "--router-workers", str(workers), "--port", str(port),
                     "--admin-port", str(free_port()), "--journal", str(folder / "j.sqlite"),
                     "--quiet", "--log-level", "error"],
                    cwd=folder, stdout=subprocess.DEVNULL))
                name = f"fleetwarden up, {workers} router worker(s)"
                targets[name] = f"http://127.0.0.1:{port}"
                pids[name] = up.pid
            if "sglang-router" in args.peer:
                python = peer_python(SGLANG_ROUTER)
                port = free_port()
                peer = stack.enter_context(process(
                    [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                     "--port", str(port), "--worker-urls", backend_url,
                     "--policy", "round_robin", "--log-level", "warn",
                     # its exporter defaults to port 29000, which another run may hold
                     "--prometheus-port", str(free_port())],
                    stderr=subprocess.DEVNULL))
                targets["sglang-router 0.3.2"] = f"http://127.0.0.1:{port}"
                pids["sglang-router 0.3.2"] = peer.pid
            for url in targets.values():
                _wait_until_serving(url)
            results = {}
            for name, url in targets.items():
                single = _run_load(url, 1, args.requests, 0)
                many = _run_load(url, 64, 0, args.seconds, pids.get(name))
                results[name] = (single, many)
                print(f"{name}: {single['statuses']} {many['statuses']}", file=sys.stderr)
    _report(results)
    # Figures of errors are not a router's figures: say so, and fail.
    wrong = {name: (s["statuses"], m["statuses"]) for name, (s, m) in results.items()
             if set(s["statuses"]) | set(m["statuses"]) != {"200"}}  # type: ignore[call-overload]
    if wrong:
        sys.exit(f"not every answer was 200, so these rows measure errors: {wrong}")


def _report(results: dict[str, tuple[dict[str, object], dict[str, object]]]) -> None:
    direct_single, direct_many = results["direct"]
    cpu = os.cpu_count()
    print(f"\n{cpu} CPUs; same backend measured directly and through each router\n")
    print("| path | p50 ms (c=1) | p99 ms (c=1) | added p50 ms | added p99 ms "
          "| req/s (c=64) | throughput vs direct | router CPU µs/request (c=64) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (single, many) in results.items():
        p50, p99 = float(single["p50_ms"]), float(single["p99_ms"])  # type: ignore[arg-type]
        rps = float(many["rps"])  # type: ignore[arg-type]
        added50 = p50 - float(direct_single["p50_ms"])  # type: ignore[arg-type]
        added99 = p99 - float(direct_single["p99_ms"])  # type: ignore[arg-type]
        ratio = rps / float(direct_many["rps"])  # type: ignore[arg-type]
        added = "—" if name == "direct" else f"{added50:.3f}"
        added_tail = "—" if name == "direct" else f"{added99:.3f}"
        cost = "—" if "cpu_us" not in many else f"{float(many['cpu_us']):.0f}"  # type: ignore[arg-type]
        print(f"| {name} | {p50:.3f} | {p99:.3f} | {added} | {added_tail} | {rps:,.0f} "
              f"| {ratio:.2f}× | {cost} |")


if __name__ == "__main__":
    main()
