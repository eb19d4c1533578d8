"""What one request does after a failed attempt: re-send it, and how, or give up, and how.

Owns: :class:`Cause` (why an attempt ended without an answer) and the retry rules of one
request (docs/design.md section 4), as a table of cases: :func:`settle` for the failures that
end or move a request without counting against its engine, :class:`Retries` for the re-send
of one that counts.
Must not: do I/O, count, or touch the pool: :mod:`fleetwarden.router.forward` does what the
step says (answers, counts, drops), as the ledger's caller does with a transition.

A failed attempt is first settled (:func:`settle`): a stream read to its end is whole; a
rescue or a moved stream is re-sent at once at no cost; the same 5xx on a second backend is
poison (the request is the problem, not the engines); the router's own exhaustion is
answered 503. Anything else counts against its engine, and then :meth:`Retries.resend`
decides: free if it never reached an engine, else paid within ``max_retries`` and the fleet's
retry budget (a backend the reflex took out is replaced at no cost to the budget), else the
request gives up: a stream under way ends with why, an engine's 5xx goes back as it stands,
anything else gets the router's deliberate answer.
"""

from __future__ import annotations

import enum

from fleetwarden.router.pool import RetryBudget

__all__ = ["AfterFailure", "Cause", "Retries", "settle"]


class Cause(enum.Enum):
    """Why an attempt on a backend ended without an answer. Values are metric labels."""

    REFUSED = "refused"  # nothing listens: the request never reached an engine
    CONNECT_TIMEOUT = "connect_timeout"  # no connection: the request never reached an engine
    RESET = "reset"  # the connection broke: an engine may have worked on it
    TIMEOUT = "timeout"  # backend_timeout_s passed: an engine may have worked on it
    SERVER_ERROR = "server_error"  # a 5xx before any byte reached the client
    RESCUED = "rescued"  # the controller condemned the backend while the request waited there
    #: It held the request, taking no step, while another engine answered it (a hedge), or a
    #: stream was moved off it for that (``WaitingRequests.hedge``): a lost race, not a failure
    #: of its engine (out of this router's list until the next push), unless the hedge said no
    #: step is in progress there (``lost_race_fails``: a lost core).
    HEDGED = "hedged"
    STREAM_ERROR = "stream_error"  # the engine ended a stream with a server error event
    #: A 200 whose generation the engine itself aborted (vLLM's ``finish_reason`` "abort"):
    #: what a vLLM that is shut down (SIGTERM) answers for what it held, cut short. The client
    #: asked for a completion, not for the engine's shutdown: re-sent like a 5xx.
    ABORTED = "aborted"
    #: The router itself ran out of descriptors or buffers (EMFILE, ENFILE, ENOBUFS): never
    #: evidence against an engine, and answered 503 at once (another engine would fare no
    #: better from this process).
    LOCAL_EXHAUSTION = "local_exhaustion"

    @property
    def never_reached_an_engine(self) -> bool:
        return self is Cause.REFUSED or self is Cause.CONNECT_TIMEOUT


class AfterFailure(enum.Enum):
    """What comes after a failed attempt. The values of the re-sends are the labels of the
    router's retry counter (``AT_ONCE`` is not counted: the controller's call, not a retry)."""

    #: A stream whose final chunk was read: whole whatever became of its end, a success.
    WHOLE = "whole"
    #: Rescued (the controller's call), or a stream moved off an engine holding it: re-sent
    #: at once, and no budget spent.
    AT_ONCE = "at_once"
    #: The same 5xx on a second backend: the request is the problem; passed through, and
    #: neither engine blamed.
    POISON = "poison"
    #: The router's own trouble: answered 503, no engine blamed, none tried next.
    EXHAUSTED = "exhausted"
    FREE = "free"  # it never reached an engine: re-sent, costing no engine any work
    #: Its backend is out of the serving set (the reflex): re-sending moves its load to the
    #: others rather than adding to the fleet's, so it spends no budget.
    REPLACED = "replaced"
    PAID = "paid"  # an engine may have worked on it: re-sent with a budget token
    END_STREAM = "end_stream"  # retries spent on a stream under way: it ends with why
    PASS_THROUGH = "pass_through"  # retries spent: the engine's own 5xx, as it stands
    REFUSE = "refuse"  # retries spent, no engine's answer to give: the router's own

    @property
    def resends(self) -> bool:
        return self in _RESENDS


_RESENDS = frozenset({AfterFailure.AT_ONCE, AfterFailure.FREE, AfterFailure.REPLACED,
                      AfterFailure.PAID})


def settle(cause: Cause, *, streamed: bool, began: bool, finished: bool,
           same_5xx_again: bool) -> AfterFailure | None:
    """The step of a failed attempt that ends or moves its request without counting against
    its engine, or None: the failure counts (then :meth:`Retries.resend`).

    ``streamed``: a stream the router continues; ``began``: it reached its client (from then
    on continued, never restarted); ``finished``: its final chunk was read;
    ``same_5xx_again``: this 5xx completes the same status from every engine the request may
    try (:func:`~fleetwarden.router.pool.poison_quorum`): the request is poison."""
    if began and finished:
        return AfterFailure.WHOLE
    if cause is Cause.RESCUED or (cause is Cause.HEDGED and streamed):
        return AfterFailure.AT_ONCE
    if cause is Cause.SERVER_ERROR and same_5xx_again and not began:
        return AfterFailure.POISON
    if cause is Cause.LOCAL_EXHAUSTION:
        return AfterFailure.EXHAUSTED
    return None


class Retries:
    """One request's paid retries: how many were spent, and whether it holds the fleet's
    retry-budget token (taken at its first paid retry, held until :meth:`release`)."""

    __slots__ = ("budget", "holds_token", "max_retries", "paid")

    def __init__(self, budget: RetryBudget, max_retries: int) -> None:
        self.budget = budget
        self.max_retries = max_retries
        self.paid = 0
        self.holds_token = False

    def resend(self, cause: Cause, *, began: bool, replaced: bool) -> AfterFailure:
        """After a failure that counted against its engine: how it is re-sent, or how the
        request gives up. ``replaced``: its backend is out of the serving set now."""
        if cause.never_reached_an_engine:
            return AfterFailure.FREE
        if self.paid < self.max_retries and (
                replaced or self.holds_token or self.budget.try_acquire()):
            if not replaced:
                self.holds_token = True  # held until this request is answered
            self.paid += 1
            return AfterFailure.REPLACED if replaced else AfterFailure.PAID
        if began:
            return AfterFailure.END_STREAM
        if cause is Cause.SERVER_ERROR or cause is Cause.ABORTED:
            return AfterFailure.PASS_THROUGH
        return AfterFailure.REFUSE

    def release(self) -> None:
        """The request is answered: its token, if it took one, goes back to the fleet."""
        if self.holds_token:
            self.holds_token = False  # given back: a second release must not free another
            self.budget.release()
