"""The retry rules of one request (router/retry.py), as tables: what each failed attempt
leads to, with no socket and no clock (docs/design.md section 4)."""

from __future__ import annotations

import pytest

from fleetwarden.router.pool import RetryBudget
from fleetwarden.router.retry import AfterFailure, Cause, Retries, settle
from fleetwarden.router.stats import RouterStats

C = Cause
A = AfterFailure

#: (cause, streamed, began, finished, same_5xx_again) -> the step, or None: it counts.
SETTLED = [
    # a stream read to its end is whole, whatever ended the attempt
    (C.RESET, True, True, True, False, A.WHOLE),
    (C.RESCUED, True, True, True, False, A.WHOLE),
    # the controller's rescue: re-sent at once, requests and streams alike
    (C.RESCUED, False, False, False, False, A.AT_ONCE),
    (C.RESCUED, True, True, False, False, A.AT_ONCE),
    # a stream moved off an engine holding it: at once; a request's lost race counts
    (C.HEDGED, True, False, False, False, A.AT_ONCE),
    (C.HEDGED, False, False, False, False, None),
    # the same 5xx twice before anything reached the client: poison
    (C.SERVER_ERROR, False, False, False, True, A.POISON),
    (C.SERVER_ERROR, True, True, False, True, None),  # a stream under way is continued
    (C.SERVER_ERROR, False, False, False, False, None),
    (C.RESET, False, False, False, True, None),  # only a 5xx is poison
    # the router's own exhaustion: never an engine's failure
    (C.LOCAL_EXHAUSTION, False, False, False, False, A.EXHAUSTED),
    (C.LOCAL_EXHAUSTION, True, True, False, False, A.EXHAUSTED),
    # the rest count against their engine
    (C.REFUSED, False, False, False, False, None),
    (C.TIMEOUT, True, True, False, False, None),
    (C.STREAM_ERROR, True, True, False, False, None),
    (C.ABORTED, False, False, False, False, None),
]


@pytest.mark.parametrize(("cause", "streamed", "began", "finished", "same", "step"), SETTLED)
def test_a_failed_attempt_is_settled_by_the_table(cause: Cause, streamed: bool, began: bool,
                                                  finished: bool, same: bool,
                                                  step: AfterFailure | None) -> None:
    assert settle(cause, streamed=streamed, began=began, finished=finished,
                  same_5xx_again=same) is step


#: (cause, began, replaced, paid so far, max_retries, budget tokens free) -> the step.
RESENT = [
    (C.REFUSED, False, False, 2, 2, 0, A.FREE),  # free even with retries and budget spent
    (C.CONNECT_TIMEOUT, True, False, 2, 2, 0, A.FREE),
    (C.RESET, False, False, 0, 2, 1, A.PAID),
    (C.RESET, False, True, 0, 2, 0, A.REPLACED),  # the reflex took it out: no budget
    (C.RESET, False, False, 2, 2, 1, A.REFUSE),  # max_retries spent
    (C.RESET, False, False, 0, 2, 0, A.REFUSE),  # the fleet's budget spent
    (C.TIMEOUT, True, False, 2, 2, 1, A.END_STREAM),
    (C.SERVER_ERROR, False, False, 2, 2, 1, A.PASS_THROUGH),
    (C.ABORTED, False, True, 1, 1, 1, A.PASS_THROUGH),
    (C.SERVER_ERROR, True, False, 0, 0, 1, A.END_STREAM),  # under way: ends with why
    (C.STREAM_ERROR, True, False, 0, 1, 1, A.PAID),
]


@pytest.mark.parametrize(("cause", "began", "replaced", "paid", "most", "free", "step"), RESENT)
def test_a_failure_that_counts_is_resent_or_given_up_by_the_table(
        cause: Cause, began: bool, replaced: bool, paid: int, most: int, free: int,
        step: AfterFailure) -> None:
    budget = RetryBudget(0.0, free)
    retries = Retries(budget, most)
    retries.paid = paid
    assert retries.resend(cause, began=began, replaced=replaced) is step
    assert step.resends is (step in (A.FREE, A.PAID, A.REPLACED))
    assert budget.retries_in_flight == (1 if step is A.PAID else 0)


def test_a_request_takes_one_budget_token_and_gives_it_back_once() -> None:
    budget = RetryBudget(0.0, 1)
    retries = Retries(budget, 3)
    assert retries.resend(C.RESET, began=False, replaced=False) is A.PAID
    assert retries.resend(C.RESET, began=False, replaced=False) is A.PAID  # the same token
    assert budget.retries_in_flight == 1
    other = Retries(budget, 3)
    assert other.resend(C.RESET, began=False, replaced=False) is A.REFUSE  # none left
    retries.release()
    retries.release()  # twice: one token back, not two
    assert budget.retries_in_flight == 0
    assert other.resend(C.RESET, began=False, replaced=False) is A.PAID


def test_paid_retries_stop_at_max_retries() -> None:
    retries = Retries(RetryBudget(0.0, 10), 2)
    steps = [retries.resend(C.TIMEOUT, began=False, replaced=False) for _ in range(3)]
    assert steps == [A.PAID, A.PAID, A.REFUSE]


def test_the_retry_counter_labels_are_the_resends_values() -> None:
    # router/stats.py counts re-sends by these labels: a rename would lose the series.
    assert {s.value for s in AfterFailure if s.resends and s is not A.AT_ONCE} == set(
        RouterStats().retries)
