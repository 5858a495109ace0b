"""kmp.LossScaleOptimizer on Keras's torch backend.

The guarantees of the TensorFlow backend, on torch (`fit`'s skips are in
`tests/core/test_jax_and_torch.py`, over both backends): the custom loop
(`loss.backward()` on `get_scaled_loss(loss)`, then
`get_unscaled_gradients` and `apply_gradients`, or Keras 3's `scale_loss`
with the scaled gradients straight to `apply_gradients`) gives the float32
reference bit for bit and skips a non-finite step exactly; a `.keras` file
keeps the scale and counter.
"""

import keras
import pytest

import kmp
from tests.support import backends
from tests.support import reliability as rel
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import INF
from tests.support.training import NAN
from tests.support.training import OPTIMIZERS
from tests.support.training import X
from tests.support.training import Y

# torch only: skipped, before anything imports it, elsewhere.
backends.require("torch")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

# --- The custom loop ----------------------------------------------------------


def _train_step(model, optimizer, recipe):
    """The custom loop of the contract, on torch: `loss.backward()`."""
    loss_fn = keras.losses.MeanSquaredError()
    variables = model.trainable_variables

    def step(x, y, factor=1.0):
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True)) * factor
        if recipe == "contract":
            optimizer.get_scaled_loss(loss).backward()
        elif recipe == "keras":
            optimizer.scale_loss(loss).backward()
        else:
            loss.backward()
        grads = [v.value.grad for v in variables]
        if recipe == "contract":
            grads = optimizer.get_unscaled_gradients(grads)
        with torch.no_grad():
            optimizer.apply_gradients(zip(grads, variables))

    return step


def _batches():
    for start in range(0, len(X), BATCH_SIZE):
        yield (
            backends.tensor(X[start : start + BATCH_SIZE]),
            backends.tensor(Y[start : start + BATCH_SIZE]),
        )


@pytest.mark.parametrize("recipe", ["contract", "keras"])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_custom_loop_matches_the_float32_reference(optimizer_name, recipe):
    reference = training.model()
    plain_step = _train_step(reference, OPTIMIZERS[optimizer_name](), "plain")
    model = training.model()
    optimizer = kmp.LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    step = _train_step(model, optimizer, recipe)
    for x, y in _batches():
        plain_step(x, y)
        step(x, y)
    training.assert_weights_equal(model.get_weights(), reference.get_weights())
    training.assert_weights_equal(
        model.get_weights(), training.reference_weights(optimizer_name, "eager")
    )
    assert training.optimizer_state(optimizer) == (2.0**15, 3, 0, 3)


@pytest.mark.parametrize("recipe", ["contract", "keras"])
def test_custom_loop_skips_a_non_finite_step_exactly(recipe):
    model = training.model()
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=8, dynamic_growth_steps=2
    )
    optimizer.build(model.trainable_variables)
    step = _train_step(model, optimizer, recipe)
    x, y = next(_batches())
    states = [rel.snapshot(model, optimizer)]
    for factor in [1.0, INF, 1.0, 1.0, NAN, 1.0]:
        step(x, y, factor)
        states.append(rel.snapshot(model, optimizer))
    rel.assert_skipped_exactly(states, bad_steps={1, 4})
    assert rel.scales(states[1:]) == [8.0, 4.0, 4.0, 8.0, 4.0, 4.0]
    assert training.optimizer_state(optimizer) == (4.0, 1, 2, 4)
    for variable in model.trainable_variables:
        assert torch.isfinite(variable.value).all()
