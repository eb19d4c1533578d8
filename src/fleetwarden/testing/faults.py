"""A fault, checked on the engine after it ran: by what the router under test cannot fake.

Owns: reading back, from the engine's side, that a fault happened (the kernel's process state,
the simulated engine's own counters).
Must not: inject faults (the callers do) or judge any router.

A benchmark or a test that measures a router against a fault must show the fault was there:
a SIGSTOP that missed its process, or a black hole posted to the wrong port, would make any
router look perfect. So each fault has a check, and a check aimed at an engine that got no
fault must fail (``tests/scenario/test_comeback.py`` runs that control).
"""

from __future__ import annotations

import asyncio

import aiohttp

from fleetwarden.launchers.procs import process_info

__all__ = ["check_fault", "process_state"]


def process_state(pid: int) -> str | None:
    """The state the kernel reports of process ``pid`` (``/proc/PID/stat``, field 3: ``T`` is
    stopped by a signal), or None when there is no such process."""
    info = process_info(pid)
    return None if info is None else info.state


#: How long :func:`check_fault` waits for a SIGSTOP to show in /proc: 40 reads 0.05 s apart.
_STOP_SEEN_READS = 40
_STOP_SEEN_EVERY_S = 0.05


async def check_fault(url: str, fault: str, pid: int) -> str:
    """Whether ``fault`` is on the engine at ``url`` (process ``pid``), read from the engine's
    side, never the router's: "verified: ..." or "NOT verified: ...". SIGSTOP: the kernel
    reports the process stopped (``T``); a black hole: the engine's own count of the
    requests it swallowed, and its fault; anything else is not checked ("")."""
    if fault == "sigstop":
        # The kernel stops a running process when it next handles the signal: on a loaded
        # machine some milliseconds after kill() returns (state R meanwhile), so the state is
        # read until it shows, for a bounded while; one never stopped stays S or R.
        state = process_state(pid)
        for _ in range(_STOP_SEEN_READS):
            if state == "T":
                break
            await asyncio.sleep(_STOP_SEEN_EVERY_S)
            state = process_state(pid)
        ok = state == "T"
        return (f"{'verified' if ok else 'NOT verified'}: /proc/{pid}/stat state "
                f"{state or 'gone'}")
    if fault == "blackhole":
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
                    http.get(url + "/sim/stats") as resp:
                stats = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return f"NOT verified: /sim/stats: {type(exc).__name__}"
        mode, swallowed = stats["fault"]["mode"], int(stats.get("blackholed", 0))
        ok = mode == "blackhole" and swallowed > 0
        return (f"{'verified' if ok else 'NOT verified'}: fault {mode}, {swallowed} requests "
                "swallowed (the engine's own count)")
    return ""
