"""A simulated vLLM engine: a test double for the engine, never for the system under test.

Owns: the simulated engine package (a test double for engines).
Must not: stand in for fleetwarden itself: only for the engines it manages.

It speaks vLLM 0.32's OpenAI API and ``/metrics`` as the captures in ``tests/fixtures/vllm/``
show them, runs an engine loop with a slot limit and a step rate, and takes the faults real
vLLM shows (docs/design.md section 10, docs/real-vllm.md):

* :mod:`fleetwarden.sim.config` — what it is told at start, and the fault modes;
* :mod:`fleetwarden.sim.engine` — the engine core: waiting, running, steps (no I/O);
* :mod:`fleetwarden.sim.families` — vLLM's metric families in a registry of its own;
* :mod:`fleetwarden.sim.wire` — vLLM's bodies, SSE chunks and error shapes;
* :mod:`fleetwarden.sim.server` — the aiohttp shell, the faults and the control endpoints.

In a test: ``async with Sim(SimConfig(slots=2)) as sim: ...``. As a process:
``fleetwarden sim --port 8000`` (:func:`serve`); both run the same :class:`Sim`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetwarden.sim.config import FaultMode, SimConfig

if TYPE_CHECKING:
    from fleetwarden.sim.server import Sim, serve

__all__ = ["FaultMode", "Sim", "SimConfig", "serve"]


def __getattr__(name: str) -> Any:
    # The server (aiohttp, prometheus-client) loads only when used: `fleetwarden --help` and
    # the config's defaults stay cheap to import.
    if name in ("Sim", "serve"):
        from fleetwarden.sim import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
