"""The whole fleet, driven by random operator sequences: the contract holds after every step.

A seeded run of :mod:`fleetwarden.testing.fleet_model` (docs/design.md, "The fleet's
contract"): two fleets side by side behind ``fleetwarden up`` (static weights, a trainer's),
engines of every simulated profile, at least 300 operations. The seed is printed; replay one
with ``FLEETWARDEN_MODEL_SEED=N``. No invariant is gated (``fleet_model.GATES`` is empty): every
violation fails the test. A gate, if one is ever opened for a known defect, is printed with
its count and still checked.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from fleetwarden.testing.fleet_model import GATES, AttachedEngine, run_model

pytestmark = pytest.mark.scenario

#: The suite's seed (FLEETWARDEN_MODEL_SEED replays another).
SEED = 3
OPERATIONS = 300
#: A liveness bound, not a timing claim (the two fleets side by side: 150 operations each,
#: the run as long as the static fleet's, whose restarts of fleetwarden cost seconds).
BUDGET_S = 600.0


@pytest.mark.timeout(BUDGET_S + 120)  # the run's own bound ends it first, with its report
async def test_the_fleet_keeps_its_contract_through_random_operator_sequences(
        tmp_path: Path) -> None:
    seed = int(os.environ.get("FLEETWARDEN_MODEL_SEED", SEED))
    print(f"\nfleet model seed {seed} (replay: FLEETWARDEN_MODEL_SEED={seed})")
    report = await run_model(seed, OPERATIONS, BUDGET_S, tmp_path, concurrent=True)
    for gate, n in report.gated.items():
        print(f"gated ({GATES[gate]}): {n} violation(s)")
    assert report.steps >= OPERATIONS, report.summary()
    assert set(report.operations) >= {"crash", "refit_complete", "sleep2", "kill9_restart"}, (
        report.summary())
    assert report.ungated == [], "\n".join(str(v) for v in report.ungated)


def test_an_attached_engine_whose_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    """The model draws each attached engine's port before any starts, side by side with
    other tests: one bound meanwhile is drawn again (not an error that fails the run), and
    the cause of a start that fails is in its message."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = AttachedEngine("vllm", port, tmp_path)
        try:
            engine.start()
            assert engine.port != port and engine.proc is not None
            assert engine.proc.poll() is None
            first = tmp_path / f"sim-{port}-1.err"
            assert "address already in use" in first.read_text().lower()
        finally:
            engine.stop()
        engine.port = port
        with pytest.raises(RuntimeError, match="address already in use"):
            engine.restart()  # the same port, still taken: waited out, then refused
