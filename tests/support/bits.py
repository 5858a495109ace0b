"""Bit-for-bit comparison of variables, on every backend.

Not a test module: `values` copies the variables of models, optimizers or
layers into NumPy, `assert_bits_equal` compares two such lists byte for
byte (dtype and shape first; NaN payloads and -0.0 count). The adversarial
suite (`tests/adversarial`) and the seams matrix (`tests/seams`) share them.
"""

import keras
import numpy as np


def values(*objects):
    """NumPy copies of the variables of `objects` (optimizers, models,
    layers, variables, or lists of them), in order."""
    out = []
    for obj in objects:
        if isinstance(obj, (list, tuple)):
            out += values(*obj)
            continue
        variables = obj.variables if hasattr(obj, "variables") else [obj]
        out += [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
    return out


def assert_bits_equal(actual, expected, what="value"):
    """Same dtypes, shapes and bytes (NaN payloads and -0.0 included)."""
    assert len(actual) == len(expected), (what, len(actual), len(expected))
    for index, (a, b) in enumerate(zip(actual, expected)):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, index)
        if a.tobytes() != b.tobytes():
            raise AssertionError(f"{what} {index} differs:\n{a}\n!=\n{b}")
