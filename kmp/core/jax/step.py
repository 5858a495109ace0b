"""One `LossScaleOptimizer` step on JAX: `stateless_apply`, `apply`, and
what `keep_on_skip` keeps.

The step is pure (`kmp.core.loss_scale.shared_step.stateless_apply`): in a
trace (`jax.jit`: `fit`'s compiled step, a jitted loop) the inner
optimizer's `stateless_apply` runs in one branch of a `lax.cond` on the
finite check, and the other branch returns the values it was given (as
Keras's own `LossScaleOptimizer`): a skipped step leaves weights, slots and
`iterations` exactly as they were, XLA still updates donated buffers in
place, and the update is compiled as the bare optimizer's. (A `jnp.where`
of new against old values, as Flax's `DynamicScale`, keeps both alive: XLA
then copies every weight and slot each step, 1.5-3x the step time of Adam
alone on 202 small variables on a CPU;
`benchmarks/diagnostics/jax_apply_or_skip.py`.) The
gradients of a scaled loss are unscaled before the conditional
(`step_unscale`): the branch's update reads them as finished values, as the
bare optimizer's and Keras's `LossScaleOptimizer`'s updates read theirs,
and XLA compiles and rounds it as theirs (unscaled inside the branch, by a
multiplication XLA fuses into the update, the products are contracted into
the update's multiply-adds otherwise: Muon 256 ulps away after two steps on
JAX 0.12; `tests/core/jax/test_optimizer_zoo.py`). Run eagerly (no trace),
the update runs op by op as the inner optimizer's own and each value is
then selected on the device, without reading the finite check on the host.
The stateful `apply` is that step on the variables' values, assigned after.
A traced step's persistent-skips report is left to `check_persistent_skips`
on its results (`kmp.core.loss_scale.lagged`).
"""

import jax
import keras
import numpy as np
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope

from kmp.core.loss_scale import jax_tracing
from kmp.core.loss_scale import process_settings
from kmp.core.loss_scale import rule as loss_scale
from kmp.core.loss_scale import scaling
from kmp.core.loss_scale import shared_step as common


def stateless_apply(
    optimizer, optimizer_variables, grads, trainable_variables, scaled
):
    """See `LossScaleOptimizer.stateless_apply`."""
    new_trainable, new_values, in_a_row, scale = common.stateless_apply(
        optimizer,
        optimizer_variables,
        grads,
        trainable_variables,
        scaled,
        choose,
        unscale=step_unscale(optimizer),
    )
    if not isinstance(in_a_row, jax.core.Tracer):
        common.report(optimizer, in_a_row, scale)
    return new_trainable, new_values


def apply(optimizer, grads, variables, scaled, aggregate=True):
    """A stateful step (an eager `apply`): the pure step on the variables'
    values, whose results are then assigned. (`aggregate` is TensorFlow's;
    nothing is summed here.)"""
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
    new_trained, new_optimizer, _, _ = common.stateless_apply(
        optimizer,
        [v.value for v in optimizer.variables],
        all_grads,
        [v.value for v in trained],
        scaled,
        choose,
        unscale=step_unscale(optimizer),
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


# `check_finite`'s and `get_unscaled_gradients`' (and the step's) check and
# division: the shared ones, which XLA fuses. `scale_loss` and
# `get_unscaled_gradients` refuse a scale read inside `jax.jit`.
all_finite = scaling.all_finite
unscale_gradients = scaling.unscale_gradients
check_live_scale = jax_tracing.check_live_scale


def choose(apply_ok, applied, skipped):
    """JAX's way to apply or skip
    (`kmp.core.loss_scale.shared_step.stateless_apply`'s)."""
    if isinstance(apply_ok, jax.core.Tracer):
        # Traced (jax.jit, fit): the inner update in a branch of its own.
        return ops.cond(apply_ok, applied, skipped)
    # Run eagerly, op by op, as the inner optimizer's own; then chosen on
    # the device, without a read (a cond would compile the update).
    return select(apply_ok, applied(), skipped())


def step_unscale(optimizer):
    """How the step unscales the gradients of the scaled loss, before the
    conditional (`kmp.core.loss_scale.shared_step.stateless_apply`'s
    `unscale`). Where every scale the optimizer can take is a power of two
    (`loss_scale.powers_of_two`: the default rule's), by a multiplication
    by the reciprocal, which gives the division's values exactly and which
    XLA fuses into the check's reductions and into the kernel that makes
    the gradient, where there is one (under a mixed policy, the cast of
    each float16 gradient to its float32 variable's dtype): the branch then
    reads the unscaled gradients as the bare update reads its own, and no
    pass is added. (A division would be written out on its own: XLA
    repeats no division in several fusions.) Otherwise by the division."""
    if loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale):
        return scaling.unscale_by_reciprocal
    return scaling.unscale_gradients


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


def snapshot(variables, buffers=None):
    """What `keep_on_skip` keeps of `variables` on JAX: their arrays (which
    never change), by reference. Returns `restore(skipped=None)`, which
    writes them back (where `skipped`, a bool scalar, is true, selected on
    the device without a read) and returns no ops. `buffers` is torch's."""
    values = [v.value for v in variables]

    def restore(skipped=None) -> list:
        for variable, value in zip(variables, values):
            if skipped is not None:
                value = ops.where(skipped, value, variable.value)
            variable.assign(value)
        return []

    return restore


def check_strategy() -> None:
    """Nothing to check (TensorFlow's `tf.distribute` strategies)."""


def check_replica_context() -> None:
    """Nothing to check (TensorFlow's `tf.distribute` replica contexts)."""


read_value = common.read_copy
checkpoint_children = common.no_checkpoint_children


# A report on persistent skips reads its numbers a step later
# (`check_persistent_skips`): reading a device array at once would wait.
READS_SKIPS_AT_ONCE = False


def _spans_several_processes() -> bool:
    distribution = keras.distribution.distribution()
    if distribution is None:
        return False
    devices = np.asarray(distribution.device_mesh.devices).reshape(-1)
    processes = {getattr(d, "process_index", 0) for d in devices}
    return len(processes) > 1


def check_processes(optimizer) -> None:
    """Compares `optimizer`'s settings across JAX processes, once
    (`kmp.core.loss_scale.process_settings`).

    Only under a `keras.distribution` whose devices belong to several
    processes: there every process creates the same variables together
    (Keras makes that a collective), so gathering the settings cannot wait
    for a process that does not come. Elsewhere, and after the first check,
    nothing happens.

    Args:
        optimizer: The `LossScaleOptimizer`, being created or built.

    Raises:
        ValueError: see `process_settings.check_gathered`.
    """
    if getattr(optimizer, "_settings_checked", False):
        return
    if not _spans_several_processes():
        return
    from jax.experimental import multihost_utils

    # As 32-bit words: JAX without x64 would round float64 to float32.
    words = process_settings.encode(optimizer).view("uint32")
    rows = np.asarray(multihost_utils.process_allgather(words))
    optimizer._settings_checked = True
    process_settings.check_gathered(rows.astype("uint32").view("float64"))
