"""`LossScaleOptimizer`: loss scaling for `model.fit` and for custom loops.

It wraps any Keras optimizer and owns a few scalar variables: the current
scale, the count of finite steps since the scale last changed, and the counts
of skipped steps (in all and in a row). Every step it

* sums the gradients across replicas (under a `tf.distribute` strategy), once;
* divides them by the scale if they came from `scale_loss` (the `fit` path);
* checks them for inf/NaN, after aggregation, so every replica decides alike;
* applies them with the inner optimizer only if all are finite; a skipped step
  ends with variables, the inner optimizer's slots and `iterations` exactly
  as they were.
  For Keras's own optimizers on models of many small variables (up to 4M
  parameters, 16K per variable on average; single device, in a
  `tf.function`), the inner update is applied at once, alongside the backward
  pass, and the state read just before it is written back if the check
  fails; otherwise the whole update waits for the check, in a cond;
* assigns the scale and counter that `kmp.loss_scale.next_dynamic_scale`
  returns (a fixed scale is left as it is).

Importing kmp also makes `model.compile` wrap its optimizer in this class,
not in Keras's own, when it adds loss scaling by itself (a `mixed_float16`
model with `auto_scale_loss=True`), so such a model saves and restores its
scale; and only when some layer computes in float16.
"""

import contextlib
import functools
import numbers
import threading
import warnings
import weakref
from typing import Callable
from typing import Iterable
from typing import List
from typing import Mapping
from typing import Optional
from typing import Union

from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.saving import serialization_lib
from keras.src.trainers import trainer as _keras_trainer
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import control_flow_util_v2

from kmp import loss_scale as _rule
from kmp._backend import keras
from kmp._backend import tf
from kmp._checks import checked_gradients
from kmp._checks import describe
from kmp.fused import FusedAdam

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_KerasOptimizer = keras.optimizers.Optimizer
_FLOAT16_TYPES = (tf.float16, tf.bfloat16)
_MAX_INT64 = 2**63 - 1  # The step counters are int64 variables.


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: both a `TypeError` and a `ValueError`.

    Raised for an `initial_scale` that is not a number and a
    `dynamic_growth_steps` that is not an integer, which the contract
    answers with `ValueError` ("must be a finite number >= 1", "a positive
    integer") and Python's convention with `TypeError`: either catches it.

    >>> try:
    ...     LossScaleOptimizer(keras.optimizers.SGD(), initial_scale="8")
    ... except ValueError as error:
    ...     print(type(error).__name__, isinstance(error, TypeError))
    ArgumentTypeError True
    """


# Which protocol the gradients reaching `apply_gradients` follow: "scaled"
# after `scale_loss` (Keras 3's protocol, which `fit` uses), "unscaled" after
# `get_scaled_loss` / `get_unscaled_gradients`. Recorded per thread (each
# MirroredStrategy replica runs in its own) and per graph, so it is known when
# the step is traced; when the gradients come from another tf.function, the
# optimizer's `_grads_scaled` variable decides when the step runs.
_protocol = threading.local()
_SCALED, _UNSCALED = "scaled", "unscaled"


def _protocol_records() -> weakref.WeakKeyDictionary:
    if not hasattr(_protocol, "by_graph"):
        _protocol.by_graph = weakref.WeakKeyDictionary()
    return _protocol.by_graph


def _unsupported_strategy_types():
    names = (
        ("TPUStrategy", tf.distribute),
        ("TPUStrategy", tf.distribute.experimental),
        ("ParameterServerStrategy", tf.distribute.experimental),
        ("CentralStorageStrategy", tf.distribute.experimental),
    )
    return tuple(
        getattr(module, name) for name, module in names if hasattr(module, name)
    )


def _check_arguments(inner_optimizer, dynamic, initial_scale, growth_steps):
    """Validates the constructor's arguments; changes nothing."""
    if isinstance(inner_optimizer, _KerasLossScaleOptimizer):
        raise TypeError(
            "'inner_optimizer' must not be a LossScaleOptimizer: loss scaling "
            "would be applied twice. Wrap the plain optimizer instead, e.g. "
            "kmp.LossScaleOptimizer(keras.optimizers.Adam()). Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, _KerasOptimizer):
        raise TypeError(
            "'inner_optimizer' must be a Keras optimizer instance, such as "
            "keras.optimizers.SGD(0.01). Received: "
            f"inner_optimizer={inner_optimizer!r} of type "
            f"{type(inner_optimizer).__name__}"
        )
    if getattr(inner_optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            "'inner_optimizer' has its own loss_scale_factor="
            f"{inner_optimizer.loss_scale_factor!r}; the loss would be scaled "
            "twice. Leave it unset and pass the scale here instead: "
            "kmp.LossScaleOptimizer(inner, dynamic=False, initial_scale=...)."
        )
    if not isinstance(dynamic, bool):
        raise TypeError(
            f"'dynamic' must be True or False. Received: dynamic={dynamic!r}"
        )
    if initial_scale is None:
        if not dynamic:
            raise ValueError(
                "'initial_scale' is required when dynamic=False: it is the "
                "fixed loss scale, e.g. initial_scale=128. Received: "
                "initial_scale=None"
            )
        initial_scale = _rule.DEFAULT_INITIAL_SCALE
    elif isinstance(initial_scale, bool) or not isinstance(
        initial_scale, numbers.Real
    ):
        raise ArgumentTypeError(
            "'initial_scale' must be a number (a finite float >= 1). "
            f"Received: initial_scale={initial_scale!r} of type "
            f"{type(initial_scale).__name__}"
        )
    elif not _rule.MIN_SCALE <= initial_scale <= _rule.MAX_SCALE:
        # Also false for NaN; compared before any float() of a huge int.
        raise ValueError(
            "'initial_scale' must be a finite number >= 1 (and at most the "
            f"largest float32, {_rule.MAX_SCALE:.4g}). Received: "
            f"initial_scale={initial_scale!r}"
        )
    if growth_steps is None:
        growth_steps = _rule.DEFAULT_GROWTH_STEPS if dynamic else None
    elif not dynamic:
        raise ValueError(
            "'dynamic_growth_steps' applies only to a dynamic loss scale; "
            "leave it None with dynamic=False. Received: "
            f"dynamic_growth_steps={growth_steps!r}"
        )
    elif isinstance(growth_steps, bool) or not isinstance(
        growth_steps, numbers.Integral
    ):
        raise ArgumentTypeError(
            "'dynamic_growth_steps' must be a positive integer. Received: "
            f"dynamic_growth_steps={growth_steps!r} of type "
            f"{type(growth_steps).__name__}"
        )
    elif not 1 <= growth_steps <= _MAX_INT64:
        raise ValueError(
            "'dynamic_growth_steps' must be a positive integer (at most "
            f"2**63 - 1). Received: dynamic_growth_steps={growth_steps!r}"
        )
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, _unsupported_strategy_types()):
        raise ValueError(
            "kmp.LossScaleOptimizer supports the default strategy, "
            "MirroredStrategy, MultiWorkerMirroredStrategy and "
            f"OneDeviceStrategy. Received: {type(strategy).__name__}, under "
            "which skipped steps could not be made consistent. On TPUs use "
            "the 'mixed_bfloat16' policy, which needs no loss scaling."
        )
    grow = None if growth_steps is None else int(growth_steps)
    return float(initial_scale), grow


def _check_skip_options(max_skips, on_persistent_skips, record_nonfinite):
    if max_skips is not None and (
        isinstance(max_skips, bool)
        or not isinstance(max_skips, numbers.Integral)
    ):
        raise TypeError(
            "'max_consecutive_skips' must be a positive integer or None. "
            f"Received: max_consecutive_skips={max_skips!r} of type "
            f"{type(max_skips).__name__}"
        )
    if max_skips is not None and not 1 <= max_skips <= _MAX_INT64:
        raise ValueError(
            "'max_consecutive_skips' must be a positive integer (at most "
            f"2**63 - 1) or None. Received: max_consecutive_skips={max_skips!r}"
        )
    if on_persistent_skips not in ("warn", "raise"):
        raise ValueError(
            "'on_persistent_skips' must be 'warn' or 'raise'. Received: "
            f"on_persistent_skips={on_persistent_skips!r}"
        )
    if not isinstance(record_nonfinite, bool):
        raise TypeError(
            "'record_nonfinite' must be True or False. Received: "
            f"record_nonfinite={record_nonfinite!r}"
        )


def _floating_tensor(value, argument: str) -> tf.Tensor:
    if isinstance(value, bool):
        raise TypeError(
            f"'{argument}' must be a floating tensor or number. Received: "
            f"{argument}={describe(value)}"
        )
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        if isinstance(value, float):
            raise ValueError(
                f"'{argument}' must fit in float32 (at most about 3.4e38 in "
                f"magnitude). Received: {argument}={value!r}"
            ) from None
        raise TypeError(
            f"'{argument}' must be a floating tensor or number. Received: "
            f"{argument}={describe(value)}"
        ) from None
    if not tensor.dtype.is_floating:
        received = describe(value)
        if not isinstance(value, (tf.Tensor, tf.Variable, keras.Variable)):
            received += f" (dtype {tensor.dtype.name})"
        raise TypeError(
            f"'{argument}' must be floating point. Received: "
            f"{argument}={received}"
        )
    return tensor


def _check_learning_rate(value) -> None:
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(value, schedule) or (
        callable(value) and not isinstance(value, (tf.Variable, keras.Variable))
    ):
        return
    if isinstance(value, bool) or not isinstance(
        value, (numbers.Real, tf.Tensor, tf.Variable, keras.Variable)
    ):
        raise TypeError(
            "'learning_rate' must be a number, a scalar tensor or a "
            "keras.optimizers.schedules.LearningRateSchedule. Received: "
            f"learning_rate={describe(value)}"
        )
    if isinstance(value, numbers.Real):
        if not -_rule.MAX_SCALE <= value <= _rule.MAX_SCALE:  # NaN too.
            raise ValueError(
                "'learning_rate' must be a finite number that fits in "
                f"float32. Received: learning_rate={value!r}"
            )
    elif not value.dtype.is_floating:
        raise TypeError(
            "'learning_rate' must be floating point. Received: "
            f"learning_rate={describe(value)}"
        )


def _scale_tensor(tensor: tf.Tensor, scale: tf.Tensor, divide: bool):
    """`tensor * scale` or `tensor / scale`, in float32 or wider.

    float16 math would be wrong here: 1 / 2**25 is 0 in float16, and a float16
    loss times 2**16 is inf. The result keeps `tensor`'s dtype.
    """
    if tensor.dtype in _FLOAT16_TYPES:
        wide = tf.cast(tensor, tf.float32)
        wide = wide / scale if divide else wide * scale
        return tf.cast(wide, tensor.dtype)
    scale = tf.cast(scale, tensor.dtype)
    return tensor / scale if divide else tensor * scale


def _unscale_gradients(gradients, scale: tf.Tensor, keep=()) -> List:
    """Divides every gradient by `scale` (None stays None; `keep` indices too).

    One op per gradient, which runs as soon as that gradient is computed,
    alongside the rest of the backward pass. Sparse gradients are divided on
    their values and stay sparse.
    """
    unscaled = []
    for index, g in enumerate(gradients):
        if g is None or index in keep:
            unscaled.append(g)
        elif isinstance(g, tf.IndexedSlices):
            values = _scale_tensor(g.values, scale, divide=True)
            unscaled.append(tf.IndexedSlices(values, g.indices, g.dense_shape))
        else:
            unscaled.append(_scale_tensor(g, scale, divide=True))
    return unscaled


def _float32_sum(gradient) -> tf.Tensor:
    """The sum of a gradient's elements (of its values, if sparse).

    Low-precision values are summed in float32, so that many large finite
    elements do not add up to inf. An inf or NaN anywhere makes the sum
    non-finite; so does a sum beyond float32's range (about 3.4e38).
    """
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    if gradient.dtype in _FLOAT16_TYPES:
        gradient = tf.cast(gradient, tf.float32)
    return tf.reduce_sum(gradient)


def _all_finite(gradients) -> tf.Tensor:
    """A bool scalar: whether all gradients are free of inf and NaN.

    An inf or NaN in any gradient makes any sum over it inf or NaN, so one
    total suffices. Float32 and float64 gradients of one shape are first
    added elementwise (one `AddN` per shape), then each group and every
    other gradient (low-precision ones in float32) is reduced, and the sums
    added: a few ops per shape rather than two per gradient, which matters
    for models with hundreds of small variables (`benchmarks/
    overhead_breakdown.py`). A total beyond float32's range counts as
    non-finite too.
    """
    groups = {}
    sums = []
    for gradient in gradients:
        if gradient is None:
            continue
        if isinstance(gradient, tf.IndexedSlices):
            gradient = gradient.values
        if gradient.dtype in (tf.float32, tf.float64) and (
            gradient.shape.is_fully_defined()
        ):
            key = (tuple(gradient.shape), gradient.dtype)
            groups.setdefault(key, []).append(gradient)
        else:
            sums.append(_float32_sum(gradient))
    for group in groups.values():
        sums.append(tf.reduce_sum(tf.add_n(group)))
    if not sums:
        return tf.constant(True)
    sums = [tf.cast(total, tf.float32) for total in sums]
    return tf.math.is_finite(tf.add_n(sums))


def _finite_per_gradient(gradients) -> tf.Tensor:
    """A bool vector: whether each gradient is free of inf and NaN (None is).

    Used when the optimizer records which variables were non-finite; like
    `_all_finite`, one reduction per gradient.
    """
    flags = [
        tf.constant(True) if g is None else tf.math.is_finite(_float32_sum(g))
        for g in gradients
    ]
    return tf.stack(flags) if flags else tf.ones([0], tf.bool)


def _in_xla_context() -> bool:
    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def _cond_as_one_call(predicate, true_fn) -> None:
    """`tf.cond(predicate, true_fn, no-op)`, run as one function call.

    Inside a `tf.function`, TensorFlow normally lowers a cond into its
    enclosing graph: every tensor and variable the branch uses passes through
    its own Switch op, which for restoring a whole optimizer state means a
    thousand small ops per step for a 200-variable model. Kept as a single
    `If` op, the branch runs as one function call instead. Only for branches
    without arithmetic (Grappler optimizes a function body apart from its
    caller, which could round differently).
    """
    graph = tf.compat.v1.get_default_graph()
    first_new_op = len(graph.get_operations())
    tf.cond(predicate, true_fn, lambda: None)
    if tf.executing_eagerly():
        return
    for op in graph.get_operations()[first_new_op:]:
        if op.type in ("If", "StatelessIf"):
            control_flow_util_v2.maybe_set_lowering_attr(
                op, lower_using_switch_merge=False
            )


# Keras's own optimizers, which write nothing but the model's variables and
# their own (`optimizer.variables`: slots, `iterations`, accumulators, EMA).
# Exact types only: a subclass may keep state elsewhere.
_RESTORABLE_TYPES = tuple(
    getattr(keras.optimizers, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "Adafactor",
        "Ftrl",
        "Lamb",
        "Lion",
        "Nadam",
        "RMSprop",
    )
    if hasattr(keras.optimizers, name)
) + (FusedAdam,)
# Applying the update first pays one copy of every variable and slot per
# step and saves the wait for the check, whose cost grows with the number of
# variables. Measured on CPU (`python benchmarks/overhead_breakdown.py
# --layers L --units U --variants plain,apply-first,in-cond`), it pays off
# for many small variables (means of 0.5K, 2K and 8K elements: 100, 50 and
# 30 Dense layers of 32, 64 and 128 units) and loses to waiting for fewer,
# larger ones (31K: 20 Dense(256); 6 variables of up to 2.4M). Above 4M
# elements in all, the copies' memory alone rules it out.
_RESTORE_MAX_ELEMENTS = 2**22
_RESTORE_MAX_MEAN_ELEMENTS = 2**14


def _can_apply_then_restore(inner, grads, variables) -> bool:
    """Whether `inner`'s update can be applied before the finite check."""
    if tf.executing_eagerly() or in_stateless_scope():
        return False  # Eagerly, checking first costs nothing.
    if type(inner) not in _RESTORABLE_TYPES:
        return False
    if not all(isinstance(v, keras.Variable) for v in variables):
        return False
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return False
    sizes = [v.shape.num_elements() for v in variables]
    if None in sizes:
        return False
    total = sum(sizes)
    return total <= min(
        _RESTORE_MAX_ELEMENTS, _RESTORE_MAX_MEAN_ELEMENTS * len(sizes)
    )


def _read_now(variable) -> tf.Tensor:
    """The variable's value at this point of the program, never autocast."""
    handle = variable._value.handle
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=variable.dtype)


def _snapshot(variables):
    """Reads `variables` now; returns a function that writes those values back.

    The function returns its write ops. Variables of one shape and dtype are
    read into one stacked tensor: a few tensors to keep instead of one per
    variable, and once they are stacked the variables' buffers are free to
    be updated in place (a pending read would make TensorFlow copy a buffer
    before writing it).
    """
    groups = {}
    for variable in variables:
        key = (tuple(variable.shape), variable.dtype)
        groups.setdefault(key, []).append(variable)
    saved = []
    for group in groups.values():
        values = [_read_now(variable) for variable in group]
        saved.append(values[0] if len(values) == 1 else tf.stack(values))

    def restore():
        writes = []
        for group, value in zip(groups.values(), saved):
            values = [value] if len(group) == 1 else tf.unstack(value)
            for variable, old_value in zip(group, values):
                writes.append(
                    tf.raw_ops.AssignVariableOp(
                        resource=variable._value.handle, value=old_value
                    )
                )
        return writes

    return restore


_aggregation_lock = threading.Lock()
_aggregation_depth = {}


@contextlib.contextmanager
def _without_gradient_aggregation(optimizer):
    """Keeps a Keras TF optimizer from all-reducing gradients a second time.

    The loss-scale optimizer sums the gradients across replicas itself, before
    deciding whether the step is finite; the inner optimizer must then apply
    them as they are. Replica threads enter this together, hence the count.
    """
    key = id(optimizer)
    with _aggregation_lock:
        depth = _aggregation_depth.get(key, 0)
        if depth == 0:
            optimizer._all_reduce_sum_gradients = list
        _aggregation_depth[key] = depth + 1
    try:
        yield
    finally:
        with _aggregation_lock:
            _aggregation_depth[key] -= 1
            if _aggregation_depth[key] == 0:
                del _aggregation_depth[key]
                del optimizer._all_reduce_sum_gradients


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(_KerasLossScaleOptimizer):
    """Wraps a Keras optimizer and scales the loss so float16 gradients survive.

    Under `mixed_float16`, small gradients underflow to zero in float16.
    Multiplying the loss by a scale multiplies every gradient by it too;
    dividing the gradients by it before they are applied gives back the true
    update.

    * Dynamic (default): start at `initial_scale` (2**15); after
      `dynamic_growth_steps` (2000) finite steps in a row, double; on a step
      with any inf/NaN gradient, skip it and halve (never below 1).
    * Fixed (`dynamic=False`): the scale is `initial_scale` forever; a step with
      an inf/NaN gradient is still skipped.

    In `model.fit` all of it happens by itself. In a custom loop:

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    Keras 3's own protocol also works: gradients of `scale_loss(loss)` passed
    straight to `apply_gradients` are unscaled there (that is what `fit` does).

    Args:
        inner_optimizer: The Keras optimizer to wrap (not a loss-scale one).
        dynamic: Whether the scale adapts (True) or stays fixed (False).
        initial_scale: The first scale; a finite number >= 1. Defaults to 2**15
            when dynamic; required when fixed.
        dynamic_growth_steps: Finite steps in a row before the scale doubles;
            a positive integer, 2000 by default; must be None when fixed.
        name: The optimizer's name.
        max_consecutive_skips: After this many skipped steps in a row (1000 by
            default; None turns the check off) something is persistently
            wrong: the optimizer warns once, naming the likely causes.
        on_persistent_skips: `"warn"` (default) or `"raise"`, which stops
            training with a `FloatingPointError` instead (inside a
            `tf.function`, as `fit` runs, TensorFlow raises it as a
            `tf.errors.UnknownError` carrying that message).
        record_nonfinite: Whether to record which variables had non-finite
            gradients on the last skipped step (`nonfinite_variables`). Off by
            default, when it costs nothing.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer, or is already a
            loss-scale optimizer; an argument has the wrong type (for
            `initial_scale` and `dynamic_growth_steps` an `ArgumentTypeError`,
            which is a `ValueError` too).
        ValueError: an argument has a wrong value, or the optimizer is created
            under an unsupported distribution strategy (TPU, parameter servers).

    Example:

    >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    >>> float(opt.loss_scale), int(opt.dynamic_counter)
    (8.0, 0)
    >>> float(opt.get_scaled_loss(tf.constant(0.5)))
    4.0
    >>> [float(g) for g in opt.get_unscaled_gradients([tf.constant(4.0)])]
    [0.5]
    """

    def __init__(
        self,
        inner_optimizer: _KerasOptimizer,
        dynamic: bool = True,
        initial_scale: Optional[float] = None,
        dynamic_growth_steps: Optional[int] = None,
        name: Optional[str] = None,
        *,
        max_consecutive_skips: Optional[int] = 1000,
        on_persistent_skips: str = "warn",
        record_nonfinite: bool = False,
    ):
        initial_scale, dynamic_growth_steps = _check_arguments(
            inner_optimizer, dynamic, initial_scale, dynamic_growth_steps
        )
        _check_skip_options(
            max_consecutive_skips, on_persistent_skips, record_nonfinite
        )
        # Keras's LossScaleOptimizer is the base class only so that Keras
        # recognises this one (model.compile does not wrap it again); its
        # constructor mutates the inner optimizer, so it is skipped.
        _KerasOptimizer.__init__(self, learning_rate=0.0, name=name)
        self._inner_optimizer = inner_optimizer
        self._dynamic = dynamic
        self._initial_scale = initial_scale
        self._dynamic_growth_steps = dynamic_growth_steps
        self._max_consecutive_skips = max_consecutive_skips
        self._on_persistent_skips = on_persistent_skips
        self._record_nonfinite = record_nonfinite
        self._warned_persistent_skips = False
        self._nonfinite_mask = None
        # Created now, not in build(), so that a loss scaled before the first
        # step already reads the variable rather than a constant.
        with keras.name_scope(self.name, caller=self):
            self._scale = self._own_variable(
                "dynamic_scale", initial_scale, "float32"
            )
            self._counter = self._own_variable("step_counter", 0, "int64")
            self._skipped = self._own_variable("skipped_steps", 0, "int64")
            self._skipped_in_a_row = self._own_variable(
                "consecutive_skips", 0, "int64"
            )
        # Run-time record of the protocol (see `_take_protocol`): not training
        # state, so set past Keras's tracking, out of `variables` and files.
        with keras.name_scope(self.name, caller=self):
            grads_scaled = keras.Variable(
                False,
                dtype="bool",
                trainable=False,
                aggregation="only_first_replica",
                name="grads_scaled",
            )
        object.__setattr__(self, "_grads_scaled", grads_scaled)

    def _own_variable(self, name, value, dtype):
        variable = keras.Variable(
            value,
            dtype=dtype,
            trainable=False,
            # Every replica computes the same value; take the first one's.
            aggregation="only_first_replica",
            name=name,
        )
        self._track_variable(variable)
        return variable

    # --- Properties -------------------------------------------------------

    @property
    def inner_optimizer(self) -> _KerasOptimizer:
        """The wrapped optimizer, which computes every update."""
        return self._inner_optimizer

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale adapts (True) or is fixed (False)."""
        return self._dynamic

    @property
    def initial_scale(self) -> float:
        """The loss scale training started with, a Python float."""
        return self._initial_scale

    @property
    def dynamic_growth_steps(self) -> Optional[int]:
        """Finite steps in a row before the scale doubles; None when fixed."""
        return self._dynamic_growth_steps

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current loss scale, a float32 scalar tensor."""
        return tf.convert_to_tensor(self._scale)

    @property
    def dynamic_counter(self) -> Optional[tf.Tensor]:
        """Finite steps since the scale last changed (int64); None if fixed."""
        if not self._dynamic:
            return None
        return tf.convert_to_tensor(self._counter)

    @property
    def skipped_steps(self) -> tf.Tensor:
        """How many steps were skipped for non-finite gradients (int64)."""
        return tf.convert_to_tensor(self._skipped)

    @property
    def consecutive_skips(self) -> tf.Tensor:
        """How many of the latest steps were skipped in a row (int64)."""
        return tf.convert_to_tensor(self._skipped_in_a_row)

    @property
    def nonfinite_variables(self) -> List[str]:
        """Paths of the variables whose gradients were inf/NaN on the last
        skipped step (empty before any skip).

        Raises:
            ValueError: the optimizer was created without
                `record_nonfinite=True`.
        """
        if not self._record_nonfinite:
            raise ValueError(
                "nonfinite_variables is recorded only when the optimizer is "
                "created with record_nonfinite=True."
            )
        if self._nonfinite_mask is None:
            return []
        mask = self._nonfinite_mask.numpy()
        return [
            variable.path
            for variable, bad in zip(self._trainable_variables, mask)
            if bad
        ]

    @property
    def variables(self):
        return self._variables + self._inner_optimizer.variables

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (read and assign)."""
        return self._inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        _check_learning_rate(value)
        self._inner_optimizer.learning_rate = value

    # --- Scaling ------------------------------------------------------------

    def get_scaled_loss(
        self, loss: Union[tf.Tensor, float, Callable[[], tf.Tensor]]
    ):
        """Returns `loss` times the current scale, in `loss`'s dtype.

        Args:
            loss: A floating scalar tensor, or a callable returning one (then a
                callable is returned).

        Returns:
            The scaled loss (or a callable that computes it).

        Raises:
            TypeError: `loss` is not floating point.
        """
        if callable(loss):
            return lambda: self.get_scaled_loss(loss())
        scaled = self._scaled(loss)
        self._set_protocol(_UNSCALED)
        return scaled

    def _scaled(self, loss):
        loss = _floating_tensor(loss, "loss")
        return _scale_tensor(loss, self.loss_scale, divide=False)

    def get_unscaled_gradients(self, grads: Iterable) -> List:
        """Divides each gradient by the current scale, keeping its dtype.

        The division happens in float32 (or float64), never in float16.

        Args:
            grads: Gradients of a scaled loss: tensors, `tf.IndexedSlices`
                (unscaled on their values, kept sparse) or `None` (kept).

        Returns:
            A list of the unscaled gradients, in order.

        Raises:
            TypeError: `grads` is not an iterable of gradients.
        """
        if isinstance(
            grads, (tf.Tensor, tf.IndexedSlices, str, bytes, Mapping)
        ) or not isinstance(grads, Iterable):
            raise TypeError(
                "'grads' must be a list of gradients (tensors, IndexedSlices "
                f"or None), such as tape.gradient(...)'s result. Received: "
                f"grads={describe(grads)}"
            )
        grads = list(grads)
        for index, gradient in enumerate(grads):
            if gradient is not None and not isinstance(
                gradient, tf.IndexedSlices
            ):
                grads[index] = _floating_tensor(gradient, f"grads[{index}]")
        with keras.name_scope(self.name, caller=self):
            unscaled = _unscale_gradients(grads, self.loss_scale)
        self._set_protocol(_UNSCALED)
        return unscaled

    def scale_loss(self, loss):
        """Keras 3's hook, called by `fit`: scales like `get_scaled_loss`.

        The gradients of its result may be passed, still scaled, to the next
        `apply_gradients` in this thread, which then unscales them itself.
        """
        scaled = self._scaled(loss)
        self._set_protocol(_SCALED)
        return scaled

    def _set_protocol(self, protocol):
        graph = tf.compat.v1.get_default_graph()
        _protocol_records()[graph] = protocol
        self._grads_scaled.assign(protocol == _SCALED)

    def _take_protocol(self):
        """Whether the gradients now being applied are scaled; resets it.

        Returns True or False when known at trace time, else a bool tensor.
        """
        graph = tf.compat.v1.get_default_graph()
        protocol = _protocol_records().pop(graph, None)
        if protocol == _UNSCALED:
            return False
        scaled = (
            tf.convert_to_tensor(self._grads_scaled)
            if protocol is None
            else True
        )
        self._grads_scaled.assign(False)
        return scaled

    # --- Applying -----------------------------------------------------------

    def build(self, var_list):
        self._inner_optimizer.build(var_list)
        _KerasOptimizer.build(self, var_list)
        if self._record_nonfinite:
            with keras.name_scope(self.name, caller=self):
                self._nonfinite_mask = keras.Variable(
                    [False] * len(var_list),
                    dtype="bool",
                    trainable=False,
                    aggregation="only_first_replica",
                    name="nonfinite_mask",
                )

    def apply_gradients(self, grads_and_vars):
        """Applies `(gradient, variable)` pairs; returns `iterations`.

        See `apply` for what it checks.
        """
        if isinstance(grads_and_vars, (str, bytes, Mapping)) or not (
            isinstance(grads_and_vars, Iterable)
        ):
            raise TypeError(
                "'grads_and_vars' must be (gradient, variable) pairs, such as "
                "zip(grads, model.trainable_variables). Received: "
                f"grads_and_vars={describe(grads_and_vars)}"
            )
        pairs = list(grads_and_vars)
        for index, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(
                    "'grads_and_vars' must be (gradient, variable) pairs, "
                    "such as zip(grads, model.trainable_variables). Received "
                    f"at position {index}: {describe(pair)}"
                )
        self.apply([g for g, _ in pairs], [v for _, v in pairs])
        return self.iterations  # The inner optimizer's, as Keras's returns.

    def apply(self, grads, trainable_variables=None):
        """Applies one step; see the class docstring. Not for stateless use.

        Raises:
            TypeError: a variable is not a variable, or a gradient is not a
                floating tensor, `tf.IndexedSlices` or None.
            ValueError: the counts of gradients and variables differ, or a
                gradient's shape is not its variable's.
        """
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without 'trainable_variables' needs a built "
                    "optimizer: call "
                    "optimizer.build(model.trainable_variables) first, or "
                    "pass the variables."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = checked_gradients(grads, trainable_variables)
        if not grads:
            return
        if tf.distribute.has_strategy() and (
            tf.distribute.in_cross_replica_context()
        ):
            raise ValueError(
                "apply_gradients() must be called in a replica context, inside "
                "strategy.run(...), not directly under strategy.scope()."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        with keras.name_scope(self.name, caller=self):
            scaled = self._take_protocol()
            self._apply_step(grads, trainable_variables, scaled)

    def _apply_step(self, grads, variables, scaled):
        distributed = tf.distribute.has_strategy()
        replica_context = tf.distribute.get_replica_context()
        if distributed:
            grads = self._sum_over_replicas(grads, replica_context)
        if scaled is not False:
            # True, or a bool tensor: divide by the scale, or by 1.
            scale = self.loss_scale
            if scaled is not True:
                scale = tf.where(scaled, scale, tf.ones_like(scale))
            keep = {
                index
                for index, variable in enumerate(variables)
                if self._overwrite_variable_with_gradient(variable)
            }
            grads = _unscale_gradients(grads, scale, keep)
        # The gradients are the same on every replica now, and so is this.
        if self._record_nonfinite:
            finite_per_gradient = _finite_per_gradient(grads)
            finite = tf.reduce_all(finite_per_gradient)
        else:
            finite_per_gradient = None
            finite = _all_finite(grads)
        if distributed and not (
            tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            # A cond whose branch calls merge_call (as the inner optimizer's
            # apply does) must run in cross-replica context.
            replica_context.merge_call(
                self._cross_replica_step,
                args=(grads, variables, finite, finite_per_gradient),
            )
            return
        if distributed:
            tf.cond(
                finite,
                lambda: self._inner_apply(grads, variables, True),
                lambda: None,
            )
        elif _can_apply_then_restore(self._inner_optimizer, grads, variables):
            restore = self._apply_keeping_old_state(grads, variables)
            self._after_step(finite, finite_per_gradient, restore)
            return
        else:
            # Lowered into the graph, as TensorFlow does it: Grappler then
            # optimizes the update exactly as it would without the cond, so
            # its arithmetic (and its rounding) is the inner optimizer's own.
            tf.cond(
                finite,
                lambda: self._inner_apply(grads, variables, False),
                lambda: None,
            )
        self._after_step(finite, finite_per_gradient)

    def _apply_keeping_old_state(self, grads, variables):
        """Applies the inner update now; returns a function that undoes it.

        The old value of every variable the inner optimizer may write (model
        variables, slots, `iterations`) is read first, then the inner
        optimizer applies its update exactly as it would alone: each
        variable's update runs as soon as its gradient exists, alongside the
        rest of the backward pass, instead of waiting for the finite check.
        A value read is never changed by a later write (TensorFlow copies a
        buffer rather than write it while a read of it is pending), so on a
        skipped step `_after_step` writes the old values back, bit for bit.
        """
        inner = self._inner_optimizer
        restore = _snapshot([*variables, *inner.variables])
        inner.apply(grads, variables)
        return restore

    def _cross_replica_step(
        self, distribution, grads, variables, finite, finite_per_gradient
    ):
        # Every replica decided on the same summed gradients; AND them anyway.
        finite = tf.reduce_all(
            tf.stack(distribution.experimental_local_results(finite))
        )
        if finite_per_gradient is not None:
            finite_per_gradient = distribution.experimental_local_results(
                finite_per_gradient
            )[0]

        def apply_on_every_replica():
            distribution.extended.call_for_each_replica(
                self._inner_apply, args=(grads, variables, True)
            )

        tf.cond(finite, apply_on_every_replica, lambda: None)
        self._after_step(finite, finite_per_gradient)

    def _inner_apply(self, grads, variables, already_summed):
        inner = self._inner_optimizer
        if already_summed:
            with _without_gradient_aggregation(inner):
                inner.apply(grads, variables)
        else:
            inner.apply(grads, variables)

    @staticmethod
    def _sum_over_replicas(grads, replica_context):
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        summed = iter(
            replica_context.all_reduce(tf.distribute.ReduceOp.SUM, present)
        )
        return [None if g is None else next(summed) for g in grads]

    def _after_step(self, finite, finite_per_gradient, restore=None):
        """Updates the scale, the skip counters and the records of a step.

        What only a skipped step needs (`restore`, which undoes an update
        already applied, and the persistent-skips report) runs in one `If`
        kept as a single function call: a step that is not skipped pays one
        op for it.
        """
        skipped = tf.cast(tf.logical_not(finite), tf.int64)
        self._skipped.assign_add(skipped)
        in_a_row = (self._skipped_in_a_row + skipped) * skipped
        self._skipped_in_a_row.assign(in_a_row)
        if finite_per_gradient is not None and self._nonfinite_mask is not None:
            self._nonfinite_mask.assign(
                tf.where(
                    finite,
                    self._nonfinite_mask,
                    tf.logical_not(finite_per_gradient),
                )
            )
        scale = self._scale
        if self._dynamic:
            scale, counter = _rule.next_dynamic_scale(
                self._scale, self._counter, finite, self._dynamic_growth_steps
            )
            self._scale.assign(scale)
            self._counter.assign(counter)
        scale = tf.convert_to_tensor(scale)
        limit = self._max_consecutive_skips
        if tf.executing_eagerly():  # The update waited for the check.
            if limit is not None and int(in_a_row) == limit:
                self._report_persistent_skips(in_a_row, scale)
            return
        # py_function cannot run under XLA; there, LossScaleMonitor reports
        # consecutive_skips from fit's logs instead.
        report = limit is not None and not _in_xla_context()
        if restore is None and not report:
            return
        # A py_function outside a function call slows every step (by a tenth
        # on the 202-variable model); here it only exists inside the If.
        reached = tf.equal(in_a_row, limit) if report else None

        def report_persistent_skips():
            tf.py_function(self._report_persistent_skips, [in_a_row, scale], [])

        def when_skipped():
            restored = restore() if restore is not None else []
            if report:
                # After the state is back: "raise" must not stop a step
                # that is half undone.
                with tf.control_dependencies(restored):
                    tf.cond(reached, report_persistent_skips, lambda: None)

        _cond_as_one_call(tf.logical_not(finite), when_skipped)

    def _report_persistent_skips(self, in_a_row, scale):
        message = (
            f"kmp.LossScaleOptimizer skipped the last {int(in_a_row)} steps in "
            "a row: every one had inf or NaN gradients, and the loss scale is "
            f"now {float(scale):g}. Likely causes: a layer "
            "overflows in its forward pass (float16 activations above 65504) "
            "- find it with kmp.audit(model, x, y) and keep it in float32 "
            "with dtype='float32'; the loss or the final softmax is computed "
            "in float16 - give the last layer dtype='float32'; or the model "
            "produces inf/NaN in float32 too (data, learning rate)."
        )
        if self._on_persistent_skips == "raise":
            raise FloatingPointError(message)
        if not self._warned_persistent_skips:
            self._warned_persistent_skips = True
            warnings.warn(
                message + " Pass on_persistent_skips='raise' to stop instead.",
                RuntimeWarning,
                stacklevel=2,
            )

    # --- Serialization ------------------------------------------------------

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # In a tf.train.Checkpoint this optimizer looks like its inner one
        # plus the loss-scale state under names of its own, so checkpoints
        # carry over between a plain and a loss-scale optimizer, both ways.
        children = dict(
            self._inner_optimizer._trackable_children(save_type, **kwargs)
        )
        children.update(
            {
                "loss_scale": self._scale,
                "loss_scale_counter": self._counter,
                "loss_scale_skipped_steps": self._skipped,
                "loss_scale_consecutive_skips": self._skipped_in_a_row,
            }
        )
        return children

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(
                self._inner_optimizer
            ),
            "dynamic": self._dynamic,
            "initial_scale": self._initial_scale,
            "dynamic_growth_steps": self._dynamic_growth_steps,
            "max_consecutive_skips": self._max_consecutive_skips,
            "on_persistent_skips": self._on_persistent_skips,
            "record_nonfinite": self._record_nonfinite,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        """Creates the optimizer from `get_config()`'s output."""
        if not isinstance(config, Mapping) or "inner_optimizer" not in config:
            raise ValueError(
                "'config' must be a dict with at least the key "
                "'inner_optimizer', as returned by get_config(). Received: "
                f"config={describe(config)}"
            )
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


# --- model.compile's automatic loss scaling -----------------------------------

_keras_compile = _keras_trainer.Trainer.compile


def _computes_in_float16(model) -> Optional[bool]:
    """Whether any layer of `model` computes in float16 (None: no layers)."""
    layers = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    if not layers:
        return None
    return any(
        getattr(layer.dtype_policy, "compute_dtype", None) == "float16"
        for layer in layers
    )


@functools.wraps(_keras_compile)
def _compile_with_kmp_loss_scaling(self, optimizer="rmsprop", *args, **kwargs):
    _keras_compile(self, optimizer, *args, **kwargs)
    chosen = getattr(self, "optimizer", None)
    if type(chosen) is not _KerasLossScaleOptimizer or chosen is optimizer:
        return
    # Keras wrapped the user's optimizer by itself, because the model was
    # created under mixed_float16.
    if _computes_in_float16(self) is False:
        # No layer computes in float16 (a float32 model loaded while the
        # global policy is mixed_float16): no loss scaling, and the saved
        # optimizer state still fits.
        self.optimizer = chosen.inner_optimizer
        return
    # Wrap in kmp's optimizer instead, and record it in the compile config,
    # so a saved model restores it (scale and counter included) whatever the
    # global policy at load time.
    self.optimizer = LossScaleOptimizer(
        chosen.inner_optimizer, name=chosen.name
    )
    self._compile_config.config["optimizer"] = self.optimizer


_keras_trainer.Trainer.compile = _compile_with_kmp_loss_scaling
