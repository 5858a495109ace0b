"""Tests for kmp.tools.bench.timing, on a fake clock: what is timed, in
what order."""

import gc

import pytest

from kmp.tools.bench import timing


class _Clock:
    """Replaces time.perf_counter: each step advances it by its cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Subject:
    def __init__(self, label, clock, costs, log):
        self.label = label
        self._clock = clock
        self._costs = iter(costs)
        self._log = log
        self.calls = 0

    def step(self):
        self.calls += 1
        self._log.append((self.label, gc.isenabled()))
        self._clock.now += next(self._costs)
        return self.calls


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def _constant(cost):
    while True:
        yield cost


def test_measure_rotates_the_order_and_times_only_the_timed_steps(clock):
    log = []
    a = _Subject("a", clock, _constant(1.0), log)
    b = _Subject("b", clock, _constant(2.0), log)
    observed = []
    timings = timing.measure(
        [a, b],
        rounds=3,
        steps=2,
        warmup_min=1,
        warmup_max=1,
        observe=lambda s, value, seconds, timed: observed.append(
            (s.label, value, timed)
        ),
    )
    # Warm-up: the first call and one more step each; then per round one
    # untimed step and two timed ones, b first in the second round.
    labels = [label for label, _ in log]
    assert labels == ["a"] * 2 + ["b"] * 2 + (["a"] * 3 + ["b"] * 3) + (
        ["b"] * 3 + ["a"] * 3
    ) + (["a"] * 3 + ["b"] * 3)
    assert timings["a"].times == [1.0] * 6
    assert timings["b"].times == [2.0] * 6
    assert timings["a"].round_medians == [1.0] * 3
    assert timings["a"].warmup_steps == 1
    assert timings["a"].trace_seconds == 1.0
    assert [t for _, _, t in observed].count(True) == 12
    assert observed[0] == ("a", 1, False)
    assert timing.ratio(timings["b"], timings["a"]).median == 2.0


def test_timed_steps_run_with_the_garbage_collector_off(clock):
    log = []
    subject = _Subject("a", clock, _constant(1.0), log)
    timing.measure([subject], rounds=1, steps=2, warmup_min=1, warmup_max=1)
    # First call, warm-up step, the untimed switch step: collector on.
    assert [enabled for _, enabled in log] == [True, True, True, False, False]
    assert gc.isenabled()


def test_steps_per_round_can_differ(clock):
    subject = _Subject("a", clock, _constant(1.0), [])
    timings = timing.measure(
        [subject],
        rounds=2,
        steps=timing.chunks(5, 2),
        warmup_min=1,
        warmup_max=1,
        switch_steps=0,
    )
    assert len(timings["a"].times) == 5 and subject.calls == 2 + 5
    with pytest.raises(ValueError, match="one count per round"):
        timing.measure(
            [subject], rounds=3, steps=[1, 2], warmup_min=1, warmup_max=1
        )


def test_warm_up_stops_once_the_step_time_settles(clock):
    # Slow right after tracing, then steady: stops after two equal windows.
    costs = [10.0] + [5.0] * 3 + [1.0] * 100
    subject = _Subject("a", clock, costs, [])
    trace, count, last = timing.warm_up(subject.step, 2, 50, window=3)
    assert trace == 10.0
    assert last == 1.0
    # 5 5 5 1 1 1 1 1: the last window and the one before are both 1.
    assert count == 8


def test_warm_up_stops_at_the_maximum(clock):
    subject = _Subject("a", clock, [2.0**i for i in range(40)], [])
    _, count, _ = timing.warm_up(subject.step, 1, 7, window=2)
    assert count == 7


def test_quantiles_and_median():
    measured = timing.Timing("a", times=[4.0, 1.0, 3.0, 2.0, 5.0])
    assert measured.median == 3.0
    assert measured.quantiles() == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert timing.Timing("b", times=[2.0]).quantiles() == (2.0,) * 5


def test_ratio_is_taken_round_by_round():
    a = timing.Timing("a", round_medians=[2.0, 4.0, 9.0])
    b = timing.Timing("b", round_medians=[1.0, 2.0, 3.0])
    ratio = timing.ratio(a, b)
    assert (ratio.median, ratio.low, ratio.high) == (2.0, 2.0, 3.0)
    assert str(ratio) == "2.000 [2.000-3.000]"
