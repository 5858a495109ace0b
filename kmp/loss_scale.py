"""The dynamic loss-scale rule, as a pure function of (scale, counter, finite).

After each step, with `finite` telling whether every gradient was finite:

    if not finite:                         # overflow: the step is skipped
        scale = max(scale / 2, MIN_SCALE)
        counter = 0
    elif counter + 1 >= growth_steps:      # growth_steps finite steps in a row
        if scale * 2 is finite in float32:
            scale = scale * 2
        counter = 0
    else:
        counter = counter + 1

The scale therefore always stays within [MIN_SCALE, largest float32]. A fixed
scale never changes; steps with non-finite gradients are skipped either way.
`LossScaleOptimizer` owns the variables and assigns what this rule returns.
"""

from typing import Tuple

from kmp._backend import tf

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
MIN_SCALE = 1.0
MAX_SCALE = float(tf.float32.max)


def next_dynamic_scale(
    scale, counter, finite, growth_steps
) -> Tuple[tf.Tensor, tf.Tensor]:
    """Applies the rule above once; works on numbers and on tensors alike.

    It has no Python control flow on values, so it runs unchanged inside
    `tf.function`, under XLA and in every replica.

    Args:
        scale: The current loss scale (float32).
        counter: Consecutive finite steps since the scale last changed (int64).
        finite: Whether this step's gradients were all finite (bool).
        growth_steps: How many finite steps in a row double the scale.

    Returns:
        `(new_scale, new_counter)` as float32 and int64 scalar tensors.

    Example:

    >>> scale, counter = next_dynamic_scale(8.0, 1, True, growth_steps=2)
    >>> float(scale), int(counter)
    (16.0, 0)
    >>> scale, counter = next_dynamic_scale(1.0, 0, False, growth_steps=2)
    >>> float(scale), int(counter)
    (1.0, 0)
    """
    scale = tf.convert_to_tensor(scale, tf.float32)
    counter = tf.cast(counter, tf.int64)
    finite = tf.convert_to_tensor(finite, tf.bool)
    grow = tf.logical_and(finite, counter + 1 >= growth_steps)
    doubled = scale * 2.0
    grown = tf.where(tf.math.is_finite(doubled), doubled, scale)
    halved = tf.maximum(scale * 0.5, MIN_SCALE)
    new_scale = tf.where(finite, tf.where(grow, grown, scale), halved)
    new_counter = tf.where(
        tf.logical_and(finite, tf.logical_not(grow)),
        counter + 1,
        tf.zeros_like(counter),
    )
    return new_scale, new_counter
