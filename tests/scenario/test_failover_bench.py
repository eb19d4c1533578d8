"""The failover benchmark's harness, smoke-tested on fleetwarden alone.

One short scenario (``--quick``: a wedge under load, fleetwarden's timings compressed) run the
way a user runs the benchmark, as a process; its JSON rows are checked for what actually
happened on the engines and at the clients, not only that it ran. The engines are a mixed
fleet (``--sim-engines vllm,llamacpp,sglang``): the wedged one speaks llama.cpp's metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.scenario

ROOT = Path(__file__).resolve().parents[2]


def test_the_failover_harness_measures_a_wedge_on_fleetwarden(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "failover.py"), "--quick",
         "--routers", "fleetwarden", "--scenarios", "wedge", "--json", str(out),
         "--sim-engines", "vllm,llamacpp,sglang"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert row["not_run"] == "", row["not_run"]
    assert row["router"] == "fleetwarden" and row["scenario"] == "wedge"
    # the clients kept going through the wedge, and not one of them saw an error
    assert row["sent"] >= 30 and row["failed"] == 0 and row["ok"] == row["sent"], row
    # the engines' own logs: the wedged engine got no new request by the end of the window
    assert row["bad_after"] is not None and not row["bad_still_at_end"], row
    # fleetwarden condemned the wedged engine (from its journal), and only that one
    assert any(n.startswith("engine 1 DEAD") and "STUCK" in n for n in row["notes"]), row
    assert row["healthy_ejected"] == 0, row
    # the table a reader sees says the same
    assert "| wedge | fleetwarden |" in done.stdout and " 0 |" in done.stdout


def test_the_failover_harness_measures_streams_wedged_mid_answer(tmp_path: Path) -> None:
    """Streams on the wedged engine are held there with no token: moved when the controller
    hedges it (or rescued at its condemnation) although their answers have begun, they go on
    elsewhere: every stream whole, through `fleetwarden up` as a user runs it."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "failover.py"), "--quick",
         "--routers", "fleetwarden", "--scenarios", "stream-wedge", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["not_run"] == "", row["not_run"]
    assert row["sent"] >= 20 and row["failed"] == 0 and row["ok"] == row["sent"], row
    # condemned as stuck with its streams running: each of them was cut there, mid-answer
    assert any(n.startswith("engine 1 DEAD") and "STUCK" in n for n in row["notes"]), row
    assert f"| stream-wedge | fleetwarden | {row['sent']} ({row['sent']} whole) |" in done.stdout
