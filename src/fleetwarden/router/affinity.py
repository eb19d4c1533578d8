"""Cache-aware placement: which engine likely holds a prompt's prefix, and whether to use it.

Owns: the approximate prefix index per backend, RL-group placement, session hints, the load
guard, and the predicted-hit tallies.
Must not: do I/O, await or read a clock (pure: the shell passes the time in).

The router cannot see the engines' KV caches, so it remembers where it sent each prompt
(docs/design.md 4.3), as sglang-router's ``cache_aware`` policy does, with four differences:

* **Blocks, not a radix tree of characters.** A prompt is cut into fixed-size blocks (token ids
  where the request carries them, ``token_block`` ids each; text otherwise, ``text_block``
  characters each) and each block is keyed by a hash chain over every block before it, as the
  engines' own prefix caches key theirs: a block matches only under the same whole prefix, and
  a lookup is one dictionary probe per block. An entry lives ``ttl_s`` after its last use (near
  an engine's cache lifetime under load) and at most ``max_blocks`` are kept, least recently
  used first out: memory is bounded whatever the traffic.
* **A load guard that fires, at any fleet size.** A backend is used for its cache only while,
  with the request, it holds at most ``balance_abs`` more than the fleet's mean (growing to
  ``balance_rel`` times the mean under load), and at most ``balance_abs`` in all while another
  backend idles (:func:`load_bound`; a conversation at home, by the mean's bound alone).
  sglang-router's guard is a slack over the least loaded engine (64 apart): it never fires in
  a fleet whose concurrency is below it, so a shared system prompt above its match threshold
  put every request on one engine; here the excess spills to the best match among the
  others, which then hold the shared prefix too, and ties go to the least loaded.
* **RL groups.** Siblings (the same whole prompt within ``group_window_s``: a GRPO group's n
  samples) stay on one engine up to ``group_per_engine`` of them, past the load guard, so a
  group is prefilled once per ``group_per_engine`` siblings rather than once per engine it was
  scattered over. A request with ``n`` > 1 counts as ``n`` siblings.
* **Health-coupled.** :meth:`Affinity.sync` is given every push of the serving set with each
  backend's incarnation and weight version: a backend that left the set, restarted (a new
  incarnation) or was refit (a new weight version) loses its entries at once, since its cache
  went with them. Sleep, condemnation and retirement take a backend out of the set.

Session keys (``x-session-id``, OpenAI's ``prompt_cache_key``, ``user`` where configured) are
hints: a session goes back to its last backend when no backend matches its prompt better and
that backend holds some of it. A session whose conversation does not go on at its home (a new
one, or an id reused for another conversation) and whose prompt matches above the threshold
goes to an idle backend if there is one, the deepest match among them, before a busy holder:
what it matches is another session's prefix, prefilled again on the idle engine beside the
burst instead of queued behind it (docs/design.md 4.3).

A prompt that matches nowhere above the threshold and has no session home goes to the least
loaded backend, ties to the one the index takes to hold the fewest blocks (sglang-router's
smallest tree): never by the pool's session hash, whose few sessions land unevenly (as 3, 3, 7
and 11 of 24 on four engines), and an engine whose cache just went (a restart) is refilled
with the prompts nobody holds, while those another engine holds go there.

The predicted hits (blocks the index said the chosen backend held, of the blocks looked up) are
tallied per backend (:meth:`Affinity.predicted`), to be set beside the engines' own counters.

**Precise where the engines say.** Where an engine publishes its KV events (router/kv_index.py,
``precise``) and they are whole (heard from, no gap unfilled), what it holds is read from them
for a prompt of token ids, instead of guessed: an eviction the guess cannot see is seen. The
guess serves every other engine, every prompt of text (the router has no tokenizer: the
events' keys are token ids), and an engine whose events had a gap, until they are whole again.
The guess is still kept for every engine, so that a gap falls back on it at once, and it still
names where a prompt no engine holds any more is prefilled again (where it went last).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetwarden.router.kv_index import KVIndex
from fleetwarden.router.settings import RouterSettings

__all__ = ["Affinity", "AffinitySettings", "Predicted", "Query", "load_bound", "query_of",
           "text_keys", "token_keys", "within_guard"]


_DEFAULTS = RouterSettings()


@dataclass(frozen=True, slots=True)
class AffinitySettings:
    """How the cache-aware policy weighs cache against load: the router's settings of that
    name (router/settings.py holds every default with its reason)."""

    #: Characters of a text block: ~16 tokens of English text, vLLM's block size.
    text_block: int = 64
    #: Token ids of a token block: vLLM's block size.
    token_block: int = 16
    ttl_s: float = _DEFAULTS.cache_ttl_s
    max_blocks: int = _DEFAULTS.cache_max_blocks
    threshold: float = _DEFAULTS.cache_threshold
    balance_abs: int = _DEFAULTS.cache_balance_abs
    balance_rel: float = _DEFAULTS.cache_balance_rel
    group_window_s: float = _DEFAULTS.rl_group_window_s
    group_per_engine: int = _DEFAULTS.rl_group_per_engine

    @classmethod
    def of(cls, settings: RouterSettings) -> AffinitySettings:
        return cls(ttl_s=settings.cache_ttl_s, max_blocks=settings.cache_max_blocks,
                   threshold=settings.cache_threshold, balance_abs=settings.cache_balance_abs,
                   balance_rel=settings.cache_balance_rel,
                   group_window_s=settings.rl_group_window_s,
                   group_per_engine=settings.rl_group_per_engine)


@dataclass(frozen=True, slots=True)
class Query:
    """What the policy reads of one request: its prompt's block keys, its session hint, how
    many completions it asks for, and whether the keys are of token ids (the engines' KV
    events can answer for those; text keys only the guess)."""

    keys: tuple[int, ...]
    session: str | None = None
    n: int = 1
    tokens: bool = False


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones carry the prefix
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def query_of(body: Any, session: str | None, settings: AffinitySettings,
             user_is_session: bool = False) -> Query | None:
    """The :class:`Query` of a parsed request body, or ``None`` if it names no prompt.

    Chat messages are read as ``role`` and text in order (the engine's template adds the same
    text around each, so equal message prefixes are equal token prefixes); a completion's
    ``prompt`` as text, or as token ids when it is a list of integers. The session is the
    header's value, else ``prompt_cache_key``, else ``user`` when ``user_is_session``."""
    if not isinstance(body, dict):
        return None
    if session is None:
        for name in ("prompt_cache_key", *(("user",) if user_is_session else ())):
            value = body.get(name)
            if isinstance(value, str) and value:
                session = f"{name}:{value}"
                break
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    messages = body.get("messages")
    if isinstance(messages, list):
        # Blocks never span two messages: a conversation's next turn appends a message, so
        # every block of the earlier ones, the last partial one included, keys alike again.
        keys: list[int] = []
        for m in messages:
            if isinstance(m, dict):
                text = f"{m.get('role', '')}\x1f{_text_of_content(m.get('content'))}"
                keys.extend(text_keys(text, settings.text_block, keys[-1] if keys else 0))
        return Query(tuple(keys), session, n)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Query(token_keys(prompt, settings.token_block), session, n, tokens=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Query(text_keys(prompt, settings.text_block), session, n)
    return None


def load_bound(loads: Sequence[int], balance_abs: int, balance_rel: float,
               idle_clause: bool = True) -> float:
    """The most requests an engine of a fleet with ``loads`` in flight may hold, the new one
    included, and still be chosen for its cache (docs/design.md 4.3).

    ``balance_abs`` above the fleet's mean (the new request counted) in a quiet fleet, growing
    with load to ``balance_rel`` times the mean: the bounded-load rule of consistent hashing,
    as the pool's session ring keeps. Measured from the mean, not from the least loaded engine,
    because the least of many engines is low by chance alone: a slack over it moves
    conversations, and their whole histories, off engines that merely had a burst.

    While an engine idles, ``balance_abs`` in all: the mean is then no guard, since a few
    engines holding a shared prefix (a system prompt above the match threshold) stay within
    their share of it while an engine that holds nothing takes nothing, however long it idles.
    One request there makes it a holder too, and ties go to the least loaded.

    ``idle_clause=False``: the mean's bound alone, for a conversation at home (its history is
    its own, so no idle engine holds any of it; :meth:`Affinity.choose`).

    The least loaded engine is always within it (its load is at most the mean, and
    ``balance_abs`` >= 1), so the guard never leaves no choice."""
    if not loads or (idle_clause and min(loads) == 0):
        return float(balance_abs)
    mean = (sum(loads) + 1) / len(loads)
    return max(mean + balance_abs, balance_rel * mean)


def within_guard(candidates: Sequence[str], loads: Mapping[str, int], balance_abs: int,
                 balance_rel: float) -> list[str]:
    """The candidates the load guard lets be chosen for their cache: those that, with one more
    request, hold at most :func:`load_bound`. Never none of them."""
    counts = [loads.get(u, 0) for u in candidates]
    bound = load_bound(counts, balance_abs, balance_rel)
    return [u for u, n in zip(candidates, counts, strict=True) if n + 1 <= bound]


def text_keys(text: str, block: int, parent: int = 0) -> tuple[int, ...]:
    """The hash chain of ``text``'s blocks after ``parent``, the last partial one included
    (a prompt's tail still tells two sibling groups apart)."""
    keys = []
    for start in range(0, len(text), block):
        parent = hash((parent, text[start:start + block]))
        keys.append(parent)
    return tuple(keys)


def token_keys(ids: Sequence[int], block: int) -> tuple[int, ...]:
    """The hash chain of ``ids``' blocks of ``block`` token ids, the last partial one included."""
    keys = []
    parent = 0
    for start in range(0, len(ids), block):
        parent = hash((parent, *ids[start:start + block]))
        keys.append(parent)
    return tuple(keys)


@dataclass(slots=True)
class _Group:
    first_seen: float
    placed: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Predicted:
    """One backend's tallies since it was first chosen: requests placed, prompt blocks looked
    up, and the blocks of those the index said it held (a predicted hit)."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hit_blocks / self.blocks if self.blocks else None


class Affinity:
    """The approximate prefix index and the choice it drives."""

    def __init__(self, settings: AffinitySettings | None = None) -> None:
        self.settings = settings if settings is not None else AffinitySettings()
        #: block key -> {backend: when it was last placed there}; least recently used first.
        self._index: OrderedDict[int, dict[str, float]] = OrderedDict()
        #: session -> (its last backend, when, blocks of the prompt it was sent there).
        self._sessions: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        #: What the last push said of each backend: (incarnation, weight version).
        self._epochs: dict[str, tuple[str | None, int | None]] = {}
        self._predicted: dict[str, Predicted] = {}
        #: Index entries per backend, kept as entries come and go (the smallest-index choice
        #: reads it per request; counting the index would cost a pass over it).
        self._held: dict[str, int] = {}
        #: Entries dropped because their backend's cache went (a restart, a refit, leaving).
        self.forgotten = 0
        #: The last :meth:`choose`'s query and its matches, for :meth:`placed` to tally the
        #: same request without looking its prompt up again; dropped by any change to the
        #: index (:meth:`_hold`, :meth:`forget`).
        self._memo: tuple[Query, dict[str, int]] | None = None
        #: The engines' own KV events, where they publish them (router/kv_events.py feeds it);
        #: None: the guess alone.
        self.precise: KVIndex | None = None

    # ------------------------------------------------------------------ health

    def sync(self, serving: Iterable[str],
             epochs: Mapping[str, tuple[str | None, int | None]]) -> list[str]:
        """A push: forget every backend that left ``serving`` or whose (incarnation, weight
        version) changed since the last push; returns those forgotten. A backend whose epoch
        the push leaves unknown keeps its entries while it stays."""
        kept = set(serving)
        gone = [u for u in self._epochs if u not in kept]
        for url in kept:
            epoch = epochs.get(url, (None, None))
            before = self._epochs.get(url)
            if before is not None and before != epoch and epoch != (None, None):
                gone.append(url)
            self._epochs[url] = epoch
        for url in gone:
            if url not in kept:
                del self._epochs[url]
            self.forget(url)
        return gone

    def forget(self, backend: str) -> None:
        """Drop every entry of ``backend``: its prefix cache is gone (or it is)."""
        if self.precise is not None:
            self.precise.forget(backend)
        self._forget_guess(backend)

    def _obey_events(self) -> None:
        """Engines whose own KV events said their cache went since the last request: their
        guessed entries go too (the guess is the fallback where no engine's events hold a
        prompt; it must not send the prompt back for blocks the engine said it lost)."""
        precise = self.precise
        if precise is not None and precise.emptied:
            for backend in precise.emptied:
                self._forget_guess(backend)
            precise.emptied.clear()

    def _forget_guess(self, backend: str) -> None:
        self._memo = None
        emptied = []
        for key, holders in self._index.items():
            if holders.pop(backend, None) is not None:
                self.forgotten += 1
                if not holders:
                    emptied.append(key)
        for key in emptied:
            del self._index[key]
        self._held.pop(backend, None)
        for session in [s for s, (u, _, _) in self._sessions.items() if u == backend]:
            del self._sessions[session]
        for group in self._groups.values():
            group.placed.pop(backend, None)

    # ------------------------------------------------------------------ the choice

    def matched(self, query: Query, now: float) -> dict[str, int]:
        """Leading blocks of ``query`` each backend holds: by its KV events where they are
        whole and the prompt is token ids, else by the guess (fresh entries only)."""
        self._obey_events()
        guessed = self._guessed(query, now)
        precise = self.precise
        if precise is None or not query.tokens:
            return guessed
        held = precise.told(query.keys, now)
        if not held:
            # No engine that tells holds any of it: the guess names where the prefix went
            # last, which is where it is prefilled again, so that each prefix keeps to one
            # engine instead of being copied wherever load sends it (the cache's room is what
            # eviction is short of).
            return guessed
        found = {u: n for u, n in guessed.items() if not precise.synced(u, now)}
        found.update(held)
        return found

    def _guessed(self, query: Query, now: float) -> dict[str, int]:
        """Leading blocks of ``query`` each backend is guessed to hold (fresh entries only)."""
        ttl = self.settings.ttl_s
        index = self._index
        alive: dict[str, int] | None = None
        for depth, key in enumerate(query.keys):
            holders = index.get(key)
            if not holders:
                break
            fresh = {u for u, t in holders.items() if now - t <= ttl}
            if alive is None:
                alive = dict.fromkeys(fresh, 1)
            else:
                still = [u for u in alive if u in fresh and alive[u] == depth]
                if not still:
                    break
                for u in still:
                    alive[u] = depth + 1
        return alive or {}

    def choose(self, query: Query, candidates: Sequence[str], loads: Mapping[str, int],
               now: float) -> str | None:
        """The backend whose cache serves ``query`` best among ``candidates`` within the load
        guard, or ``None``: no cache to speak of, let the pool balance load."""
        if not candidates:
            return None
        s = self.settings
        group = self._groups.get(query.keys[-1]) if query.keys else None
        full: list[str] = []
        if group is not None and now - group.first_seen <= s.group_window_s:
            # An RL group: fill its engine up to the share, whatever the guard says; an engine
            # whose share is taken takes no more of the group while others can.
            for url, count in group.placed.items():
                if url in candidates:
                    if count + query.n <= s.group_per_engine:
                        return url
                    full.append(url)
            if len(full) < len(candidates):
                candidates = [u for u in candidates if u not in full]
        allowed = within_guard(candidates, loads, s.balance_abs, s.balance_rel)
        matched = self.matched(query, now) if query.keys else {}
        self._memo = (query, matched)
        home, depth = self._session_home(query, now)
        # The session's conversation goes on: its home holds every block of the prompt the
        # session last sent there (a next turn re-sends them all, key for key). A home that
        # holds only a prefix other sessions share (a session id reused for a new
        # conversation) is no conversation's home.
        at_home = home is not None and 0 < depth <= matched.get(home, 0)
        if home is not None and at_home and home not in allowed and home in candidates:
            # A conversation at home: bounded by the mean alone. The idle clause is for a
            # shared prefix, which an idle engine can start holding at the cost of one
            # prefill; a conversation moved to it re-prefills its whole history
            # (bench/cache_model.py: every move of a conversation was this clause, its home
            # at 5 of 8 slots, and cost 50-80 ms against 13 at home).
            counts = [loads.get(u, 0) for u in candidates]
            if loads.get(home, 0) + 1 <= load_bound(counts, s.balance_abs, s.balance_rel,
                                                    idle_clause=False):
                allowed = [*allowed, home]
        best = max((matched.get(u, 0) for u in allowed), default=0)
        if query.keys and best / len(query.keys) > s.threshold:
            if query.session is not None and not at_home:
                # A new conversation whose match is a prefix other sessions put there (a
                # shared system prompt): an idle engine first, the deepest match among them.
                # Queued on a busy holder, it waits out the holder's prefills (the cold start
                # of a burst of sessions: the tail of TTFT); on an idle engine the prefix is
                # prefilled beside them, once, as the balance guard has every engine do anyway.
                idle = [u for u in allowed if not loads.get(u, 0)]
                if idle:
                    held = self._held
                    return max(idle, key=lambda u: (matched.get(u, 0), -held.get(u, 0)))
            tied = [u for u in allowed if matched.get(u, 0) == best]
            if home in tied:
                return home
            return min(tied, key=lambda u: loads.get(u, 0))
        # The hint counts where its home holds some of this prompt: one that holds none of it
        # (the session's earlier requests had other prompts) is worth no more than any engine.
        if home is not None and home in allowed and (not query.keys or matched.get(home)):
            return home
        if full:  # the rest of a group: the least loaded engine without its share
            return min(allowed, key=lambda u: loads.get(u, 0))
        if not query.keys:
            return None
        # Nothing worth its cache: the least loaded backend, ties to the one the index takes to
        # hold the fewest blocks (the most room; an engine whose cache just went, first).
        held = self._held
        return min(allowed, key=lambda u: (loads.get(u, 0), held.get(u, 0)))

    def _session_home(self, query: Query, now: float) -> tuple[str | None, int]:
        """The session's last backend while fresh, and the blocks of the prompt it sent there
        (``(None, 0)``: no session, or none known)."""
        if query.session is None:
            return None, 0
        found = self._sessions.get(query.session)
        if found is None or now - found[1] > self.settings.ttl_s:
            return None, 0
        return found[0], found[2]

    def placed(self, query: Query, backend: str, now: float) -> None:
        """``query`` was sent to ``backend``: it will hold the prompt's blocks, and a sibling
        or the session's next turn should find them there."""
        s = self.settings
        tally = self._predicted.get(backend)
        if tally is None:
            tally = self._predicted[backend] = Predicted()
        tally.requests += 1
        if query.keys:
            memo, self._memo = self._memo, None
            # The matches choose() found for this very request, if nothing changed since
            # (the shell places it right after the pick): one lookup a request, not two.
            matched = memo[1] if memo is not None and memo[0] is query else self.matched(
                query, now)
            tally.blocks += len(query.keys)
            tally.hit_blocks += matched.get(backend, 0)
        self._hold(query.keys, backend, now)
        if query.session is not None:
            self._sessions[query.session] = (backend, now, len(query.keys))
            self._sessions.move_to_end(query.session)
            while len(self._sessions) > s.max_blocks:
                self._sessions.popitem(last=False)
        if query.keys:
            last = query.keys[-1]
            group = self._groups.get(last)
            if group is None or now - group.first_seen > s.group_window_s:
                group = self._groups[last] = _Group(now)
                self._groups.move_to_end(last)
            group.placed[backend] = group.placed.get(backend, 0) + query.n
            while self._groups:
                oldest = next(iter(self._groups.values()))
                if now - oldest.first_seen <= s.group_window_s and len(
                        self._groups) <= s.max_blocks:
                    break
                self._groups.popitem(last=False)

    def _hold(self, keys: Sequence[int], backend: str, now: float) -> None:
        """``backend`` holds ``keys`` as of ``now``; the least recently used entries go past
        ``max_blocks``."""
        self._memo = None
        index = self._index
        held = self._held
        for key in keys:
            holders = index.get(key)
            if holders is None:
                holders = index[key] = {}
            else:
                index.move_to_end(key)
            if backend not in holders:
                held[backend] = held.get(backend, 0) + 1
            holders[backend] = now
        while len(index) > self.settings.max_blocks:
            _, gone = index.popitem(last=False)
            for url in gone:
                held[url] -= 1

    def moved(self, query: Query, backend: str, now: float) -> None:
        """A generation continued on ``backend`` (its engine died mid-stream): the new engine
        prefills the same prompt, so it is the holder now."""
        self._hold(query.keys, backend, now)
        if query.session is not None:
            self._sessions[query.session] = (backend, now, len(query.keys))

    # ------------------------------------------------------------------ reading

    def predicted(self) -> dict[str, Predicted]:
        """Per backend: requests placed, blocks looked up, blocks predicted held."""
        return dict(self._predicted)

    def held_blocks(self) -> dict[str, int]:
        """Index entries per backend (fresh or not): what it is predicted to hold."""
        return {url: n for url, n in self._held.items() if n}

    @property
    def size(self) -> int:
        return len(self._index)

