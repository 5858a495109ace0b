"""Checks of user input shared by kmp's optimizers, and how errors show values.

>>> describe([1, 2])
'[1, 2] of type list'
"""

import numbers
from typing import Callable
from typing import List

from kmp._backend import keras
from kmp._backend import tf

_VARIABLE_TYPES = (keras.Variable, tf.Variable)


def describe(value) -> str:
    """A short description of a user's value for an error message."""
    if isinstance(value, (tf.Tensor, *_VARIABLE_TYPES)):
        # A Keras variable's dtype is a string, a TensorFlow one's a DType.
        dtype = tf.as_dtype(value.dtype).name
        kind = "a tensor" if isinstance(value, tf.Tensor) else "a variable"
        return f"{kind} of dtype {dtype} and shape {_shape_text(value.shape)}"
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{text} of type {type(value).__name__}"


def checked_number(
    value, argument: str, allowed: str, in_range: Callable[[float], bool]
) -> float:
    """`value` as a float, if it is a real number (not a bool) in range.

    `allowed` completes "'argument' must be ..." in the errors. The range is
    checked before float(), which overflows on a huge int; `in_range` must
    be false for NaN (a comparison is).

    Raises:
        TypeError: `value` is not a number.
        ValueError: `in_range(value)` is false.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"'{argument}' must be {allowed}. Received: "
            f"{argument}={describe(value)}"
        )
    if not in_range(value):
        raise ValueError(
            f"'{argument}' must be {allowed}. Received: {argument}={value!r}"
        )
    return float(value)


def checked_gradients(grads, variables) -> List:
    """`grads` as tensors, after checking each against its variable.

    There must be one gradient per variable. A gradient may be None, a
    `tf.IndexedSlices` (of rows of its variable) or anything convertible to
    a floating tensor of its variable's shape; each variable must be a Keras
    or TensorFlow variable. Only static shapes and dtypes are read, so in a
    `tf.function` this runs once, when it is traced, and adds no op. The
    error names the position and the variable.

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
        if not isinstance(variable, _VARIABLE_TYPES):
            raise TypeError(
                "Every variable must be a Keras or TensorFlow variable, such "
                "as those in model.trainable_variables. Received at position "
                f"{index}: {describe(variable)}"
            )
        if gradient is not None:
            gradient = _checked_gradient(gradient, variable, index)
        checked.append(gradient)
    return checked


def _checked_gradient(gradient, variable, index: int):
    name = getattr(variable, "path", None) or variable.name
    where = f"The gradient of {name!r} (position {index})"
    shape = tf.TensorShape(variable.shape)
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values
        dense_shape = tf.get_static_value(gradient.dense_shape)
        fits = shape.rank != 0 and values.shape[1:].is_compatible_with(
            shape[1:]
        )
        if dense_shape is not None:
            fits = fits and shape.is_compatible_with(dense_shape.tolist())
        received = (
            "a tf.IndexedSlices with values of shape "
            f"{_shape_text(values.shape)} and dense_shape "
            f"{_shape_text(dense_shape)}"
        )
    else:
        try:
            gradient = tf.convert_to_tensor(gradient)
        except (TypeError, ValueError):
            raise TypeError(
                f"{where} must be a floating tensor, a tf.IndexedSlices or "
                f"None. Received: {describe(gradient)}"
            ) from None
        values = gradient
        fits = gradient.shape.is_compatible_with(shape)
        received = describe(gradient)
    if not values.dtype.is_floating:
        raise TypeError(
            f"{where} must be floating point. Received: {describe(values)}"
        )
    if not fits:
        raise ValueError(
            f"{where} must have its variable's shape {_shape_text(shape)} (a "
            f"tf.IndexedSlices: rows of it). Received: {received}"
        )
    return gradient


def _shape_text(shape) -> str:
    """`(2, 3)`, or "unknown" for a shape of unknown rank (or None)."""
    if shape is None:
        return "unknown"
    if not isinstance(shape, tf.TensorShape):
        shape = tf.TensorShape(list(shape))  # A tuple or a NumPy array.
    return "unknown" if shape.rank is None else str(tuple(shape.as_list()))
