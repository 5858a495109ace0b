"""The data and loss `kmp.audit` is given, checked and cut into batches.

Every check raises at the user's call, naming the argument: `x` and `y` are
arrays (NumPy arrays or tensors) or lists, tuples or dicts of them, with one
row per sample; the loss is a name, a `keras.losses.Loss` or a function of
`(y_true, y_pred)` returning numbers.

>>> x, rows = as_arrays([np.ones((3, 2)), np.zeros((3,))], "x")
>>> rows, [a.shape for a in x]
(3, [(3, 2), (3,)])
"""

import numbers
from typing import Callable
from typing import Optional

import keras
import numpy as np

from kmp.core.checks import describe
from kmp.tools.audit.backend import SHAPE_ERRORS
from kmp.tools.audit.probe import output_names


def resolve_loss(loss, model, needed: bool) -> Optional[Callable]:
    """The loss function: `loss`, else the compiled one; None if not needed."""
    if loss is None and needed:
        loss = getattr(model, "loss", None) if model.compiled else None
        if loss is None:
            raise ValueError(
                "audit() needs a loss to measure gradients: pass loss= (a "
                "name such as 'mse' or a keras.losses.Loss), compile the "
                "model with one, or pass y=None to audit activations only."
            )
        if not (isinstance(loss, str) or callable(loss)):
            raise ValueError(
                f"Model {model.name!r} was compiled with one loss per output "
                f"({loss!r}); audit() applies a single loss to every output. "
                "Pass it explicitly, e.g. audit(model, x, y, loss='mse')."
            )
    if isinstance(loss, type):
        raise TypeError(
            "'loss' must be a loss instance, not a class: pass "
            f"loss={loss.__name__}() (e.g. keras.losses.MeanSquaredError()). "
            f"Received: loss={loss!r}"
        )
    if loss is not None and not (isinstance(loss, str) or callable(loss)):
        raise TypeError(
            "'loss' must be a loss name (such as 'mse'), a keras.losses.Loss "
            "or a callable(y_true, y_pred), one for every output. Received: "
            f"loss={loss!r} of type {type(loss).__name__}"
        )
    if not needed:
        return None
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def _loss_name(loss_fn) -> str:
    return getattr(loss_fn, "name", None) or getattr(
        loss_fn, "__name__", type(loss_fn).__name__
    )


def mean_loss(loss_fn, target, output, output_name: str):
    """The mean of `loss_fn(target, output)`, as float32.

    A target that does not fit the output (the loss fails on it) and a loss
    that returns no numbers are reported as the user's `y` and `loss`.
    """
    name = _loss_name(loss_fn)
    try:
        value = loss_fn(target, output)
    except SHAPE_ERRORS as error:
        raise ValueError(
            f"'y' does not fit model output {output_name!r} under the loss "
            f"{name!r}: target shape {tuple(target.shape)}, output shape "
            f"{tuple(output.shape)}. The loss failed with: {error}"
        ) from error
    dtype = _dtype(value)
    if dtype is None or not ("float" in dtype or "int" in dtype):
        returned = type(value).__name__ if dtype is None else dtype
        raise TypeError(
            f"'loss' must return numbers (the losses per sample). Received: "
            f"the loss {name!r}, which returned {returned}"
        )
    return keras.ops.mean(keras.ops.cast(value, "float32"))


def _dtype(value) -> Optional[str]:
    """The dtype name of what a loss returned, or None if not numbers."""
    try:
        return keras.backend.standardize_dtype(
            keras.ops.convert_to_tensor(value).dtype
        )
    except (TypeError, ValueError):
        return None


def _is_array(value) -> bool:
    return isinstance(value, (np.ndarray, keras.Variable)) or (
        keras.ops.is_tensor(value)
    )


def as_arrays(value, argument: str):
    """`value` (x or y) with NumPy arrays for leaves, and its number of rows.

    Allowed: an array (NumPy array or tensor), or a list, tuple or dict of
    arrays, all with the same number of rows (samples).
    """
    allowed = (
        f"'{argument}' must be an array (a NumPy array or tensor), or a list, "
        "tuple or dict of arrays"
    )
    if isinstance(value, dict):
        leaves = list(value.values())
    elif isinstance(value, (list, tuple)):
        leaves = list(value)
    else:
        leaves = [value]
    for leaf in leaves:
        if not _is_array(leaf):
            hint = ""
            if isinstance(value, (list, tuple)):
                hint = f" For lists of numbers, pass np.asarray({argument})."
            held = "" if leaf is value else f" holding a {type(leaf).__name__}"
            raise TypeError(
                f"{allowed}. Received: {argument}={describe(value)}{held}."
                f"{hint}"
            )
    if not leaves:
        raise ValueError(
            f"{allowed}; it holds none. Received: {argument}={value!r}"
        )
    arrays = [
        leaf
        if isinstance(leaf, np.ndarray)
        else keras.ops.convert_to_numpy(leaf)
        for leaf in leaves
    ]
    for array in arrays:
        if array.dtype.kind in "OSU":
            raise TypeError(
                f"{allowed} of numbers. Received: {argument} holding an array "
                f"of dtype {array.dtype}"
            )
        if array.ndim == 0:
            raise ValueError(
                f"{allowed}, with one row per sample. Received: {argument} "
                f"holding a scalar (shape ())"
            )
    shapes = [array.shape for array in arrays]
    if len({shape[0] for shape in shapes}) > 1:
        raise ValueError(
            f"Every array in '{argument}' must have the same number of rows "
            f"(samples). Received: {argument} with shapes "
            f"{', '.join(map(str, shapes))}"
        )
    if shapes[0][0] == 0:
        raise ValueError(
            f"'{argument}' holds no samples (its first dimension is 0). "
            f"Received: {argument} with shape(s) {', '.join(map(str, shapes))}"
        )
    if isinstance(value, dict):
        return dict(zip(value, arrays)), shapes[0][0]
    if isinstance(value, (list, tuple)):
        return arrays, shapes[0][0]
    return arrays[0], shapes[0][0]


def targets(y, model, samples: int):
    """`y` as a list of arrays in the order of the model's outputs."""
    y, rows = as_arrays(y, "y")
    names = output_names(model)
    if isinstance(y, dict):
        if set(y) != set(names):
            raise ValueError(
                "'y' as a dict must have one key per model output, named "
                f"after it: {names}. Received: y with keys {list(y)}"
            )
        y = [y[name] for name in names]
    targets = y if isinstance(y, list) else [y]
    if len(targets) != len(names):
        raise ValueError(
            f"'y' must hold one target per model output: the model has "
            f"{len(names)} output(s), y has {len(targets)}."
        )
    if rows != samples:
        raise ValueError(
            f"'y' must have one row per sample of 'x', {samples}. Received: "
            f"y with {rows} rows"
        )
    return targets


def batches(x, y, samples, batch_size, steps):
    for start in range(0, min(samples, batch_size * steps), batch_size):
        chunk = slice(start, start + batch_size)
        yield _take(x, chunk), None if y is None else _take(y, chunk)


def _take(structure, chunk: slice):
    return keras.tree.map_structure(lambda array: array[chunk], structure)


def checked_positive_int(value, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"'{argument}' must be a positive integer. Received: "
            f"{argument}={value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"'{argument}' must be a positive integer. Received: "
            f"{argument}={value!r}"
        )
    return int(value)


__all__ = [
    "as_arrays",
    "batches",
    "checked_positive_int",
    "mean_loss",
    "resolve_loss",
    "targets",
]
