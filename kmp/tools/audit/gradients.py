"""The loss's gradients at every layer call, for `kmp.audit`.

`Gradients(probe, loss_fn)` computes, for a batch, the gradient of the
loss (the mean of `loss_fn` per output, summed over the outputs) with
respect to every floating output of every call of the probe's float32
model and, for the first call of each layer, to its trainable weights.
A zero tensor added to each call output on the way (a tap, see
`kmp.tools.audit.probe.Probe`) gives the gradient at that output on every
backend; `kmp.tools.audit.backend` differentiates (`tf.GradientTape`,
`jax.value_and_grad`, `torch.autograd.grad`).

On JAX, where the gradient of a value the loss does not depend on is zero
rather than None, such a value counts as a gradient of zeros (no
underflow) where TensorFlow and torch leave the cell empty.
"""

from typing import List
from typing import Tuple

import keras
import numpy as np

from kmp.tools.audit import backend as gradients
from kmp.tools.audit import data as audit_data
from kmp.tools.audit import probe as audit_probe


class Gradients:
    """The gradients of the loss at each call of `probe`, batch by batch.

    Calling it with a batch's values (what `probe(x)` returned), `x` and
    `y` (a list of targets, one per output) returns two lists, one entry
    per call: the gradients with respect to its outputs, and with respect
    to its trainable weights (empty but for a layer's first call), as
    float32 NumPy arrays; a gradient that is None is left out.
    """

    def __init__(self, probe: audit_probe.Probe, loss_fn):
        self._probe = probe
        self._loss_fn = loss_fn
        self._first_calls = {}
        for index, call in enumerate(probe.calls):
            self._first_calls.setdefault(id(call.operation), index)
        weights = {}  # Each variable once (shared layers; JAX needs it).
        for index in self._first_calls.values():
            for weight in audit_probe.trainable_weights(probe.calls[index]):
                weights.setdefault(id(weight), weight)
        self._weights = list(weights.values())
        start = len(probe.inputs)
        self._outputs = slice(start, start + len(probe.outputs))
        # Set at the first batch: the floating call outputs that are not
        # None, and the gradient function (compiled once on JAX).
        self._positions = None
        self._run = None

    def __call__(self, values, x, y) -> Tuple[List[list], List[list]]:
        probe = self._probe
        if self._run is None:
            self._positions = [
                position
                for positions in probe.tap_positions
                for position in positions
                if values[position] is not None
            ]
            self._run = gradients.gradient_function(self._loss, self._weights)
        taps = [_zeros_like(values[p]) for p in self._positions]
        _, _, tap_gradients, weight_gradients = self._run(taps, x, y)
        at_position = dict(zip(self._positions, tap_gradients))
        of_weight = {id(w): g for w, g in zip(self._weights, weight_gradients)}
        output_gradients, call_weight_gradients = [], []
        for index, call in enumerate(probe.calls):
            output_gradients.append(
                [
                    audit_probe.numpy_float32(at_position[position])
                    for position in probe.tap_positions[index]
                    if at_position.get(position) is not None
                ]
            )
            weight_gradients = []
            if self._first_calls[id(call.operation)] == index:
                weight_gradients = [
                    audit_probe.numpy_float32(of_weight[id(weight)])
                    for weight in audit_probe.trainable_weights(call)
                    if of_weight[id(weight)] is not None
                ]
            call_weight_gradients.append(weight_gradients)
        return output_gradients, call_weight_gradients

    def _loss(self, taps, x, y):
        """The loss of the probe's model on `x`, `y`, with `taps` added."""
        probe = self._probe
        values = probe(x, dict(zip(self._positions, taps)))
        losses = [
            audit_data.mean_loss(self._loss_fn, target, output, name)
            for target, output, name in zip(
                y, values[self._outputs], probe.output_names
            )
        ]
        return sum(losses[1:], losses[0]), None


def _zeros_like(value):
    # Made in NumPy: no op to compile per shape on JAX.
    zeros = np.zeros(tuple(value.shape), np.float32)
    return keras.ops.convert_to_tensor(zeros, value.dtype)


__all__ = ["Gradients"]
