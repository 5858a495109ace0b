"""The tensor math of loss scaling, on any Keras backend.

Scaling and unscaling happen in float32 (or float64), never in float16:
1 / 2**25 is 0 in float16, and a float16 loss times 2**16 is inf. Results
keep the dtype of what was scaled. The finite check is exact: a step is
skipped only for an inf or NaN element, never for finite values whose sum
overflows.

>>> import numpy as np
>>> bool(all_finite([np.float32([3e38, 3e38])]))
True
>>> bool(all_finite([np.float32([1.0, np.nan]), None]))
False
"""

from typing import Iterable
from typing import List

from keras import ops

from kmp.core import backend
from kmp.core import checks


def _values(gradient):
    """A gradient's dense values (a `tf.IndexedSlices`' values)."""
    return gradient.values if checks.is_indexed_slices(gradient) else gradient


def scale_tensor(tensor, scale, divide: bool):
    """`tensor * scale` or `tensor / scale`, in float32 or wider.

    The result keeps `tensor`'s dtype.
    """
    dtype = checks.dtype_name(tensor)
    if dtype in checks.LOW_PRECISION_DTYPES:
        wide = ops.cast(tensor, "float32")
        scale = ops.cast(scale, "float32")
        wide = ops.divide(wide, scale) if divide else ops.multiply(wide, scale)
        return ops.cast(wide, dtype)
    scale = ops.cast(scale, dtype)
    return ops.divide(tensor, scale) if divide else ops.multiply(tensor, scale)


def unscale_gradients(gradients: Iterable, scale, keep=()) -> List:
    """Divides every gradient by `scale` (None stays None; `keep` indices too).

    One op per gradient, which runs as soon as that gradient is computed,
    alongside the rest of the backward pass (torch's step uses one
    multi-tensor op per dtype instead, `kmp.core.torch.step.unscale`).
    Sparse gradients are divided on their values and stay sparse.
    """
    return _each(gradients, keep, lambda t: scale_tensor(t, scale, True))


def unscale_by_reciprocal(gradients: Iterable, scale, keep=()) -> List:
    """`unscale_gradients` as a multiplication by `1 / scale` (in float32):
    the same values where `scale` is a power of two, whose reciprocal
    float32 holds exactly (then both are the one correctly rounded
    quotient); within an ulp of them otherwise. XLA fuses a multiplication,
    unlike a division, into each of the fusions that read it."""
    factor = ops.divide(1.0, ops.cast(scale, "float32"))
    return _each(gradients, keep, lambda t: scale_tensor(t, factor, False))


def _each(gradients, keep, scale_one) -> List:
    """`scale_one` of every gradient but None and the indices in `keep`;
    a sparse gradient's values, and it stays sparse."""
    result = []
    for index, gradient in enumerate(gradients):
        if gradient is None or index in keep:
            result.append(gradient)
        elif checks.is_indexed_slices(gradient):
            values = scale_one(gradient.values)
            result.append(
                _tf().IndexedSlices(
                    values, gradient.indices, gradient.dense_shape
                )
            )
        else:
            result.append(scale_one(gradient))
    return result


def _tf():
    return backend.tensorflow()


def all_finite(gradients: Iterable):
    """A bool scalar tensor: whether no gradient holds an inf or a NaN.

    Elementwise and exact, without a conditional (on a GPU, XLA's, and
    torch's Python `if`, waits for the device): gradients of one shape and
    dtype are checked together (their flags AND-ed elementwise, then one
    reduction), so XLA reads every gradient of a group in one fused kernel,
    rather than one reduction per gradient. TensorFlow's step decides with
    a quick sum first (`all_finite_quick_sum_first`).
    """
    present = [_values(g) for g in gradients if g is not None]
    if not present:
        return ops.convert_to_tensor(True)
    groups = {}
    for gradient in present:
        key = (tuple(gradient.shape), checks.dtype_name(gradient))
        groups.setdefault(key, []).append(ops.isfinite(gradient))
    flags = []
    for (shape, _), group in groups.items():
        if None in shape:
            flags += [ops.all(flag) for flag in group]
            continue
        together = group[0]
        for flag in group[1:]:
            together = ops.logical_and(together, flag)
        flags.append(ops.all(together))
    return flags[0] if len(flags) == 1 else ops.all(ops.stack(flags))


def all_finite_quick_sum_first(gradients: Iterable, add_n=None):
    """`all_finite`, decided by a quick sum of everything when that is
    finite (as it is on almost every step): TensorFlow's
    (`kmp.core.tensorflow.step`), where the sum's few ops (`add_n`, its one
    op for a sum of many tensors) cost less than a check per group. Only
    when the sum is not finite does the elementwise check run, in a
    conditional, to tell an inf or NaN from finite values whose sum
    overflowed."""
    present = [_values(g) for g in gradients if g is not None]
    if not present:
        return ops.convert_to_tensor(True)
    quick = ops.isfinite(_quick_sum(present, add_n or _add))
    return ops.cond(
        quick,
        lambda: ops.convert_to_tensor(True),
        lambda: all_finite(present),
    )


def _quick_sum(gradients, add_n) -> object:
    """The sum of all elements (low precision in float32), as float32.

    Gradients of one shape and dtype are added elementwise first: a few ops
    per shape rather than one per gradient, which matters for models of
    hundreds of small variables. Any inf or NaN makes it non-finite; so may
    finite values whose sum overflows, which the exact check then clears.
    """
    groups = {}
    sums = []
    for gradient in gradients:
        dtype = checks.dtype_name(gradient)
        shape = tuple(gradient.shape)
        if dtype in checks.LOW_PRECISION_DTYPES:
            sums.append(ops.sum(ops.cast(gradient, "float32")))
        elif None in shape:
            sums.append(ops.cast(ops.sum(gradient), "float32"))
        else:
            groups.setdefault((shape, dtype), []).append(gradient)
    for group in groups.values():
        total = group[0] if len(group) == 1 else add_n(group)
        sums.append(ops.cast(ops.sum(total), "float32"))
    return sums[0] if len(sums) == 1 else add_n(sums)


def _add(tensors):
    total = tensors[0]
    for tensor in tensors[1:]:
        total = ops.add(total, tensor)
    return total


def finite_per_gradient(gradients: Iterable) -> List:
    """A bool scalar tensor per gradient: whether it is free of inf/NaN."""
    return [
        ops.convert_to_tensor(True)
        if g is None
        else ops.all(ops.isfinite(_values(g)))
        for g in gradients
    ]
