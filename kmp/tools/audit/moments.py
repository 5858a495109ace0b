"""How much of Adam's update 8-bit moments lose, per layer.

`kmp.LowPrecisionOptimizer(..., slot_dtype="8bit")` keeps Adam's moments in 8
bits per element with a scale per block (`kmp.core.low_bit.quantization`). Where
a block mixes values many decades apart, its small values lose most of their
precision. What matters is the update the moments give, `m / (sqrt(v) + eps)`,
so that is what is measured: the audit's batch gradients of each weight are
averaged into Adam's two moments (its default betas, the batches in order), the
moments are written to 8 bits and read back, and the update from them is
compared with the exact one: `||u_8bit - u|| / ||u||`. Weights smaller than the
optimizer's `min_8bit_size` (4096 elements by default) keep their moments and
are not measured. With few batches the moments are a few gradients' averages:
the measure shows how the values of a layer spread within its blocks, which is
what decides.
"""

import math

import numpy as np
from keras import ops

from kmp.core.low_bit import codes
from kmp.core.low_bit import quantization

BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7
# The largest error of a layer's update that 8 bits may make before the
# audit suggests keeping that layer's moments at full precision.
MAX_ERROR = 0.1


class Moments:
    """Adam's moments of one layer call's weights, batch by batch."""

    def __init__(self):
        self._moments = []  # [m, v] per weight (float64), in order.
        self._steps = 0

    def add(self, weight_gradients) -> None:
        """Adds one batch's gradients (one float32 array per weight)."""
        if not weight_gradients:
            return
        if not self._moments:
            self._moments = [
                [np.zeros(g.shape), np.zeros(g.shape)] for g in weight_gradients
            ]
        self._steps += 1
        for (m, v), gradient in zip(self._moments, weight_gradients):
            g = gradient.astype(np.float64)
            m += (1 - BETA_1) * (g - m)
            v += (1 - BETA_2) * (g * g - v)

    def error(
        self,
        min_size: int = quantization.MIN_8BIT_SIZE,
        block_size: int = quantization.BLOCK_SIZE,
    ):
        """The largest relative error of the update over the weights of
        `min_size` elements or more; None if there is none."""
        errors = [
            update_error(m, v, self._steps, block_size)
            for m, v in self._moments
            if m.size >= min_size
        ]
        return max(errors) if errors else None


def _round_trip(value, name, block_size):
    encoded = quantization.encode(
        ops.convert_to_tensor(value.astype(np.float32)), name
    )
    signed = quantization.is_signed(name)
    code = codes.CODES["8bit"]
    data, scales = quantization.quantize(encoded, code, signed, block_size)
    back = quantization.dequantize(
        data, scales, code, signed, value.shape, block_size
    )
    return np.asarray(
        ops.convert_to_numpy(quantization.decode(back, name)), np.float64
    )


def update_error(m, v, steps, block_size=quantization.BLOCK_SIZE) -> float:
    """`||u_8bit - u|| / ||u||` for Adam's update `u` from moments `m`, `v`
    after `steps` steps (0 if the update is 0).

    >>> m = np.full((64,), 0.1); v = np.full((64,), 0.01)
    >>> update_error(m, v, 1, block_size=64) < 1e-6  # One value per block.
    True
    """
    correction = math.sqrt(1 - BETA_2**steps) / (1 - BETA_1**steps)
    exact = correction * m / (np.sqrt(v) + EPSILON)
    m8 = _round_trip(m, "momentum", block_size)
    v8 = _round_trip(v, "velocity", block_size)
    approximate = correction * m8 / (np.sqrt(v8) + EPSILON)
    norm = float(np.linalg.norm(exact))
    if norm == 0.0:
        return 0.0
    return float(np.linalg.norm(approximate - exact)) / norm


__all__ = ["MAX_ERROR", "Moments", "update_error"]
