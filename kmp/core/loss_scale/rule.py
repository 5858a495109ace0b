"""The dynamic loss-scale rule: a pure function of the state and one step.

`ScaleRule` holds the settings; `ScaleRule.next(state, finite)` returns the
state after a step whose gradients were all finite (`finite=True`) or not.
The state is `(scale, counter, hysteresis_left)`:

    if finite:
        counter = counter + 1
        if counter >= growth_steps:                # growth_steps in a row
            if scale * growth_factor <= max_scale: # never above, never inf
                scale = scale * growth_factor
            counter = 0
            hysteresis_left = hysteresis
    else:                                          # the step is skipped
        counter = 0
        if hysteresis_left <= 1:
            scale = max(scale * backoff_factor, min_scale)
        else:
            hysteresis_left = hysteresis_left - 1

So the scale stays within [min_scale, max_scale]. With `hysteresis=h`, the
first h - 1 non-finite steps after a growth (or the start) leave the scale
alone; the h-th and every later one back it off, until it grows again (as
DeepSpeed's `hysteresis`). The defaults (2000, 2, 0.5, 1, the largest
float32, 1) are `tf.keras`'s rule. A fixed scale never changes; steps with
non-finite gradients are skipped either way. `LossScaleOptimizer` owns the
variables and assigns what `next` returns.

>>> rule = ScaleRule(growth_steps=2)
>>> state = rule.initial_state(8.0)
>>> for finite in (True, True, False):
...     state = rule.next(state, finite)
...     print([float(x) for x in state])
[8.0, 1.0, 1.0]
[16.0, 0.0, 1.0]
[8.0, 0.0, 1.0]
"""

import dataclasses
import math
from typing import Tuple

from keras import ops
from keras.backend import standardize_dtype

from kmp.core import checks

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_MIN_SCALE = 1.0
# The smallest `min_scale` allowed: float16's smallest subnormal. A scale
# below 1 shrinks the loss (for models whose float16 gradients overflow even
# unscaled); dividing by 2**-24 multiplies a gradient by 2**24 at most.
SMALLEST_MIN_SCALE = 2.0**-24
MAX_SCALE = checks.largest_float32()
MAX_INT = 2**31 - 1  # Counters are int32 on JAX without x64.

State = Tuple  # (scale, counter, hysteresis_left)


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The settings of the dynamic rule above; checked when made.

    Args:
        growth_steps: Finite steps in a row before the scale grows.
        growth_factor: What the scale is multiplied by when it grows (> 1).
        backoff_factor: What it is multiplied by when it backs off (0 to 1).
        min_scale: The floor, at least `SMALLEST_MIN_SCALE`.
        max_scale: The ceiling, at most the largest float32.
        hysteresis: Which non-finite step since the last growth backs off.

    Raises:
        TypeError, ValueError: a setting of the wrong type or value.
    """

    growth_steps: int = DEFAULT_GROWTH_STEPS
    growth_factor: float = DEFAULT_GROWTH_FACTOR
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR
    min_scale: float = DEFAULT_MIN_SCALE
    max_scale: float = MAX_SCALE
    hysteresis: int = 1

    def __post_init__(self):
        settings = checked_settings(
            growth_steps=self.growth_steps,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
        )
        for field, value in settings.items():
            object.__setattr__(self, field, value)

    def initial_state(self, scale) -> State:
        """`(scale, 0, hysteresis)`: where a run starts."""
        return (scale, 0, self.hysteresis)

    def next(self, state: State, finite, xp=None) -> State:
        """The state after one step; see the module docstring.

        Works on numbers and on tensors of any backend alike, without
        Python control flow on values (so it runs inside `tf.function`,
        `jax.jit` and on every replica). Returns float32 / integer tensors of
        the counters' dtype.

        `xp` is the namespace of the few operations it takes (`KerasOps`,
        the default; torch's step passes its own, whose Python numbers are
        kernel arguments, never uploaded). With it, `finite` may be the
        Python `True` (a step the host already knows was applied): then the
        same rule takes fewer operations.
        """
        xp = xp or KerasOps
        scale, counter, hysteresis_left, finite = xp.prepare(state, finite)
        counted = counter + 1
        grown = scale * self.growth_factor
        grown = xp.where(grown <= self.max_scale, grown, scale)
        reset = xp.full_like(hysteresis_left, self.hysteresis)
        if finite is True:
            grow = counted >= self.growth_steps
            return (
                xp.where(grow, grown, scale),
                xp.where(grow, xp.zeros_like(counter), counted),
                xp.where(grow, reset, hysteresis_left),
            )
        grow = xp.logical_and(finite, counted >= self.growth_steps)
        backs_off = xp.logical_and(xp.logical_not(finite), hysteresis_left <= 1)
        backed_off = xp.maximum(scale * self.backoff_factor, self.min_scale)

        new_scale = xp.where(
            grow, grown, xp.where(backs_off, backed_off, scale)
        )
        new_counter = xp.where(
            xp.logical_and(finite, xp.logical_not(grow)),
            counted,
            xp.zeros_like(counter),
        )
        new_hysteresis = xp.where(
            grow,
            reset,
            xp.where(
                xp.logical_or(finite, backs_off),
                hysteresis_left,
                hysteresis_left - 1,
            ),
        )
        return new_scale, new_counter, new_hysteresis


def powers_of_two(rule, initial_scale) -> bool:
    """Whether every scale a run can take is a power of two, so that its
    reciprocal is exact: a fixed `initial_scale` (`rule` None) that is one,
    or a rule whose initial scale, factors and floor are (the default's:
    2**15, 2, 0.5, 1). The ceiling does not count: the scale stops below
    it rather than being clamped to it. A scale restored from elsewhere
    need not be one."""
    values = [initial_scale]
    if rule is not None:
        values += [rule.growth_factor, rule.backoff_factor, rule.min_scale]
    return all(_is_power_of_two(v) for v in values)


def _is_power_of_two(value) -> bool:
    mantissa, _ = math.frexp(float(value))
    return mantissa == 0.5


class KerasOps:
    """The operations `ScaleRule.next` takes, from `keras.ops` (any
    backend); `prepare` makes tensors of the state and the flag."""

    where = staticmethod(ops.where)
    logical_and = staticmethod(ops.logical_and)
    logical_or = staticmethod(ops.logical_or)
    logical_not = staticmethod(ops.logical_not)
    maximum = staticmethod(ops.maximum)
    full_like = staticmethod(ops.full_like)
    zeros_like = staticmethod(ops.zeros_like)

    @staticmethod
    def prepare(state, finite):
        """`(scale, counter, hysteresis_left, finite)` as tensors: float32,
        the counter's integer dtype (int32 for a float), bool."""
        scale, counter, hysteresis_left = state
        scale = ops.convert_to_tensor(scale, "float32")
        counter = ops.convert_to_tensor(counter)
        if not standardize_dtype(counter.dtype).startswith("int"):
            counter = ops.cast(counter, "int32")
        hysteresis_left = ops.cast(hysteresis_left, counter.dtype)
        finite = ops.convert_to_tensor(finite, "bool")
        return scale, counter, hysteresis_left, finite


def checked_settings(
    growth_steps,
    growth_factor,
    backoff_factor,
    min_scale,
    max_scale,
    hysteresis,
) -> dict:
    """The rule's settings as ints and floats, each checked.

    The factors and bounds are rounded to float32 here, once, and checked
    after rounding (`checks.checked_float`): the rule computes in float32,
    so what it holds, reports and compares restored scales with is exactly
    what it applies. A factor that rounds to 1 is refused.

    Raises:
        TypeError: a setting is not a number (an integer where one is due).
        ValueError: a setting is out of range, or min_scale > max_scale.
    """
    settings = {
        "growth_steps": checks.checked_integer(
            growth_steps,
            "dynamic_growth_steps",
            1,
            MAX_INT,
            f"a positive integer (at most {MAX_INT})",
        ),
        "growth_factor": checks.checked_float(
            growth_factor,
            "growth_factor",
            "a finite number > 1 (2 by default)",
            lambda v: 1 < v <= MAX_SCALE,
        ),
        "backoff_factor": checks.checked_float(
            backoff_factor,
            "backoff_factor",
            "a number > 0 and < 1 (0.5 by default)",
            lambda v: 0 < v < 1,
        ),
        "min_scale": checks.checked_float(
            min_scale,
            "min_scale",
            f"a number >= {SMALLEST_MIN_SCALE:g} (2**-24) and at most the "
            "largest float32 (1 by default)",
            lambda v: SMALLEST_MIN_SCALE <= v <= MAX_SCALE,
        ),
        "max_scale": checks.checked_float(
            max_scale,
            "max_scale",
            f"a number >= {SMALLEST_MIN_SCALE:g} and at most the largest "
            f"float32, {MAX_SCALE:.6g} (the default)",
            lambda v: SMALLEST_MIN_SCALE <= v <= MAX_SCALE,
        ),
        "hysteresis": checks.checked_integer(
            hysteresis,
            "hysteresis",
            1,
            MAX_INT,
            f"a positive integer (at most {MAX_INT}; 1 by default)",
        ),
    }
    if settings["min_scale"] > settings["max_scale"]:
        raise ValueError(
            "'min_scale' must not be above 'max_scale'. Received: "
            f"min_scale={min_scale!r}, max_scale={max_scale!r}"
        )
    return settings
