"""Under attack, the fleet keeps serving: normal clients beside 1,000 slow or idle connections
and pipelining abusers, against simulated engines, through one ``fleetwarden route`` process.

Processes, so that none steals another's event loop: two backends (router_overhead.py's: a
fixed vLLM completion), the router, the attackers, and the normal clients. The normal clients
run twice in one run: alone, then under attack; each phase reports their p50/p99 and errors,
and the router's RSS and open descriptors (peaks, sampled every 0.25 s).

    python bench/hostile_load.py [--seconds 15] [--normal 16] [--attackers 1000]
                                 [--pipeliners 20]

The attackers (each reconnects when the router lets it go, so the pressure stays):
  40 % silent: connect and send nothing (the head timeout answers 408 at 10 s);
  30 % slowloris: a head that never ends, one byte a second (408 at 10 s);
  30 % idle keep-alive: one request, then nothing (closed at the 5 s idle timeout);
  and ``--pipeliners`` connections that write 64 KiB requests pipelined without reading a
  single answer, as long as the router reads them.
Success: the normal clients see no error, the router's RSS and descriptors stay bounded, and no
failure is counted against an engine (none would be ejected).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
import urllib.request

from _peers import process
from router_overhead import PAYLOAD, _loop_policy, _read_response, _serve_backend

#: The head the slowloris never finishes, and the pipeliners' request (64 KiB of prompt).
_SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: "
_FILLER = json.dumps({"model": "tiny", "prompt": "x" * 65536, "max_tokens": 1}).encode()
_PIPELINED = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%b" % (len(_FILLER), _FILLER))


def _request(host: str, port: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(PAYLOAD)}\r\n\r\n"
            ).encode() + PAYLOAD


# ---------------------------------------------------------------------- the attackers

async def _attack(host: str, port: int, attackers: int, pipeliners: int) -> None:
    counts = {"connections": 0, "refused": 0}

    async def forever(kind: str) -> None:
        await asyncio.sleep(random.random())  # not all at once
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                counts["refused"] += 1
                await asyncio.sleep(1)
                continue
            counts["connections"] += 1
            try:
                if kind == "slowloris":
                    writer.write(_SLOW_HEAD)
                    while not reader.at_eof():
                        writer.write(b"a")
                        await asyncio.sleep(1)
                elif kind == "idle":
                    writer.write(_request(host, port))
                    await _read_response(reader)
                    await reader.read()  # then nothing, until the router closes it
                elif kind == "pipeliner":
                    while True:  # never reads: the router must stop reading it
                        writer.write(_PIPELINED)
                        await writer.drain()
                else:  # silent
                    await reader.read()
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                pass  # let go by the router (uvloop says so with a RuntimeError on write)
            finally:
                writer.close()

    kinds = (["silent"] * (attackers * 4 // 10) + ["slowloris"] * (attackers * 3 // 10))
    kinds += ["idle"] * (attackers - len(kinds)) + ["pipeliner"] * pipeliners
    tasks = [asyncio.create_task(forever(kind)) for kind in kinds]
    print("attacking", flush=True)
    try:
        await asyncio.gather(*tasks)
    finally:
        print(json.dumps(counts), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the normal clients

async def _normal(host: str, port: int, clients: int, seconds: float) -> dict[str, object]:
    request = _request(host, port)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            try:
                if connection is None:
                    connection = await asyncio.open_connection(host, port)
                reader, writer = connection
                writer.write(request)
                status = str(await asyncio.wait_for(_read_response(reader), 30))
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                status = type(exc).__name__
                if connection is not None:
                    connection[1].close()
                connection = None
            latencies.append(time.perf_counter() - start)
            statuses[status] = statuses.get(status, 0) + 1
        if connection is not None:
            connection[1].close()

    await asyncio.gather(*(client() for _ in range(clients)))
    latencies.sort()
    return {"requests": len(latencies), "rps": len(latencies) / seconds,
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
            "max_ms": 1000 * latencies[-1], "statuses": statuses}


# ---------------------------------------------------------------------- the orchestrator

def _rss_and_fds(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _phase(url: str, router: int, args: argparse.Namespace) -> dict[str, object]:
    """The normal clients for ``args.seconds``, the router sampled meanwhile."""
    peaks = [0.0, 0]
    with process([sys.executable, __file__, "--role", "normal", "--url", url,
                  "--normal", str(args.normal), "--seconds", str(args.seconds)]) as normal:
        while normal.poll() is None:
            rss, fds = _rss_and_fds(router)
            peaks = [max(peaks[0], rss), max(int(peaks[1]), fds)]
            time.sleep(0.25)
        assert normal.stdout is not None
        figures: dict[str, object] = json.loads(normal.stdout.read())
    figures["router_rss_mib_peak"], figures["router_fds_peak"] = peaks
    return figures


def _backend_failures(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fleetwarden_router_backend_failures_total{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["bench", "backend", "attack", "normal"],
                        default="bench")
    parser.add_argument("--url")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--normal", type=int, default=16, help="normal clients at once")
    parser.add_argument("--attackers", type=int, default=1000)
    parser.add_argument("--pipeliners", type=int, default=20)
    args = parser.parse_args()
    _loop_policy()
    host, _, port = (args.url or "http://127.0.0.1:0").removeprefix("http://").rpartition(":")
    if args.role == "backend":
        asyncio.run(_serve_backend(0))
        return
    if args.role == "attack":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_attack(host, int(port), args.attackers, args.pipeliners))
        return
    if args.role == "normal":
        print(json.dumps(asyncio.run(_normal(host, int(port), args.normal, args.seconds))))
        return

    with contextlib.ExitStack() as stack:
        backends = []
        for _ in range(2):
            backend = stack.enter_context(process([sys.executable, __file__,
                                                   "--role", "backend"]))
            assert backend.stdout is not None
            backends.append(f"http://127.0.0.1:{backend.stdout.readline().strip()}")
        router = stack.enter_context(process(
            [sys.executable, "-m", "fleetwarden", "route", "--port", "0", "--log-level",
             "error", *(a for b in backends for a in ("--backend", b))]))
        assert router.stdout is not None
        url = router.stdout.readline().split(" on ", 1)[1].split(",")[0]
        alone = _phase(url, router.pid, args)
        attack = stack.enter_context(process(
            [sys.executable, __file__, "--role", "attack", "--url", url,
             "--attackers", str(args.attackers), "--pipeliners", str(args.pipeliners)]))
        assert attack.stdout is not None
        attack.stdout.readline()
        time.sleep(3)  # the attackers' connections are open
        attacked = _phase(url, router.pid, args)
        failures = _backend_failures(url)
    _report(alone, attacked, failures, args)
    errors = {k: v for k, v in attacked["statuses"].items() if k != "200"}  # type: ignore[attr-defined]
    if errors or failures:
        sys.exit(f"under attack: normal clients' errors {errors}, engine failures {failures}")


def _report(alone: dict[str, object], attacked: dict[str, object], failures: float,
            args: argparse.Namespace) -> None:
    print(f"\n{os.cpu_count()} CPUs; {args.normal} normal clients for {args.seconds:g} s a "
          f"phase; attack: {args.attackers} slow or idle connections + {args.pipeliners} "
          "pipeliners\n")
    print("| phase | requests | req/s | p50 ms | p99 ms | max ms | errors "
          "| router RSS MiB (peak) | router fds (peak) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, f in (("normal clients alone", alone), ("under attack", attacked)):
        errors = sum(v for k, v in f["statuses"].items() if k != "200")  # type: ignore[attr-defined]
        print(f"| {name} | {f['requests']} | {f['rps']:.0f} | {f['p50_ms']:.2f} "
              f"| {f['p99_ms']:.2f} | {f['max_ms']:.1f} | {errors} "
              f"| {f['router_rss_mib_peak']:.0f} | {f['router_fds_peak']} |")
    print(f"\nfailures counted against the engines (an ejection's evidence): {failures:g}")


if __name__ == "__main__":
    main()
