"""What `kmp bench` runs: its configurations, and how many steps fit.

`plan_configurations` lists the configurations in the order they run and
are reported; `plan_steps` turns a time budget and measured step times into
timed steps (never fewer than `bench_stats.MIN_ROUND_STEPS` per round);
`StepWalls` measures what a step costs in all during the warm-up, and
`steps_for_budget` plans on it.

>>> plan_steps(600.0, [0.1, 0.2, 0.3])  # 1000 steps of all three fit.
(995, True)
"""

import gc
import time

from kmp.core import backend
from kmp.tools.bench.configuration import STATE_IMPLEMENTATIONS
from kmp.tools.bench.configuration import STATE_POLICY
from kmp.tools.bench.configuration import needs_loss_scaling
from kmp.tools.bench.stats import MIN_ROUND_STEPS
from kmp.tools.bench.stats import MIN_ROUNDS

# Timed steps per configuration from a budget: at most this many.
MAX_BUDGET_STEPS = 5000
# The share of what is left after the warm-up that the timed steps plan on.
_BUDGET_SHARE = 0.85


def _amp_policy(policy, device):
    """Plain PyTorch AMP has a counterpart of float32 and the mixed
    policies; its float16 needs a CUDA device (on a CPU torch's float16
    autocast is emulated: over ten times slower than float32)."""
    if policy == "mixed_float16":
        return device == "gpu"
    return policy in ("float32", "mixed_bfloat16")


def plan_configurations(
    policies,
    loops,
    native,
    overhead,
    torch_amp,
    device="gpu",
    low_precision=False,
):
    """`(policy, loop, implementation)` of every configuration, in order:
    kmp's, Keras's loss scaling, no loss scaling, plain PyTorch AMP (its
    custom loop only; on torch only; float16 on a GPU only), and with
    `low_precision` bfloat16 weights with 16-bit and 8-bit state."""
    scaled = [p for p in policies if needs_loss_scaling(p)]
    plan = [(p, loop, "kmp") for p in policies for loop in loops]
    if native:
        plan += [(p, loop, "native") for p in scaled for loop in loops]
    if overhead:
        plan += [(p, loop, "unscaled") for p in scaled for loop in loops]
    if torch_amp and backend.is_torch() and "custom" in loops:
        amp = [p for p in policies if _amp_policy(p, device)]
        plan += [(p, "custom", "torch") for p in amp]
        if overhead:
            unscaled = [p for p in amp if p in scaled]
            plan += [(p, "custom", "torch_unscaled") for p in unscaled]
    if low_precision:
        plan += [
            (STATE_POLICY, loop, implementation)
            for implementation in STATE_IMPLEMENTATIONS
            for loop in loops
        ]
    return plan


def plan_steps(seconds, step_seconds, rounds=MIN_ROUNDS):
    """How many timed steps per configuration fit in `seconds`, in
    `rounds` rounds: `(steps, fits)`.

    A round costs each configuration one untimed step more. Never fewer
    than `MIN_ROUND_STEPS` timed steps per round: `fits` is False when
    even those do not fit (the run then takes longer than planned); at most
    `MAX_BUDGET_STEPS`.

    Args:
        seconds: The time for the timed rounds.
        step_seconds: One step time per configuration (from the warm-up).
        rounds: The rounds.

    >>> plan_steps(60.0, [0.01, 0.02, 0.03])  # 1000 steps of all three.
    (995, True)
    >>> plan_steps(6.0, [0.1, 0.2, 0.3])
    (100, False)
    """
    per_step = max(sum(step_seconds), 1e-9)
    fitting = int(max(seconds, 0.0) / per_step + 1e-6)  # 0.6 / 0.2 -> 3
    per_round = fitting // rounds - 1  # Less the untimed step.
    fits = per_round >= MIN_ROUND_STEPS
    steps = max(MIN_ROUND_STEPS, per_round) * rounds
    return min(MAX_BUDGET_STEPS, steps), fits


def minimum_seconds(step_seconds, rounds=MIN_ROUNDS):
    """About how long the fewest steps `plan_steps` allows take."""
    return rounds * (MIN_ROUND_STEPS + 1) * sum(step_seconds)


class StepWalls:
    """What a warm-up step costs in all: the step and its record (a step's
    time alone, without the record, would promise more steps than fit)."""

    def __init__(self):
        self._walls = {}
        self._last = None

    def observe(self, configuration, loss, seconds, timed):
        configuration.record([loss])
        now = time.perf_counter()
        if self._last is not None and self._last[0] is configuration:
            # From the end of the step before to the end of this one.
            walls = self._walls.setdefault(configuration.label, [])
            walls.append(now - self._last[1])
        self._last = (configuration, now)

    def per_step(self, timings):
        """Seconds per step of each configuration: the larger of its last
        warm-up steps' time and their median wall time with the record."""
        seconds = []
        for label, timing_ in timings.items():
            walls = self._walls.get(label, [])[-5:]
            wall = sorted(walls)[len(walls) // 2] if walls else 0.0
            seconds.append(max(timing_.warmup_last, wall))
        return seconds


def steps_for_budget(step_seconds, data, spec, seconds, rounds):
    """`plan_steps` on `seconds` less the evaluation (every training and
    test example through the model once: about a third of a training step
    per batch) and the garbage collections that start every round
    (`bench.rounds`), less a share for machines that slow down."""
    examples = len(data[0]) + len(data[1])
    evaluation = examples / spec.batch_size / 3 * sum(step_seconds)
    started = time.perf_counter()
    gc.collect()
    turns = rounds * (time.perf_counter() - started)
    seconds = _BUDGET_SHARE * (seconds - evaluation - turns)
    return plan_steps(seconds, step_seconds, rounds)


__all__ = [
    "MAX_BUDGET_STEPS",
    "StepWalls",
    "minimum_seconds",
    "plan_configurations",
    "plan_steps",
    "steps_for_budget",
]
