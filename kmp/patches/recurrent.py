"""Patch `recurrent`: recurrent layers cast their weights once per call.

Under a mixed policy Keras 3 casts a layer's float32 variables to the compute
dtype where the layer reads them. Its recurrent layers read them in the cell,
and the cell runs inside the loop over time steps, so on TensorFlow without
cuDNN every step of `LSTM`, `GRU` and `SimpleRNN` reads the kernel, the
recurrent kernel and the bias, casts them again, and keeps each step's copy
for the backward pass. The patch makes these layers read and cast each
weight once per call, before the loop, and gives the loop that tensor.

The results stay bit-identical to Keras's: the loop computes with the same
cast values, and the gradient still reaches each variable as Keras's
per-step cast sends it (each step's gradient cast to float32, then summed over
the steps in float32), not summed in the compute dtype first
(`set_exact(False)` sums it in the compute dtype, as `tf.keras` did:
faster, rounded differently). Layers running
in their variables' dtype (float32 policies), custom cells, stacked cells,
`stateless_call` and symbolic tracing keep Keras's own path. Nothing about a
layer's config or weights changes, so models save and load as before.

It replaces `keras.src.layers.rnn.rnn.RNN.inner_loop` (the method every
recurrent layer runs its loop through on this backend) with a wrapper that
enters a Keras `AutocastScope` which hands out the cast tensors.
TensorFlow backend only.
"""

import keras
from keras.src.backend.common import variables as _keras_variables
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.layers.rnn import rnn as _keras_rnn

from kmp.core import backend
from kmp.core import checks
from kmp.patches import registry

# Cells whose step only reads their variables, never assigns them.
_CELLS = (
    keras.layers.LSTMCell,
    keras.layers.GRUCell,
    keras.layers.SimpleRNNCell,
)


class _Settings:
    exact = True


# Kept by importlib.reload, which runs this module again in the same dict.
_settings = globals().get("_settings") or _Settings()


def set_exact(exact: bool) -> None:
    """Chooses how the gradient reaches the weights (see the docstring).

    Args:
        exact: `True` (default): outputs and gradients are bit-identical to
            Keras's. `False`: the loop uses the cast weights directly, so
            TensorFlow sums their gradient over the time steps in the compute
            dtype before casting it to float32 once (as `tf.keras` did). The
            outputs are still identical and the backward pass is faster, but
            the gradients are rounded differently. From the next trace on.

    Raises:
        TypeError: `exact` is not a bool.

    >>> set_exact(True)
    """
    _settings.exact = checks.checked_bool(exact, "exact")


def _cast_once(tf, variable, dtype, exact):
    """Reads `variable`, casts it to `dtype` and returns a reader of the cast.

    The reader is called wherever the layer reads the variable, inside the
    time loop too, and returns the cast tensor. With `exact`, its gradient is
    the incoming one cast to the variable's dtype, as the gradient of a cast
    at that place would be, so the gradient of every step reaches the
    variable as before; without, the loop uses the cast tensor directly and
    TensorFlow sums its gradient over the steps in `dtype`.
    """
    value = tf.convert_to_tensor(variable)
    if not exact:
        cast = tf.cast(value, dtype)
        return lambda: cast
    cast = tf.stop_gradient(tf.cast(value, dtype))

    @tf.custom_gradient
    def read(value):
        def gradient(upstream):
            return tf.cast(upstream, value.dtype)

        return tf.identity(cast), gradient

    return lambda: read(value)


class _CastOnceScope(_keras_variables.AutocastScope):
    """An `AutocastScope` that casts the given variables once, on entry."""

    def __init__(self, dtype, variables, exact):
        super().__init__(dtype)
        tf = backend.tensorflow()
        self._readers = {}
        for variable in variables:
            # `_value` is the backend variable that `KerasVariable.value`
            # passes to `maybe_cast`; `_dtype` is its own dtype (`dtype`
            # answers the autocast one inside the scope).
            value = variable._value
            if (
                value is None
                or not variable._autocast
                or not _keras_variables.is_float_dtype(variable._dtype)
                or variable._dtype == self.dtype
            ):
                continue
            self._readers[id(value)] = (
                value,
                _cast_once(tf, value, self.dtype, exact),
            )

    def maybe_cast(self, value):
        entry = self._readers.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]()
        return super().maybe_cast(value)


def inner_loop(original, self, sequences, initial_state, mask, training=False):
    """`RNN.inner_loop`, with the cell's weights cast once beforehand."""
    scope = _keras_variables.get_autocast_scope()
    if (
        scope is None
        or scope.dtype is None
        or isinstance(scope, _CastOnceScope)
        or not isinstance(self.cell, _CELLS)
        or in_stateless_scope()
        or in_symbolic_scope()
    ):
        return original(self, sequences, initial_state, mask, training=training)
    with _CastOnceScope(scope.dtype, self.cell.variables, _settings.exact):
        return original(self, sequences, initial_state, mask, training=training)


PATCH = registry.Patch(
    name="recurrent",
    kind=registry.PERFORMANCE,
    summary=(
        "LSTM, GRU and SimpleRNN under a mixed policy cast their weights "
        "once per call instead of at every time step (bit-identical)"
    ),
    targets=lambda: [registry.Target(_keras_rnn.RNN, "inner_loop", inner_loop)],
    backends=("tensorflow",),
    tensorflow_versions=registry.TESTED_TENSORFLOW,
)
