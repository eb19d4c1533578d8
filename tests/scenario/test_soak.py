"""The fault soak, one minute of it (`bench/soak.py`; the 10-minute figures are in
BENCHMARKS.md): random faults, one SIGKILL of fleetwarden, and the books checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.scenario

SOAK = Path(__file__).parents[2] / "bench" / "soak.py"


def test_a_one_minute_soak_loses_nothing_breaks_no_invariant_and_leaves_nothing(
        tmp_path: Path) -> None:
    out_file = tmp_path / "soak.json"
    out = subprocess.run([sys.executable, str(SOAK), "--minutes", "1", "--seed", "7",
                          "--json", str(out_file)],
                         capture_output=True, text=True, timeout=400, cwd=tmp_path)
    print(out.stdout)
    result = json.loads(out_file.read_text())
    assert result["requests"]["lost"] == 0, result["lost_examples"]
    # the router runs in processes of its own: fleetwarden's SIGKILL fails nothing
    assert result["requests"]["failed_while_fleetwarden_down"] == 0
    assert result["invariant_violations"] == 0, result["violation_examples"]
    assert result["leftover_processes"] == 0
    assert result["fleetwarden_down_s"] is not None  # fleetwarden was killed and came back
    assert result["faults_injected"] >= 3
    assert result["requests"]["ok_200"] > 100
    assert out.returncode == 0
