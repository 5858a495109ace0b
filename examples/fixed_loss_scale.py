"""Train under mixed_float16 with a fixed loss scale of 128, then of 512.

A fixed scale (`dynamic=False`) multiplies the loss by the same number on
every step. 128 and 512 are the classic values other frameworks used before
dynamic scaling became the default: large enough to lift the small gradients
of a typical network out of float16's underflow range, small enough not to
overflow. A step whose gradients overflow anyway is skipped; the scale stays.

At the end the script counts, on the trained model, the gradient entries that
are non-zero in float32 but come out as zero in float16 when the loss is
scaled by 1 (no scaling), 128 and 512.

    python examples/fixed_loss_scale.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 12
SCALES = (128, 512)


def train(scale, data) -> keras.Model:
    (x_train, y_train), (x_test, y_test) = data
    keras.utils.set_random_seed(0)  # Same initial weights for every scale.
    model = build_model()
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), dynamic=False, initial_scale=scale
    )
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    loss_before, _ = model.evaluate(x_test, y_test, verbose=0)
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0)
    loss_after, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(
        f"initial_scale={scale}: "
        f"loss scale stayed {float(optimizer.loss_scale):g} "
        f"(dynamic={optimizer.dynamic}), "
        f"{int(optimizer.iterations)} steps applied, "
        f"{int(optimizer.skipped_steps)} skipped, "
        f"test accuracy {accuracy:.3f}"
    )
    print(
        f"initial_scale={scale}: loss went from {loss_before:.4f} "
        f"to {loss_after:.4f}"
    )
    return model


def gradients(model, x, y, scale) -> list:
    """The gradients of the loss scaled by `scale`, divided by it again."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x)) * scale
    grads = tape.gradient(loss, model.trainable_variables)
    return [g.numpy() / scale for g in grads]


def count_underflow(mixed_model, x, y) -> None:
    with kmp.policy_scope("float32"):
        reference = build_model()
    reference.set_weights(mixed_model.get_weights())
    exact = gradients(reference, x, y, 1.0)
    nonzero = sum(int(np.count_nonzero(g)) for g in exact)
    for scale in (1,) + SCALES:
        half = gradients(mixed_model, x, y, float(scale))
        lost = sum(
            int(np.count_nonzero((e != 0) & (h == 0)))
            for e, h in zip(exact, half)
        )
        print(
            f"loss scaled by {scale:>3}: {lost} of {nonzero} non-zero "
            "gradient entries underflow to zero in float16"
        )


def main() -> None:
    data = load_data()
    kmp.set_global_policy("mixed_float16")
    model = None
    for scale in SCALES:
        model = train(scale, data)
    (x_train, y_train), _ = data
    count_underflow(model, x_train[:256], y_train[:256])


if __name__ == "__main__":
    main()
