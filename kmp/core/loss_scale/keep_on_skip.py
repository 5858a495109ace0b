"""Model state a skipped step puts back: `LossScaleOptimizer.keep_on_skip`
and `LossScaleOptimizer.stateless_keep_on_skip`.

A skipped step leaves the variables it would update, the inner optimizer's
slots and `iterations` as they were. But the forward pass of the same step
already wrote other state: BatchNormalization's moving mean and variance, a
dropout layer's seed-generator state, any variable a layer assigns in its
training call. When a float16 layer overflows, the moving statistics
become inf/NaN and the model predicts NaN from then on, while training
itself goes on. Both forms here put such state back on a skipped step:

* `keep_on_skip`, through `kmp.core.loss_scale.shared_step.KeptStates`, for
  stateful steps (TensorFlow, torch, JAX outside `jax.jit`): entering reads the
  variables; a step of the optimizer inside the block that is skipped writes
  those values back, as part of the step, in the branch that skips it (before a
  persistent-skips "raise"). Nothing is checked again and nothing waits for the
  device. Each backend's step module reads them (`snapshot`): TensorFlow reads
  each variable once per step (a reference, no copy) and, in a graph, writes
  inside the conditional the step already has for a skip (under a merge-call
  `tf.distribute` strategy, in one of its own); JAX keeps references (its arrays
  never change) and selects on the device; torch, whose variables are written in
  place, copies them with one multi-tensor op into buffers kept from step to
  step (the forward pass writes them before the step can know it will skip).
* `select(...)` (`stateless_keep_on_skip`), for JAX's stateless steps: of
  the values before and after the step, those before if the step that
  returned `optimizer_variables` was skipped; a select of each value the
  step wrote (the others are passed through), no conditional.

`fit` uses them by itself (the `compile` patch), on
`model.non_trainable_variables` but those marked with `exempt` (a counter
that must advance on every call, such as `kmp.testing.OverflowAt`'s, which
would otherwise repeat its fault on every retry).
"""

import keras
from keras import ops

from kmp.core import checks
from kmp.core.loss_scale import jax_tracing
from kmp.core.loss_scale import shared_step as common

_EXEMPT_ATTRIBUTE = "_kmp_not_kept_on_skip"


def exempt(variable):
    """Marks `variable` as state `fit` does not put back on a skipped step.

    For a variable that counts calls (not a statistic of the data): put
    back, it would make every retried step repeat the call it counts.
    Returns `variable`.
    """
    setattr(variable, _EXEMPT_ATTRIBUTE, True)
    return variable


def is_exempt(variable) -> bool:
    """Whether `exempt` marked `variable`."""
    return bool(getattr(variable, _EXEMPT_ATTRIBUTE, False))


def checked_variables(variables, name: str) -> list:
    """`variables` as a list of Keras variables.

    Raises:
        TypeError: `variables` is not an iterable of Keras variables.
    """
    if isinstance(variables, (str, bytes, keras.Variable)) or not hasattr(
        variables, "__iter__"
    ):
        raise TypeError(
            f"'{name}' must be a list of Keras variables, such as "
            f"model.non_trainable_variables. Received: {name}="
            f"{checks.describe(variables)}"
        )
    variables = list(variables)
    for index, variable in enumerate(variables):
        if not isinstance(variable, keras.Variable):
            raise TypeError(
                f"'{name}' must be a list of Keras variables, such as "
                "model.non_trainable_variables. Received at position "
                f"{index}: {checks.describe(variable)}"
            )
    return variables


def was_skipped(optimizer, optimizer_variables):
    """A bool scalar: whether the step that returned `optimizer_variables`
    (values of `optimizer.variables`) was skipped."""
    in_a_row = common.value_of(
        optimizer, optimizer_variables, optimizer.consecutive_skips_variable
    )
    return ops.not_equal(in_a_row, 0)


def select(optimizer, optimizer_variables, values_before, values_after):
    """See `LossScaleOptimizer.stateless_keep_on_skip`."""
    try:
        keras.tree.assert_same_structure(values_before, values_after)
    except (TypeError, ValueError) as error:
        raise ValueError(
            "'values_before' and 'values_after' must have the same "
            "structure (the state passed into the step, and the state it "
            f"returned). {error}"
        ) from None
    skipped = was_skipped(optimizer, optimizer_variables)
    flat_before = keras.tree.flatten(values_before)
    flat_after = keras.tree.flatten(values_after)
    # Values the step did not write (the same object) need no choice.
    written = [
        i
        for i, (before, after) in enumerate(zip(flat_before, flat_after))
        if after is not before
    ]
    if not written:
        return values_after
    # A select, not a cond: XLA fuses it into the forward pass that
    # computes the new values and copies nothing, where a cond would copy
    # each value (twice, measured with
    # benchmarks/diagnostics/jax_apply_or_skip.py). The program
    # differs from Keras's alone, and XLA may round what the forward pass
    # writes otherwise, by an ulp or so: docs/guarantees.md.
    chosen = [
        ops.where(skipped, flat_before[i], flat_after[i]) for i in written
    ]
    flat = list(flat_after)
    for i, value in zip(written, chosen):
        flat[i] = value
    return keras.tree.pack_sequence_as(values_after, flat)


class KeepOnSkipMixin:
    """`LossScaleOptimizer`'s two calls for state outside it (see the
    module docstring)."""

    def keep_on_skip(self, variables):
        """A context manager: a skipped step inside it restores `variables`.

        Entering it reads `variables`; a step of this optimizer inside it
        that is skipped writes those values back, as part of the step. Wrap
        the whole step, the forward pass included, for the model's
        non-trainable variables (BatchNormalization's moving statistics,
        which the forward pass writes). `fit` does it by itself.

            with optimizer.keep_on_skip(model.non_trainable_variables):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                    scaled_loss = optimizer.get_scaled_loss(loss)
                ...
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

        Works eagerly, in a `tf.function` (also with `jit_compile=True`),
        inside `strategy.run` (each replica writes back its own copies),
        on torch, and on JAX outside `jax.jit` (inside, use
        `stateless_keep_on_skip`). Nothing is written back if no step of
        this optimizer ran in the block, or if it was applied. Entering
        reads the variables: a reference on TensorFlow and JAX, a copy on
        torch (whose variables change in place). The values come back
        before a persistent-skips "raise" stops the step.

        Args:
            variables: Keras variables, such as
                `model.non_trainable_variables`.

        Returns:
            The context manager (entering it gives None).

        Raises:
            TypeError: `variables` is not a list of Keras variables.
            RuntimeError: on JAX, inside a function `jax.jit` traces.

        >>> import kmp
        >>> opt = kmp.LossScaleOptimizer(keras.optimizers.SGD())
        >>> w, count = keras.Variable([1.0]), keras.Variable(0.0)
        >>> with opt.keep_on_skip([count]):
        ...     _ = count.assign(count + 1.0)  # As a forward pass writes.
        ...     _ = opt.apply_gradients([(keras.ops.array([float("nan")]), w)])
        >>> float(keras.ops.convert_to_numpy(count)), int(opt.skipped_steps)
        (0.0, 1)
        """
        variables = checked_variables(variables, "variables")
        # Only JAX traces (Keras's test is False on the other backends).
        jax_tracing.check_not_traced(
            "keep_on_skip()",
            "optimizer.stateless_keep_on_skip(optimizer_variables, "
            "values_before, values_after) after stateless_apply",
        )
        return self._kept_states.keep(variables)

    def stateless_keep_on_skip(
        self, optimizer_variables, values_before, values_after
    ):
        """`keep_on_skip` for stateless steps: the values to keep.

        For JAX loops over `stateless_apply`: `values_after` (the
        non-trainable values `stateless_call` returned) if the step that
        returned `optimizer_variables` was applied, `values_before` (those
        the step was given) if it was skipped. Pure: jit it with the step.

            y_pred, non_trainable_after = model.stateless_call(
                trainable, non_trainable, x, training=True)
            ...
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable, scaled=False)
            non_trainable = optimizer.stateless_keep_on_skip(
                optimizer_values, non_trainable, non_trainable_after)

        Args:
            optimizer_variables: The optimizer values `stateless_apply`
                returned.
            values_before: Values (a list, or any nested structure) before
                the step.
            values_after: The same values after it, in the same structure.

        Returns:
            Values in that structure; each the value before if the step was
            skipped, else the value after.

        Raises:
            ValueError: `optimizer_variables` does not hold one value per
                optimizer variable, or the two structures differ.

        >>> import kmp
        >>> opt = kmp.LossScaleOptimizer(keras.optimizers.SGD())
        >>> w = keras.Variable([1.0])
        >>> _ = opt.apply_gradients([(keras.ops.array([float("nan")]), w)])
        >>> values = [v.value for v in opt.variables]  # After a skipped step.
        >>> kept = opt.stateless_keep_on_skip(
        ...     values, [keras.ops.array([1.0])], [keras.ops.array([9.0])])
        >>> [float(keras.ops.convert_to_numpy(v)[0]) for v in kept]
        [1.0]
        """
        return select(self, optimizer_variables, values_before, values_after)
