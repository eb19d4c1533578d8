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
    out = fleetwarden("demo", "--ledger-story")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("HEALTHY → SUSPECT: request timed out",
                     "SUSPECT → STALE: a refit aborted",
                     "STALE → DEAD: silent participant",
                     "DEAD → RESTARTING: restart 1 of 5",
                     "RESTARTING → STALE: replacement up at",
                     "STALE → HEALTHY: refit to version 1"):
        assert expected in text


def test_history_reads_the_journal(tmp_path: object) -> None:
    from pathlib import Path

    from fleetwarden.journal import Journal
    from fleetwarden.ledger import Ledger

    assert isinstance(tmp_path, Path)
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger(["http://a:1", "http://b:1"])
    with Journal(path) as journal:
        journal.attach(ledger)
        ledger.report_failure(1, "reset by peer")
        ledger.report_failure(1, "reset by peer")
        ledger.condemn(0, "engine process exited with code -9")
    out = fleetwarden("history", "--journal", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2  # state changes only: the second failure only grew a streak
    assert "shard 1  HEALTHY -> SUSPECT  reset by peer" in lines[0]
    assert "shard 0  HEALTHY -> DEAD  engine process exited with code -9" in lines[1]
    out = fleetwarden("history", "--journal", str(path), "--shard", "1", "--all", "--json")
    assert len(out.stdout.strip().splitlines()) == 2
    out = fleetwarden("history", "--journal", str(path), "--since", "1h")
    assert len(out.stdout.strip().splitlines()) == 2
    out = fleetwarden("history", "--journal", str(tmp_path / "missing.sqlite"))
    assert out.returncode == 2 and "no journal" in out.stderr


def test_the_demo_refuses_a_fleet_too_small_to_rescue_anything() -> None:
    out = fleetwarden("demo", "--engines", "1", "--no-live")
    assert out.returncode == 2
    assert "--engines" in out.stderr and "greater than or equal to 2" in out.stderr


def test_the_mixed_demo_is_simulated_engines_of_three_kinds_and_takes_no_others() -> None:
    for extra in (("--engines", "4"), ("--engine-cmd", "vllm serve --port {port}")):
        out = fleetwarden("demo", "--mixed", "--no-live", *extra)
        assert out.returncode == 2 and "no --engine-cmd and no --engines" in out.stderr


def test_up_group_and_engine_are_checked_like_the_config() -> None:
    out = fleetwarden("up", "--group", "llamacpp-two-engines")
    assert out.returncode == 2 and "expected KIND:COUNT:COMMAND" in out.stderr
    out = fleetwarden("up", "--group", "ollama:1:ollama serve --port {port}")
    assert out.returncode == 2 and "fleet.groups.0.engine = 'ollama'" in out.stderr
    out = fleetwarden("up", "--engine", "vlm")
    assert out.returncode == 2 and "fleet.engine = 'vlm'" in out.stderr


def test_check_and_sim_refuse_an_unknown_engine() -> None:
    out = fleetwarden("check", "http://127.0.0.1:9", "--engine", "ollama")
    assert out.returncode == 2 and "choose one of: auto, vllm, llamacpp" in out.stderr
    out = fleetwarden("sim", "--engine", "tgi")
    assert out.returncode == 2 and "choose one of: vllm, llamacpp, sglang" in out.stderr
    out = fleetwarden("sim", "--override-generation-config", '{"max_new_tokens": 0}')
    assert out.returncode == 2 and "max_new_tokens must be an" in out.stderr


def test_sim_takes_a_model_folders_default_limit_as_vllm_does(tmp_path: object) -> None:
    """``fleetwarden sim --model DIR``: as vLLM's ``--generation-config auto``, the folder's
    generation_config.json max_new_tokens is the default of a chat that names none; an
    override's replaces it; a served name that is no folder sets none."""
    from pathlib import Path

    from fleetwarden.cli import _sim_default_max_new_tokens

    assert isinstance(tmp_path, Path)
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 48}')
    assert _sim_default_max_new_tokens(str(tmp_path), None) == 48
    assert _sim_default_max_new_tokens(str(tmp_path), 20) == 20
    assert _sim_default_max_new_tokens("tiny", None) is None


def test_keys_add_prints_the_key_once_and_up_refuses_a_broken_keys_file(
        tmp_path: object) -> None:
    from pathlib import Path

    from fleetwarden.router.keys import hash_secret, read_keys

    keys = Path(str(tmp_path)) / "keys"
    out = fleetwarden("keys", "add", "trainer", "--file", str(keys))
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip()
    assert secret.startswith("sk-fw-") and "shown once" in out.stderr
    assert read_keys(keys) == {"trainer": hash_secret(secret)}
    assert secret not in keys.read_text()
    again = fleetwarden("keys", "add", "trainer", "--file", str(keys))
    assert again.returncode == 2 and "already has a key named 'trainer'" in again.stderr

    keys.write_text(keys.read_text() + "eval sha256:nothex\n")
    config = Path(str(tmp_path)) / "fleet.toml"
    config.write_text(f'[router]\nkeys_file = "{keys}"\n')
    up = fleetwarden("up", "--config", str(config))
    assert up.returncode == 2
    assert "[router] keys_file" in up.stderr and "line 3" in up.stderr
    route = fleetwarden("route", "--backend", "http://127.0.0.1:9", "--keys-file", str(keys))
    assert route.returncode == 2 and "line 3" in route.stderr
