"""The admin side's event bus: the recent state changes and the dashboard's listeners.

Owns: the in-memory buffer of recent transitions (numbered, for ``/admin/transitions`` and
the page's last hour), and the queues of the open event streams (``/admin/events``).

Must not: decide anything, or reach into the ledger. ``fleet.py`` wires the ledger's
transition stream to :meth:`EventBus.transition` and tells the bus about ticks and refits.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetwarden.ledger import Transition

__all__ = ["LISTENER_QUEUE", "RECENT_CHANGES", "EventBus"]

#: State changes kept in memory for the admin API and the dashboard's last hour.
RECENT_CHANGES = 5000
#: Events a listener (a dashboard's event stream) may fall behind by before it starts over.
LISTENER_QUEUE = 1000


class EventBus:
    """Recent transitions, and the listeners that hear every event as it happens."""

    def __init__(self) -> None:
        self.recent: list[dict[str, Any]] = []
        self.listeners: set[asyncio.Queue[dict[str, Any]]] = set()
        self._seq = 0

    @property
    def seq(self) -> int:
        """The sequence number of the last state change (``recent[-1]["seq"]``)."""
        return self._seq

    def transition(self, t: Transition) -> None:
        """Remember a state change and tell the listeners (a ledger subscriber)."""
        if not t.changes_state:
            return
        self._seq += 1
        entry = {"seq": self._seq, "wall": t.at, **t.to_dict()}
        self.recent.append(entry)
        if len(self.recent) > RECENT_CHANGES:
            del self.recent[: len(self.recent) - RECENT_CHANGES]
        self.publish({"type": "transition", "data": entry})

    def since(self, since: int, limit: int, shard: int | None) -> list[dict[str, Any]]:
        """State changes after sequence number ``since``, of one shard or of all."""
        picked = [e for e in self.recent
                  if e["seq"] > since and (shard is None or e["shard"] == shard)]
        return picked[:limit]

    def publish(self, event: dict[str, Any]) -> None:
        """Hand ``event`` (``{"type": ..., "data": ...}``) to every listener. A listener that
        fell :data:`LISTENER_QUEUE` events behind has lost some: its queue is emptied and
        told to start over (``resync``); a ``bye`` always gets through."""
        for q in list(self.listeners):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                while not q.empty():
                    q.get_nowait()
                q.put_nowait({"type": "resync"})
                if event["type"] == "bye":
                    q.put_nowait(event)

    def listen(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=LISTENER_QUEUE)
        self.listeners.add(q)
        return q

    def unlisten(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self.listeners.discard(q)
