"""The note-001 story, played through the real ledger.

Owns: note 001's story as a sequence of ledger operations.
Must not: do I/O or read a clock (pure).

Note 001 (``shared/seeds/001_*``): a shard fails two requests, a refit aborts, it is condemned
as the silent participant, the supervisor restarts it, the next refit lands. Before the fix the
new engine came back SUSPECT holding the dead engine's failure streak, one request from being
killed again. Here it comes back HEALTHY with streak 0, and one failed request makes it SUSPECT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleetwarden.ledger import Ledger, Outcome, ShardRecord, Transition


@dataclass(frozen=True)
class Scene:
    """One scene of the story: what happened, and shard 1's record afterwards."""

    title: str
    record: ShardRecord
    transitions: list[Transition]


def play_note_001(on_transition: Callable[[Transition], None] | None = None) -> list[Scene]:
    """Play the story on 4 shards with the default policy; return shard 1 after each step."""
    clock = iter(range(10_000))
    ledger = Ledger([f"http://127.0.0.1:{8100 + i}" for i in range(4)], clock=lambda: next(clock))
    seen: list[Transition] = []
    ledger.subscribe(seen.append)
    if on_transition is not None:
        ledger.subscribe(on_transition)
    scenes: list[Scene] = []

    def step(title: str, *calls: Callable[[], Outcome]) -> None:
        start = len(seen)
        for call in calls:
            call()
        scenes.append(Scene(title, ledger.shard(1), seen[start:]))

    step("shard 1 fails 2 requests",
         lambda: ledger.report_failure(1, "request timed out"),
         lambda: ledger.report_failure(1, "request timed out"))
    step("a refit aborts", *[
        (lambda i=i: ledger.mark_weights_partial(i)) for i in ledger.refit_participants()
    ])
    suspects = ledger.suspected_shards()
    step("it is condemned as the silent participant",
         lambda: ledger.condemn_silent_participant(suspects[0], "refit to version 1 aborted"))
    step("the supervisor restarts it",
         lambda: ledger.mark_restarting(1),
         lambda: ledger.mark_loaded(1, "http://127.0.0.1:8201", "launch-2"))
    step("the next refit lands", *[
        (lambda i=i: ledger.report_refit(i, 1)) for i in ledger.refit_participants()
    ])
    step("one failed request", lambda: ledger.report_failure(1, "request timed out"))
    return scenes
