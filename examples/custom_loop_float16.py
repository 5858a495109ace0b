"""A custom training loop under mixed_float16, with gradient clipping.

The loop follows kmp's recipe: scale the loss, take the gradients of the
scaled loss, unscale them, then apply them. Between unscaling and applying
the gradients are true gradients, so they can be clipped by their global norm
like in any float32 loop. A step whose gradients overflowed has an infinite
norm; clipping then turns every gradient into NaN, and the optimizer skips the
step and lowers the scale, as it would have without clipping.

    python examples/custom_loop_float16.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 20
BATCH_SIZE = 32
CLIP_NORM = 1.0


def main() -> None:
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    kmp.set_global_policy("mixed_float16")
    model = build_model()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=0)
        .batch(BATCH_SIZE)
    )

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        grads, norm = tf.clip_by_global_norm(grads, CLIP_NORM)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, norm

    def test_loss() -> float:
        return float(loss_fn(y_test, model(x_test)))

    print("policy:", kmp.global_policy().name)
    print("output dtype:", model(x_test[:1]).dtype.name)
    loss_before = test_loss()
    clipped = 0
    for epoch in range(EPOCHS):
        for x, y in dataset:
            loss, norm = train_step(x, y)
            clipped += int(norm > CLIP_NORM)
        if epoch == 0 or epoch + 1 == EPOCHS or (epoch + 1) % 10 == 0:
            print(
                f"epoch {epoch + 1}: train loss {float(loss):.4f}, "
                f"gradient norm {float(norm):.3f}, "
                f"loss scale {float(optimizer.loss_scale):g}"
            )
    loss_after = test_loss()
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(y_test, model(x_test))
    print(
        f"steps: {int(optimizer.iterations)} applied, "
        f"{int(optimizer.skipped_steps)} skipped, "
        f"{clipped} clipped to norm {CLIP_NORM}"
    )
    print(f"test accuracy: {float(accuracy.result()):.3f}")
    print(f"loss went from {loss_before:.4f} to {loss_after:.4f}")


if __name__ == "__main__":
    main()
