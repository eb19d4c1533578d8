"""`fleetwarden demo --quick --mixed` as CI runs it: every fault detected, no request lost, on
a mixed fleet (simulated vLLM, llama.cpp and SGLang engines), each act on the kind it names.
The same story as the plain demo (three vLLM engines): only the fleet's config and the shard
each act falls on differ, so this one test covers both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetwarden.testing.scenarios import condemned_as_a_stopped_core

pytestmark = pytest.mark.scenario


#: The kind each act falls on: a different kind per act where the act allows (not the idle
#: wedge on SGLang, whose gauges lag by up to 30 s when idle: a 30 s wait for the lost core).
KINDS = {"wedge under load": "llamacpp", "crash": "sglang", "trickle": "vllm",
         "idle wedge": "vllm"}


def test_the_mixed_demo_detects_every_fault_on_each_kind_and_loses_no_request(
        tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "fleetwarden", "demo", "--quick", "--mixed",
                          "--no-live",
                          "--report", str(tmp_path / "report")],
                         capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    faults = {f["name"]: f for f in summary["faults"]}
    assert set(faults) == {"wedge under load", "crash", "trickle", "idle wedge",
                           "saturated but healthy"}
    # the fleet's shard view at the end: each engine judged by its own profile
    judged = {e["shard"]: e["engine"] for e in summary["engines"]}
    assert sorted(judged.values()) == ["llamacpp", "sglang", "vllm"], summary["engines"]
    for name, kind in KINDS.items():  # each act on the kind it names, and the summary says so
        shard = faults[name]["shard"]
        assert faults[name]["engine"] == kind == judged[shard], faults[name]
        assert f"{name} (shard {shard}, {kind}): quarantined" in out.stdout, name
    for name in ("wedge under load", "crash", "trickle", "idle wedge"):
        f = faults[name]
        assert f["quarantined_after_s"] is not None, name  # detected
        assert f["back_after_s"] is not None and f["restarts"] >= 1, name  # and repaired
    wedged = faults["wedge under load"]["what_happened"]
    assert condemned_as_a_stopped_core(wedged), wedged
    # what the wedge held: answered by hedges, or rescued at its condemnation
    assert faults["wedge under load"]["rescued"] + faults["wedge under load"]["hedged"] >= 1
    # The exit, or its failed requests and the refused read that confirmed them at once,
    # whichever the fleet saw first: never a streak of probes.
    crash = faults["crash"]["what_happened"]
    assert "exited" in crash or "confirmed by a failed probe" in crash, crash
    # failed requests, then their confirmation (or a streak of failed windows on trial)
    assert "failed request window" in faults["trickle"]["what_happened"], faults["trickle"]
    # the first routed requests' lost core (or its lost races confirmed by a canary it never
    # answered), or a canary the engine held with nothing advancing, whichever came first
    # (the demo canaries every 5 s)
    idle = faults["idle wedge"]["what_happened"]
    assert condemned_as_a_stopped_core(idle), idle
    saturated = faults["saturated but healthy"]
    assert saturated["canaries"] == 0 and saturated["restarts"] == 0
    assert "0 state changes" in saturated["what_happened"]
    assert summary["totals"]["client_errors"] == 0 and summary["totals"]["ok"] > 200
    assert (tmp_path / "report" / "timeline.png").stat().st_size > 10_000
