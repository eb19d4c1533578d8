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
from pathlib import Path

import pytest

from fleetwarden.testing.fleet_model import GATES, run_model

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
