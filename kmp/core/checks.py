"""Checks of user input shared across kmp, and how errors show values.

Every check raises at the call the user made, before anything changes:
`TypeError` for a wrong type, `ValueError` for a wrong value, with the
argument's name, what is allowed and what was received.

>>> describe([1, 2])
'[1, 2] of type list'
"""

import decimal
import fractions
import math
import numbers
from typing import Callable
from typing import List
from typing import Optional

import keras
import numpy as np

from kmp.core import backend

FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")
LOW_PRECISION_DTYPES = ("float16", "bfloat16")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# Decided once: these checks run on every gradient and variable of a step.
_TF_VARIABLE = (
    (backend.tensorflow().Variable,) if backend.is_tensorflow() else ()
)


def is_tensor(value) -> bool:
    """Whether `value` is a backend tensor, a Keras variable or a TF one."""
    if isinstance(value, keras.Variable) or keras.ops.is_tensor(value):
        return True
    return isinstance(value, _TF_VARIABLE)


def is_variable(value) -> bool:
    """Whether `value` is a Keras variable (or, on TensorFlow, a TF one)."""
    if isinstance(value, keras.Variable):
        return True
    return isinstance(value, _TF_VARIABLE)


_INDEXED_SLICES = (
    (backend.tensorflow().IndexedSlices,) if backend.is_tensorflow() else ()
)
_TENSOR_SHAPE = (
    backend.tensorflow().TensorShape if backend.is_tensorflow() else None
)


def is_indexed_slices(value) -> bool:
    """Whether `value` is a TensorFlow sparse gradient (`tf.IndexedSlices`)."""
    return isinstance(value, _INDEXED_SLICES)


def dtype_name(value) -> str:
    """The standard Keras name of a tensor's or variable's dtype."""
    return keras.backend.standardize_dtype(value.dtype)


def shape_text(shape) -> str:
    """`(2, 3)`, or "unknown" for a shape of unknown rank (or None)."""
    if shape is None:
        return "unknown"
    if _TENSOR_SHAPE is not None and isinstance(shape, _TENSOR_SHAPE):
        if shape.rank is None:
            return "unknown"
        shape = shape.as_list()
    return str(tuple(None if d is None else int(d) for d in shape))


def describe(value) -> str:
    """A short description of a user's value for an error message."""
    if is_tensor(value):
        kind = "a variable" if is_variable(value) else "a tensor"
        return (
            f"{kind} of dtype {dtype_name(value)} and shape "
            f"{shape_text(value.shape)}"
        )
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{text} of type {type(value).__name__}"


def checked_bool(value, argument: str) -> bool:
    """`value` if it is True or False (a NumPy bool too).

    Raises:
        TypeError: anything else, 0 and 1 included.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"'{argument}' must be True or False. Received: "
            f"{argument}={describe(value)}"
        )
    return bool(value)


def is_real_number(value) -> bool:
    """Whether a setting may be given as `value`: a real number that is not
    a bool (a Python or NumPy int or float, an ml_dtypes float such as
    bfloat16, a `fractions.Fraction` or a `decimal.Decimal`)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        return True
    return (  # ml_dtypes' scalars (bfloat16, float8_*) are not numbers.Real.
        isinstance(value, np.generic)
        and value.dtype.kind == "V"
        and value.dtype.name.startswith(("bfloat", "float"))
    )


def checked_float(
    value,
    argument: str,
    allowed: str,
    in_range: Callable[[float], bool],
    dtype: str = "float32",
    received: Optional[str] = None,
) -> float:
    """`value` rounded once to `dtype`, the dtype it is stored and applied
    in, and checked after rounding: the door of every numeric setting.

    What comes out is what is applied, reported (properties, `get_config`)
    and compared with restored state, so they agree exactly. Refused: a
    value that is not a real number (`is_real_number`), NaN, a finite value
    that overflows `dtype`, a non-zero one that rounds to 0, and a rounded
    value `in_range` refuses (so a factor > 1 that rounds to 1 is refused
    where a factor must be > 1). `allowed` completes "'argument' must be
    ..."; `received` replaces "argument=value" in the message (for a
    tensor's value).

    >>> checked_float(0.7, "min_scale", "a number", lambda v: v > 0)
    0.699999988079071

    Returns:
        The rounded value as a Python float (exactly a `dtype` number).

    Raises:
        TypeError: `value` is not a real number.
        ValueError: otherwise refused, as above.
    """
    if received is None:
        received = f"{argument}={_short_repr(value)}"
    if not is_real_number(value):
        raise TypeError(
            f"'{argument}' must be {allowed}. Received: "
            f"{argument}={describe(value)}"
        )
    refused = f"'{argument}' must be {allowed}. Received: {received}"
    if _is_nan(value):
        raise ValueError(refused)
    rounded = _rounded(value, dtype)
    if _is_finite(value):
        exact = _exact(value)
        if math.isinf(rounded):
            largest = float(np.finfo(dtype).max)
            raise ValueError(
                f"{refused}, which overflows {dtype} (its largest value is "
                f"{largest:.8g})"
            )
        if rounded == 0 and exact != 0:
            raise ValueError(f"{refused}, which rounds to 0 in {dtype}")
        if not in_range(rounded):
            if fractions.Fraction(rounded) != exact:
                refused += f", which rounds to {rounded!r} in {dtype}"
            raise ValueError(refused)
    elif not in_range(rounded):
        raise ValueError(refused)
    return rounded


def _short_repr(value) -> str:
    text = repr(value)
    if isinstance(value, np.generic) and type(value).__name__ not in text:
        text = f"{type(value).__name__}({text})"  # ml_dtypes: bfloat16(inf)
    return text if len(text) <= 200 else text[:197] + "..."


def _is_nan(value) -> bool:
    if isinstance(value, decimal.Decimal):
        return value.is_nan()
    if isinstance(value, numbers.Rational):
        return False
    return bool(np.isnan(value))


def _is_finite(value) -> bool:
    if isinstance(value, decimal.Decimal):
        return value.is_finite()
    if isinstance(value, numbers.Rational):
        return True
    return bool(np.isfinite(value))


def _exact(value) -> fractions.Fraction:
    """A finite number's exact value."""
    if isinstance(value, numbers.Integral):
        return fractions.Fraction(int(value))
    if isinstance(value, (fractions.Fraction, decimal.Decimal, float)):
        return fractions.Fraction(value)
    if isinstance(value, np.floating):
        return fractions.Fraction(*value.as_integer_ratio())
    if isinstance(value, numbers.Rational):
        return fractions.Fraction(value.numerator, value.denominator)
    return fractions.Fraction(float(value))  # An ml_dtypes float: exact.


def _rounded(value, dtype: str) -> float:
    """`value` rounded to `dtype` (to inf beyond its range), as a float."""
    if not isinstance(value, np.generic):
        try:
            value = float(value)  # Exact for an int up to 2**53.
        except OverflowError:  # An int or Fraction beyond float64.
            value = math.inf if value > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.dtype(dtype).type(value))


def checked_integer(
    value, argument: str, minimum: int, maximum: int, allowed: str
) -> int:
    """`value` as an int if it is an integer (not a bool) in [min, max]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, numbers.Integral
    ):
        raise TypeError(
            f"'{argument}' must be {allowed}. Received: "
            f"{argument}={describe(value)}"
        )
    # As a Python int: NumPy would compare an int8 with a bound it cannot
    # hold in int8.
    if not minimum <= int(value) <= maximum:
        raise ValueError(
            f"'{argument}' must be {allowed}. Received: {argument}={value!r}"
        )
    return int(value)


def concrete_value(value) -> Optional[float]:
    """A scalar tensor's or variable's value as a float, when it has one now.

    None for a symbolic tensor (inside a `tf.function` or a JAX trace).
    """
    if backend.is_tensorflow():
        tf = backend.tensorflow()
        if isinstance(value, keras.Variable):
            value = value.value
        if isinstance(value, tf.Variable):
            if not tf.executing_eagerly():
                return None
            return float(value.numpy())
        if isinstance(value, tf.Tensor):
            static = tf.get_static_value(value)
            return None if static is None else float(static)
    try:
        return float(keras.ops.convert_to_numpy(value))
    except Exception:  # A tracer: no value until the trace runs.
        return None


def is_finite_number(value: float) -> bool:
    """Whether `value`, a Python float, is finite and fits in float32."""
    return -_FLOAT32_MAX <= float(value) <= _FLOAT32_MAX


def checked_gradients(grads, variables) -> List:
    """`grads` as tensors, after checking each against its variable.

    There must be one gradient per variable. A gradient may be None, a
    `tf.IndexedSlices` (rows of its variable; TensorFlow only) or anything
    convertible to a floating tensor of its variable's shape; each variable
    must be a Keras variable (or a TensorFlow one). Only static shapes and
    dtypes are read, so inside a traced function this adds no op.

    Raises:
        TypeError: a variable is not one, or a gradient is not floating.
        ValueError: the counts differ, or a gradient's shape is not its
            variable's.
    """
    if len(grads) != len(variables):
        raise ValueError(
            "There must be one gradient per variable. Received "
            f"{len(grads)} gradients for {len(variables)} variables."
        )
    checked = []
    for index, (gradient, variable) in enumerate(zip(grads, variables)):
        if not is_variable(variable):
            raise TypeError(
                "Every variable must be a Keras variable, such as those in "
                "model.trainable_variables. Received at position "
                f"{index}: {describe(variable)}"
            )
        if gradient is not None:
            gradient = _checked_gradient(gradient, variable, index)
        checked.append(gradient)
    return checked


def variable_name(variable) -> str:
    """A variable's path (Keras) or name (TensorFlow)."""
    return getattr(variable, "path", None) or variable.name


def _checked_gradient(gradient, variable, index: int):
    where = f"The gradient of {variable_name(variable)!r} (position {index})"
    shape = tuple(variable.shape)
    if is_indexed_slices(gradient):
        tf = backend.tensorflow()
        values = gradient.values
        dense_shape = tf.get_static_value(gradient.dense_shape)
        fits = len(shape) != 0 and values.shape[1:].is_compatible_with(
            shape[1:]
        )
        if dense_shape is not None:
            fits = fits and tuple(dense_shape.tolist()) == shape
        received = (
            "a tf.IndexedSlices with values of shape "
            f"{shape_text(values.shape)} and dense_shape "
            f"{shape_text(dense_shape)}"
        )
    else:
        if not is_tensor(gradient):
            try:
                gradient = keras.ops.convert_to_tensor(gradient)
            except Exception:
                raise TypeError(
                    f"{where} must be a floating tensor or None. Received: "
                    f"{describe(gradient)}"
                ) from None
        values = gradient
        fits = _shapes_compatible(gradient.shape, shape)
        received = None  # Described only for the error: not on every step.
    if dtype_name(values) not in FLOATING_DTYPES:
        raise TypeError(
            f"{where} must be floating point. Received: {describe(values)}"
        )
    if not fits:
        # tf.IndexedSlices exist on TensorFlow only: named there only.
        sparse = " (a tf.IndexedSlices: rows of it)" * backend.is_tensorflow()
        raise ValueError(
            f"{where} must have its variable's shape {shape_text(shape)}"
            f"{sparse}. Received: {received or describe(gradient)}"
        )
    return gradient


def _shapes_compatible(shape, expected) -> bool:
    """Whether a (possibly partly unknown) shape can be `expected`."""
    if _TENSOR_SHAPE is not None:
        return _TENSOR_SHAPE(shape).is_compatible_with(expected)
    shape = tuple(shape)
    return len(shape) == len(expected) and all(
        a is None or b is None or int(a) == int(b)
        for a, b in zip(shape, expected)
    )


def largest_float32() -> float:
    """The largest finite float32, about 3.4e38."""
    return _FLOAT32_MAX
