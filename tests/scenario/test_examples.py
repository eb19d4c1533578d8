"""The examples run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.scenario

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_rl_loop_finishes_every_step_when_an_engine_is_killed_and_a_refit_hangs(
        tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "rl_loop.py"), "--steps", "5", "--kill-at-step", "2",
         "--hang-refit-at-step", "3", "--rollouts", "12"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    steps = [line for line in lines if line.strip()[:1].isdigit()]
    assert len(steps) == 5
    assert all(" 12/12 " in line for line in steps), steps
    assert any("crashed shard" in line for line in lines)
    # every rollout named the weights it demanded: the step's version, never another
    assert [line.split()[3] for line in steps] == ["v0", "v1", "v2", "v3", "v4"], steps
    assert all(int(line.split()[4]) >= 2 for line in steps)  # engines slept each step
    named = next(line for line in lines if "fleetwarden named shard" in line)
    wedged = next(line for line in lines if "wedged in the refit" in line)
    assert wedged.split()[2] == named.split()[4]  # the wedged one is the one named
    assert float(named.split()[6]) < 15  # within seconds (a 5 s tick)
    assert any(f"condemned [{wedged.split()[2]}]" in line for line in lines)
    assert "HEALTHY': 3" in steps[-1]  # the replacement rejoined at a later refit
    assert "every step finished" in out.stdout


def test_the_refit_from_loop_loads_each_checkpoint_and_survives_a_bad_path(
        tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "refit_from_loop.py"), "--steps", "4",
         "--bad-path-at-step", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    steps = [line for line in lines if line.strip()[:1].isdigit()]
    assert [line.split()[2] for line in steps] == ["[0]", "[1]", "[2]", "[3]"], steps
    assert all(line.count("y/y/HEAL") == 3 for line in steps), steps
    refused = next(line for line in lines if "a path that is not there" in line)
    assert "credited []" in refused and "reload_weights answered 500" in refused
    assert "every answer named the checkpoint behind it" in out.stdout
