"""Tests for `kmp.core.loss_scale.lagged`: a loop's persistent-skips
check, a step late, keeping only the steps that may reach the limit.

Each test counts steps as a loop's check does (`check_persistent_skips`):
a step's numbers are kept where `LaggedChecks.needed` says so, and the
steps `due` are reported. The reports must be those of keeping every step
(what the check did before it knew which steps cannot reach the limit):
the same steps, at the same calls, with the same numbers.
"""

import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kmp.core.loss_scale import lagged

pytestmark = pytest.mark.anybackend


def in_a_row_of(skipped):
    """The skips in a row after each step of a pattern (True: skipped)."""
    counts, run = [], 0
    for skip in skipped:
        run = run + 1 if skip else 0
        counts.append(run)
    return counts


def reports(counts, limit, keep_all=False):
    """`(call, step, in_a_row)` of every report a loop's check makes, one
    call per step (as `check_persistent_skips`), and the steps it kept."""
    checks = lagged.LaggedChecks()
    made, kept = [], 0
    for call, in_a_row in enumerate(counts):
        if keep_all or checks.needed(limit):
            # The scale carries the step, to tell which step is reported.
            checks.add(np.int32(in_a_row), np.float32(call))
            kept += 1
        else:
            checks.skip()
        for numbers in checks.due():
            if numbers[0] >= limit:
                made.append((call, int(numbers[1]), numbers[0]))
    for numbers in checks.flush():  # check_persistent_skips_now
        if numbers[0] >= limit:
            made.append((len(counts), int(numbers[1]), numbers[0]))
    return made, kept


@settings(max_examples=60, deadline=None)
@given(
    skipped=st.lists(st.booleans(), min_size=1, max_size=60),
    limit=st.integers(1, 8),
)
def test_the_reports_are_those_of_keeping_every_step(skipped, limit):
    counts = in_a_row_of(skipped)
    made, _ = reports(counts, limit)
    assert made == reports(counts, limit, keep_all=True)[0]
    # Each step that reached the limit, a step later.
    assert made == [
        (step + 1, step, n) for step, n in enumerate(counts) if n >= limit
    ]


def test_a_run_to_the_limit_after_many_steps_not_kept_is_reported():
    counts = in_a_row_of([False] * 50 + [True] * 5 + [False])
    made, kept = reports(counts, limit=5)
    assert made == [(55, 54, 5)]
    # Two steps in about five (the limit) while none is skipped.
    assert kept < len(counts) / 2


def test_without_skips_about_two_steps_a_limit_are_kept():
    # The default limit, 1000: 3 of the first 2,000 steps (the first two,
    # before a step was read, and one where the count could have grown to
    # the limit since), rather than 2,000.
    made, kept = reports([0] * 2000, limit=1000)
    assert made == []
    assert kept <= 4


def test_after_a_flush_the_next_step_is_kept():
    # A loop's end (check_persistent_skips_now): the next values may be
    # another run's.
    checks = lagged.LaggedChecks()
    for _ in range(3):
        if checks.needed(1000):
            checks.add(np.int32(0), np.float32(1))
        else:
            checks.skip()
        list(checks.due())
    assert not checks.needed(1000)
    list(checks.flush())
    assert checks.needed(1000)
    checks.skip()
    checks.clear()
    assert checks.needed(1000)


@settings(max_examples=60, deadline=None)
@given(
    skipped=st.lists(st.booleans(), min_size=1, max_size=60),
    limit=st.integers(1, 8),
    steps=st.integers(2, 4),
)
# Counted as one step a call, the call that reaches the limit is dropped.
@example(skipped=[False] * 10 + [True] * 4 + [False] * 4, limit=4, steps=2)
def test_calls_of_several_steps_report_as_keeping_every_call(
    skipped, limit, steps
):
    # fit with steps_per_execution: a call's numbers are those after its
    # last step, and the count may have grown by `steps` since the call
    # before. Counting each call as one step would keep too few.
    counts = in_a_row_of(skipped)[steps - 1 :: steps]

    def calls(keep_all):
        checks = lagged.LaggedChecks()
        made = []
        for call, in_a_row in enumerate(counts):
            if keep_all or checks.needed(limit, steps):
                checks.add(np.int32(in_a_row), np.float32(call), steps)
            else:
                checks.skip(steps)
            for numbers in checks.due():
                if numbers[0] >= limit:
                    made.append((call, int(numbers[1]), numbers[0]))
        return made

    assert calls(keep_all=False) == calls(keep_all=True)
