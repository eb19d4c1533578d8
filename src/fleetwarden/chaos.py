"""Fault injection into one shard's engine: what `fleetwarden chaos` and the dashboard do.

Owns: how each fault is injected: a simulated engine's fault endpoint, or signals to a real
engine's core.
Must not: decide anything about health: what a fault does to a shard is for the watchdog and the
ledger to find.

On a simulated engine (``fleetwarden sim``) through its fault endpoint, with every mode it has.
On a real local vLLM engine by signals to its ``VLLM::EngineCore`` process, which is what the
real faults look like (docs/real-vllm.md): ``wedge`` = SIGSTOP (``/health`` stays 200, every
generation hangs, ``/metrics`` freezes), ``unwedge`` = SIGCONT, ``crash`` = SIGKILL (in-flight
requests get vLLM's 500, the API server exits by itself). On a local llama.cpp
``llama-server`` (one process: ``SIGSTOP`` would freeze its ``/metrics`` and ``/health`` too),
``wedge`` is the compute-only wedge instead: its busiest thread other than the main one is
ptrace-stopped (:mod:`fleetwarden.launchers.threadstop`), ``/health`` and ``/metrics`` keep
answering with ``n_decode_total`` flat; ``unwedge`` releases it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp

from fleetwarden.launchers import EngineHandle
from fleetwarden.launchers.procs import find_group_member, group_members, signal_group_member
from fleetwarden.launchers.threadstop import busiest_thread, release, stop_thread, stopped
from fleetwarden.sim.config import FaultMode

__all__ = ["FAULTS", "REAL_ENGINE_FAULTS", "inject"]

#: Faults a simulated engine takes, plus ``unwedge`` (= clear) and ``clear``.
FAULTS = (*(m.value for m in FaultMode), "unwedge", "clear")
#: Faults a real engine takes, as signals to its engine core.
REAL_ENGINE_FAULTS = {"wedge": signal.SIGSTOP, "unwedge": signal.SIGCONT,
                      "clear": signal.SIGCONT, "crash": signal.SIGKILL}
ENGINE_CORE = "VLLM::EngineCore"
LLAMA_SERVER = "llama-server"
_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


async def _is_simulated(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                session.get(url + "/sim/fault") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def inject(url: str, handle: EngineHandle | None, fault: str,
                 options: dict[str, Any]) -> str:
    """Inject ``fault``; return how it was done. ValueError for a fault this engine cannot
    take, LookupError when the engine can be reached neither way."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of: {', '.join(FAULTS)}")
    if await _is_simulated(url):
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
            if fault in ("unwedge", "clear"):
                async with session.delete(url + "/sim/fault") as resp:
                    resp.raise_for_status()
                return f"cleared the simulated engine's fault at {url}"
            body: dict[str, Any] = {"mode": fault}
            body.update({k: options[k] for k in ("factor", "duration_s") if k in options})
            try:
                async with session.post(url + "/sim/fault", json=body) as resp:
                    if resp.status >= 400:
                        raise ValueError(f"the simulated engine refused {fault}: "
                                         f"{(await resp.text())[:300]}")
            except aiohttp.ServerDisconnectedError:
                if fault != "crash":
                    raise
            return f"{fault} set on the simulated engine at {url}"
    if handle is None or handle.pgid is None:
        raise LookupError(f"{url} is neither a simulated engine nor a local engine that "
                          "fleetwarden started; chaos cannot reach it")
    sig = REAL_ENGINE_FAULTS.get(fault)
    if sig is None:
        raise ValueError(f"a real engine takes {', '.join(REAL_ENGINE_FAULTS)}; {fault!r} "
                         "needs a simulated engine")
    pgid = handle.pgid
    if fault in ("wedge", "unwedge", "clear"):
        done = await _llamacpp_thread_wedge(url, pgid, fault)
        if done is not None:
            return done
    core = await asyncio.to_thread(find_group_member, pgid, ENGINE_CORE)
    if core is not None:
        await asyncio.to_thread(signal_group_member, pgid, ENGINE_CORE, sig)
        return f"{signal.Signals(sig).name} to {ENGINE_CORE} pid {core.pid} (group {pgid})"
    # Not vLLM: the whole group stands in for the engine core.
    members = await asyncio.to_thread(group_members, pgid)
    if not members:
        raise LookupError(f"process group {pgid} of {url} has no live process")
    os.killpg(pgid, sig)
    return f"{signal.Signals(sig).name} to process group {pgid} (no {ENGINE_CORE} in it)"


async def _is_llamacpp(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                session.get(url + "/health") as resp:
            return resp.headers.get("Server", "") == "llama.cpp"
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _llamacpp_thread_wedge(url: str, pgid: int, fault: str) -> str | None:
    """The compute-only wedge of a local llama-server, or its release; None when the engine is
    not a llama-server (the caller then signals as for any engine)."""
    member = await asyncio.to_thread(find_group_member, pgid, LLAMA_SERVER)
    pid = member.pid if member is not None else None
    if fault != "wedge":
        held = pid if pid in stopped else next((p for p in stopped if p == pgid), None)
        if held is None:
            return None
        tid = release(held)  # from this thread, the one that stopped it (the loop's)
        return f"released thread {tid} of llama-server pid {held}"
    if pid is None or not await _is_llamacpp(url):
        return None
    tid = await asyncio.to_thread(busiest_thread, pid)
    if tid is None:
        raise ValueError(f"llama-server pid {pid} has no busy thread to stop (is it idle? the "
                         "compute-only wedge needs load); SIGSTOP would freeze /health too")
    stop_thread(pid, tid)  # on the loop's thread: the tracer is this thread
    return (f"ptrace-stopped thread {tid} of llama-server pid {pid} (its busiest): /health "
            "and /metrics still answer, decoding stops; unwedge releases it")
