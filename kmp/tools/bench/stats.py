"""How `kmp bench` counts its steps and how sure its ratios are.

The timed steps of every configuration run in rounds (at least
`MIN_ROUNDS`, each of at least `MIN_ROUND_STEPS` timed steps), and inside
a round in blocks: the steps of a block are dispatched back to back and the
device is waited for once, at the block's end. A block's time over its
steps is one sample; a configuration's step time is the median of its
blocks.

A ratio of two configurations' step times comes with a 95% interval from a
seeded bootstrap over rounds and blocks (`ratio_interval`): rounds are
drawn with replacement, the same rounds for both configurations (a round
runs them minutes apart at most, so what drifts between rounds cancels),
then the blocks of each drawn round. An interval wider than `SPREAD_LIMIT`
of its ratio is flagged as noisy (`is_noisy`).

>>> block_sizes(20)
[5, 5, 5, 5]
>>> a = [[2.0, 2.1, 1.9, 2.0]] * 5
>>> b = [[1.0, 1.0, 1.1, 0.9]] * 5
>>> [round(x, 2) for x in ratio_interval(a, b)]
[1.95, 2.05]
"""

from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

# Never fewer: a median of fewer steps says little about a step time.
MIN_ROUNDS = 5
MIN_ROUND_STEPS = 20
MIN_STEPS = MIN_ROUNDS * MIN_ROUND_STEPS
# Blocks: at least this many steps each, at most this many per round.
MIN_BLOCK_STEPS = 5
MAX_BLOCKS_PER_ROUND = 10
CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# Intervals wider than this fraction of their ratio are flagged.
SPREAD_LIMIT = 0.10


def check_counts(steps: int, rounds: int) -> Optional[str]:
    """Why `steps` timed steps in `rounds` rounds are too few, or None.

    >>> check_counts(100, 5) is None
    True
    >>> check_counts(1, 1)[:35]
    'At least 5 rounds of 20 timed steps'
    """
    if rounds >= MIN_ROUNDS and steps >= MIN_ROUND_STEPS * rounds:
        return None
    return (
        f"At least {MIN_ROUNDS} rounds of {MIN_ROUND_STEPS} timed steps "
        f"({MIN_STEPS} steps) per configuration are needed: a median of "
        "fewer steps says little about a step time, and a ratio needs "
        "rounds to put an interval on."
    )


def round_steps(steps: int, rounds: int) -> List[int]:
    """`steps` split into `rounds` counts differing by at most one.

    >>> round_steps(101, 5)
    [21, 20, 20, 20, 20]
    """
    base, extra = divmod(steps, rounds)
    return [base + (1 if index < extra else 0) for index in range(rounds)]


def block_sizes(steps: int, blocks: Optional[int] = None) -> List[int]:
    """A round's `steps` cut into blocks (sizes differing by at most one).

    Args:
        steps: The round's timed steps.
        blocks: How many blocks (None: as many as hold `MIN_BLOCK_STEPS`
            steps each, at most `MAX_BLOCKS_PER_ROUND`, at least one).

    >>> block_sizes(100)
    [10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    >>> block_sizes(21, 4)
    [6, 5, 5, 5]
    """
    if blocks is None:
        blocks = blocks_per_round(steps)
    return round_steps(steps, min(blocks, steps))


def blocks_per_round(steps: int) -> int:
    """How many blocks a round of `steps` timed steps is cut into."""
    return max(1, min(MAX_BLOCKS_PER_ROUND, steps // MIN_BLOCK_STEPS))


def _as_rounds(blocks):
    try:
        array = np.asarray(blocks, dtype="float64")
    except ValueError:  # Rounds of different lengths.
        array = np.zeros(0)
    if array.ndim != 2 or array.size == 0:
        raise ValueError(
            "Block times must be one list per round, every round with the "
            f"same number of blocks. Received: {blocks!r}"
        )
    return array


def ratio_interval(
    a_blocks: Sequence[Sequence[float]],
    b_blocks: Sequence[Sequence[float]],
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Tuple[float, float]:
    """A bootstrap interval of median(a's blocks) / median(b's blocks).

    Each resample draws rounds with replacement (the same rounds for `a`
    and `b`), then within every drawn round its blocks with replacement,
    `a`'s and `b`'s independently, and takes the ratio of the medians.

    Args:
        a_blocks, b_blocks: Per round, each block's time per step. Rounds
            pair up by index (the shorter list decides how many).
        confidence: The interval's coverage.
        resamples: Bootstrap resamples.
        seed: NumPy's generator seed: the same data give the same interval.

    Returns:
        `(low, high)`: the percentile interval.

    Raises:
        ValueError: the blocks are not one equal-length list per round.
    """
    a, b = _as_rounds(a_blocks), _as_rounds(b_blocks)
    rounds = min(len(a), len(b))
    a, b = a[:rounds], b[:rounds]
    rng = np.random.default_rng(seed)
    picked = rng.integers(0, rounds, (resamples, rounds))

    def medians(blocks):
        chosen = rng.integers(0, blocks.shape[1], (resamples,) + blocks.shape)
        samples = blocks[picked[:, :, None], chosen]
        return np.median(samples.reshape(resamples, -1), axis=1)

    ratios = medians(a) / medians(b)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def spread(ratio: float, interval: Optional[Sequence[float]]) -> float:
    """The interval's width as a fraction of `ratio` (nan without one)."""
    if interval is None or not ratio:
        return float("nan")
    return (interval[1] - interval[0]) / abs(ratio)


def is_noisy(ratio: float, interval: Optional[Sequence[float]]) -> bool:
    """Whether the interval is wider than `SPREAD_LIMIT` of its ratio."""
    return bool(spread(ratio, interval) > SPREAD_LIMIT)


def relative_difference(first: float, second: float) -> float:
    """How far a second measurement of a ratio is from the first:
    `second / first - 1`.

    >>> round(relative_difference(1.25, 1.2), 3)
    -0.04
    """
    return second / first - 1.0


__all__ = [
    "CONFIDENCE",
    "MAX_BLOCKS_PER_ROUND",
    "MIN_BLOCK_STEPS",
    "MIN_ROUNDS",
    "MIN_ROUND_STEPS",
    "MIN_STEPS",
    "SPREAD_LIMIT",
    "block_sizes",
    "blocks_per_round",
    "check_counts",
    "is_noisy",
    "ratio_interval",
    "relative_difference",
    "round_steps",
    "spread",
]
