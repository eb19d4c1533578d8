"""The keeper: one small process per Ray engine that owns the engine's process group.

Owns: one Ray engine's process group, from inside its actor: start, watch, stop.
Must not: talk to the fleet: it answers the Ray launcher only.

A Ray actor cannot promise to stop its engine by itself: ``ray.kill`` and a lost raylet end the
actor's worker process at once, no Python cleanup runs in it, and Ray then SIGKILLs the
worker's direct children. An engine started by the actor directly would be killed alone — and
a vLLM API server killed alone orphans its EngineCore and Worker, which hold a GPU for good. So
the actor starts this keeper, which

- detaches (forks; the first process exits, the second calls ``setsid``): it is nobody's child
  that Ray kills, and no signal to the worker's process group reaches it;
- starts the engine in a process group of its own, its output in the incarnation's log file;
- tells the actor, in JSON lines on stdout, the engine's PID and start time, and later how the
  engine ended and whether anything of its group was left;
- stops the whole group (SIGTERM and SIGCONT, SIGKILL after the grace period, then verified in
  ``/proc``) when the actor asks (``stop`` on stdin), when the actor is gone however it went
  (stdin closes: nobody holds the other end any more), or on SIGTERM; when the engine exits on
  its own, whatever it left in its group is stopped the same way.

It exits when that is done. Standard library and ``launchers.procs`` only: it runs on every
node, next to the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from fleetwarden.launchers.procs import process_start_ticks, process_start_time, terminate_group

__all__ = ["main"]

#: What ends the keeper's wait: the engine exited, the actor asked, the actor is gone, SIGTERM.
EXITED, STOP, OWNER_GONE, SIGNALLED = "exited", "stop", "owner gone", "signalled"


def _say(event: dict[str, Any]) -> None:
    """One JSON line to the actor; nobody listening (the actor is gone) is no error."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetwarden.launchers.keeper")
    parser.add_argument("--grace", type=float, required=True,
                        help="seconds between SIGTERM to the group and SIGKILL")
    parser.add_argument("--kill-wait", type=float, required=True,
                        help="seconds to wait for the group to go after SIGKILL")
    parser.add_argument("--log", type=Path, required=True, help="the engine's log file")
    parser.add_argument("--no-detach", action="store_true",
                        help="stay the caller's child (tests that watch the keeper itself)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no engine command after --")

    if not args.no_detach:
        if os.fork() > 0:
            os._exit(0)  # the caller waits for this exit; the keeper lives on in the child
        os.setsid()

    # A SimpleQueue: the SIGTERM handler runs in the main thread between two bytecodes, maybe
    # while that thread holds the lock of the queue it waits on, and a Queue's lock is not
    # reentrant (the handler would wait on itself for ever); SimpleQueue.put takes none.
    events: queue.SimpleQueue[tuple[str, int | None]] = queue.SimpleQueue()
    signal.signal(signal.SIGTERM, lambda *_: events.put((SIGNALLED, None)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is not for us

    with open(args.log, "ab") as log:
        log.write(f"# fleetwarden keeper {os.getpid()}: {' '.join(command)}\n".encode())
        log.flush()
        try:
            engine = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            _say({"event": "failed", "error": f"cannot start {command[0]!r}: {exc}"})
            return 1
    _say({"event": "started", "pid": engine.pid, "start_ticks": process_start_ticks(engine.pid),
          "start_time": process_start_time(engine.pid), "keeper_pid": os.getpid()})

    def watch_engine() -> None:
        events.put((EXITED, engine.wait()))

    def watch_owner() -> None:
        for line in sys.stdin:
            if line.strip() == STOP:
                events.put((STOP, None))
                return
        events.put((OWNER_GONE, None))  # EOF: the actor's end of the pipe is closed

    threading.Thread(target=watch_engine, daemon=True).start()
    threading.Thread(target=watch_owner, daemon=True).start()

    why, code = events.get()
    # Also after an exit of its own: a vLLM API server that died leaves its EngineCore behind.
    stopped = terminate_group(engine.pid, args.grace, args.kill_wait)
    if code is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = engine.wait(args.kill_wait)
    _say({"event": "ended", "why": why, "code": code, "killed": stopped.killed,
          "seconds": round(stopped.seconds, 3), "left": [p.pid for p in stopped.left]})
    return 0 if stopped.clean else 1


if __name__ == "__main__":
    sys.exit(main())
