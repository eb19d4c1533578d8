"""A minimal engine process for launcher tests: /health 200, and the ways real engines misbehave.

    python tiny_engine.py --port P [--spawn-child] [--ignore-term] [--exit-after S] [--never-ready]

``--spawn-child`` starts a grandchild in the same process group (as vLLM's API server starts its
EngineCore), so a stop that signals only the leader would leave it behind.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--spawn-child", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--exit-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--api-key", default=None)  # taken and unused: a keyed command's argv
    args = p.parse_args()

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        cmd = [sys.executable, "-c", "import signal, time\n"
               + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if args.ignore_term else "")
               + "time.sleep(3600)"]
        subprocess.Popen(cmd)  # same process group, like VLLM::EngineCore

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=503 if args.never_ready else 200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print("ready", flush=True)
        if args.exit_after is not None:
            await asyncio.sleep(args.exit_after)
            sys.exit(args.exit_code)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
