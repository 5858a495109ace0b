"""Fault injection for testing training loops under loss scaling.

Two small tools that make a training step go non-finite on purpose, so a test
can check that the step is skipped and that training recovers:

* `GradientFaults` writes inf or NaN into chosen gradients at chosen steps,
  optionally on one replica only (TensorFlow's `tf.distribute`). Call it
  between computing and applying the gradients (in a custom loop, or in a
  model's `train_step`).
* `OverflowAt` is a Keras layer that multiplies its input by a huge factor on
  chosen training steps: under `mixed_float16` the activations leave float16's
  range (largest finite value 65504) and the loss becomes inf or NaN, as a real
  forward-pass overflow would.

Both are written in `keras.ops` with no Python branching on values, so they
work on Keras's TensorFlow, JAX and torch backends: eagerly, inside
`tf.function` or `jax.jit`, with `jit_compile=True`, and (on TensorFlow) in
every replica of a `tf.distribute` strategy. In a custom loop:

    faults = GradientFaults({3: ("inf", [0])})
    ...
    grads = optimizer.get_unscaled_gradients(scaled_grads)
    grads = faults(grads, step)          # step: your own counter
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

In `model.fit`, do the same in an overridden `train_step`, between computing
the gradients and `self.optimizer.apply_gradients(...)`; or put an
`OverflowAt` layer in the model, which needs no change to the step.
"""

import math
import numbers
from typing import Dict
from typing import Iterable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import keras
import numpy as np
from keras import ops

from kmp.core import backend
from kmp.core.checks import checked_float
from kmp.core.checks import is_indexed_slices
from kmp.core.loss_scale import keep_on_skip as kept_state

FAULT_KINDS = ("inf", "nan")

# The largest finite float32: a larger factor cannot even be a float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# OverflowAt's call counter: JAX has no int64 unless x64 is enabled.
_COUNT_DTYPE = "int32" if backend.is_jax() else "int64"

# Containers accepted for several step or gradient indices.
_INDEX_CONTAINERS = (list, tuple, set, frozenset, range)

Schedule = Dict[int, Tuple[str, Sequence[int]]]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_index(value, argument: str, what: str = "step index") -> int:
    if not _is_int(value):
        raise TypeError(
            f"'{argument}' must be a non-negative integer {what}. "
            f"Received: {argument}={value!r} of type {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(
            f"'{argument}' must be a non-negative integer {what}. "
            f"Received: {argument}={value!r}"
        )
    return int(value)


def _check_indices(
    values, expected: str, received: str, argument: str, what: str
) -> Tuple[int, ...]:
    """`values`, a non-empty list, tuple or set of indices, as a tuple.

    `expected` says what is allowed and `received` shows `values` in the
    errors; `argument` and `what` name each index, as for `_check_index`.
    """
    if not isinstance(values, _INDEX_CONTAINERS):
        raise TypeError(
            f"{expected}. Received: {received}, of type {type(values).__name__}"
        )
    if not values:
        raise ValueError(f"{expected}. Received: {received}")
    return tuple(_check_index(value, argument, what) for value in values)


def _rank(value) -> Optional[int]:
    try:
        return len(value.shape)
    except (TypeError, ValueError):  # A graph tensor of unknown rank.
        return None


def _is_tensor(value) -> bool:
    return isinstance(value, keras.Variable) or ops.is_tensor(value)


def _check_step(step) -> None:
    """Checks that `step` is a non-negative int or an integer scalar tensor.

    Only static properties (type, dtype, rank) are read, never a tensor's
    value: inside `tf.function` or `jax.jit` this runs once, at trace
    time, adding no op.
    """
    if _is_int(step):
        _check_index(step, "step")
        return
    if (
        _is_tensor(step)
        and "int" in keras.backend.standardize_dtype(step.dtype)
        and _rank(step) == 0
    ):
        return
    raise TypeError(
        "'step' must be an integer scalar: a Python or NumPy int, or an "
        "integer tensor or variable of shape (). Received: "
        f"step={step!r} of type {type(step).__name__}"
    )


def _check_gradients(gradients) -> List:
    """`gradients` as a new list of tensors (`tf.IndexedSlices` on
    TensorFlow) or None."""
    if backend.is_tensorflow():
        kinds = "tensors, tf.IndexedSlices or None), as tape.gradient returns"
    else:
        kinds = "tensors or None)"
    expected = (
        f"'gradients' must be a list or tuple of gradients ({kinds}; pass "
        "the gradients alone, not (gradient, variable) pairs"
    )
    if not isinstance(gradients, (list, tuple)):
        raise TypeError(
            f"{expected}. Received: gradients={gradients!r} of type "
            f"{type(gradients).__name__}"
        )
    for index, gradient in enumerate(gradients):
        if not (
            gradient is None
            or is_indexed_slices(gradient)
            or _is_tensor(gradient)
        ):
            raise TypeError(
                f"{expected}. Received: gradients[{index}]={gradient!r} of "
                f"type {type(gradient).__name__}"
            )
    return list(gradients)


def _check_replica(replica) -> Optional[int]:
    if replica is None:
        return None
    replica = _check_index(replica, "replica", "replica id")
    if not backend.is_tensorflow():
        raise ValueError(
            "'replica' picks one replica of a tf.distribute strategy, which "
            f"Keras's TensorFlow backend has; Keras runs on "
            f"{backend.name()!r}: pass replica=None (every device). "
            + _ONE_DEVICE_HINT.get(backend.name(), "")
            + f" Received: replica={replica!r}"
        )
    return replica


_ONE_DEVICE_HINT = {
    "jax": (
        "To make one device's values non-finite under "
        "keras.distribution.DataParallel, put inf or NaN in the rows of "
        "the batch that device gets (the batch is split along its first "
        "axis, in order)."
    ),
}


def _replica_matches(replica: Optional[int]):
    """Whether this replica is the chosen one (always True when None)."""
    if replica is None:
        return ops.convert_to_tensor(True)
    tf = backend.tensorflow()  # _check_replica allows one on TF only.
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError(
            "A fault limited to one replica must be injected in a replica "
            "context, inside strategy.run(...). Received: replica="
            f"{replica!r} in a cross-replica context."
        )
    if replica >= context.num_replicas_in_sync:
        raise ValueError(
            "'replica' must be a replica id below the number of replicas in "
            f"sync, {context.num_replicas_in_sync} here, or None for every "
            f"replica. Received: replica={replica!r}"
        )
    replica_id = tf.cast(context.replica_id_in_sync_group, tf.int64)
    return tf.equal(replica_id, replica)


def _poison(values, now, kind: str):
    """`values` with its first element set to inf or NaN when `now` is True."""
    dtype = keras.backend.standardize_dtype(values.dtype)
    bad = ops.convert_to_tensor(math.inf if kind == "inf" else math.nan, dtype)
    first = ops.reshape(
        ops.equal(ops.arange(ops.size(values)), 0), ops.shape(values)
    )
    return ops.where(ops.logical_and(first, now), bad, values)


class GradientFaults:
    """Writes inf or NaN into chosen gradients at chosen steps.

    The schedule maps a step index to a fault: its kind, `"inf"` or `"nan"`,
    and the indices of the gradients to corrupt (positions in the gradient
    list). On a scheduled step the first element of each chosen gradient is
    replaced; every other step, and every other gradient, passes through
    unchanged. With `replica` set (TensorFlow's `tf.distribute` only), only
    that replica (its `replica_id_in_sync_group`) corrupts its gradients,
    which is how a fault on one GPU or one worker looks.

    The step is a tensor (or number), compared inside the graph, so one traced
    `tf.function` or `jax.jit` function serves every step. Keep your own step
    counter: an optimizer's `iterations` does not advance on a skipped step.

    Args:
        schedule: `{step: (kind, [gradient indices])}`, steps and indices
            non-negative integers, `kind` one of `"inf"`, `"nan"`, the
            indices a non-empty list, tuple or set.
        replica: Inject only on this replica; `None` (default) for all.
            TensorFlow only (a `tf.distribute` replica).

    Raises:
        TypeError: `schedule` is not a dict, or a step, kind, index list or
            index has the wrong type.
        ValueError: a step, kind or index has a wrong value, or an index list
            is empty; `replica` is set off TensorFlow.

    Example:

    >>> faults = GradientFaults({1: ("nan", [0])})
    >>> grads = [keras.ops.convert_to_tensor([1.0, 2.0]),
    ...          keras.ops.convert_to_tensor(3.0)]
    >>> [keras.ops.convert_to_numpy(g).tolist() for g in faults(grads, 0)]
    [[1.0, 2.0], 3.0]
    >>> [keras.ops.convert_to_numpy(g).tolist() for g in faults(grads, 1)]
    [[nan, 2.0], 3.0]
    """

    def __init__(self, schedule: Schedule, replica: Optional[int] = None):
        if not isinstance(schedule, dict):
            raise TypeError(
                "'schedule' must be a dict {step: (kind, [gradient indices])}"
                f", e.g. {{3: ('inf', [0])}}. Received: schedule={schedule!r}"
                f" of type {type(schedule).__name__}"
            )
        checked = {}
        for step, fault in schedule.items():
            step = _check_index(step, "schedule step")
            if not isinstance(fault, (tuple, list)) or len(fault) != 2:
                raise TypeError(
                    "Each schedule entry must be a pair (kind, [gradient "
                    f"indices]), e.g. ('inf', [0]). Received: {fault!r} at "
                    f"step {step}"
                )
            kind, indices = fault
            if kind not in FAULT_KINDS:
                raise ValueError(
                    f"A fault kind must be one of {FAULT_KINDS}. Received: "
                    f"{kind!r} at step {step}"
                )
            indices = _check_indices(
                indices,
                "The gradient indices of a fault must be a non-empty list, "
                "tuple or set of integers, e.g. [0, 2]",
                f"{indices!r} at step {step}",
                "gradient index",
                "position in the list",
            )
            checked[step] = (kind, indices)
        self._schedule = checked
        self._replica = _check_replica(replica)

    @property
    def schedule(self) -> Schedule:
        """The validated schedule, `{step: (kind, (indices, ...))}`."""
        return dict(self._schedule)

    @property
    def replica(self) -> Optional[int]:
        """The only replica that injects, or None for every replica."""
        return self._replica

    def __call__(self, gradients: Sequence, step) -> List:
        """Returns the gradients, corrupted if `step` is a scheduled step.

        Args:
            gradients: A list or tuple of gradients (tensors, `None`, and
                on TensorFlow `tf.IndexedSlices`, as `tape.gradient`
                returns).
            step: The current step index: a non-negative Python or NumPy
                int, or an integer scalar tensor or variable.

        Returns:
            A new list of the same length; `None` entries stay `None`.

        Raises:
            TypeError: `gradients` is not such a list, `step` is not an
                integer scalar, or a scheduled gradient is not floating-point.
            ValueError: a scheduled index is out of range or points at a
                `None` gradient; `replica` is set but this is a
                cross-replica context, or there are not that many replicas.
        """
        gradients = _check_gradients(gradients)
        _check_step(step)
        for step_index, (_, indices) in self._schedule.items():
            for index in indices:
                if index >= len(gradients) or gradients[index] is None:
                    raise ValueError(
                        f"The fault at step {step_index} targets gradient "
                        f"{index}, but there are {len(gradients)} gradients"
                        " and that one is missing or None."
                    )
                dtype = keras.backend.standardize_dtype(gradients[index].dtype)
                if "float" not in dtype:
                    raise TypeError(
                        f"The fault at step {step_index} targets gradient "
                        f"{index}, but only a floating-point gradient can "
                        f"hold inf or NaN. Received: gradients[{index}] of "
                        f"dtype {dtype}"
                    )
        if not self._schedule:
            return gradients
        step = ops.convert_to_tensor(step)
        on_replica = _replica_matches(self._replica)
        for step_index, (kind, indices) in self._schedule.items():
            now = ops.logical_and(on_replica, ops.equal(step, step_index))
            for index in indices:
                gradient = gradients[index]
                if is_indexed_slices(gradient):
                    gradients[index] = type(gradient)(
                        _poison(gradient.values, now, kind),
                        gradient.indices,
                        gradient.dense_shape,
                    )
                else:
                    gradients[index] = _poison(
                        ops.convert_to_tensor(gradient), now, kind
                    )
        return gradients


@keras.saving.register_keras_serializable(package="kmp")
class OverflowAt(keras.layers.Layer):
    """Multiplies its input by `factor` on chosen training steps.

    An identity layer except on the scheduled steps, where it returns
    `inputs * factor` computed in the layer's compute dtype. With a factor
    above 65504 (float16's largest finite value) the activations overflow to
    inf under `mixed_float16`, while the same layer stays finite under
    `float32`: put it before the output layer to reproduce a forward-pass
    overflow. It counts its own calls with `training=True` in a non-trainable
    integer variable, `calls` (int64; int32 on JAX), steps 0-based, so a
    skipped step does not repeat the fault; calls with `training=False` pass
    through uncounted.

    Args:
        steps: A step index or a non-empty list, tuple or set of them
            (non-negative integers).
        factor: The multiplier, a number > 0 and at most float32's largest
            finite value (about 3.4e38); 2**17 by default.
        replica: Overflow only on this replica; `None` (default) for all.
            TensorFlow only (a `tf.distribute` replica).
        **kwargs: Passed to `keras.layers.Layer` (`name`, `dtype`, ...).

    Raises:
        TypeError: `steps`, `factor` or `replica` has the wrong type.
        ValueError: a step is negative, `steps` is empty, or `factor` is
            not in (0, float32 max]; `replica` is set off TensorFlow.

    Example:

    >>> layer = OverflowAt(steps=[1], dtype="float16")
    >>> x = keras.ops.convert_to_tensor([1.0])
    >>> [float(layer(x, training=True)[0]) for _ in range(3)]
    [1.0, inf, 1.0]
    """

    def __init__(
        self,
        steps: Union[int, Iterable[int]],
        factor: float = 2.0**17,
        replica: Optional[int] = None,
        **kwargs,
    ):
        if _is_int(steps):
            steps = [steps]
        steps = _check_indices(
            steps,
            "'steps' must be a step index or a non-empty list, tuple or set "
            "of them",
            f"steps={steps!r}",
            "steps",
            "step index",
        )
        steps = sorted(set(steps))
        # As the float32 it is applied as (cast to the compute dtype from
        # there): NumPy would compare np.float16(inf) with an inf bound.
        factor = checked_float(
            factor,
            "factor",
            "a finite number > 0 within float32's range (at most "
            f"{_FLOAT32_MAX:g})",
            lambda value: 0 < value <= _FLOAT32_MAX,
        )
        super().__init__(**kwargs)
        self._steps = steps
        self._factor = factor
        self._replica = _check_replica(replica)
        self.supports_masking = True
        self.calls = self.add_weight(
            shape=(),
            dtype=_COUNT_DTYPE,
            initializer="zeros",
            trainable=False,
            aggregation="only_first_replica",
            name="calls",
        )
        # It counts calls, skipped steps included: fit must not put it back.
        kept_state.exempt(self.calls)

    @property
    def steps(self) -> List[int]:
        """The training steps on which the layer overflows, sorted."""
        return list(self._steps)

    @property
    def factor(self) -> float:
        """The multiplier applied on those steps."""
        return self._factor

    def call(self, inputs, training=None):
        if not training:
            return inputs
        calls = ops.convert_to_tensor(self.calls)  # Read before adding 1.
        steps = ops.convert_to_tensor(self._steps, _COUNT_DTYPE)
        now = ops.logical_and(
            _replica_matches(self._replica),
            ops.any(ops.equal(calls, steps)),
        )
        # The multiplier is chosen first (not where() on the two results),
        # so the other steps' gradients never meet 0 * inf. Multiplying in
        # the compute dtype is the point: float16 overflows (JAX casts the
        # constant with NumPy, which would warn).
        with np.errstate(over="ignore"):
            factor = ops.cast(self._factor, inputs.dtype)
        multiplier = ops.where(now, factor, ops.ones_like(factor))
        self.calls.assign_add(1)
        return inputs * multiplier

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            {
                "steps": list(self._steps),
                "factor": self._factor,
                "replica": self._replica,
            }
        )
        return config
