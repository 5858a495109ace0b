"""Adam whose update is one in-place TensorFlow kernel per variable.

Keras 3's Adam updates a variable with about ten separate elementwise
operations (each a pass over the variable's memory, most making a new
tensor); tf_keras used TensorFlow's fused `ResourceApplyAdam` kernel, which
updates the variable and both moments in one pass, in place. The update is
float32 work of the same size under every policy, so it is the part of a
mixed-precision step that does not get faster: on a 784-4096-4096-10 MLP it
is most of a `mixed_bfloat16` step (see `benchmarks/diagnostics/op_profile.py`).

`FusedAdam` is `keras.optimizers.Adam` (same arguments, variables, config and
checkpoints) with that kernel. Its arithmetic is Adam's, rounded differently
in the last bits: TensorFlow computes `1 - beta_1` in the variable's dtype and
may contract a multiply and an add, so it is close to Keras's Adam, not
bit-identical to it.

Keras's own update is used instead (so the results are exactly Adam's) for
`amsgrad=True`, sparse (`IndexedSlices`) gradients, non-floating variables
and inside a `tf.distribute` strategy.

Example:

    import keras
    import kmp

    kmp.set_global_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=kmp.FusedAdam(1e-3), loss="mse")
    model.fit(keras.ops.ones((16, 8)), keras.ops.zeros((16, 4)), verbose=0)
"""

import math

import keras
import numpy as np

from kmp.core import backend
from kmp.core.checks import checked_float
from kmp.core.checks import checked_gradients
from kmp.core.checks import describe

tf = backend.tensorflow()

_FLOATING = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_TENSOR_TYPES = (tf.Tensor, tf.Variable, keras.Variable)
_RATE = "a number in [0, 1) or a scalar floating tensor with a value in [0, 1)"
_EPSILON = "a finite number >= 0 or a scalar floating tensor with such a value"


@keras.saving.register_keras_serializable(package="kmp")
class FusedAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, updating each variable in one fused kernel.

    Takes exactly `keras.optimizers.Adam`'s arguments; see the module
    docstring for when Keras's own update runs instead.

    Unlike Adam, it checks its hyperparameters when it is made (a wrong type
    is a TypeError, a wrong value a ValueError) and every gradient's shape
    against its variable's in `apply` / `apply_gradients`, before anything
    is built or updated. The learning rate may also be an int, a NumPy
    number or a constant scalar tensor (its value is used). A number must
    keep its meaning in float32, which float32 and mixed-precision variables
    apply it in: a learning rate or epsilon beyond float32's range, a beta
    that rounds to 1 or a non-zero that rounds to 0 is refused. Numbers are
    kept as Python floats (a `Fraction` or `Decimal` too), as Adam keeps
    them, so the config serializes.

    On torch `kmp.FusedAdam` is `kmp.core.torch.fused.FusedAdam`
    (PyTorch's fused kernel); on JAX a class whose construction raises a
    RuntimeError saying to use `keras.optimizers.Adam`, whose update jit
    fuses already.

    Args:
        learning_rate: A finite number >= 0 (an int, a NumPy number or a
            constant scalar tensor too), a
            `keras.optimizers.schedules.LearningRateSchedule` or a callable
            taking no arguments, as for Adam.
        beta_1: The decay of the first-moment average, in [0, 1).
        beta_2: The decay of the second-moment average, in [0, 1).
        epsilon: A finite number >= 0 added to the denominator.
        amsgrad: Whether to use AMSGrad (Keras's own update then runs).
        weight_decay: None, or a finite number >= 0, as for Adam.
        **kwargs: Keras's other optimizer arguments (`clipnorm`,
            `global_clipnorm`, `use_ema`, `name`, ...).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or float32 changes its
            meaning.

    Example:

    >>> import kmp
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model.compile(optimizer=kmp.FusedAdam(1e-3), loss="mse")
    >>> x, y = keras.ops.ones((16, 8)), keras.ops.zeros((16, 4))
    >>> losses = model.fit(x, y, epochs=3, verbose=0).history["loss"]
    >>> losses[-1] < losses[0]
    True
    >>> kmp.FusedAdam(beta_1=1.0)
    Traceback (most recent call last):
    ...
    ValueError: 'beta_1' must be a number in [0, 1) ... Received: beta_1=1.0
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
        weight_decay=None,
        **kwargs,
    ):
        if weight_decay is not None:
            weight_decay = _checked_number(
                weight_decay,
                "weight_decay",
                "None or a finite number >= 0",
                _at_least_zero,
            )
        super().__init__(
            learning_rate=_checked_learning_rate(learning_rate),
            beta_1=_checked(beta_1, "beta_1", _RATE, _below_one),
            beta_2=_checked(beta_2, "beta_2", _RATE, _below_one),
            epsilon=_checked(epsilon, "epsilon", _EPSILON, _at_least_zero),
            amsgrad=_checked_bool(amsgrad, "amsgrad"),
            weight_decay=weight_decay,
            **kwargs,
        )

    def apply(self, grads, trainable_variables=None):
        # Checked here, for all gradients at once: eagerly, update_step runs
        # variable by variable, so a check there would leave the variables
        # before the bad one updated. Static shapes and dtypes only.
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        elif self.built:
            variables = self._trainable_variables
        else:
            variables = None  # Keras raises: it cannot build without them.
        if grads and variables is not None:  # No gradients: Keras's no-op.
            grads = checked_gradients(grads, variables)
        return super().apply(grads, trainable_variables)

    def update_step(self, gradient, variable, learning_rate):
        # Keras's TensorFlow optimizer passes the tf.Variable behind a
        # keras.Variable; the moments are keras.Variables.
        variable_tensor = _tf_variable(variable)
        if not self._can_fuse(gradient, variable_tensor):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable_tensor.dtype
        index = self._get_variable_index(variable)
        m = _tf_variable(self._momentums[index])
        v = _tf_variable(self._velocities[index])
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = _constant(self.beta_1, dtype)
        beta_2 = _constant(self.beta_2, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable_tensor.handle,
            m=m.handle,
            v=v.handle,
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=_constant(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
        )

    def _can_fuse(self, gradient, variable_tensor) -> bool:
        return (
            not self.amsgrad
            and not isinstance(gradient, tf.IndexedSlices)
            and isinstance(variable_tensor, tf.Variable)
            and variable_tensor.dtype in _FLOATING
            and not tf.distribute.has_strategy()
        )


def _tf_variable(variable):
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable


def _constant(value, dtype):
    # A Python number straight to `dtype` (through float32 it would be
    # rounded twice, and a float64 variable would get a float32 beta); a
    # tensor or variable hyperparameter (which Adam allows) by a cast.
    if isinstance(value, _TENSOR_TYPES):
        return tf.cast(value, dtype)
    return tf.constant(value, dtype)


# --- Checks -------------------------------------------------------------------
# Adam takes each hyperparameter as a number; the betas and epsilon also as
# a scalar floating tensor or variable, read at every update. Adam keeps a
# number as a Python float (the learning rate in a float32 variable) and
# applies it in each variable's dtype: float32 for float32 and
# mixed-precision variables, so it must mean the same in float32 (a beta
# that rounds to 1 divides by zero, an epsilon of 1e39 is inf).


def _at_least_zero(value: float) -> bool:
    return 0 <= value < math.inf


def _below_one(value: float) -> bool:
    return 0 <= value < 1


def _checked_number(value, argument: str, allowed: str, in_range) -> float:
    """A number as the Python float Adam keeps, refused unless it also holds
    in float32 (see above)."""
    checked_float(value, argument, allowed, in_range, "float32")
    return checked_float(value, argument, allowed, in_range, "float64")


def _checked(value, argument: str, allowed: str, in_range):
    """A number in range as a float, or a scalar floating tensor or variable
    kept as it is (its value checked if known now)."""
    if isinstance(value, _TENSOR_TYPES):
        received = f"{argument}={describe(value)}"
        if not tf.as_dtype(value.dtype).is_floating:
            raise TypeError(
                f"'{argument}' must be {allowed}. Received: {received}"
            )
        if tf.TensorShape(value.shape).rank not in (0, None):
            raise ValueError(
                f"'{argument}' must be {allowed}. Received: {received}"
            )
        number = _known_value(value)
        if number is not None:
            checked_float(
                number,
                argument,
                allowed,
                in_range,
                "float32",
                received=f"{received} and value {float(number)!r}",
            )
        return value
    if callable(value):
        allowed += " (Keras 3's Adam update cannot use a callable)"
    return _checked_number(value, argument, allowed, in_range)


def _known_value(value):
    """A tensor's constant value, or a variable's value when eager; or None."""
    if isinstance(value, tf.Tensor):
        return tf.get_static_value(value)
    return value.numpy() if tf.executing_eagerly() else None


def _checked_learning_rate(value):
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(value) and not isinstance(value, _TENSOR_TYPES)
    ):
        return value
    allowed = (
        "a finite number >= 0, a constant scalar floating tensor, a "
        "keras.optimizers.schedules.LearningRateSchedule or a callable that "
        "takes no arguments and returns the learning rate"
    )
    value = _checked(value, "learning_rate", allowed, _at_least_zero)
    if isinstance(value, float):
        return value
    number = (
        tf.get_static_value(value) if isinstance(value, tf.Tensor) else None
    )
    if number is None:
        # Keras keeps its own learning-rate variable: a tensor of a graph has
        # no value to give it, and a variable's later assignments would
        # silently not reach the optimizer.
        raise TypeError(
            f"'learning_rate' must be {allowed}; a variable or a tensor "
            "inside a tf.function is not (pass its value, or assign "
            "optimizer.learning_rate later). Received: "
            f"learning_rate={describe(value)}"
        )
    return float(number)


def _checked_bool(value, argument: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"'{argument}' must be True or False. Received: "
            f"{argument}={describe(value)}"
        )
    return bool(value)
