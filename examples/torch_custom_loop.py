"""A torch training loop under mixed_float16, with kmp's loss scaling.

On Keras's torch backend a custom loop is plain torch: `loss.backward()`
fills each weight's `.grad`. With kmp, backpropagate the scaled loss
(`get_scaled_loss`), unscale the gradients (`get_unscaled_gradients`) and
apply them: a step whose gradients overflowed is skipped and the scale
lowered, as in `fit`.

    KERAS_BACKEND=torch python examples/torch_custom_loop.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 10
BATCH_SIZE = 32


def train_step(model, optimizer, loss_fn, x, y):
    weights = model.trainable_variables
    loss = loss_fn(y, model(x, training=True))
    model.zero_grad()
    optimizer.get_scaled_loss(loss).backward()
    scaled_grads = [w.value.grad for w in weights]
    grads = optimizer.get_unscaled_gradients(scaled_grads)
    # True gradients from here on: clip, log or accumulate them.
    with torch.no_grad():
        optimizer.apply_gradients(zip(grads, weights))
    return loss.detach()


def main() -> None:
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    kmp.set_global_policy("mixed_float16")
    model = build_model()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    losses = []
    for _ in range(EPOCHS):
        for start in range(0, len(x_train), BATCH_SIZE):
            batch = slice(start, start + BATCH_SIZE)
            loss = train_step(
                model, optimizer, loss_fn, x_train[batch], y_train[batch]
            )
        losses.append(float(loss))
    accuracy = np.mean(np.argmax(model.predict(x_test, verbose=0), 1) == y_test)
    print(f"compute dtype: {model.layers[0].compute_dtype}")
    print(f"loss went from {losses[0]:.3f} to {losses[-1]:.3f}")
    print(f"loss scale: {float(optimizer.loss_scale):g}")
    print(f"skipped steps: {int(optimizer.skipped_steps)}")
    print(f"test accuracy: {accuracy:.3f}")
    kmp.set_global_policy(None)


if __name__ == "__main__":
    main()
