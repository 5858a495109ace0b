"""Tests for `kmp.core.loss_scale.keep_on_skip`: the state outside the optimizer
that a skipped step puts back, in custom loops (`fit` is tested with the
`compile` patch that uses it).

A float16 input above float16's range makes BatchNormalization write
inf/NaN moving statistics in the forward pass of a step that is then
skipped. Inside `optimizer.keep_on_skip(model.non_trainable_variables)`
(stateful loops: TensorFlow eagerly, in a `tf.function` and under XLA;
torch; JAX outside `jax.jit`), or through `stateless_keep_on_skip` (a
jitted JAX loop), they come back bit for bit, and the other steps give
what the same loop gives without it on the batches without that one.
"""

import keras
import numpy as np
import pytest

import kmp
from tests.support import backends
from tests.support import overflow
from tests.support import training
from tests.support.backends import MODES
from tests.support.backends import STATEFUL_MODES

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

NAN = float("nan")


def _stateful_step(model, optimizer, keep):
    """The documented stateful loop: get_scaled_loss, unscale, apply; the
    forward pass writes the moving statistics into the variables."""
    loss_fn = keras.losses.MeanSquaredError()
    trainable = model.trainable_variables

    def forward_and_apply(x, y):
        if backends.JAX:  # Outside jax.jit: the values, then assign.
            import jax

            def loss_of(values):
                y_pred, updated = model.stateless_call(
                    values,
                    [v.value for v in model.non_trainable_variables],
                    x,
                    training=True,
                )
                scaled = optimizer.get_scaled_loss(loss_fn(y, y_pred))
                return scaled, updated

            grads, updated = jax.grad(loss_of, has_aux=True)(
                [v.value for v in trainable]
            )
            for variable, value in zip(model.non_trainable_variables, updated):
                variable.assign(value)
        else:
            grads = backends.gradients(
                lambda: optimizer.get_scaled_loss(
                    loss_fn(y, model(x, training=True))
                ),
                trainable,
            )
        grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, trainable))

    def step(x, y):
        if not keep:
            return forward_and_apply(x, y)
        with optimizer.keep_on_skip(model.non_trainable_variables):
            forward_and_apply(x, y)

    return step


def _stateless_step(model, optimizer, keep):
    """The documented JAX loop, jitted, with `stateless_keep_on_skip`."""
    import jax

    loss_fn = keras.losses.MeanSquaredError()

    @jax.jit
    def pure(state, x, y):
        trainable, non_trainable, optimizer_values = state

        def loss_of(trainable):
            y_pred, updated = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = loss_fn(y, y_pred)
            scaled = optimizer.stateless_scale_loss(optimizer_values, loss)
            return scaled, updated

        grads, updated = jax.grad(loss_of, has_aux=True)(trainable)
        grads = optimizer.stateless_unscale_gradients(optimizer_values, grads)
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable, scaled=False
        )
        if keep:
            updated = optimizer.stateless_keep_on_skip(
                optimizer_values, non_trainable, updated
            )
        return trainable, updated, optimizer_values

    def step(x, y):
        groups = (
            model.trainable_variables,
            model.non_trainable_variables,
            optimizer.variables,
        )
        state = tuple([v.value for v in group] for group in groups)
        for group, values in zip(groups, pure(state, x, y)):
            for variable, value in zip(group, values):
                variable.assign(value)

    return step


def _run(x, y, mode, keep):
    """Trains `overflow.model()` in a custom loop in `mode`; returns the
    model's variables (as bytes) before and after every batch, and the
    optimizer."""
    model = overflow.model()
    optimizer = overflow.optimizer()
    optimizer.build(model.trainable_variables)
    if backends.JAX and mode == "jit":
        step = _stateless_step(model, optimizer, keep)
    else:
        step = training.compiled(_stateful_step(model, optimizer, keep), mode)
    states = [[overflow.copies(v) for v in model.weights]]
    for start in range(0, len(x), overflow.BATCH_SIZE):
        batch = slice(start, start + overflow.BATCH_SIZE)
        step(backends.tensor(x[batch]), backends.tensor(y[batch]))
        states.append([overflow.copies(v) for v in model.weights])
    return states, model, optimizer


@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_step_restores_what_its_forward_pass_wrote(mode):
    states, model, optimizer = _run(
        overflow.X_OVERFLOW, overflow.Y, mode, keep=True
    )
    assert int(optimizer.skipped_steps) == 1
    before, after = overflow.OVERFLOW_BATCH, overflow.OVERFLOW_BATCH + 1
    assert states[after] == states[before]
    for variable in model.non_trainable_variables:
        assert np.isfinite(keras.ops.convert_to_numpy(variable)).all()
    # The other steps: as the loop without keep_on_skip, without the batch.
    rows = overflow.WITHOUT_OVERFLOW
    reference, _, _ = _run(overflow.X[rows], overflow.Y[rows], mode, False)
    del states[after]
    if backends.JAX and mode == "jit":
        # Two programs (with and without the select): XLA may round the
        # forward pass of each otherwise, by an ulp (docs/guarantees.md).
        overflow.assert_within_ulps(states, reference, model.weights)
    else:
        assert states == reference
    assert states[1] != states[0]


def test_without_it_the_statistics_turn_non_finite():
    # What the test above guards against: the loop alone keeps inf/NaN.
    _, model, optimizer = _run(
        overflow.X_OVERFLOW, overflow.Y, "eager", keep=False
    )
    assert int(optimizer.skipped_steps) == 1
    moving_mean = model.layers[1].moving_mean
    assert not np.isfinite(keras.ops.convert_to_numpy(moving_mean)).all()


def _nan_step(optimizer, weight):
    optimizer.apply_gradients([(backends.tensor([NAN]), weight)])


def _finite_step(optimizer, weight):
    optimizer.apply_gradients([(backends.tensor([1.0]), weight)])


def _value(variable):
    return float(keras.ops.convert_to_numpy(variable)[0])


@pytest.mark.parametrize("mode", STATEFUL_MODES)
def test_only_a_skipped_step_inside_the_block_restores(mode):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=4
    )
    weight = keras.Variable([1.0])
    state = keras.Variable([0.0])

    def block(step):
        def run():
            with optimizer.keep_on_skip([state]):
                state.assign(state + 1.0)
                if step is not None:
                    step(optimizer, weight)

        training.compiled(run, mode)()

    block(_nan_step)
    assert _value(state) == 0.0
    block(_finite_step)  # Applied: the written value stays.
    assert _value(state) == 1.0 and _value(weight) == 0.5
    block(None)  # No step in the block: nothing to restore.
    assert _value(state) == 2.0
    assert int(optimizer.skipped_steps) == 1


def test_a_block_left_by_an_exception_restores_nothing_later():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=4
    )
    weight = keras.Variable([1.0])
    state = keras.Variable([0.0])
    with pytest.raises(KeyError):
        with optimizer.keep_on_skip([state]):
            raise KeyError("the forward pass failed")
    state.assign([5.0])
    _nan_step(optimizer, weight)  # Outside any block.
    assert _value(state) == 5.0
    assert int(optimizer.skipped_steps) == 1


def test_nested_blocks_each_restore_their_variables():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=4
    )
    weight = keras.Variable([1.0])
    outer, inner = keras.Variable([0.0]), keras.Variable([0.0])
    with optimizer.keep_on_skip([outer]):
        outer.assign([1.0])
        with optimizer.keep_on_skip([inner]):
            inner.assign([2.0])
            _nan_step(optimizer, weight)
    assert (_value(outer), _value(inner)) == (0.0, 0.0)


@pytest.mark.parametrize(
    "variables, fragment",
    [
        ("moving_mean", "Received: variables='moving_mean'"),
        (keras.Variable([0.0]), "Received: variables=a variable"),
        ([np.zeros(2)], "Received at position 0"),
        (3, "Received: variables=3"),
    ],
    ids=["string", "one_variable", "array", "number"],
)
def test_keep_on_skip_refuses_what_is_not_a_list_of_variables(
    variables, fragment
):
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="must be a list of Keras variables"):
        optimizer.keep_on_skip(variables)
    with pytest.raises(TypeError, match=fragment.replace("(", r"\(")):
        optimizer.keep_on_skip(variables)


def test_stateless_keep_on_skip_picks_by_the_step_that_returned_the_values():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=4
    )
    weight = keras.Variable([1.0])
    before = {"a": [backends.tensor([1.0])], "b": backends.tensor(2.0)}
    after = {"a": [backends.tensor([3.0])], "b": backends.tensor(4.0)}

    def kept():
        values = [v.value for v in optimizer.variables]
        result = optimizer.stateless_keep_on_skip(values, before, after)
        return _value(result["a"][0]), float(result["b"])

    _finite_step(optimizer, weight)
    assert kept() == (3.0, 4.0)
    _nan_step(optimizer, weight)
    assert kept() == (1.0, 2.0)


def test_stateless_keep_on_skip_refuses_mismatched_arguments():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build([keras.Variable([1.0])])
    values = [v.value for v in optimizer.variables]
    one, two = [backends.tensor(1.0)], [backends.tensor(1.0)] * 2
    with pytest.raises(ValueError, match="must have the same structure"):
        optimizer.stateless_keep_on_skip(values, one, two)
    with pytest.raises(ValueError, match="one value per variable"):
        optimizer.stateless_keep_on_skip(values[:-1], one, one)


@pytest.mark.jax
def test_keep_on_skip_inside_jax_jit_names_the_stateless_form():
    import jax

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    state = keras.Variable([0.0])

    @jax.jit
    def step(x):
        with optimizer.keep_on_skip([state]):
            return x

    with pytest.raises(RuntimeError, match="stateless_keep_on_skip"):
        step(1.0)
