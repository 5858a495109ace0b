"""`kmp bench`'s timed rounds: steps timed in blocks, one device sync each.

After the warm-up (`kmp.tools.bench.timing.warm_up_all`, untimed), every
configuration runs its timed steps in rounds whose order rotates by one
from round to round. In each round a configuration first runs one untimed
step (so that it does not pay for the switch from the one before), then its
blocks: `block` steps dispatched back to back, then one wait for the
device (`Configuration.sync`: `block_until_ready` on JAX,
`torch.cuda.synchronize` on CUDA, reading the loss on TensorFlow). Only
the block is timed, with Python's garbage collector off; what the steps
recorded (losses, the loss scale) is read after it, off the clock.

A subject here is a `kmp.tools.bench.configuration.Configuration`: it has
`label`, `step()`, `sync(value)`, `record(values, block_seconds,
round_index)`.
"""

import gc
import time
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

from kmp.tools.bench import stats as bench_stats


def time_rounds(
    subjects: Sequence[Any],
    steps: int,
    rounds: int,
    context: Callable[[Any], Any],
    advance: Optional[Callable[[int], None]] = None,
) -> None:
    """Runs `steps` timed steps of every subject in `rounds` rounds.

    Args:
        subjects: Configurations (see the module).
        steps: Timed steps per subject, split evenly over the rounds.
        rounds: How many rounds.
        context: Returns the context manager a subject's turn runs in.
        advance: Called with the number of steps just run (progress).
    """
    per_round = bench_stats.round_steps(steps, rounds)
    blocks = bench_stats.blocks_per_round(min(per_round))
    for round_index, count in enumerate(per_round):
        gc.collect()  # Once a round: the blocks run with it off.
        shift = round_index % len(subjects)
        for subject in [*subjects[shift:], *subjects[:shift]]:
            with context(subject):
                _turn(subject, round_index, count, blocks, advance)


def _turn(subject, round_index, count, blocks, advance):
    """One subject's turn: an untimed step, then its timed blocks."""
    value = subject.step()
    subject.sync(value)
    subject.record([value], None, None)
    if advance is not None:
        advance(1)
    gc.disable()
    try:
        for size in bench_stats.block_sizes(count, blocks):
            start = time.perf_counter()
            values = [subject.step() for _ in range(size)]
            subject.sync(values[-1])
            seconds = time.perf_counter() - start
            subject.record(values, seconds, round_index)
            if advance is not None:
                advance(size)
    finally:
        gc.enable()


__all__ = ["time_rounds"]
