"""The SQLite journal: every transition kept, and a restarted fleetwarden remembers."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetwarden.journal import SCHEMA_VERSION, Journal, JournalError
from fleetwarden.ledger import Ledger, Policy, ShardRecord, ShardState, same_counters


def random_operations(ledger: Ledger, n: int, seed: int) -> None:
    """Drive ``ledger`` through ``n`` random operations (most of them change something)."""
    rng = random.Random(seed)
    port = 30000 + seed * n  # distinct per call, so no two shards ever share a URL
    size = len(ledger)
    for _ in range(n):
        i = rng.randrange(size)
        op = rng.randrange(9)
        if op == 0:
            ledger.record_probe(i, rng.random() < 0.5, "refused")
        elif op == 1:
            ledger.report_failure(i, "timeout")
        elif op == 2:
            ledger.report_outcomes(i, rng.randrange(3), rng.randrange(3), rng.randrange(2))
        elif op == 3:
            ledger.condemn(i, "exited")
        elif op == 4:
            ledger.mark_restarting(i)
        elif op == 5:
            port += 1
            ledger.mark_loaded(i, f"http://127.0.0.1:{port}", f"launch-{port}")
        elif op == 6:
            ledger.report_refit(i, rng.randrange(10))
        elif op == 7:
            ledger.mark_weights_partial(i)
        else:
            ledger.report_success(i)


def assert_same(a: list[ShardRecord], b: list[ShardRecord]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert same_counters(x, y), (x, y)


def test_append_close_and_restore_gives_the_identical_ledger(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger([f"http://127.0.0.1:{8000 + i}" for i in range(6)],
                    Policy(max_restart_attempts=3))
    journal = Journal(path)
    assert journal.restore() is None  # a new journal has no fleet yet
    journal.attach(ledger)
    random_operations(ledger, 500, seed=1)
    journal.close()

    with Journal(path) as again:
        restored = again.restore(Policy(max_restart_attempts=3))
    assert restored is not None
    assert restored.snapshot() == ledger.snapshot()  # timestamps too: close wrote a snapshot


def test_a_journal_written_while_the_ledger_processes_10000_transitions(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger([f"http://127.0.0.1:{8000 + i}" for i in range(16)],
                    Policy(max_restart_attempts=1000))
    journal = Journal(path, snapshot_every=750)
    journal.attach(ledger)
    count = 0

    def counter(_: object) -> None:
        nonlocal count
        count += 1

    ledger.subscribe(counter)
    seed = 0
    while count < 10_000:
        random_operations(ledger, 1000, seed=seed)
        seed += 1
    journal.flush()
    assert len(journal.transitions()) == count
    restored = journal.restore()
    assert restored is not None
    assert_same(restored.snapshot(), ledger.snapshot())
    journal.close()


CRASHING_WRITER = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {src!r})
    from fleetwarden.journal import Journal
    from fleetwarden.ledger import Ledger, Policy
    sys.path.insert(0, {tests!r})
    from test_journal import random_operations

    ledger = Ledger([f"http://127.0.0.1:{{8000 + i}}" for i in range(5)],
                    Policy(max_restart_attempts=50))
    journal = Journal({path!r}, snapshot_every=100)
    journal.attach(ledger)
    random_operations(ledger, 1500, seed=7)
    journal.flush()
    print(json.dumps([r.to_dict() for r in ledger.snapshot()]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no final snapshot
""")


def test_a_crash_without_a_snapshot_restores_the_same_ledger(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    script = CRASHING_WRITER.format(
        src=str(Path(__file__).parents[2] / "src"), tests=str(Path(__file__).parent),
        path=str(path),
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    expected = [ShardRecord.from_dict(d) for d in json.loads(proc.stdout)]
    with Journal(path) as journal:
        restored = journal.restore(Policy(max_restart_attempts=50))
    assert restored is not None
    assert_same(restored.snapshot(), expected)
    assert any(r.restart_attempts > 0 for r in expected)


def test_budgets_retirements_versions_and_streaks_survive(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger(["http://a:1", "http://b:1", "http://c:1"])
    with Journal(path) as journal:
        journal.attach(ledger)
        ledger.condemn(0, "exited")
        ledger.mark_restarting(0)
        ledger.mark_loaded(0, "http://a:2", "launch-9")
        ledger.report_refit(0, 7)
        ledger.retire(1, "operator")
        ledger.report_failure(2, "timeout")
        ledger.report_failure(2, "timeout")
    with Journal(path) as journal:
        restored = journal.restore()
    assert restored is not None
    a, b, c = restored.snapshot()
    assert (a.restart_attempts, a.base_url, a.weight_version, a.incarnation) == (
        1, "http://a:2", 7, "launch-9")
    assert b.state is ShardState.RETIRED
    assert (c.state, c.consecutive_reported_failures) == (ShardState.SUSPECT, 2)


def test_a_corrupt_journal_is_a_clear_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match=str(path)):
        Journal(path)
    assert path.read_bytes().startswith(b"this is not")  # never silently reset


def test_a_damaged_page_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger([f"http://h:{i}" for i in range(50)])
    with Journal(path) as journal:
        journal.attach(ledger)
        random_operations(ledger, 3000, seed=3)
    data = bytearray(path.read_bytes())
    for off in range(4096 * 3, min(len(data), 4096 * 6)):
        data[off] = 0xA5
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=str(path)):
        journal = Journal(path)
        journal.restore()


def test_a_journal_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    Journal(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                     (str(SCHEMA_VERSION + 1),))
    with pytest.raises(JournalError, match="newer fleetwarden"):
        Journal(path)


def test_history_is_readable_by_shard_and_sequence(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger(["http://a:1", "http://b:1"])
    with Journal(path) as journal:
        journal.attach(ledger)
        ledger.report_failure(1, "reset")
        ledger.condemn(1, "exited")
        ledger.condemn(0, "exited")
        journal.record_restart(1, 1, "started", "port 9001")
        journal.record_verdict(0, "http://a:1", "BUSY", {"steps": 12})
        journal.flush()
        entries = journal.transitions(shard=1)
        assert [(e.from_state, e.to_state) for e in entries] == [
            ("HEALTHY", "SUSPECT"), ("SUSPECT", "DEAD")]
        assert entries[1].cause == "exited"
        assert [e.shard for e in journal.transitions(after_seq=entries[1].seq)] == [0]
        assert journal.restarts()[0]["detail"] == "port 9001"
        assert journal.verdicts()[0]["evidence"] == {"steps": 12}


def test_appends_return_while_the_database_is_locked(tmp_path: Path) -> None:
    """The caller only queues; the writer thread commits. With the file locked by another
    connection, a writer on the caller's thread would block for SQLite's busy timeout."""
    path = tmp_path / "fleet.sqlite"
    ledger = Ledger(["http://a:1", "http://b:1"])
    journal = Journal(path)
    journal.attach(ledger)
    journal.flush()
    blocker = sqlite3.connect(path)
    blocker.execute("BEGIN EXCLUSIVE")
    for _ in range(50):
        ledger.report_failure(0, "x")
        ledger.report_success(0)
    assert ledger.shard(0).consecutive_reported_failures == 0  # every call returned
    blocker.rollback()
    blocker.close()
    journal.flush()
    assert len(journal.transitions(shard=0)) == 100
    journal.close()


def test_meta_keys_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    with Journal(path) as journal:
        assert journal.get_meta("clean_shutdown") is None
        journal.set_meta("clean_shutdown", "0")
        journal.set_meta("clean_shutdown", "1")
    with Journal(path) as journal:
        assert journal.get_meta("clean_shutdown") == "1"
        assert journal.get_meta("schema_version") == "1"


def test_a_failing_journal_never_stops_the_ledger_nor_its_subscribers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails (disk full, file gone) is reported, never raised into the ledger:
    the transition happens and every subscriber sees it."""
    ledger = Ledger(["http://a:1", "http://b:1"])
    journal = Journal(tmp_path / "fleet.sqlite")
    journal.attach(ledger)
    seen: list[str] = []
    ledger.subscribe(lambda t: seen.append(f"{t.shard}:{t.to_state}"))
    journal.flush()
    assert journal.failure is None

    def disk_full(*args: object) -> int:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Journal, "_write", staticmethod(disk_full))
    ledger.condemn(0, "exited")
    with pytest.raises(JournalError):
        journal.flush()
    ledger.condemn(1, "exited")  # after the failure: must not raise
    journal.record_verdict(1, "http://b:1", "STUCK", {})
    journal.record_restart(1, 1, "started")
    assert [ledger.state(0), ledger.state(1)] == [ShardState.DEAD, ShardState.DEAD]
    assert seen == ["0:DEAD", "1:DEAD"]
    assert journal.failure is not None and "disk is full" in journal.failure
    assert journal.dropped >= 3
    with pytest.raises(JournalError, match="disk is full"):
        journal.close()


def test_verdict_rows_are_kept_to_the_newest(tmp_path: Path) -> None:
    """Memory (and disk) that only grows: verdicts are pruned to the
    newest ``verdicts_kept``; transitions are all kept."""
    ledger = Ledger(["http://a:1"])
    with Journal(tmp_path / "fleet.sqlite", verdicts_kept=50) as journal:
        journal.attach(ledger)
        for n in range(300):
            journal.record_verdict(0, "http://a:1", "STALLED", {"n": n})
        journal.flush()
        kept = journal.verdicts(limit=1000)
        assert 50 <= len(kept) <= 55 and kept[-1]["evidence"] == {"n": 299}


def test_engine_rows_can_be_written_from_another_thread(tmp_path: Path) -> None:
    """The launcher writes engine rows from a worker thread, so the commit's fsync never
    holds the event loop."""
    import threading

    with Journal(tmp_path / "fleet.sqlite") as journal:
        t = threading.Thread(target=journal.engine_launched, args=("l-1", 0, {"url": "u"}))
        t.start()
        t.join()
        assert journal.launch_ids() == {"l-1"}
        assert [e["shard"] for e in journal.running_engines()] == [0]


def test_a_launch_is_journaled_before_its_process_and_a_stop_is_never_undone(
        tmp_path: Path) -> None:
    """A launch's intent (no PID yet) is a running engine until it is stopped, so the next run
    looks for its process by launch id; the record of its process fills that row in and
    leaves a stop already written standing (a stop racing the launch's last write)."""
    with Journal(tmp_path / "fleet.sqlite") as journal:
        journal.engine_launched("l-1", 0, {"url": "u", "pid": None})
        assert [(e["shard"], e["pid"]) for e in journal.running_engines()] == [(0, None)]
        journal.engine_launched("l-1", 0, {"url": "u", "pid": 42})
        assert [e["pid"] for e in journal.running_engines()] == [42]
        journal.engine_launched("l-2", 1, {"url": "v", "pid": None})
        journal.engine_stopped("l-2")
        journal.engine_launched("l-2", 1, {"url": "v", "pid": 43})
        assert [e["pid"] for e in journal.running_engines()] == [42]
        assert journal.launch_ids() == {"l-1", "l-2"}
