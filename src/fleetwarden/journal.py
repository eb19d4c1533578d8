"""The journal: a SQLite (WAL) record of every transition, verdict and restart.

Owns: the SQLite journal: its schema, its writer thread, its reads and the restore of a ledger.
Must not: decide what a restored fleet does with its engines (``restore.py``).

It answers two questions. *What happened?* (``fleetwarden history``, the dashboard), and *where
were we?* (:meth:`Journal.restore` rebuilds a :class:`~fleetwarden.ledger.Ledger` after a
restart of fleetwarden, so restart budgets, retirements, weight versions and streaks survive).

Writes never block the caller for long. The journal sits beside an event loop, and a SQLite
commit costs an fsync (milliseconds, more on a busy disk). So :meth:`Journal.append` only puts
the event on a queue; one writer thread owns the write connection and commits whatever has
queued up as one transaction: a batch per commit, one fsync per batch, however many
transitions a tick produced. ``synchronous=NORMAL`` in WAL mode keeps every committed batch
across a crash of fleetwarden; a power cut can lose the last batches, never corrupt the file.

Each transition carries the whole record of its shard after the change, so a restore is the
latest snapshot plus every record written after it. Snapshots are written when the journal is
attached, every ``snapshot_every`` transitions (from the writer's own mirror), and on close.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetwarden.ledger import Ledger, Policy, ShardRecord, Transition

__all__ = ["RUN_SUMMARY_KEY", "SCHEMA_VERSION", "VERDICTS_KEPT", "Journal", "JournalEntry",
           "JournalError"]

#: The meta key of the last run's summary (:meth:`Journal.record_run_summary`).
RUN_SUMMARY_KEY = "run_summary"

log = logging.getLogger(__name__)

#: Bump when the tables change in a way an older fleetwarden cannot read.
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    shard INTEGER NOT NULL,
    from_state TEXT NOT NULL,
    to_state TEXT NOT NULL,
    event TEXT NOT NULL,
    cause TEXT NOT NULL,
    at REAL NOT NULL,
    wall REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_by_shard ON transitions (shard, seq);
CREATE TABLE IF NOT EXISTS snapshots (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    wall REAL NOT NULL,
    upto_seq INTEGER NOT NULL,
    shards TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS verdicts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    shard INTEGER NOT NULL,
    url TEXT NOT NULL,
    verdict TEXT NOT NULL,
    evidence TEXT NOT NULL,
    wall REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS engines (
    launch_id TEXT PRIMARY KEY,
    shard INTEGER NOT NULL,
    record TEXT NOT NULL,
    launched_wall REAL NOT NULL,
    stopped_wall REAL
);
CREATE TABLE IF NOT EXISTS routers (
    launch_id TEXT PRIMARY KEY,
    worker INTEGER NOT NULL,
    record TEXT NOT NULL,
    launched_wall REAL NOT NULL,
    stopped_wall REAL
);
CREATE TABLE IF NOT EXISTS restarts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    shard INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL,
    wall REAL NOT NULL
);
"""


#: Verdict rows kept (the newest). Verdicts are evidence for ``fleetwarden history`` and the
#: dashboard, not for a restore; a watchdog writing one non-steady verdict per shard per 5 s
#: tick would otherwise grow the file without end. 100 000 rows is a few days of a troubled
#: 8-engine fleet, tens of MB. Transitions (the fleet's history) are all kept.
VERDICTS_KEPT = 100_000


#: An engine's row. A launch writes it twice: its intent before the spawn (``pid`` None), so
#: an engine whose PID never reaches the journal (fleetwarden killed between the spawn and the
#: second write, or that write failed) is still named by its launch id, which the next run
#: finds it by (``restore.adopt_or_stop``); then its process, which fills in the record and
#: leaves a stop written meanwhile standing (a stop racing the launch's last write).
_ENGINE_ROW = ("INSERT INTO engines (launch_id, shard, record, launched_wall) VALUES (?, ?, ?, ?) "
               "ON CONFLICT(launch_id) DO UPDATE SET record = excluded.record")


class JournalError(Exception):
    """The journal file cannot be used as it is. The message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One transition as read back from the journal."""

    seq: int
    shard: int
    from_state: str
    to_state: str
    event: str
    cause: str
    at: float
    wall: float
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    records: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Verdict:
    shard: int
    url: str
    verdict: str
    evidence: dict[str, Any]
    wall: float


@dataclass(frozen=True, slots=True)
class _Restart:
    shard: int
    attempt: int
    outcome: str
    detail: str
    wall: float


_Item = Transition | _Snapshot | _Verdict | _Restart


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, timeout=30.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class _ProcessRows:
    """The rows of the processes fleetwarden started, engines and router workers: each
    committed before its call returns, from any thread (its own connection, one writer at a
    time), so that a fleetwarden killed a moment later still knows what it left running; their
    reads; and the journal's first failed write, of either writer."""

    path: Path
    _read: sqlite3.Connection
    #: Items not written because the journal had failed (:class:`Journal`).
    dropped: int
    _writer_error: BaseException | None
    _engines_lock: threading.Lock
    _engines_conn: sqlite3.Connection | None

    def engine_launched(self, launch_id: str, shard: int, record: dict[str, Any]) -> None:
        """An engine process about to start (``pid`` None, before the spawn) or started (PID,
        process group, start time, URL): written at once, so a fleetwarden killed a moment
        later still knows what it left running (:data:`_ENGINE_ROW`)."""
        self._process_write(_ENGINE_ROW, (launch_id, shard, json.dumps(record), time.time()))

    def engine_stopped(self, launch_id: str) -> None:
        self._process_write("UPDATE engines SET stopped_wall = ? WHERE launch_id = ?",
                           (time.time(), launch_id))

    def _process_write(self, sql: str, args: tuple[Any, ...]) -> None:
        """One engine or router row, committed before this returns. Callable from any thread
        (the launchers call it from a worker thread, so the commit's fsync never holds the
        event loop): a connection of its own, one writer at a time. A failed write is counted
        and reported, never raised: the process runs all the same, and a caller that raised
        here would leave it unwatched (a router worker's watcher that died on a full disk
        never started the worker again)."""
        try:
            with self._engines_lock:
                if self._engines_conn is None:
                    self._engines_conn = _connect(self.path)
                with self._engines_conn:
                    self._engines_conn.execute(sql, args)
        except sqlite3.Error as exc:  # the engine runs all the same; the failure is reported
            self.dropped += 1
            self._failed(exc)

    def launch_ids(self) -> set[str]:
        """Every engine this journal ever recorded."""
        return {r[0] for r in self._read.execute("SELECT launch_id FROM engines")}

    def running_engines(self) -> list[dict[str, Any]]:
        """Engines launched and never seen stopped: what an earlier run may have left (``pid``
        None: a launch whose process never reached the journal, known by its launch id)."""
        rows = self._read.execute(
            "SELECT shard, record FROM engines WHERE stopped_wall IS NULL ORDER BY launched_wall"
        ).fetchall()
        return [{"shard": shard, **json.loads(record)} for shard, record in rows]

    # ------------------------------------------------------------------ router processes

    def router_launched(self, launch_id: str, worker: int, record: dict[str, Any]) -> None:
        """A router process started (``[router] workers``): written at once, as an engine's."""
        self._process_write(
            "INSERT OR REPLACE INTO routers (launch_id, worker, record, launched_wall) "
            "VALUES (?, ?, ?, ?)", (launch_id, worker, json.dumps(record), time.time()))

    def router_stopped(self, launch_id: str) -> None:
        self._process_write("UPDATE routers SET stopped_wall = ? WHERE launch_id = ?",
                            (time.time(), launch_id))

    def router_launch_ids(self) -> set[str]:
        """Every router process this journal ever recorded."""
        return {r[0] for r in self._read.execute("SELECT launch_id FROM routers")}

    def running_routers(self) -> list[dict[str, Any]]:
        """Router processes launched and never seen stopped: what an earlier run may have
        left serving."""
        rows = self._read.execute(
            "SELECT worker, record FROM routers WHERE stopped_wall IS NULL ORDER BY launched_wall"
        ).fetchall()
        return [{"worker": worker, **json.loads(record)} for worker, record in rows]

    def _failed(self, exc: BaseException) -> None:
        if self._writer_error is None:
            self._writer_error = exc
            log.error("journal %s: writes fail (%s); the fleet goes on without a history until "
                      "the journal is fixed and fleetwarden restarted", self.path, exc)


class Journal(_ProcessRows):
    """A journal file. Open it, :meth:`restore` from it, then :meth:`attach` a ledger."""

    def __init__(self, path: str | Path, *, snapshot_every: int = 1000, batch_max: int = 2000,
                 verdicts_kept: int = VERDICTS_KEPT):
        self.path = Path(path)
        self.snapshot_every = snapshot_every
        self.verdicts_kept = verdicts_kept
        self.batch_max = batch_max
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ledger: Ledger | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._writer_error: BaseException | None = None
        #: Items (transitions, verdicts, restarts) not written because the journal had failed.
        self.dropped = 0
        self._engines_lock = threading.Lock()
        self._engines_conn: sqlite3.Connection | None = None
        self._closed = False
        self._read = self._open_checked()

    # ------------------------------------------------------------------ opening

    def _open_checked(self) -> sqlite3.Connection:
        where = f"journal {self.path}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = _connect(self.path)
            ok = conn.execute("PRAGMA quick_check").fetchone()
            if ok is None or ok[0] != "ok":
                raise JournalError(f"{where} is corrupt ({ok[0] if ok else 'no answer'}); "
                                   "move it aside to start a fresh fleet history")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', ?), "
                    "('created_wall', ?)",
                    (str(SCHEMA_VERSION), repr(time.time())),
                )
                conn.commit()
            else:
                found = int(row[0])
                if found > SCHEMA_VERSION:
                    raise JournalError(
                        f"{where} was written by a newer fleetwarden (schema {found}; this one "
                        f"reads up to {SCHEMA_VERSION}); upgrade fleetwarden or use another file"
                    )
        except sqlite3.DatabaseError as exc:
            raise JournalError(
                f"{where} is not a readable fleetwarden journal ({exc}); "
                "move it aside to start a fresh fleet history"
            ) from exc
        return conn

    # ------------------------------------------------------------------ meta

    def get_meta(self, key: str) -> str | None:
        row = self._read.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        """Write one small key at once (rare: start and clean stop), beside the writer."""
        with self._read:
            self._read.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                               "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                               (key, value))

    def record_run_summary(self, summary: dict[str, Any]) -> None:
        """Keep what a run measured of its own work (``Fleet.run_summary``), replacing the
        previous run's: ``fleetwarden history --summary`` shows it after the fleet is gone."""
        self.set_meta(RUN_SUMMARY_KEY, json.dumps(summary, sort_keys=True))

    def run_summary(self) -> dict[str, Any] | None:
        """The last run's summary, or None when no run has stopped with one."""
        raw = self.get_meta(RUN_SUMMARY_KEY)
        if raw is None:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            return None  # a summary that cannot be read is no summary; the journal is intact
        return found if isinstance(found, dict) else None

    # ------------------------------------------------------------------ restore

    def restore(
        self, policy: Policy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> Ledger | None:
        """Rebuild the ledger as the journal last recorded it, or ``None`` for a new journal."""
        try:
            snap = self._read.execute(
                "SELECT upto_seq, shards FROM snapshots ORDER BY id DESC LIMIT 1"
            ).fetchone()
            if snap is None:
                return None
            upto, shards_json = snap
            records = {int(d["index"]): d for d in json.loads(shards_json)}
            for (record_json,) in self._read.execute(
                "SELECT record FROM transitions WHERE seq > ? ORDER BY seq", (upto,)
            ):
                d = json.loads(record_json)
                records[int(d["index"])] = d
            return Ledger.from_records(
                [ShardRecord.from_dict(records[i]) for i in sorted(records)], policy, clock
            )
        except (sqlite3.DatabaseError, ValueError, KeyError, TypeError) as exc:
            raise JournalError(f"journal {self.path} cannot be restored: {exc}") from exc

    # ------------------------------------------------------------------ writing

    def attach(self, ledger: Ledger) -> None:
        """Journal every transition of ``ledger`` from now on, starting with a snapshot."""
        if self._ledger is not None:
            raise RuntimeError("a journal records one ledger")
        self._ledger = ledger
        self._start()
        self._queue.put(_Snapshot([r.to_dict() for r in ledger.snapshot()]))
        self._unsubscribe = ledger.subscribe(self.append)

    def append(self, transition: Transition) -> None:
        """Queue one transition. Returns at once; the writer thread commits it."""
        self._put(transition)

    def record_verdict(self, shard: int, url: str, verdict: str, evidence: dict[str, Any]) -> None:
        self._put(_Verdict(shard, url, verdict, evidence, time.time()))

    def record_restart(self, shard: int, attempt: int, outcome: str, detail: str = "") -> None:
        self._put(_Restart(shard, attempt, outcome, detail, time.time()))

    @property
    def failure(self) -> str | None:
        """Why the journal stopped writing (the first error, in words); ``None`` while it
        writes. A failing journal never stops the fleet: the fleet's status, its log and the
        ``fleetwarden_journal_dropped_total`` metric say so instead."""
        exc = self._writer_error
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def _put(self, item: _Item) -> None:
        """Queue ``item``; once the writer has failed, count it as dropped instead. Never
        raises: the journal's callers are the ledger's subscribers and the controller's tick,
        and a disk that fails must not stop them."""
        if self._closed or self._writer_error is not None:
            self.dropped += 1
            return
        self._start()
        self._queue.put(item)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until everything queued so far is committed."""
        if self._thread is None:
            return
        self._check_writer()
        marker = _Flush()
        self._queue.put(marker)
        deadline = time.monotonic() + timeout
        # In slices: a writer that fails after this marker was queued no longer reads it.
        while not marker.done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            self._check_writer()
            if time.monotonic() >= deadline:
                raise JournalError(
                    f"journal {self.path}: writes did not finish within {timeout} s")
        self._check_writer()

    def close(self) -> None:
        """Write a final snapshot, commit everything queued, and stop the writer."""
        if self._closed:
            return
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._thread is not None:
            if self._ledger is not None and self._writer_error is None:
                self._queue.put(_Snapshot([r.to_dict() for r in self._ledger.snapshot()]))
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        self._read.close()
        with self._engines_lock:
            if self._engines_conn is not None:
                self._engines_conn.close()
                self._engines_conn = None
        if self._writer_error is not None:
            raise JournalError(f"journal {self.path}: a write failed: {self._writer_error}")

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_writer(self) -> None:
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")
        if self._writer_error is not None:
            raise JournalError(f"journal {self.path}: a write failed: {self._writer_error}")
        self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._writer, name=f"journal:{self.path.name}", daemon=True
            )
            self._thread.start()

    def _writer(self) -> None:
        conn = _connect(self.path)
        mirror: dict[int, dict[str, Any]] = {}
        since_snapshot = 0
        verdicts_since_prune = 0
        try:
            while True:
                batch = [self._queue.get()]
                while len(batch) < self.batch_max:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                flushes: list[_Flush] = []
                stop = False
                with conn:  # one transaction per batch
                    for item in batch:
                        if item is _STOP:
                            stop = True
                        elif isinstance(item, _Flush):
                            flushes.append(item)
                        else:
                            wrote = self._write(conn, item, mirror)
                            since_snapshot += wrote
                            if since_snapshot >= self.snapshot_every and mirror:
                                self._write(conn, _Snapshot(list(mirror.values())), mirror)
                                since_snapshot = 0
                            if isinstance(item, _Verdict):
                                verdicts_since_prune += 1
                                if verdicts_since_prune >= max(1, self.verdicts_kept // 10):
                                    conn.execute(
                                        "DELETE FROM verdicts WHERE seq <= "
                                        "(SELECT MAX(seq) FROM verdicts) - ?",
                                        (self.verdicts_kept,))
                                    verdicts_since_prune = 0
                for f in flushes:
                    f.done.set()
                if stop:
                    return
        except BaseException as exc:  # reported (status, log, metric); never silently lost
            self.dropped += sum(1 for item in batch if isinstance(item, _Item))
            self._failed(exc)
            for item in batch:  # a flush in the failed batch too (it waited its whole timeout)
                if isinstance(item, _Flush):
                    item.done.set()
            while True:  # release anyone waiting on a flush
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Flush):
                    item.done.set()
                elif isinstance(item, _Item):
                    self.dropped += 1
        finally:
            conn.close()

    @staticmethod
    def _write(conn: sqlite3.Connection, item: _Item, mirror: dict[int, dict[str, Any]]) -> int:
        if isinstance(item, Transition):
            record = item.record.to_dict()
            mirror[item.shard] = record
            conn.execute(
                "INSERT INTO transitions (shard, from_state, to_state, event, cause, at, wall, "
                "record) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (item.shard, item.from_state.value, item.to_state.value, item.event.value,
                 item.cause, item.at, time.time(), json.dumps(record)),
            )
            return 1
        if isinstance(item, _Snapshot):
            for r in item.records:
                mirror[int(r["index"])] = r
            upto = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM transitions").fetchone()[0]
            conn.execute(
                "INSERT INTO snapshots (wall, upto_seq, shards) VALUES (?, ?, ?)",
                (time.time(), upto, json.dumps([mirror[i] for i in sorted(mirror)])),
            )
            return 0
        if isinstance(item, _Verdict):
            conn.execute(
                "INSERT INTO verdicts (shard, url, verdict, evidence, wall) VALUES (?, ?, ?, ?, ?)",
                (item.shard, item.url, item.verdict, json.dumps(item.evidence), item.wall),
            )
            return 0
        conn.execute(
            "INSERT INTO restarts (shard, attempt, outcome, detail, wall) VALUES (?, ?, ?, ?, ?)",
            (item.shard, item.attempt, item.outcome, item.detail, item.wall),
        )
        return 0

    # ------------------------------------------------------------------ reading

    def transitions(
        self,
        *,
        shard: int | None = None,
        since_wall: float | None = None,
        after_seq: int | None = None,
        limit: int | None = None,
        state_changes_only: bool = False,
    ) -> list[JournalEntry]:
        """Transitions in order, optionally for one shard, after a time or a sequence number."""
        where: list[str] = []
        args: list[Any] = []
        if shard is not None:
            where.append("shard = ?")
            args.append(shard)
        if since_wall is not None:
            where.append("wall >= ?")
            args.append(since_wall)
        if after_seq is not None:
            where.append("seq > ?")
            args.append(after_seq)
        if state_changes_only:
            where.append("from_state != to_state")
        sql = "SELECT seq, shard, from_state, to_state, event, cause, at, wall, record " \
              "FROM transitions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return list(self._entries(sql, args))

    def _entries(self, sql: str, args: list[Any]) -> Iterator[JournalEntry]:
        try:
            for row in self._read.execute(sql, args):
                seq, shard, f, t, event, cause, at, wall, record = row
                yield JournalEntry(seq, shard, f, t, event, cause, at, wall, json.loads(record))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"journal {self.path} cannot be read: {exc}") from exc

    def restarts(self, shard: int | None = None) -> list[dict[str, Any]]:
        sql = "SELECT seq, shard, attempt, outcome, detail, wall FROM restarts"
        args: list[Any] = []
        if shard is not None:
            sql += " WHERE shard = ?"
            args.append(shard)
        cols = ("seq", "shard", "attempt", "outcome", "detail", "wall")
        return [dict(zip(cols, row, strict=True))
                for row in self._read.execute(sql + " ORDER BY seq", args)]

    def verdicts(self, shard: int | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        sql = "SELECT seq, shard, url, verdict, evidence, wall FROM verdicts"
        args: list[Any] = []
        if shard is not None:
            sql += " WHERE shard = ?"
            args.append(shard)
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(limit)
        out = []
        for seq, sh, url, verdict, evidence, wall in self._read.execute(sql, args):
            out.append({"seq": seq, "shard": sh, "url": url, "verdict": verdict,
                        "evidence": json.loads(evidence), "wall": wall})
        return out[::-1]
