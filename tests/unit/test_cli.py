"""The `fleetwarden` command as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

from fleetwarden import __version__


def fleetwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetwarden", *args],
                          capture_output=True, text=True, timeout=60)


def test_version_and_help() -> None:
    out = fleetwarden("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"fleetwarden {__version__}"
    out = fleetwarden("--help")
    assert out.returncode == 0
    for command in ("demo", "check", "sim"):
        assert command in out.stdout


def test_the_ledger_demo_prints_each_transition_with_its_cause() -> None:
    out = fleetwarden("demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("HEALTHY → SUSPECT: request timed out",
                     "SUSPECT → STALE: a refit aborted",
                     "STALE → DEAD: silent participant",
                     "DEAD → RESTARTING: restart 1 of 5",
                     "RESTARTING → STALE: replacement up at",
                     "STALE → HEALTHY: refit to version 1"):
        assert expected in text
