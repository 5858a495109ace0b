"""Timing training steps fairly: one toolkit for `kmp bench` and benchmarks/.

A "subject" is anything with a `label` and a `step()` that runs one
training step and returns a value computed by it (the loss). `measure`
times several subjects in one process so that a busy or drifting machine
does not decide which is faster:

* every subject is warmed up first, untimed: its first call (tracing) and
  then steps until its step time settles (the median of the last `window`
  steps within `tolerance` of the `window` before), at least `warmup_min`
  and at most `warmup_max` of them (right after tracing, steps can be many
  times slower than later ones);
* then the timed steps run in rounds: in each round every subject runs one
  untimed step (so it does not pay for switching from the one before) and
  then its timed steps, in an order rotated by one from round to round;
* each step is timed on its own, from the call to the moment its returned
  value is available on the host (which waits for the step to finish),
  with Python's garbage collector off; the process's CPU time per step is
  kept too, which a busy machine disturbs less;
* `Timing` keeps every step time and each round's median: medians with the
  interquartile range describe a subject, and `ratio` compares two round by
  round, which cancels slow drift of the machine.

Backend-neutral: a step's value is waited for with
`keras.ops.convert_to_numpy`.

>>> import itertools
>>> clock = itertools.count()
>>> class Subject:
...     def __init__(self, label):
...         self.label = label
...     def step(self):
...         return next(clock)
>>> timings = measure([Subject("a"), Subject("b")], rounds=2, steps=3,
...                   warmup_min=1, warmup_max=1)
>>> [(t.label, len(t.times), len(t.round_medians)) for t in timings.values()]
[('a', 6, 2), ('b', 6, 2)]
"""

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import keras


@dataclasses.dataclass
class Timing:
    """What `measure` recorded for one subject. Times are in seconds.

    Attributes:
        label: The subject's label.
        trace_seconds: Its first call (tracing and the first step).
        warmup_steps: The steps run after it before timing started.
        warmup_last: The median of the last warm-up steps.
        times: Every timed step, in the order run.
        cpu_times: The process's CPU time during each timed step.
        round_medians: The median step time of each round.
        skipped: Steps the subject's optimizer skipped (inf/NaN gradients)
            while timed, for a caller that counts them; None otherwise.
    """

    label: str
    trace_seconds: float = 0.0
    warmup_steps: int = 0
    warmup_last: float = 0.0
    times: List[float] = dataclasses.field(default_factory=list)
    cpu_times: List[float] = dataclasses.field(default_factory=list)
    round_medians: List[float] = dataclasses.field(default_factory=list)
    skipped: Optional[int] = None

    @property
    def median(self) -> float:
        """The median timed step."""
        return statistics.median(self.times)

    def quantiles(self) -> Tuple[float, float, float, float, float]:
        """`(min, first quartile, median, third quartile, max)`."""
        times = sorted(self.times)
        if len(times) < 2:
            return (times[0],) * 5
        q1, q2, q3 = statistics.quantiles(times, n=4, method="inclusive")
        return times[0], q1, q2, q3, times[-1]


def wait(value) -> Any:
    """`value` (a tensor, or a structure of them) on the host, as NumPy."""
    return keras.tree.map_structure(keras.ops.convert_to_numpy, value)


def time_step(step: Callable[[], Any]) -> Tuple[float, Any]:
    """Runs `step()` and waits for its value: `(seconds, value)`."""
    seconds, _, value = _time_step(step)
    return seconds, value


def _time_step(step):
    """`(wall seconds, process CPU seconds, value)` of one step."""
    start, cpu_start = time.perf_counter(), time.process_time()
    value = wait(step())
    return time.perf_counter() - start, time.process_time() - cpu_start, value


def chunks(total: int, rounds: int) -> List[int]:
    """Splits `total` steps into `rounds` counts differing by at most one.

    >>> chunks(10, 3)
    [4, 3, 3]
    """
    base, extra = divmod(total, rounds)
    return [base + (1 if index < extra else 0) for index in range(rounds)]


def warm_up(
    step: Callable[[], Any],
    minimum: int,
    maximum: int,
    window: int = 5,
    tolerance: float = 0.1,
    observe: Optional[Callable[[Any, float], None]] = None,
    max_seconds: Optional[float] = None,
) -> Tuple[float, int, float]:
    """Traces `step` and runs it until its step time settles.

    Runs the first call, then at least `minimum` and at most `maximum`
    steps, stopping once the median of the last `window` steps is within
    `tolerance` (a fraction) of the median of the `window` before them, or
    once the steps after the first call took `max_seconds` in all.
    `minimum == maximum` (and no `max_seconds`) runs exactly that many.

    Args:
        step: Runs one step and returns its value.
        minimum, maximum: Bounds on the steps after the first call.
        window: Steps per median compared.
        tolerance: How close the two medians must be.
        observe: Called with `(value, seconds)` after every step.
        max_seconds: A time limit on the steps after the first call (None:
            none); `minimum` steps run in any case.

    Returns:
        `(seconds of the first call, steps after it, median of the last
        window)`.
    """
    trace_seconds, value = time_step(step)
    if observe is not None:
        observe(value, trace_seconds)
    times = []
    while len(times) < maximum:
        seconds, value = time_step(step)
        if observe is not None:
            observe(value, seconds)
        times.append(seconds)
        if len(times) < minimum:
            continue
        if max_seconds is not None and sum(times) >= max_seconds:
            break
        if len(times) >= 2 * window:
            last = statistics.median(times[-window:])
            before = statistics.median(times[-2 * window : -window])
            if abs(last - before) <= tolerance * before:
                break
    last = statistics.median(times[-window:]) if times else trace_seconds
    return trace_seconds, len(times), last


def _no_context(subject):
    return contextlib.nullcontext()


def measure(
    subjects: Sequence[Any],
    rounds: int,
    steps: Union[int, Sequence[int]],
    warmup_min: int,
    warmup_max: int,
    switch_steps: int = 1,
    context: Callable[[Any], Any] = _no_context,
    observe: Optional[Callable[[Any, Any, float, bool], None]] = None,
    warmed_up: Optional[Callable[[Any, Timing], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Timing]:
    """Warms every subject up, then times them in interleaved rounds.

    `warm_up_all`, then `time_rounds`.

    Args:
        subjects: Objects with a `label` (unique) and a `step()`.
        rounds: How many rounds.
        steps: Timed steps per subject per round: a count, or one count per
            round.
        warmup_min, warmup_max: Bounds on the warm-up steps (`warm_up`).
        switch_steps: Untimed steps each subject runs at the start of its
            turn in a round.
        context: Returns the context manager a subject's steps run in (for
            settings that differ between subjects).
        observe: Called as `observe(subject, value, seconds, timed)` after
            every step, off the clock.
        warmed_up: Called as `warmed_up(subject, timing)` once a subject is
            warmed up, before any round.
        log: Called with one line per subject once it is warmed up.
        progress: Called with one line per subject and round.

    Returns:
        `{label: Timing}` in the order of `subjects`.
    """
    counts = _round_counts(rounds, steps)
    timings = warm_up_all(
        subjects,
        warmup_min,
        warmup_max,
        context=context,
        observe=observe,
        warmed_up=warmed_up,
        log=log,
    )
    time_rounds(
        subjects,
        timings,
        rounds,
        counts,
        switch_steps=switch_steps,
        context=context,
        observe=observe,
        progress=progress,
    )
    return timings


def _round_counts(rounds, steps):
    counts = [steps] * rounds if isinstance(steps, int) else list(steps)
    if len(counts) != rounds:
        raise ValueError(
            f"'steps' must be a count or one count per round ({rounds}). "
            f"Received: steps={steps!r}"
        )
    return counts


def warm_up_all(
    subjects: Sequence[Any],
    warmup_min: int,
    warmup_max: int,
    context: Callable[[Any], Any] = _no_context,
    observe: Optional[Callable[[Any, Any, float, bool], None]] = None,
    warmed_up: Optional[Callable[[Any, Timing], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    max_seconds: Optional[float] = None,
) -> Dict[str, Timing]:
    """`warm_up` for every subject in turn (arguments as for `measure`;
    `max_seconds` limits each subject's warm-up steps, see `warm_up`).

    Returns:
        `{label: Timing}` in the order of `subjects`, without timed steps.
    """
    timings = {}
    for subject in subjects:

        def seen(value, seconds, subject=subject):
            if observe is not None:
                observe(subject, value, seconds, False)

        with context(subject):
            trace, count, last = warm_up(
                subject.step,
                warmup_min,
                warmup_max,
                observe=seen,
                max_seconds=max_seconds,
            )
        timings[subject.label] = Timing(subject.label, trace, count, last)
        if warmed_up is not None:
            warmed_up(subject, timings[subject.label])
        if log is not None:
            log(
                f"  warmed up {subject.label}: first call {trace:.2f} s, "
                f"{count} warm-up steps, last {last * 1e3:.2f} ms/step"
            )
    return timings


def time_rounds(
    subjects: Sequence[Any],
    timings: Dict[str, Timing],
    rounds: int,
    steps: Union[int, Sequence[int]],
    switch_steps: int = 1,
    context: Callable[[Any], Any] = _no_context,
    observe: Optional[Callable[[Any, Any, float, bool], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Timing]:
    """The timed rounds of `measure`, added to `timings` (from
    `warm_up_all`); the other arguments as for `measure`."""
    counts = _round_counts(rounds, steps)
    for round_index, count in enumerate(counts):
        shift = round_index % len(subjects)
        for subject in [*subjects[shift:], *subjects[:shift]]:
            if progress is not None:
                progress(
                    f"round {round_index + 1}/{rounds}, {count} steps: "
                    f"{subject.label}"
                )
            with context(subject):
                times, cpu_times = _timed_turn(
                    subject, count, switch_steps, observe
                )
            timing = timings[subject.label]
            timing.times.extend(times)
            timing.cpu_times.extend(cpu_times)
            timing.round_medians.append(statistics.median(times))
    return timings


def _timed_turn(subject, count, switch_steps, observe):
    """One subject's turn in a round: untimed steps, then `count` timed.

    Returns the wall and the CPU seconds of the timed steps.
    """
    for _ in range(switch_steps):
        seconds, value = time_step(subject.step)
        if observe is not None:
            observe(subject, value, seconds, False)
    gc.collect()
    gc.disable()
    times, cpu_times = [], []
    try:
        for _ in range(count):
            seconds, cpu_seconds, value = _time_step(subject.step)
            times.append(seconds)
            cpu_times.append(cpu_seconds)
            if observe is not None:
                observe(subject, value, seconds, True)
    finally:
        gc.enable()
    return times, cpu_times


@dataclasses.dataclass
class Ratio:
    """`a / b` of two subjects' step times, from round-by-round ratios.

    Attributes:
        median: The median over rounds of (a's round median / b's).
        low, high: The smallest and largest round ratio.
    """

    median: float
    low: float
    high: float

    def __str__(self):
        return f"{self.median:.3f} [{self.low:.3f}-{self.high:.3f}]"


def ratio(a: Timing, b: Timing) -> Ratio:
    """a's step time over b's, round by round (see `Ratio`).

    >>> ratio(Timing("a", round_medians=[2.0, 3.0]),
    ...       Timing("b", round_medians=[1.0, 1.0])).median
    2.5
    """
    rounds = [x / y for x, y in zip(a.round_medians, b.round_medians)]
    return Ratio(statistics.median(rounds), min(rounds), max(rounds))


__all__ = [
    "Ratio",
    "Timing",
    "chunks",
    "measure",
    "ratio",
    "time_rounds",
    "time_step",
    "wait",
    "warm_up",
    "warm_up_all",
]
