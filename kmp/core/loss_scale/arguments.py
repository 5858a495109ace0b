"""The checks of `LossScaleOptimizer`'s arguments, each at the user's call.

Every function raises `TypeError` or `ValueError` naming the argument, what
is allowed and what was received, before anything changes.
"""

import math
import numbers
from typing import Iterable
from typing import List
from typing import Mapping

import keras
import numpy as np
from keras import ops

from kmp.core import checks
from kmp.core.loss_scale import rule as rule_module

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_KerasOptimizer = keras.optimizers.Optimizer
_MAX_SKIPS = 2**31 - 1
# kmp's settings at their defaults, which get_config leaves out.
DEFAULT_SETTINGS = {
    "dynamic": True,
    "max_consecutive_skips": 1000,
    "on_persistent_skips": "warn",
    "record_nonfinite": False,
}


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: both a `TypeError` and a `ValueError`.

    Raised for an `initial_scale` that is not a number and a
    `dynamic_growth_steps` that is not an integer, which the contract
    answers with `ValueError` and Python's convention with `TypeError`:
    either catches it.

    >>> import kmp
    >>> try:
    ...     kmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale="8")
    ... except ValueError as error:
    ...     print(type(error).__name__, isinstance(error, TypeError))
    ArgumentTypeError True
    """


def check_inner(inner_optimizer):
    if isinstance(inner_optimizer, _KerasLossScaleOptimizer):
        raise TypeError(
            "'inner_optimizer' must not be a LossScaleOptimizer: loss scaling "
            "would be applied twice. Wrap the plain optimizer instead, e.g. "
            "kmp.LossScaleOptimizer(keras.optimizers.Adam()). Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, _KerasOptimizer):
        raise TypeError(
            "'inner_optimizer' must be a Keras optimizer instance, such as "
            "keras.optimizers.SGD(0.01). Received: "
            f"inner_optimizer={checks.describe(inner_optimizer)}"
        )
    if getattr(inner_optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            "'inner_optimizer' has its own loss_scale_factor="
            f"{inner_optimizer.loss_scale_factor!r}; the loss would be scaled "
            "twice. Leave it unset and pass the scale here instead: "
            "kmp.LossScaleOptimizer(inner, dynamic=False, initial_scale=...)."
        )
    check_inner_learning_rate(inner_optimizer)


def check_dynamic(dynamic):
    if isinstance(dynamic, bool):
        return
    if isinstance(dynamic, str) or (
        isinstance(dynamic, numbers.Real) and not isinstance(dynamic, bool)
    ):
        raise TypeError(
            f"'dynamic' must be True or False. Received: dynamic={dynamic!r}. "
            "kmp follows tf.keras's order, LossScaleOptimizer(inner, dynamic, "
            "initial_scale, dynamic_growth_steps): pass a scale by keyword, "
            "initial_scale=N (Keras 3's second argument), and "
            "LossScaleOptimizer(opt, 'dynamic') or loss_scale=... from "
            "TensorFlow 2.1-2.3 becomes LossScaleOptimizer(opt) (dynamic) or "
            "LossScaleOptimizer(opt, dynamic=False, initial_scale=N) (fixed)."
        )
    raise TypeError(
        f"'dynamic' must be True or False. Received: "
        f"dynamic={checks.describe(dynamic)}"
    )


def check_scale_settings(dynamic, initial_scale, growth_steps, knobs):
    """The rule (None when fixed) and the initial scale, checked.

    The scale and the rule's settings are rounded to float32 (the dtype of
    the scale variable and of the rule's arithmetic) once, here, and
    checked after rounding; the optimizer keeps, reports and saves the
    rounded values (see `checks.checked_float`).
    """
    received = None
    if initial_scale is None:
        if not dynamic:
            raise ValueError(
                "'initial_scale' is required when dynamic=False: it is the "
                "fixed loss scale, e.g. initial_scale=128. Received: "
                "initial_scale=None"
            )
        initial_scale = rule_module.DEFAULT_INITIAL_SCALE
        received = (
            f"initial_scale={initial_scale!r} (the default, as none was "
            "given: pass one between min_scale and max_scale)"
        )
    elif not checks.is_real_number(initial_scale):
        raise ArgumentTypeError(
            "'initial_scale' must be a number (a finite float from "
            "min_scale to max_scale; at least 1 when fixed). "
            f"Received: initial_scale={checks.describe(initial_scale)}"
        )
    if not dynamic:
        changed = [key for key, value in knobs.items() if value is not None]
        if growth_steps is not None:
            changed.insert(0, "dynamic_growth_steps")
        given = dict(knobs, dynamic_growth_steps=growth_steps)
        if changed:
            raise ValueError(
                f"{', '.join(repr(k) for k in changed)} apply only to a "
                "dynamic loss scale; leave them unset with dynamic=False. "
                "Received: "
                + ", ".join(f"{key}={given[key]!r}" for key in changed)
            )
        floor = rule_module.DEFAULT_MIN_SCALE
        return None, checks.checked_float(
            initial_scale,
            "initial_scale",
            "a finite number >= 1 (and at most the largest float32, "
            f"{rule_module.MAX_SCALE:.4g})",
            lambda v: floor <= v <= rule_module.MAX_SCALE,
        )
    if growth_steps is not None and (
        isinstance(growth_steps, bool)
        or not isinstance(growth_steps, numbers.Integral)
    ):
        raise ArgumentTypeError(
            "'dynamic_growth_steps' must be a positive integer. Received: "
            f"dynamic_growth_steps={checks.describe(growth_steps)}"
        )
    settings = {k: v for k, v in knobs.items() if v is not None}
    if growth_steps is not None:
        settings["growth_steps"] = growth_steps
    rule = rule_module.ScaleRule(**settings)
    return rule, checks.checked_float(
        initial_scale,
        "initial_scale",
        f"a finite number >= min_scale ({rule.min_scale:g}) and <= "
        f"max_scale ({rule.max_scale:.6g})",
        lambda v: rule.min_scale <= v <= rule.max_scale,
        received=received,
    )


def checked_skip_options(max_skips, on_persistent_skips, record_nonfinite):
    """The three settings as plain Python values, each checked."""
    if max_skips is not None:
        max_skips = checks.checked_integer(
            max_skips,
            "max_consecutive_skips",
            1,
            _MAX_SKIPS,
            f"a positive integer (at most {_MAX_SKIPS}) or None",
        )
    if not isinstance(on_persistent_skips, str) or on_persistent_skips not in (
        "warn",
        "raise",
    ):
        raise ValueError(
            "'on_persistent_skips' must be 'warn' or 'raise'. Received: "
            f"on_persistent_skips={on_persistent_skips!r}"
        )
    record_nonfinite = checks.checked_bool(record_nonfinite, "record_nonfinite")
    return max_skips, str(on_persistent_skips), record_nonfinite


def checked_learning_rate(value, argument: str = "learning_rate"):
    """`value` as the learning rate to assign: a number rounded to Keras's
    float dtype (the learning-rate variable's, float32 by default), checked
    after rounding; a tensor with a finite value, or a schedule or a
    callable, as it is. Messages name `argument` (`"lr"` for the alias).

    Raises:
        TypeError: not a number, a floating scalar tensor, a schedule or a
            callable.
        ValueError: NaN, inf, a number beyond float32, a non-zero one that
            rounds to 0, or a tensor that is not a scalar.
    """
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(value, schedule) or (
        callable(value) and not checks.is_tensor(value)
    ):
        return value
    dtype = keras.backend.floatx()
    allowed = f"a finite number that fits in {dtype}"
    if not checks.is_tensor(value):
        if not checks.is_real_number(value):
            raise TypeError(
                f"'{argument}' must be a number, a scalar tensor or a "
                "keras.optimizers.schedules.LearningRateSchedule. Received: "
                f"{argument}={checks.describe(value)}"
            )
        return checks.checked_float(
            value, argument, allowed, math.isfinite, dtype
        )
    if checks.dtype_name(value) not in checks.FLOATING_DTYPES:
        raise TypeError(
            f"'{argument}' must be floating point. Received: "
            f"{argument}={checks.describe(value)}"
        )
    if tuple(value.shape) not in ((),):
        raise ValueError(
            f"'{argument}' must be a scalar. Received: "
            f"{argument}={checks.describe(value)}"
        )
    number = checks.concrete_value(value)
    if number is not None:
        checks.checked_float(
            number,
            argument,
            allowed,
            math.isfinite,
            dtype,
            received=f"{argument}={checks.describe(value)} of value {number}",
        )
    return value


def check_inner_learning_rate(inner_optimizer):
    """Refuses an inner optimizer whose learning rate is not finite in
    float32, the dtype every step checks it in (each step would be
    skipped). Keras stores a number beyond float32, such as `SGD(1e39)`'s,
    as inf. A schedule or a callable is left alone: its value is checked at
    every step.
    """
    rate = getattr(inner_optimizer, "_learning_rate", None)
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(rate, schedule) or not (
        checks.is_tensor(rate) or checks.is_real_number(rate)
    ):
        return
    if checks.is_tensor(rate):
        value = checks.concrete_value(rate)  # None for a symbolic tensor.
        shown = f"{checks.describe(rate)} of value {value}"
    else:
        value, shown = rate, repr(rate)
    if value is None:
        return
    try:
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(value)))
    except OverflowError:  # An int beyond float64.
        finite = False
    if not finite:
        raise ValueError(
            "The learning rate of 'inner_optimizer' must be a finite number "
            "that fits in float32, as LossScaleOptimizer's learning_rate "
            "setter requires: with any other, every step would be skipped "
            "(Keras stores a number beyond float32, such as SGD(1e39)'s, as "
            "inf). Received: inner_optimizer.learning_rate="
            f"{shown}"
        )


def checked_config(config) -> dict:
    """A copy of `config`, if it is a dict as `get_config()` returns."""
    if not isinstance(config, Mapping) or "inner_optimizer" not in config:
        raise ValueError(
            "'config' must be a dict with at least the key "
            "'inner_optimizer', as returned by get_config(). Received: "
            f"config={checks.describe(config)}"
        )
    return dict(config)


def check_keras_kwargs(kwargs):
    """Accepts what Keras's own LossScaleOptimizer config may hold.

    Keras's `LossScaleOptimizer` allows the base optimizer's arguments at
    their defaults, for configs saved by older Keras releases.
    """
    defaults = {
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
    }
    if "loss_scale" in kwargs:
        raise TypeError(
            "LossScaleOptimizer(opt, loss_scale=...) is TensorFlow "
            "2.1-2.3's API. Use kmp.LossScaleOptimizer(opt) for a dynamic "
            "scale or kmp.LossScaleOptimizer(opt, dynamic=False, "
            "initial_scale=N) for a fixed one (or import the old names from "
            "kmp.mixed_precision.experimental, which translates them)."
        )
    unknown = [key for key in kwargs if key not in defaults]
    if unknown:
        raise ArgumentTypeError(
            "LossScaleOptimizer does not support arguments: "
            + ", ".join(f"`{key}`" for key in unknown)
            + ". Received: "
            + ", ".join(f"{key}={kwargs[key]!r}" for key in unknown)
        )
    for key, value in kwargs.items():
        if value != defaults[key]:
            raise ValueError(
                f"LossScaleOptimizer does not support `{key}`: set `{key}` "
                f"on the `inner_optimizer` instead. Received: {key}={value!r}"
            )


def checked_loss(loss):
    """`loss` as a floating tensor: a tensor, a Python float (float32), or
    anything `keras.ops.convert_to_tensor` takes (a NumPy array, a list).

    A non-finite loss is allowed (its gradients are non-finite, and the step
    is skipped); a Python float beyond float32's range is not.
    """
    if isinstance(loss, (bool, np.bool_)):
        raise TypeError(
            "'loss' must be a floating tensor or number. Received: "
            f"loss={checks.describe(loss)}"
        )
    given = loss
    if isinstance(loss, float):
        if math.isfinite(loss) and not checks.is_finite_number(loss):
            raise ValueError(
                "'loss' must fit in float32 (at most about 3.4e38 in "
                f"magnitude). Received: loss={loss!r}"
            )
        loss = ops.convert_to_tensor(loss, "float32")
    elif not checks.is_tensor(loss):
        try:
            loss = ops.convert_to_tensor(loss)
        except Exception:
            raise TypeError(
                "'loss' must be a floating tensor or number. Received: "
                f"loss={checks.describe(given)}"
            ) from None
    if checks.dtype_name(loss) not in checks.FLOATING_DTYPES:
        received = checks.describe(given)
        if not checks.is_tensor(given):
            received += f" (dtype {checks.dtype_name(loss)})"
        raise TypeError(
            f"'loss' must be floating point. Received: loss={received}"
        )
    return loss


def checked_gradient_list(grads, argument) -> List:
    """`grads` as a list of floating tensors, IndexedSlices and None."""
    if (
        checks.is_tensor(grads)
        or checks.is_indexed_slices(grads)
        or isinstance(grads, (str, bytes, Mapping))
        or not isinstance(grads, Iterable)
    ):
        raise TypeError(
            f"'{argument}' must be a list of gradients (tensors, "
            "IndexedSlices or None), such as tape.gradient(...)'s "
            f"result. Received: {argument}={checks.describe(grads)}"
        )
    grads = list(grads)
    for index, gradient in enumerate(grads):
        if gradient is None or checks.is_indexed_slices(gradient):
            continue
        if isinstance(gradient, (tuple, list)) and any(
            checks.is_variable(item) for item in gradient
        ):
            items = ", ".join(checks.describe(item) for item in gradient)
            raise TypeError(
                f"'{argument}' must be the gradients only, not (gradient, "
                "variable) pairs: pass tape.gradient(...)'s result, or "
                "[g for g, _ in grads_and_vars]. Received: "
                f"{argument}[{index}]=({items})"
            )
        given = gradient
        if isinstance(gradient, (bool, np.bool_)):
            raise TypeError(
                f"'{argument}[{index}]' must be a floating tensor or None. "
                f"Received: {argument}[{index}]={checks.describe(given)}"
            )
        if not checks.is_tensor(gradient):
            try:
                gradient = ops.convert_to_tensor(gradient)
            except Exception:
                raise TypeError(
                    f"'{argument}[{index}]' must be a floating tensor or "
                    f"None. Received: {argument}[{index}]="
                    f"{checks.describe(given)}"
                ) from None
        if checks.dtype_name(gradient) not in checks.FLOATING_DTYPES:
            received = checks.describe(given)
            if not checks.is_tensor(given):
                received += f" (dtype {checks.dtype_name(gradient)})"
            raise TypeError(
                f"'{argument}[{index}]' must be floating point. "
                f"Received: {argument}[{index}]={received}"
            )
        grads[index] = gradient
    return grads


def checked_pairs(
    grads_and_vars, name, aggregate_gradients, skip_gradients_aggregation
):
    """`apply_gradients`' arguments as `(grads, variables, aggregate)`.

    `name`, `experimental_aggregate_gradients` and Keras 2.11's
    `skip_gradients_aggregation` are Keras 2's, accepted for ported code:
    `aggregate` is False when either says the gradients are summed already.

    Raises:
        TypeError: pairs that are not pairs, or a Keras 2 argument of the
            wrong type.
        ValueError: no pairs at all (an exhausted `zip`).
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"'name' must be a string or None. Received: "
            f"name={checks.describe(name)}"
        )
    aggregate = checks.checked_bool(
        aggregate_gradients, "experimental_aggregate_gradients"
    ) and not checks.checked_bool(
        skip_gradients_aggregation, "skip_gradients_aggregation"
    )
    if isinstance(grads_and_vars, (str, bytes, Mapping)) or not (
        isinstance(grads_and_vars, Iterable)
    ):
        raise TypeError(
            "'grads_and_vars' must be (gradient, variable) pairs, such as "
            "zip(grads, model.trainable_variables). Received: "
            f"grads_and_vars={checks.describe(grads_and_vars)}"
        )
    pairs = list(grads_and_vars)
    if not pairs:
        raise ValueError(
            "'grads_and_vars' holds no (gradient, variable) pairs. A zip "
            "can be iterated only once: was it used already? Pass "
            "zip(grads, model.trainable_variables) anew at every step."
        )
    for index, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                "'grads_and_vars' must be (gradient, variable) pairs, "
                "such as zip(grads, model.trainable_variables). Received "
                f"at position {index}: {checks.describe(pair)}"
            )
    return [g for g, _ in pairs], [v for _, v in pairs], aggregate
