"""`LossScaleOptimizer.stateless_apply`: one step as a pure function (JAX).

Keras's JAX trainer (and a JAX loop over `stateless_call`) passes the
values of the optimizer's and the model's variables and gets new values
back. Here, in a trace (`jax.jit`: `fit`'s compiled step, a jitted loop),
the inner optimizer's `stateless_apply` runs in one branch of a
`lax.cond` on the finite check, and the other branch returns the values
it was given (as Keras's own `LossScaleOptimizer`): a skipped step leaves
weights, slots and `iterations` exactly as they were, XLA still updates
donated buffers in place, and the update is compiled as the bare
optimizer's. (A `jnp.where` of new against old values, as Flax's
`DynamicScale`, keeps both alive: XLA then copies every weight and slot
each step, 1.5-3x the step time of Adam alone on 202 small variables on a
CPU; `benchmarks/README.md`.) Run eagerly (no trace), the update runs op
by op as the inner optimizer's own and each value is then selected on the
device, without reading the finite check on the host.
Then the loss-scale state is updated by the same code as the stateful step,
inside a Keras `StatelessScope`. The persistent-skips check reads the
state a step or more later, without waiting for the device
(`kmp.core.step.lagged`).
"""

import keras
from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import in_stateless_scope

from kmp.core import backend
from kmp.core import jax_tracing
from kmp.core import scaling
from kmp.core.step import common as steps


def apply(
    optimizer,
    optimizer_variables,
    grads,
    trainable_variables,
    scaled,
    report=True,
    unscale=scaling.unscale_gradients,
    agree=None,
    choose=None,
):
    """See `LossScaleOptimizer.stateless_apply`; `report=False` leaves the
    persistent-skips report to the caller; `unscale` and `agree` are the
    backend's, as `kmp.core.step.common.prepare` takes them, and so is
    `choose(apply_ok, applied, skipped)`, which runs one of the two and
    returns its `(new trainable values, new inner values)` (`choose`
    here: JAX's; torch's is `kmp.core.torch.step.choose`)."""
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
    if backend.is_tensorflow():
        # As Keras's optimizers: a TensorFlow step is stateful. (Checked
        # after the arguments, so a wrong call says what is wrong first.)
        raise ValueError(
            "stateless_apply is not supported with the TensorFlow backend "
            "(as for Keras's optimizers): use apply_gradients."
        )
    if scaled is None:
        scaled = optimizer._recipes.grads_are_scaled(grads, stateless=True)
    grads = steps.raw_overwrite_gradients(optimizer, grads, variables)
    optimizer._recipes.applied()
    own_count = len(optimizer._variables)
    inner_values = optimizer_variables[own_count:]
    mapping = list(zip(optimizer.variables, optimizer_variables))
    mapping += list(zip(variables, trainable_variables))

    with StatelessScope(state_mapping=mapping):
        grads, finite, apply_ok, per_gradient = steps.prepare(
            optimizer, grads, variables, scaled, unscale, agree
        )

    inner = optimizer.inner_optimizer

    def applied():
        new_trainable, new_inner = inner.stateless_apply(
            inner_values, grads, trainable_variables
        )
        return list(new_trainable), list(new_inner)

    def skipped():
        return list(trainable_variables), list(inner_values)

    new_trainable, new_inner = (choose or _choose)(apply_ok, applied, skipped)

    with StatelessScope(state_mapping=mapping) as scope:
        in_a_row = optimizer.update_state(
            finite, apply_ok, per_gradient, variables
        )
        new_own = [scope.get_current_value(v) for v in optimizer._variables]
        scale = scope.get_current_value(optimizer.dynamic_scale)
    if report:
        _report(optimizer, in_a_row, scale)
    return new_trainable, new_own + new_inner


def _choose(apply_ok, applied, skipped):
    """JAX's way to apply or skip (`apply`'s `choose`)."""
    if jax_tracing.any_tracer([apply_ok]):
        # Traced (jax.jit, fit): the inner update in a branch of its own.
        return ops.cond(apply_ok, applied, skipped)
    # Run eagerly, op by op, as the inner optimizer's own; then chosen on
    # the device, without a read (a cond would compile the update).
    return select(apply_ok, applied(), skipped())


def select(condition, when_true, when_false):
    """Of two structures of values alike, each leaf from `when_true` where
    the bool scalar `condition` is true, else from `when_false`; a leaf
    that is the same object in both is passed through."""
    flat_true = keras.tree.flatten(when_true)
    flat_false = keras.tree.flatten(when_false)
    chosen = [
        a if a is b else ops.where(condition, a, b)
        for a, b in zip(flat_true, flat_false)
    ]
    return keras.tree.pack_sequence_as(when_true, chosen)


def apply_to_variables(optimizer, grads, variables, scaled):
    """A stateful step on JAX (an eager `apply`): `apply` on the variables'
    values, whose results are then assigned."""
    if in_stateless_scope():
        raise RuntimeError(
            "On JAX, call stateless_apply(optimizer_variables, grads, "
            "trainable_variables) inside a stateless function, not apply."
        )
    trained = list(optimizer._trainable_variables)
    positions = {id(v): i for i, v in enumerate(trained)}
    all_grads = [None] * len(trained)
    for gradient, variable in zip(grads, variables):
        all_grads[positions[id(variable)]] = gradient
    new_trained, new_optimizer = apply(
        optimizer,
        [v.value for v in optimizer.variables],
        all_grads,
        [v.value for v in trained],
        scaled,
        report=False,
    )
    for variable, value in zip(trained, new_trained):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer):
        variable.assign(value)
    restore = optimizer._kept_states.current()
    if restore is not None:
        # Selected on the device: the values kept where the step skipped.
        restore(ops.not_equal(optimizer.consecutive_skips_variable.value, 0))
    optimizer.report_persistent_skips_now()


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


def _report(optimizer, in_a_row, scale):
    """The persistent-skips report, now; in a JAX trace (or inside
    `_skips_reported_after_step`), left to `check_persistent_skips` on the
    step's results (which `fit` calls after every step): a host callback
    inside the step would cost more than the rest of the loss scaling on
    models of many small variables."""
    if (
        optimizer._max_consecutive_skips is None
        or optimizer._skips_reported_by_caller
    ):
        return
    if backend.is_jax():
        import jax

        if isinstance(in_a_row, jax.core.Tracer):
            return
    optimizer.report_persistent_skips(
        ops.convert_to_numpy(in_a_row), ops.convert_to_numpy(scale)
    )
