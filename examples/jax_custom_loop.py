"""A jitted JAX training loop under mixed_float16, with kmp's loss scaling.

Keras documents this loop for JAX: `jax.value_and_grad` over
`model.stateless_call`, then `optimizer.stateless_apply`, all inside one
`jax.jit`, with the state passed in and out explicitly. kmp adds the
call Keras 3 lacks, in its stateless form: `stateless_scale_loss` reads the
scale from the optimizer values the step receives, so the compiled step
always uses the current scale, and `stateless_apply` unscales the
gradients of the scaled loss (`scaled=True`) and skips a step whose
gradients overflowed (`stateless_unscale_gradients` gives the true
gradients, to clip or log them first). A jitted step
cannot warn: `check_persistent_skips(optimizer_values)` after the step does
(`fit` does it by itself), without waiting for the step: it reports on the
step before, one step late. The step donates the state it is given
(`donate_argnums`), so XLA updates the weights and slots in place.

    KERAS_BACKEND=jax python examples/jax_custom_loop.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import functools
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 10
BATCH_SIZE = 32


def make_train_step(model, optimizer, loss_fn):
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_values = state

        def scaled_loss(trainable):
            y_pred, non_trainable_after = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = loss_fn(y, y_pred)
            scaled = optimizer.stateless_scale_loss(optimizer_values, loss)
            return scaled, (loss, non_trainable_after)

        (_, (loss, non_trainable)), grads = jax.value_and_grad(
            scaled_loss, has_aux=True
        )(trainable)
        # The gradients of the scaled loss, unscaled inside the step (fused
        # into the update). To clip, log or accumulate the true gradients,
        # unscale them first, then say so: stateless_unscale_gradients(
        # optimizer_values, grads), then stateless_apply(..., scaled=False).
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable, scaled=True
        )
        return (trainable, non_trainable, optimizer_values), loss

    return train_step


def main() -> None:
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    kmp.set_global_policy("mixed_float16")
    model = build_model()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    train_step = make_train_step(model, optimizer, loss_fn)
    # Copies: the first step donates them, and the variables keep theirs.
    state = jax.tree.map(
        jax.numpy.copy,
        (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        ),
    )
    losses = []
    for _ in range(EPOCHS):
        for start in range(0, len(x_train), BATCH_SIZE):
            batch = slice(start, start + BATCH_SIZE)
            state, loss = train_step(state, x_train[batch], y_train[batch])
            # Warns (or raises) after max_consecutive_skips skips in a row:
            # the jitted step cannot, so the loop asks, with its own state
            # (the check does not wait for the device).
            optimizer.check_persistent_skips(state[2])
        losses.append(float(loss))
    # The last step's check, waiting for it; then write the final state
    # back into the model and the optimizer.
    optimizer.check_persistent_skips_now(state[2])
    trainable, non_trainable, optimizer_values = state
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)
    accuracy = np.mean(np.argmax(model.predict(x_test, verbose=0), 1) == y_test)
    print(f"compute dtype: {model.layers[0].compute_dtype}")
    print(f"loss went from {losses[0]:.3f} to {losses[-1]:.3f}")
    print(f"loss scale: {float(optimizer.loss_scale):g}")
    print(f"skipped steps: {int(optimizer.skipped_steps)}")
    print(f"test accuracy: {accuracy:.3f}")
    kmp.set_global_policy(None)


if __name__ == "__main__":
    main()
