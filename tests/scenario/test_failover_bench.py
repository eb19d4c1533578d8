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
from typing import Any

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


def _bench(tmp_path: Path, *args: str, timeout_s: float = 240) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "failover.py"), "--routers", "fleetwarden",
         "--json", str(out), *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["not_run"] == "", row["not_run"]
    return rows, done.stdout


def test_a_rolling_restart_paced_by_health_loses_nothing(tmp_path: Path) -> None:
    """Every attached engine restarted in turn (its process exits, a new one on its port 2 s
    later, the next one as soon as that answers /health), answers and streams, fleetwarden at
    its defaults: not one request fails, and each restarted engine gets a client request
    within a second or so of its /health (printed; the target is < 1 s)."""
    rows, _ = _bench(tmp_path, "--quick-windows", "--scenarios",
                     "rolling-restart,stream-rolling-restart")
    for row in rows:
        print(f"\n{row['scenario']}: {row['sent']} sent, {row['failed']} failed; restarted "
              "engines' first client request after their /health: "
              + " / ".join("none" if s is None else f"{s:.2f} s" for s in row["comeback_s"]))
        assert row["fault_check"].startswith("verified"), row["fault_check"]
        assert row["sent"] >= 30 and row["failed"] == 0, row
        assert len(row["comeback_s"]) == 3 and None not in row["comeback_s"], row


def test_silence_under_load_is_rescued_on_the_wedges_timeline(tmp_path: Path) -> None:
    """SIGSTOP of a whole attached engine and a black hole, beside a wedge in the same run,
    at the defaults: nothing fails, no healthy engine is ejected, each fault is read back from
    the engine, and the slowest answers are printed side by side. (The saturated fleet at the
    defaults: BENCHMARKS.md, "Back at once, out at once"; at compressed timings,
    tests/scenario/test_fleet.py.)"""
    rows, _ = _bench(tmp_path, "--quick-windows", "--scenarios", "wedge,sigstop,blackhole",
                     timeout_s=300)
    by = {row["scenario"]: row for row in rows}
    print("\nslowest answer / last parked request answered: " + "; ".join(
        f"{name} {by[name]['max_s']:.1f} s / {by[name]['parked_answered_s'] or 0:.1f} s"
        for name in ("wedge", "sigstop", "blackhole")))
    for name in ("wedge", "sigstop", "blackhole"):
        assert by[name]["failed"] == 0 and by[name]["sent"] >= 30, by[name]
        assert by[name]["healthy_ejected"] == 0, by[name]
    for name in ("sigstop", "blackhole"):
        assert by[name]["fault_check"].startswith("verified"), by[name]["fault_check"]
        assert any(n.startswith("engine 1 DEAD") and "SILENT" in n
                   for n in by[name]["notes"]), by[name]["notes"]


def test_a_control_run_aimed_at_nothing_fails_the_fault_check(tmp_path: Path) -> None:
    """The same harness with every fault sent nowhere: its check must say so, or a check that
    passes would prove nothing."""
    rows, _ = _bench(tmp_path, "--quick", "--control", "--scenarios", "sigstop")
    (row,) = rows
    assert row["fault_check"].startswith("NOT verified"), row["fault_check"]
