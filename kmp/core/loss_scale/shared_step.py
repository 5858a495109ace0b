"""What every backend's `LossScaleOptimizer` step shares.

`prepare` unscales the gradients (when they are scaled) and decides, as
tensors, whether the step is applied: all gradients finite, and a finite
learning rate (a NaN learning rate would write NaN into every weight).
TensorFlow's step (`kmp.core.tensorflow.step`) and the pure step use it;
torch's stateful step (`kmp.core.torch.step`) does the same with
multi-tensor ops. Under `torch.distributed` the flags are agreed across
processes where asked (`kmp.core.torch.distributed`).

`update_state` is what every step does after it: the skip counters, the
mask of non-finite gradients and the rule's new scale, written once, with
the operations of an `xp` (`KerasOps` here; torch's in-place ones), as
`kmp.core.loss_scale.ScaleRule.next` takes them.

`stateless_apply` is the pure step (`LossScaleOptimizer.stateless_apply`:
JAX's, and torch's): Keras's JAX trainer (and a JAX loop over
`stateless_call`) passes the values of the optimizer's and the model's
variables and gets new values back. The gradients are unscaled and checked
inside a Keras `StatelessScope` that maps the variables to the values
given, the inner optimizer's `stateless_apply` runs or not by the
backend's `choose` (JAX's `lax.cond` in a trace, torch's one read), and the
state is updated by `update_state`. The caller reports persistent skips
(`report`), or leaves the report to `check_persistent_skips` a step later
(`kmp.core.loss_scale.lagged`).

`KeptStates` keeps what the open `keep_on_skip` blocks read (each
backend's `snapshot`), for a skipped step to write back
(`restore_kept_state`).
"""

import contextlib
import operator
import threading

from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope

from kmp.core.loss_scale import rule as loss_scale
from kmp.core.loss_scale import scaling


def raw_overwrite_gradients(optimizer, grads, variables):
    """For variables Keras overwrites with their "gradient" (float8 scales
    and amax histories), what `get_unscaled_gradients` was given, not its
    quotient: they are values, not scaled gradients."""
    recipes = optimizer._recipes
    return [
        recipes.unscaled_input(g)
        if g is not None
        and optimizer._overwrite_variable_with_gradient(v)
        and recipes.unscaled_input(g) is not None
        else g
        for g, v in zip(grads, variables)
    ]


def current_learning_rate(optimizer):
    """The optimizer's learning rate now, or None if it has no single one
    (a `MultiOptimizer`'s are its sub-optimizers')."""
    try:
        return optimizer.learning_rate
    except (AttributeError, NotImplementedError):
        return None


def prepare(
    optimizer,
    grads,
    variables,
    scaled,
    unscale=scaling.unscale_gradients,
    agree=None,
    check=scaling.all_finite,
):
    """Unscaled gradients and the step's finite flags.

    `unscale` divides the gradients by the scale (the backend's own where
    it has one); `check` tells whether they are all finite (TensorFlow's
    decides with a quick sum first);
    `agree(finite, apply_ok, per_gradient, optimizer)`, if given, agrees
    the flags across processes (torch's, which the caller picks).
    Returns `(grads, finite, apply_ok, finite_per_gradient)`: whether the
    gradients are finite (what the scale rule sees) and
    whether the step is applied (which also needs a finite learning rate);
    the per-gradient flags only with `record_nonfinite=True`, else None.
    """
    if scaled:
        grads = unscale(
            grads, optimizer.dynamic_scale, kept_gradients(optimizer, variables)
        )
    if optimizer._record_nonfinite:
        per_gradient = scaling.finite_per_gradient(grads)
        finite = ops.all(ops.stack(per_gradient))
    else:
        per_gradient = None
        finite = check(grads)
    rate = current_learning_rate(optimizer.inner_optimizer)
    apply_ok = finite
    if rate is not None:
        apply_ok = ops.logical_and(
            finite, ops.all(ops.isfinite(ops.cast(rate, "float32")))
        )
    if agree is not None:
        finite, apply_ok, per_gradient = agree(
            finite, apply_ok, per_gradient, optimizer
        )
    return grads, finite, apply_ok, per_gradient


def kept_gradients(optimizer, variables) -> set:
    """The positions of the gradients no unscaling divides: those of the
    variables Keras overwrites with their "gradient" (float8 scales)."""
    return {
        i
        for i, v in enumerate(variables)
        if optimizer._overwrite_variable_with_gradient(v)
    }


def restore_kept_state(optimizer) -> None:
    """On a skipped step taken eagerly: writes back what the open
    `keep_on_skip` blocks read (see `kmp.core.loss_scale.keep_on_skip`)."""
    restore = optimizer._kept_states.current()
    if restore is not None:
        restore()


def update_state(optimizer, finite, apply_ok, per_gradient, variables, xp):
    """Assigns the skip counters, the mask and the rule's new scale.

    In pseudo-code, with `skipped = 1 - apply_ok`:

        skipped_steps += skipped
        consecutive_skips = (consecutive_skips + skipped) * skipped
        nonfinite_mask = apply_ok ? nonfinite_mask : not per_gradient
        (scale, counter, hysteresis_left) = rule.next(..., finite)

    `xp` holds the operations (`KerasOps`: Keras variables, also inside a
    `StatelessScope`; torch's, in place). `apply_ok` may be the Python bool
    a step read already (torch's): then an applied step is finite and
    records no mask. Returns the new count of skips in a row.
    """
    skipped = xp.skipped(apply_ok, optimizer.consecutive_skips_variable.dtype)
    total = optimizer.skipped_steps_variable
    xp.assign(total, xp.add(xp.read(total), skipped))
    consecutive = optimizer.consecutive_skips_variable
    in_a_row = xp.multiply(xp.add(xp.read(consecutive), skipped), skipped)
    xp.assign(consecutive, in_a_row)
    mask = optimizer.nonfinite_mask
    if per_gradient is not None and mask is not None and apply_ok is not True:
        position = {id(v): i for i, v in enumerate(variables)}
        bad = [
            xp.logical_not(per_gradient[position[id(v)]])
            if id(v) in position
            else xp.false(finite)
            for v in optimizer._trainable_variables
        ]
        xp.assign(mask, xp.where(apply_ok, mask.value, xp.stack(bad)))
    if optimizer.dynamic:
        state = (
            optimizer.dynamic_scale,
            optimizer.step_counter,
            optimizer.hysteresis_left,
        )
        scale, counter, hysteresis = optimizer.rule.next(
            tuple(xp.read(v) for v in state),
            True if apply_ok is True else finite,
            xp=xp,
        )
        xp.assign(optimizer.dynamic_scale, scale)
        xp.assign(
            optimizer.step_counter,
            xp.cast(counter, optimizer.step_counter.dtype),
        )
        xp.assign(
            optimizer.hysteresis_left,
            xp.cast(hysteresis, optimizer.hysteresis_left.dtype),
        )
    return in_a_row


class KerasOps(loss_scale.KerasOps):
    """`update_state`'s operations on Keras variables (any backend, also
    inside a `StatelessScope`): the rule's, and assignments."""

    add = staticmethod(operator.add)
    multiply = staticmethod(operator.mul)
    cast = staticmethod(ops.cast)
    stack = staticmethod(ops.stack)

    @staticmethod
    def read(variable):
        return variable

    @staticmethod
    def assign(variable, value):
        variable.assign(value)

    @staticmethod
    def skipped(apply_ok, dtype):
        return ops.cast(ops.logical_not(apply_ok), dtype)

    @staticmethod
    def false(like):
        return ops.convert_to_tensor(False)


def check_arguments(optimizer, optimizer_variables, grads, trainable_variables):
    """`stateless_apply`'s arguments as lists, checked against the
    optimizer (built, one value per variable).

    Raises:
        ValueError: the optimizer is not built, or a count is wrong.
    """
    if not optimizer.built:
        raise ValueError(
            "To call stateless_apply, the optimizer must be built (its "
            "variables created): call optimizer.build(trainable_variables) "
            "first."
        )
    optimizer_variables = list(optimizer_variables)
    trainable_variables = list(trainable_variables)
    grads = list(grads)
    variables = list(optimizer._trainable_variables)
    if len(optimizer_variables) != len(optimizer.variables):
        raise ValueError(
            "'optimizer_variables' must hold one value per variable of "
            f"optimizer.variables ({len(optimizer.variables)}). Received "
            f"{len(optimizer_variables)} values."
        )
    if not len(trainable_variables) == len(grads) == len(variables):
        raise ValueError(
            "'grads' and 'trainable_variables' must hold one entry per "
            f"variable the optimizer was built with ({len(variables)}). "
            f"Received {len(grads)} gradients and "
            f"{len(trainable_variables)} values."
        )
    return optimizer_variables, grads, trainable_variables


def stateless_apply(
    optimizer,
    optimizer_variables,
    grads,
    trainable_variables,
    scaled,
    choose,
    unscale=scaling.unscale_gradients,
    agree=None,
):
    """See `LossScaleOptimizer.stateless_apply`; the backend's step passes
    `choose(apply_ok, applied, skipped)`, which runs one of the two and
    returns its `(new trainable values, new inner values)`, and `unscale`
    and `agree`, as `kmp.core.loss_scale.shared_step.prepare` takes them.
    The gradients are unscaled once, before `choose`: the check and the
    inner update read the same unscaled values (`kmp.core.jax.step`).

    Returns:
        `(new trainable values, new optimizer values, skips in a row,
        scale)`: the last two for the persistent-skips report (`report`).
    """
    optimizer_variables, grads, trainable_variables = check_arguments(
        optimizer, optimizer_variables, grads, trainable_variables
    )
    variables = list(optimizer._trainable_variables)
    if scaled is None:
        scaled = optimizer._recipes.grads_are_scaled(grads, stateless=True)
    grads = raw_overwrite_gradients(optimizer, grads, variables)
    optimizer._recipes.applied()
    own_count = len(optimizer._variables)
    inner_values = optimizer_variables[own_count:]
    mapping = list(zip(optimizer.variables, optimizer_variables))
    mapping += list(zip(variables, trainable_variables))

    with StatelessScope(state_mapping=mapping):
        unscaled, finite, apply_ok, per_gradient = prepare(
            optimizer, grads, variables, scaled, unscale, agree
        )
    inner = optimizer.inner_optimizer

    def applied():
        new_trainable, new_inner = inner.stateless_apply(
            inner_values, unscaled, trainable_variables
        )
        return list(new_trainable), list(new_inner)

    def skipped():
        return list(trainable_variables), list(inner_values)

    new_trainable, new_inner = choose(apply_ok, applied, skipped)

    with StatelessScope(state_mapping=mapping) as scope:
        in_a_row = update_state(
            optimizer, finite, apply_ok, per_gradient, variables, KerasOps
        )
        new_own = [scope.get_current_value(v) for v in optimizer._variables]
        scale = scope.get_current_value(optimizer.dynamic_scale)
    return new_trainable, new_own + new_inner, in_a_row, scale


def read_copy(variable):
    """A snapshot of `variable`'s value now (a tensor later steps do not
    change): JAX's and torch's `read_value`."""
    return ops.copy(variable.value)


def no_checkpoint_children(optimizer, save_type) -> dict:
    """Nothing beyond the inner optimizer's: JAX's and torch's
    `checkpoint_children` (TensorFlow's checkpoints hold the scale)."""
    return {}


def scale_of(optimizer, optimizer_variables):
    """The loss scale among `optimizer_variables` (values of
    `optimizer.variables`, in order)."""
    return value_of(optimizer, optimizer_variables, optimizer.dynamic_scale)


def value_of(optimizer, optimizer_variables, variable):
    """The value of `variable` (one of `optimizer.variables`) among
    `optimizer_variables` (their values, in order)."""
    optimizer_variables = list(optimizer_variables)
    if len(optimizer_variables) != len(optimizer.variables):
        raise ValueError(
            "'optimizer_variables' must hold one value per variable of "
            f"optimizer.variables ({len(optimizer.variables)}). Received "
            f"{len(optimizer_variables)} values."
        )
    index = next(i for i, v in enumerate(optimizer.variables) if v is variable)
    return optimizer_variables[index]


def report(optimizer, in_a_row, scale):
    """The persistent-skips report, now (reading the two numbers), unless
    the caller reports after the step (`_skips_reported_after_step`):
    JAX's step leaves a traced step's to `check_persistent_skips` on its
    results (which `fit` calls after every step), as a host callback
    inside the step would cost more than the rest of the loss scaling on
    models of many small variables."""
    if (
        optimizer._max_consecutive_skips is None
        or optimizer._skips_reported_by_caller
    ):
        return
    optimizer.report_persistent_skips(
        ops.convert_to_numpy(in_a_row), ops.convert_to_numpy(scale)
    )


class Restore:
    """Writes back what the `keep_on_skip` blocks open in one thread read.

    Called as a function (in that thread or, under `tf.distribute`, for
    its replica); returns TensorFlow's write ops.
    """

    def __init__(self, snapshots):
        self._snapshots = tuple(snapshots)

    def __call__(self, skipped=None) -> list:
        writes = []
        for restore in self._snapshots:  # Oldest first: the newest wins.
            writes += restore(skipped)
        return writes


class KeptStates:
    """The `keep_on_skip` blocks open on one optimizer, per thread (every
    `tf.distribute` replica runs in its own).

    `snapshot(variables, buffers)` is the backend's (`snapshot` of its
    step module): it reads the variables and returns a function
    `restore(skipped=None)` that writes them back and returns TensorFlow's
    write ops; `buffers` is a dict it may keep values in from step to step
    (torch's copies), one per thread and depth of nesting.
    """

    def __init__(self, snapshot):
        self._snapshot = snapshot
        self._local = threading.local()

    def _open(self) -> list:
        open_blocks = getattr(self._local, "open", None)
        if open_blocks is None:
            open_blocks = self._local.open = []
        return open_blocks

    def current(self):
        """A `Restore` for the blocks open in this thread, or None."""
        open_blocks = getattr(self._local, "open", None)
        return Restore(open_blocks) if open_blocks else None

    def _buffers(self) -> dict:
        """The buffers of the block about to open: kept per depth."""
        cache = getattr(self._local, "buffers", None)
        if cache is None:
            cache = self._local.buffers = {}
        return cache.setdefault(len(self._open()), {})

    @contextlib.contextmanager
    def keep(self, variables):
        restore = self._snapshot(variables, self._buffers())
        self._open().append(restore)
        try:
            yield
        finally:
            self._local.open = [r for r in self._open() if r is not restore]
