"""What the router learns of each engine's limits: its context length and its server caps.

Owns: :class:`LimitsLearner`: the caps a push says (read from the commands that started the
engines) and the defaults of a chat that names no limit; all that was learnt of a backend,
forgotten when it leaves or when a push names another process there (its incarnation);
and an engine's context length, read from its ``/v1/models`` in the background once a chat
sent without a limit begins there (its continuation keeps the context of the engine that
began it). The limits themselves are :class:`~fleetwarden.router.splice.EngineLimits`.
Must not: decide what a continuation asks: :mod:`fleetwarden.router.splice` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fleetwarden.router.background import TaskPerBackend
from fleetwarden.router.exchange import with_key
from fleetwarden.router.models import ModelCard
from fleetwarden.router.pool import Pool
from fleetwarden.router.relay import read_all
from fleetwarden.router.splice import CompletionDefault, EngineLimits
from fleetwarden.router.upstream import Address, UpstreamClient, UpstreamError

__all__ = ["LimitsLearner"]


class LimitsLearner:
    """Keeps one router's :class:`~fleetwarden.router.splice.EngineLimits` up to date."""

    def __init__(self, pool: Pool, limits: EngineLimits) -> None:
        self.pool = pool
        self.limits = limits
        #: The reads of ``/v1/models`` under way, by backend (:meth:`learn_context`).
        self._learning = TaskPerBackend("context")
        self._client: UpstreamClient | None = None
        self._target: Callable[[str], Address] = Address.parse
        #: What the last push said of each serving backend: its process (``None``: not
        #: named) and its models, which the next process's limits are told apart from.
        self._pushed: dict[str, tuple[str | None, tuple[ModelCard, ...] | None]] = {}
        #: The model list of the process a backend's new one replaced: a push that still
        #: carries it (the watchdog reads a new process's list after the push that names it)
        #: does not tell the new one's context length (:meth:`learn_context`).
        self._replaced_models: dict[str, tuple[ModelCard, ...]] = {}
        #: The caps the last push said of each serving backend (on every request, on a chat
        #: that names no limit): the controller's word, which its next push replaces.
        self._said: dict[str, tuple[int | None, int | None]] = {}

    def open(self, client: UpstreamClient, target: Callable[[str], Address]) -> None:
        """The router opened: the reads go through ``client``, to ``target(url)``."""
        self._client, self._target = client, target

    def close(self) -> None:
        self._learning.cancel_all()
        self._client = None

    def forget(self) -> None:
        """A push came: forget the limits of backends that left (one that comes back may have
        been started otherwise), and take the server caps it says (read from the commands
        that started the engines: before any ``"length"`` finish could reveal them), and the
        defaults of a chat that names no limit (its model's generation config, where the
        controller could read it) as the cap of such chats, and what each engine gives a
        completion that names no limit (its kind's rule). Where it says the cap is unknown
        (``output_cap_unknown``), a continuation begun there or sent there goes on only as far
        as what requests there produced proves
        (:class:`~fleetwarden.router.continuation.UnknownCap`, docs/design.md 4.1, "Server caps",
        rule 5).

        A backend whose push names another process than the last one did (a restart on the
        same URL: an attached engine, an operator's restart with other flags) is forgotten
        whole before the push's own facts are taken: a floor the old process proved is no
        proof of the new one's cap, nor is a cap a finish revealed there, nor its context
        length (read again: :meth:`learn_context`).

        Of the same process, a cap a push said is replaced by what the next push says, even
        unknown or none: the controller's word changes only for a reason (a declaration
        changed or removed in its config; a controller started afresh that has not read the
        engine yet), and a cap it no longer vouches for is a guess, which may be bigger than
        the engine's (a continuation would ask past it) or smaller (it would stop short of
        what the engine gives). A cap a finish revealed there is that process's own proof, and
        is kept until the process changes, the least of it and a pushed cap holding (one equal
        to the pushed cap goes with it: learnt again at the next such finish; meanwhile the
        floor holds what requests proved)."""
        serving = set(self.pool.serving)
        self.limits.forget(serving)
        for url in [u for u in self._pushed if u not in serving]:
            del self._pushed[url]
            self._replaced_models.pop(url, None)
            self._said.pop(url, None)
        for url in self.pool.serving:
            facts = self.pool.facts(url)
            self._new_process(url, facts.incarnation, facts.models)
            said = self._said.get(url, (None, None))
            self._said[url] = (facts.output_cap, facts.output_default)
            for before, now, why, known, unknown in (
                    (said[0], facts.output_cap, facts.output_cap_unknown, self.limits.cap,
                     self.limits.unknown),
                    (said[1], facts.output_default, facts.output_default_unknown,
                     self.limits.default_cap, self.limits.default_unknown)):
                if before is not None and known.get(url) == before:
                    del known[url]  # the last push's word, which this one replaces
                if now is not None:  # below a cap a finish revealed here: the least holds
                    known[url] = min(now, known.get(url, now))
                if why is None:
                    unknown.pop(url, None)
                elif url not in known:  # not revealed by a finish yet
                    unknown[url] = why
            rule = facts.completion_default
            if rule is None and facts.upstream_fields is not None:  # an older controller's
                rule = (CompletionDefault.FIXED if facts.upstream_fields
                        else CompletionDefault.UNKNOWN)
            if rule is None:
                self.limits.completion.pop(url, None)
            else:
                self.limits.completion[url] = rule

    def _new_process(self, url: str, incarnation: str | None,
                     models: tuple[ModelCard, ...] | None) -> None:
        """Forget ``url`` whole if the push names another process there than the last did.

        ``None`` is compared as a name too: a change from or to it is a new process, and
        ``None`` twice is the same. The ledger changes a shard's incarnation only for a new
        process (a restart it saw is named even where the engine gives no start time,
        ``restart-seen-N``; a process whose name is not known yet is a new one, launched or
        found at fleetwarden's start; the first name of a process already known is given
        before the routers start), so a name that comes or goes is a process that came; and
        were it not one, forgetting costs only what requests there proved, learnt again,
        where keeping a restarted engine's old floors would let a continuation ask past its
        cap. ``None`` twice: the ledger saw no restart there, or the pusher names no
        processes (an older controller): nothing tells a new process, as before."""
        # Not pushed before (new to the set, or the first push): what was learnt of it before
        # came from a process nobody named.
        before = self._pushed.get(url, (None, None))
        self._pushed[url] = (incarnation, models)
        if before[0] == incarnation:
            if models != self._replaced_models.get(url):
                self._replaced_models.pop(url, None)  # the new process's list came
            return
        self.limits.forget_backend(url)
        self._learning.cancel(url)  # its answer may be the old process's
        if before[1] is not None:
            self._replaced_models[url] = before[1]
        else:
            self._replaced_models.pop(url, None)

    def learn_context(self, backend: str) -> None:
        """Read ``backend``'s context length (``max_model_len`` in ``/v1/models``) in the
        background, once a chat sent without a limit begins there: its continuation keeps the
        context of the engine that began it, and a read on the continuation's own path would
        sit outside every rescue and hedge. Unknown when a cut comes: refused."""
        if backend in self.limits.context or backend in self._learning:
            return
        pushed = self.pool.facts(backend).models
        if (pushed and pushed[0].max_model_len is not None
                and pushed != self._replaced_models.get(backend)):
            # The watchdog read it already and the push said it: nothing to ask.
            self.limits.context[backend] = pushed[0].max_model_len
            return
        self._learning.start(backend, self._read_context(backend))

    async def _read_context(self, backend: str) -> None:
        """``backend``'s context length, where its ``/v1/models`` says it (unknown otherwise:
        the next chat that begins there asks again)."""
        assert self._client is not None, "LimitsLearner.open() was not called"
        try:
            answer = await self._client.request(self._target(backend + "/v1/models"), "GET",
                                                with_key([], self.pool.facts(backend).key),
                                                b"")
            value = json.loads(await read_all(answer))["data"][0]["max_model_len"]
        except (UpstreamError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return
        if (isinstance(value, int) and not isinstance(value, bool) and value > 0
                and backend in self.pool.serving):
            self.limits.context[backend] = value
